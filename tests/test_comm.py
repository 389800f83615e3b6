"""ultrascale.comm: ring collectives against the built-ins, the CommLogger's byte
counts, the bandwidth sweep and the alpha-beta cost model.

One Cluster per world size is shared by the whole module, and each parity test does
all lengths and ops inside one ``cluster.run`` call, because starting ranks costs about
a second and 5 ranks on 2 cores are slow.

Tolerance for sums: the ring adds the N terms of each element in a different order
than gloo does. Summing N float32 numbers in any order has an error of at most
(N-1) u sum_i |x_i| (u = 2**-24, the unit round-off), so two orders differ by at most
2 (N-1) u sum_i |x_i| = (N-1) eps sum_i |x_i| with eps = 2**-23. We allow twice that,
per element. Max involves no rounding and must match exactly.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ultrascale.comm import (
    AlphaBeta,
    CommLogger,
    bus_bandwidth_sweep,
    bus_factor,
    chunk_sizes,
    crossover_size,
    fit_alpha_beta,
    fit_ring_all_reduce,
    noise_floor,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    tensor_parallel_scaling,
    tensor_parallel_throughput,
)
from ultrascale.model import LLAMA3_8B, LLAMA_TINY, count_params, training_flops
from ultrascale.runtime import Cluster

# every technique test runs under a GPU node's rules, and on its GPUs in make test-gpu (conftest.py)
pytestmark = [pytest.mark.multigpu, pytest.mark.usefixtures("strict_modes")]

WORLD_SIZES = (1, 2, 3, 4, 5)
LENGTHS = (1, 7, 1000, 2**20 + 3)
OPS = ("sum", "avg", "max")
EPS = torch.finfo(torch.float32).eps
# torch 2.13 renamed the *_into_tensor / *_tensor collectives to *_single.
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@pytest.fixture(scope="module")
def clusters():
    """``clusters(n)``: a Cluster of n ranks, started on first use, closed at the end; gloo on a
    CPU, NCCL on a node with n GPUs (make test-gpu), as ``Cluster`` chooses."""
    started = {}

    def get(world_size):
        if world_size not in started:
            started[world_size] = Cluster(world_size)
        return started[world_size]

    yield get
    for cluster in started.values():
        cluster.close()


# ---- helpers that run on the ranks ---------------------------------------------------
def _rank_input(rank, length):
    """Rank ``rank``'s test tensor; any rank can rebuild any other rank's input."""
    return torch.randn(length, generator=torch.Generator().manual_seed(1000 * rank + length))


def _rank_input_on(ctx, rank, length):
    """``_rank_input`` on a rank: drawn on the host, then moved to its device."""
    return _rank_input(rank, length).to(ctx.device)


def _built_in(x, op):
    out = x.clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return out / dist.get_world_size() if op == "avg" else out


def _check(failures, label, got, ref, tol):
    if got.shape != ref.shape:
        failures.append(f"{label}: shape {tuple(got.shape)} != {tuple(ref.shape)}")
    elif tol is None and not torch.equal(got, ref):
        failures.append(f"{label}: not bit-identical (max diff {(got - ref).abs().max():.3g})")
    elif tol is not None and not bool(((got - ref).abs() <= tol).all()):
        failures.append(f"{label}: error {(got - ref).abs().max():.3g} above bound {tol.max():.3g}")


def _tolerance(op, abs_sum, ref, n):
    if op == "max":
        return None
    sum_bound = 2 * (n - 1) * EPS * abs_sum  # see the module docstring
    # avg: both sides divide their sum by n, each adding one rounding of the quotient.
    return sum_bound if op == "sum" else sum_bound / n + EPS * ref.abs()


def _parity_on_rank(ctx):
    """Compare the three ring collectives with the built-ins; returns failures."""
    n, r = ctx.world_size, ctx.rank
    failures = []
    for length in LENGTHS:
        x = _rank_input_on(ctx, r, length)
        abs_sum = x.abs()
        dist.all_reduce(abs_sum)
        for op in OPS:
            ref = _built_in(x, op)
            tol = _tolerance(op, abs_sum, ref, n)
            label = f"rank {r} N={n} len={length} {op}"
            # all-reduce: in place and returned
            y = x.clone()
            out = ring_all_reduce(y, op)
            if out is not y:
                failures.append(f"{label}: ring_all_reduce did not return its input")
            _check(failures, f"{label} all_reduce", y, ref, tol)
            # reduce-scatter: this rank's tensor_split chunk of the all-reduce
            mine = ring_reduce_scatter(x, op)
            part = lambda t: torch.tensor_split(t, n)[r]  # noqa: E731
            _check(failures, f"{label} reduce_scatter", mine, part(ref), None if tol is None else part(tol))
            if length % n == 0 and op != "avg":  # the built-in needs equal chunks
                rs = torch.empty(length // n, device=ctx.device)
                REDUCE_SCATTER_SINGLE(rs, x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
                _check(failures, f"{label} vs reduce_scatter_single", mine, rs, None if tol is None else part(tol))
        if not torch.equal(x, _rank_input_on(ctx, r, length)):
            failures.append(f"rank {r} len={length}: a ring collective modified its input")
        # all-gather: chunk r of every rank's input, concatenated; no arithmetic, so exact
        chunk = torch.tensor_split(x, n)[r]
        gathered = ring_all_gather(chunk, numel=length)
        expected = torch.cat([torch.tensor_split(_rank_input_on(ctx, q, length), n)[q] for q in range(n)])
        _check(failures, f"rank {r} N={n} len={length} all_gather", gathered, expected, None)
        if length % n == 0:
            built_in = torch.empty(length, device=ctx.device)
            ALL_GATHER_SINGLE(built_in, chunk)
            _check(failures, f"rank {r} N={n} len={length} vs all_gather_single", gathered, built_in, None)
    return failures


def _shapes_on_rank(ctx):
    """Multi-dimensional, non-contiguous, integer and 0-d tensors keep their shape."""
    n, r = ctx.world_size, ctx.rank
    failures = []
    dev = ctx.device
    x = torch.arange(30.0, device=dev).reshape(3, 5, 2) + r
    y = x.clone()
    ring_all_reduce(y)
    _check(failures, "3-d", y, _built_in(x, "sum"), None)  # integers in float32: exact
    t = x.clone().transpose(0, 2)  # not contiguous: reduced in a copy, copied back
    ring_all_reduce(t, "max")
    _check(failures, "transposed", t, _built_in(x, "max").transpose(0, 2), None)
    i = torch.full((4, 3), r, dtype=torch.int64, device=dev)
    ring_all_reduce(i)
    _check(failures, "int64", i, torch.full((4, 3), n * (n - 1) // 2, dtype=torch.int64, device=dev), None)
    s = torch.tensor(float(r), device=dev)
    ring_all_reduce(s)
    _check(failures, "0-d", s, torch.tensor(n * (n - 1) / 2, device=dev), None)
    rows = torch.full((2, 3), float(r), device=dev)  # equal chunks: stacked along dim 0
    _check(
        failures,
        "all_gather rows",
        ring_all_gather(rows),
        torch.arange(n, device=dev).repeat_interleave(2)[:, None].float().expand(2 * n, 3),
        None,
    )
    return failures


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_collectives_match_built_ins(clusters, world_size):
    results = clusters(world_size).run(_parity_on_rank, timeout=120)
    assert [f for rank in results for f in rank] == []


@pytest.mark.parametrize("world_size", (1, 3, 4))
def test_shapes_dtypes_and_non_contiguous_tensors(clusters, world_size):
    assert [f for rank in clusters(world_size).run(_shapes_on_rank) for f in rank] == []


# ---- the logger ----------------------------------------------------------------------
def _logged_ring_bytes(ctx):
    """Bytes the logger records for each ring collective, for several lengths."""
    rows = []
    for length in (1, 7, 12, 60, 1000):
        x = torch.ones(length, device=ctx.device)
        with CommLogger() as log:
            ring_all_reduce(x)
            ring_reduce_scatter(x)
            ring_all_gather(torch.tensor_split(x, ctx.world_size)[ctx.rank], numel=length)
        rows.append((length, [(e.op, e.bytes_sent, e.bytes_received, e.source) for e in log.events]))
    return rows


@pytest.mark.parametrize("world_size", (1, 2, 3, 4, 5))
def test_logger_counts_the_ring_bytes_exactly(clusters, world_size):
    n = world_size
    for r, rows in enumerate(clusters(n).run(_logged_ring_bytes)):
        for length, events in rows:
            c = [t.numel() * 4 for t in torch.tensor_split(torch.empty(length), n)]
            k = 4 * length
            # Reduce-scatter sends every chunk except its own; all-gather every chunk
            # except its right neighbour's (that one comes back round the ring last).
            all_reduce = (2 * k - c[r] - c[(r + 1) % n], 2 * k - c[(r - 1) % n] - c[r])
            assert events == [
                ("ring_all_reduce", *all_reduce, "measured"),
                ("ring_reduce_scatter", k - c[r], k - c[(r - 1) % n], "measured"),
                ("ring_all_gather", k - c[(r + 1) % n], k - c[r], "measured"),
            ], (r, length)
            if length % n == 0:  # the book's formula, exactly
                assert all_reduce[0] == 2 * (n - 1) * k // n == 2 * (n - 1) * k / n


def _logged_built_ins(ctx):
    n, r, dev = ctx.world_size, ctx.rank, ctx.device
    originals = (dist.all_reduce, dist.isend, c10d.isend, dist.broadcast)
    x = torch.ones(120, device=dev)  # 480 bytes
    with CommLogger() as outer:
        with CommLogger() as log:
            dist.all_reduce(x)
            getattr(dist, ALL_GATHER_SINGLE.__name__)(torch.empty(120 * n, device=dev), x)
            getattr(dist, REDUCE_SCATTER_SINGLE.__name__)(torch.empty(120 // n, device=dev), x)
            dist.broadcast(x, src=1)
            dist.reduce(x, dst=0)
            small = torch.ones(6, device=dev)  # 24 bytes
            dist.gather(small, [torch.empty(6, device=dev) for _ in range(n)] if r == 2 else None, dst=2)
            dist.scatter(small, [torch.ones(6, device=dev) for _ in range(n)] if r == 0 else None, src=0)
            dist.all_to_all_single(torch.empty(6 * n, device=dev), torch.ones(6 * n, device=dev))
            dist.barrier()
            # Point-to-point round the ring; isend first so no rank blocks.
            work = dist.isend(torch.ones(10, device=dev), (r + 1) % n)
            dist.recv(torch.empty(10, device=dev), (r - 1) % n)
            work.wait()
            ops = [
                dist.P2POp(dist.isend, torch.ones(3, device=dev), (r + 1) % n),
                dist.P2POp(dist.irecv, torch.empty(3, device=dev), (r - 1) % n),
            ]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        patched = dist.all_reduce is not originals[0]
    restored = (dist.all_reduce, dist.isend, c10d.isend, dist.broadcast) == originals
    events = [(e.op, e.bytes_sent, e.bytes_received, e.source) for e in log.events]
    return events, len(outer.events), patched, restored, log.summary()


def test_logger_wraps_built_ins_and_restores_them(clusters):
    n = 3
    for r, (events, outer_count, patched, restored, summary) in enumerate(clusters(n).run(_logged_built_ins)):
        assert patched and restored
        assert outer_count == len(events)  # nested loggers both see every event
        position = (r - 1) % n  # broadcast from rank 1: a chain 1 -> 2 -> 0
        assert events == [
            ("all_reduce", 2 * 2 * 480 // 3, 2 * 2 * 480 // 3, "algorithmic"),
            (ALL_GATHER_SINGLE.__name__, 2 * 480 * 3 // 3, 2 * 480 * 3 // 3, "algorithmic"),
            (REDUCE_SCATTER_SINGLE.__name__, 2 * 480 // 3, 2 * 480 // 3, "algorithmic"),
            ("broadcast", 0 if position == n - 1 else 480, 0 if position == 0 else 480, "algorithmic"),
            ("reduce", 0 if r == 0 else 480, 0 if r == n - 1 else 480, "algorithmic"),  # 2 -> 1 -> 0
            ("gather", 0 if r == 2 else 24, 48 if r == 2 else 0, "algorithmic"),
            ("scatter", 48 if r == 0 else 0, 0 if r == 0 else 24, "algorithmic"),
            ("all_to_all_single", 48, 48, "algorithmic"),
            ("barrier", 0, 0, "algorithmic"),
            ("isend", 40, 0, "measured"),
            ("recv", 0, 40, "measured"),
            ("batch_isend_irecv", 12, 12, "measured"),  # its inner isend/irecv not twice
        ]
        assert "all_reduce" in summary and "algorithmic" in summary


def _logged_onto_a_timeline(ctx):
    from ultrascale.parallel.timeline import Timeline

    timeline = Timeline(ctx.rank, device=ctx.device)
    x = torch.ones(1000, device=ctx.device)
    with CommLogger(timeline=timeline) as log:
        with timeline.span("compute"):
            y = x * 2
        dist.all_reduce(y)
        work = dist.all_reduce(y, async_op=True)  # async: ends at wait(), not logged as a bar
        work.wait()
    return timeline.rows(), log.rows()


def test_logger_draws_blocking_calls_on_a_timeline(clusters):
    for rows, events in clusters(2).run(_logged_onto_a_timeline):
        bars = [r for r in rows if r["lane"] == "communication"]
        assert [b["name"] for b in bars] == ["all_reduce"]
        compute = next(r for r in rows if r["lane"] == "compute")
        assert compute["end"] <= bars[0]["start"] <= bars[0]["end"]
        assert bars[0]["start"] == events[0]["start"]
        assert abs(bars[0]["end"] - bars[0]["start"] - events[0]["seconds"]) < 1e-9
        assert bars[0]["nbytes"] == events[0]["bytes_sent"] == 2 * 1 * 4000 // 2


# ---- bandwidth -----------------------------------------------------------------------
def _sweep(ctx, impl, op):
    seen = []
    points = bus_bandwidth_sweep(ctx, [4096, 1 << 16], op=op, impl=impl, iters=3, warmup=1, callback=seen.append)
    return points, seen


@pytest.mark.parametrize(
    "impl,op",
    [
        ("torch", "all_reduce"),
        ("ring", "all_reduce"),
        ("ring", "reduce_scatter"),
        ("torch", "all_gather"),
        ("torch", "broadcast"),
    ],
)
def test_bandwidth_sweep_reports_nccl_tests_quantities(clusters, impl, op):
    results = clusters(3).run(_sweep, impl, op)
    points = results[0][0]
    assert all(rank_points == points for rank_points, _ in results)  # max over ranks: same
    assert results[0][1] == points and results[1][1] == [] == results[2][1]  # rank 0 only
    assert [p["size"] for p in points] == [4092, 65532]  # whole multiples of 3 floats
    for p in points:
        assert p["time_s"] > 0 and p["algbw"] == pytest.approx(p["size"] / p["time_s"])
        assert p["busbw"] == pytest.approx(p["algbw"] * bus_factor(op, 3))


def test_bus_factors_and_bad_arguments():
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_gather", 4) == 0.75
    assert bus_factor("reduce_scatter", 8) == 7 / 8 and bus_factor("broadcast", 8) == 1.0
    with pytest.raises(ValueError, match="op must be one of"):
        bus_factor("all_to_all", 4)
    with pytest.raises(ValueError, match="op must be one of"):
        ring_all_reduce(torch.ones(3), op="min")
    with pytest.raises(ValueError, match="floating-point"):
        ring_all_reduce(torch.ones(3, dtype=torch.int32), op="avg")
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="cluster.run"):
            ring_all_reduce(torch.ones(3))


def test_chunk_sizes_follow_tensor_split():
    for numel in (0, 1, 5, 7, 12, 1001):
        for n in (1, 2, 3, 4, 5):
            assert chunk_sizes(numel, n) == [t.numel() for t in torch.tensor_split(torch.empty(numel), n)]


# ---- the cost model ------------------------------------------------------------------
def test_alpha_beta_fit_recovers_known_parameters():
    truth = AlphaBeta(alpha=20e-6, beta=5e9)  # 20 us, 5 GB/s
    sizes = np.logspace(2, 8, 25)
    fit = fit_alpha_beta(sizes, truth.message_time(sizes))
    assert fit.alpha == pytest.approx(truth.alpha, rel=1e-9)
    assert fit.beta == pytest.approx(truth.beta, rel=1e-9)
    # With 2% multiplicative noise both are still within a few per cent.
    noise = 1 + 0.02 * np.random.default_rng(0).standard_normal(sizes.size)
    noisy = fit_alpha_beta(sizes, truth.message_time(sizes) * noise)
    assert noisy.alpha == pytest.approx(truth.alpha, rel=0.05)
    assert noisy.beta == pytest.approx(truth.beta, rel=0.05)
    with pytest.raises(ValueError, match="does not grow"):
        fit_alpha_beta([1e3, 1e6], [1e-3, 1e-3 * 0.5])


def test_a_busy_machines_sweep_still_fits_a_growing_line():
    """Load only adds time: a sweep where most sizes were slowed, by 12 to 59 times, fitted as measured
    gives a line that falls with size (a0's fit raised on a busy CI machine); ``noise_floor`` caps each
    time by the fastest larger size first (leaving clean data as it is), and the fit is then within a
    factor of two of the truth."""
    truth, n = AlphaBeta(alpha=50e-6, beta=1e9), 2
    sizes = np.array([4.0**k for k in range(2, 12)])
    clean = truth.ring_all_reduce_time(sizes, n)
    slowed = clean * np.array([52.0, 21.2, 29.7, 59.3, 11.7, 38.2, 1.0, 41.1, 43.3, 31.2])
    assert np.polyfit(sizes, slowed, 1, w=1 / slowed)[0] < 0  # fitted as measured (by relative error): it falls
    floor = noise_floor(sizes[::-1], slowed[::-1])[::-1]  # any order of the points
    assert np.all(floor <= slowed) and np.all(np.diff(floor) >= 0)
    assert np.array_equal(noise_floor(sizes, clean), clean)
    fit = fit_ring_all_reduce(sizes, slowed, n)
    assert truth.alpha / 2 < fit.alpha < 2 * truth.alpha and truth.beta / 2 < fit.beta < 2 * truth.beta


def test_ring_all_reduce_model_and_crossover():
    model = AlphaBeta(alpha=10e-6, beta=2e9)
    n, k = 4, 8e6
    assert model.ring_all_reduce_time(k, n) == pytest.approx(2 * 3 * (10e-6 + k / (4 * 2e9)))
    sizes = np.logspace(3, 8, 12)
    fit = fit_ring_all_reduce(sizes, model.ring_all_reduce_time(sizes, n), world_size=n)
    assert (fit.alpha, fit.beta) == (pytest.approx(10e-6), pytest.approx(2e9))
    n_star = crossover_size(model.alpha, model.beta)
    assert n_star == model.crossover_bytes == pytest.approx(20_000)
    # At the crossover the two terms are equal: a message costs exactly 2 alpha.
    assert model.message_time(n_star) == pytest.approx(2 * model.alpha)


# ---- tensor parallelism's throughput model -----------------------------------------------
# illustrative H100-like inputs (not measurements): bf16 dense peak, NVLink, 400 Gb/s per GPU
H100_LIKE = dict(peak_flops=989e12, intra_node=AlphaBeta(5e-6, 450e9), inter_node=AlphaBeta(1e-5, 50e9))
LLAMA3_8B_4096 = training_flops(LLAMA3_8B, 4096, seq_len=4096)  # one micro-batch of one 4096-token sequence


def test_tp_model_one_rank_only_computes_and_compute_scales_as_one_over_tp():
    rows = tensor_parallel_scaling(
        LLAMA3_8B, [1, 2, 4, 8, 16, 32], seq=4096, micro_batch=1, flops=LLAMA3_8B_4096, **H100_LIKE
    )
    assert rows[0]["comm_s"] == 0 and rows[0]["step_s"] == rows[0]["compute_s"]
    for row in rows:
        assert row["compute_s"] == pytest.approx(rows[0]["compute_s"] / row["tp"])
        assert row["tokens_per_s_per_gpu"] == pytest.approx(4096 / (row["tp"] * row["step_s"]))
    assert all(row["comm_s"] > 0 for row in rows[1:])


@pytest.mark.parametrize("gpus_per_node", [4, 8])
def test_tp_model_leaves_nvlink_exactly_when_the_group_leaves_the_node(gpus_per_node):
    intra, inter = AlphaBeta(1e-6, 400e9), AlphaBeta(3e-5, 20e9)
    nbytes = 2048 * 2 * LLAMA3_8B.hidden * 2  # b*s*h in bf16
    for tp in (2, 3, 4, 5, 8, 9, 16):
        row = tensor_parallel_throughput(
            LLAMA3_8B,
            tp,
            seq=2048,
            micro_batch=2,
            peak_flops=1e15,
            flops=training_flops(LLAMA3_8B, 2 * 2048, seq_len=2048),
            intra_node=intra,
            inter_node=inter,
            gpus_per_node=gpus_per_node,
        )
        link = inter if tp > gpus_per_node else intra
        assert row["bandwidth"] == ("inter-node" if tp > gpus_per_node else "intra-node")
        assert row["comm_s"] == pytest.approx(4 * LLAMA3_8B.layers * link.ring_all_reduce_time(nbytes, tp))


def test_tp_model_by_hand():
    """LLAMA_TINY (L=2, h=64), seq 32, micro-batch 2, tp 4, 1 TFLOP/s, alpha 10 us, beta 1 GB/s."""
    tokens = 2 * 32
    flops = tokens * (6 * count_params(LLAMA_TINY) + 12 * 2 * 64 * 32)  # 6N + attention, per token
    assert training_flops(LLAMA_TINY, tokens, seq_len=32) == pytest.approx(flops)
    row = tensor_parallel_throughput(
        LLAMA_TINY,
        4,
        seq=32,
        micro_batch=2,
        flops=flops,
        peak_flops=1e12,
        intra_node=AlphaBeta(1e-5, 1e9),
        inter_node=AlphaBeta(1, 1),
    )
    compute = flops / (4 * 1e12)
    all_reduce = 2 * (4 - 1) * (1e-5 + tokens * 64 * 2 / (4 * 1e9))  # ring over 4 ranks, 8 KiB
    comm = 4 * 2 * all_reduce  # 4 per layer, 2 layers
    assert row["compute_s"] == pytest.approx(compute)
    assert comm == pytest.approx(5.78304e-4)  # 8 * 6 * (10 us + 2.048 us)
    assert row["comm_s"] == pytest.approx(comm)
    assert row["tokens_per_s_per_gpu"] == pytest.approx(tokens / (4 * (compute + comm)))
    assert row["bandwidth"] == "intra-node"


def test_tp_model_throughput_drops_and_falls_off_a_cliff_past_the_node():
    rows = tensor_parallel_scaling(
        LLAMA3_8B, [1, 2, 4, 8, 16, 32], seq=4096, micro_batch=1, flops=LLAMA3_8B_4096, **H100_LIKE
    )
    per_gpu = {row["tp"]: row["tokens_per_s_per_gpu"] for row in rows}
    assert all(a > b for a, b in zip(list(per_gpu.values()), list(per_gpu.values())[1:]))
    assert per_gpu[16] / per_gpu[8] < per_gpu[8] / per_gpu[4]  # leaving NVLink costs the most
    with pytest.raises(ValueError, match="tp"):
        tensor_parallel_throughput(LLAMA3_8B, 0, seq=4096, micro_batch=1, flops=LLAMA3_8B_4096, **H100_LIKE)


# ---- recursive doubling and the choice by size ---------------------------------------------
def _pairwise_all_reduce_on_rank(ctx, module_name="recursive", function="recursive_doubling_all_reduce"):
    """An all-reduce of ``ultrascale.comm.<module_name>`` against the built-in; the last call's
    messages as (send peer, receive peer, elements sent); results equal on all ranks."""
    import importlib

    module = importlib.import_module(f"ultrascale.comm.{module_name}")
    peers, sent, original = [], [], module.send_recv

    def spy(send, recv, right, left, group):
        peers.append((right if send.numel() else None, left if recv.numel() else None))
        sent.append(send.numel())
        original(send, recv, right, left, group)

    module.send_recv = spy
    try:
        failures = _against_the_built_in(ctx, function, getattr(module, function), [peers, sent])
    finally:
        module.send_recv = original
    return failures, peers, sent


def _against_the_built_in(ctx, name, all_reduce, logs) -> list:
    """``all_reduce(y, op)`` at every length and op against the built-in, in place and equal on
    every rank; each list of ``logs`` is emptied before each call, so it ends with the last one's."""
    n, r = ctx.world_size, ctx.rank
    failures = []
    for length in LENGTHS:
        x = _rank_input_on(ctx, r, length)
        abs_sum = x.abs()
        dist.all_reduce(abs_sum)
        for op in OPS:
            ref = _built_in(x, op)
            y = x.clone()
            for log in logs:
                log.clear()
            if all_reduce(y, op) is not y:
                failures.append(f"{name} did not return its input")
            _check(failures, f"rank {r} N={n} len={length} {op}", y, ref, _tolerance(op, abs_sum, ref, n))
            everyone = [torch.empty_like(y) for _ in range(n)]
            dist.all_gather(everyone, y)
            if not all(torch.equal(everyone[0], other) for other in everyone):
                failures.append(f"N={n} len={length} {op}: ranks hold different results")
    return failures


@pytest.mark.parametrize("world_size", (1, 2, 3, 4, 5))
def test_recursive_doubling_matches_the_built_in_in_log2_steps(clusters, world_size):
    from ultrascale.comm.recursive import doubling_steps

    n = world_size
    power = 1 << (n.bit_length() - 1)
    for r, (failures, peers, _) in enumerate(clusters(n).run(_pairwise_all_reduce_on_rank)):
        assert failures == []
        # The last call's messages: XOR partners at distance 1, 2, 4, ...; extra ranks fold.
        if r >= power:
            expected = [(r - power, None), (None, r - power)]
        else:
            expected = [(None, r + power)] if r + power < n else []
            expected += [(r ^ d, r ^ d) for d in (1 << k for k in range(power.bit_length() - 1))]
            expected += [(r + power, None)] if r + power < n else []
        assert peers == expected, (r, peers)
        assert len(peers) <= doubling_steps(n)
    assert doubling_steps(n) == {1: 0, 2: 1, 3: 3, 4: 2, 5: 4}[n]


@pytest.mark.parametrize("world_size", (1, 2, 3, 4, 5))
def test_halving_doubling_matches_the_built_in_with_the_rings_bytes_in_2_log2_minus_1_steps(clusters, world_size):
    from ultrascale.comm.halving_doubling import halving_doubling_steps

    n = world_size
    power = 1 << (n.bit_length() - 1)
    distances = [1 << k for k in range(power.bit_length() - 1)]
    length = LENGTHS[-1]
    results = clusters(n).run(_pairwise_all_reduce_on_rank, "halving_doubling", "halving_doubling_all_reduce")
    for r, (failures, peers, sent) in enumerate(results):
        assert failures == []
        # The last call's messages: XOR partners at distance 1, 2, 4, ... and back, the farthest
        # once (the innermost level is one swap); extra ranks fold.
        if r >= power:
            assert peers == [(r - power, None), (None, r - power)] and sent == [length, 0], (r, peers, sent)
            continue
        fold = r + power < n
        expected = [(None, r + power)] if fold else []
        expected += [(r ^ d, r ^ d) for d in distances + distances[-2::-1]]
        expected += [(r + power, None)] if fold else []
        assert peers == expected, (r, peers)
        assert len(peers) <= halving_doubling_steps(n)
        # Each halving step gives away one half of the range and keeps the other; the innermost
        # level swaps the whole range left; the doubling steps send back, in reverse, what was
        # kept. In all about the ring's 2 (P-1)/P of the buffer.
        exchange = sent[1:-1] if fold else sent
        halvings = max(len(distances) - 1, 0)
        given, kept = exchange[:halvings], exchange[halvings + 1 :][::-1]
        in_range = length
        for k in range(halvings):
            assert given[k] + kept[k] == in_range and abs(given[k] - kept[k]) <= 1, (r, given, kept)
            in_range = kept[k]
        if distances:
            assert exchange[halvings] == in_range, (r, exchange)  # the innermost swap: all of it
        assert abs(sum(exchange) - 2 * (power - 1) / power * length) <= 2 * len(distances)
    assert halving_doubling_steps(n) == {1: 0, 2: 1, 3: 3, 4: 3, 5: 5}[n]


def test_doubling_and_ring_times_cross_where_the_model_says():
    from ultrascale.comm.recursive import choose_algorithm, crossover_bytes, doubling_time, predicted_times

    model = AlphaBeta(alpha=1e-3, beta=1e9)
    for n in (2, 3, 4, 5, 8, 16):
        star = crossover_bytes(model, n)
        ring = lambda k: float(model.ring_all_reduce_time(k, n))  # noqa: E731
        doubling = lambda k: float(doubling_time(model, k, n))  # noqa: E731
        if n == 2:  # one exchange of everything vs two half-size steps: doubling always wins
            assert star == float("inf") and doubling(1e9) < ring(1e9)
            continue
        assert 0 < star < float("inf")
        assert ring(star) == pytest.approx(doubling(star))
        assert doubling(star / 2) < ring(star / 2) and ring(2 * star) < doubling(2 * star)
        # the choice is the fastest of the three, whatever the size
        for nbytes in (1, star / 8, star / 2, 2 * star, 1e9):
            times = predicted_times(model, int(nbytes), n)
            assert times[choose_algorithm(int(nbytes), n, model)] == min(times.values())
        assert choose_algorithm(1, n, model) == "recursive_doubling"
        # above the crossover: halving-doubling where N is a power of two (the ring's bytes in fewer
        # messages), else the ring (the fold's two whole-buffer messages cost more than it saves)
        assert choose_algorithm(int(2 * star), n, model) == ("ring" if n & (n - 1) else "halving_doubling")
    # By hand, N = 4: ring 6 alpha + 1.5 n/beta, doubling 2 alpha + 2 n/beta -> n* = 8 alpha beta;
    # halving-doubling 3 alpha + 1.5 n/beta: below the ring everywhere, below doubling from 2 alpha beta.
    assert crossover_bytes(model, 4) == pytest.approx(8 * model.alpha * model.beta)
    ab = model.alpha * model.beta
    assert predicted_times(model, ab, 4)["halving_doubling"] == pytest.approx(4.5 * model.alpha)
    assert [choose_algorithm(int(k * ab), 4, model) for k in (1.9, 2.1, 100)] == [
        "recursive_doubling",
        "halving_doubling",
        "halving_doubling",
    ]
    # N = 2: halving-doubling's one merged swap is recursive doubling's; a tie goes to doubling
    assert predicted_times(model, ab, 2)["halving_doubling"] == pytest.approx(2 * model.alpha)
    assert choose_algorithm(int(10 * ab), 2, model) == "recursive_doubling"


def _chosen_all_reduce(ctx):
    from ultrascale.comm.recursive import all_reduce, fit_on_the_spot

    # sizes up to MiBs (the median of 3 tries each): under a loaded CI machine 512 KiB x 2 once fitted no slope
    model = fit_on_the_spot(sizes=(4 << 10, 1 << 20, 4 << 20), iters=3, device=ctx.device)
    results = []
    for length in (3, 1 << 18):
        x = _rank_input_on(ctx, ctx.rank, length)
        with CommLogger() as log:
            all_reduce(x.clone(), model=model)
        results.append(log.events[0].op)
    return model, results


def test_all_reduce_chooses_by_size_with_a_model_fitted_on_the_spot(clusters):
    from ultrascale.comm.recursive import choose_algorithm

    models_and_ops = clusters(4).run(_chosen_all_reduce)
    model = models_and_ops[0][0]
    assert model.alpha > 0 and model.beta > 0
    assert all(m == model for m, _ in models_and_ops), "ranks fitted different models"
    expected = [f"{choose_algorithm(length * 4, 4, model)}_all_reduce" for length in (3, 1 << 18)]
    assert all(ops == expected for _, ops in models_and_ops)
    assert expected[0] == "recursive_doubling_all_reduce"  # 12 bytes: latency decides


def _direct_on_rank(ctx):
    """direct_all_reduce against the built-in; the last call's sends as (peer, elements)."""
    from ultrascale.comm.direct import direct_all_reduce

    from torch.distributed import distributed_c10d as c10d

    sends, original = [], dist.isend

    def spy(tensor, *args, **kwargs):
        sends.append((kwargs.get("group_dst"), tensor.numel()))
        return original(tensor, *args, **kwargs)

    dist.isend = c10d.isend = spy  # c10d: batch_isend_irecv's P2POps look isend up there
    try:
        failures = _against_the_built_in(ctx, "direct_all_reduce", direct_all_reduce, [sends])
    finally:
        dist.isend = c10d.isend = original
    return failures, sends


@pytest.mark.parametrize("world_size", (1, 2, 3, 4, 5))
def test_direct_exchange_matches_the_built_in_sending_each_chunk_straight_to_its_owner(clusters, world_size):
    from ultrascale.comm import chunk_sizes
    from ultrascale.comm.direct import direct_rounds, direct_steps

    n = world_size
    sizes = chunk_sizes(LENGTHS[-1], n)
    for r, (failures, sends) in enumerate(clusters(n).run(_direct_on_rank)):
        assert failures == []
        peers = [(r + k) % n for k in range(1, n)]
        # round 1: every other rank's chunk to its owner; round 2: this rank's summed chunk to all
        assert sends == [(p, sizes[p]) for p in peers] + [(p, sizes[r]) for p in peers], (r, sends)
        assert len(sends) == direct_steps(n)
        # (K - own chunk) + (N-1) * own chunk: the ring's 2 (N-1)/N K when N divides K
        assert sum(e for _, e in sends) == LENGTHS[-1] + (n - 2) * sizes[r]
    assert (direct_steps(n), direct_rounds(n)) == {1: (0, 0), 2: (2, 2), 3: (4, 2), 4: (6, 2), 5: (8, 2)}[n]


def test_direct_exchange_is_chosen_from_its_measured_crossover_only():
    from ultrascale.comm.recursive import AlphaBeta, all_reduce_contenders, choose_algorithm

    model = AlphaBeta(1e-4, 1e9)
    assert choose_algorithm(16 << 20, 4, model) == "halving_doubling"  # the model alone never picks it
    assert choose_algorithm(16 << 20, 4, model, direct_from=4 << 20) == "direct"
    assert choose_algorithm(1 << 20, 4, model, direct_from=4 << 20) == choose_algorithm(1 << 20, 4, model)
    assert choose_algorithm(16 << 20, 1, model, direct_from=1) != "direct"  # one rank: nothing to exchange
    assert "direct" not in all_reduce_contenders(model=model)
    assert "direct" in all_reduce_contenders(model=model, direct=True)


def _direct_crossover(ctx):
    from ultrascale.comm.recursive import direct_crossover_on_the_spot

    sizes = (1 << 12, 1 << 16, 1 << 20)
    return direct_crossover_on_the_spot(sizes=sizes, rounds=2, device=ctx.device), sizes


def test_the_direct_crossover_is_one_of_the_sizes_raced_and_the_same_on_every_rank(clusters):
    results = clusters(3).run(_direct_crossover)
    crossover, sizes = results[0]
    assert all(c == crossover for c, _ in results), "ranks measured different crossovers"
    assert crossover is None or crossover in sizes


def _race(ctx):
    from ultrascale.comm.recursive import AlphaBeta, all_reduce_contenders, race_all_reduces

    contenders = all_reduce_contenders(model=AlphaBeta(1e-4, 1e9))
    return race_all_reduces(contenders, sizes=(1 << 10, 1 << 14), rounds=2, device=ctx.device)


def test_race_times_every_contender_and_agrees_across_ranks(clusters):
    rows = clusters(3).run(_race)
    assert all(r == rows[0] for r in rows), "ranks must report the slowest rank's times"
    assert [nbytes for nbytes, _ in rows[0]] == [1 << 10, 1 << 14]
    for _, times in rows[0]:
        assert set(times) == {"builtin", "ring", "doubling", "halving", "chosen"}
        assert all(0 < t < 10 for t in times.values())


def test_again_races_the_backend_once_more_only_when_asked():
    from ultrascale.comm.recursive import all_reduce_contenders

    contenders = all_reduce_contenders(again=True)
    assert contenders["again"] is contenders["builtin"]
    assert "again" not in all_reduce_contenders()


def _race_order(ctx):
    from ultrascale.comm.recursive import race_all_reduces

    calls = []
    contenders = {name: (lambda t, name=name: calls.append(name)) for name in "abc"}
    race_all_reduces(contenders, sizes=(1 << 10,), rounds=4, device=ctx.device)
    return [name for i, name in enumerate(calls) if i == 0 or calls[i - 1] != name]


def test_race_takes_the_contenders_in_balanced_orders(clusters):
    # one warm-up call each, then the rounds of balanced_orders: b follows a in one, c follows a in another
    order = clusters(2).run(_race_order)[0]
    assert order == list("abc") + list("abc") + list("bca") + list("cab") + list("cba"), order


@pytest.mark.parametrize("count", range(1, 8))
def test_balanced_orders_give_every_position_and_predecessor_equally_often(count):
    from collections import Counter

    from ultrascale.comm.bandwidth import balanced_orders

    names = [f"c{i}" for i in range(count)]
    square = 2 * count if count % 2 else count  # rounds in one balanced block
    rounds = balanced_orders(names, 2 * square)
    assert rounds[0] == names and rounds[square:] == rounds[:square]
    assert all(sorted(r) == names for r in rounds)
    positions = Counter((pos, name) for r in rounds for pos, name in enumerate(r))
    assert set(positions.values()) == {2 * square // count}
    assert len(positions) == count * count
    followers = Counter((a, b) for r in rounds for a, b in zip(r, r[1:]))
    if count > 1:
        assert len(followers) == count * (count - 1)  # every ordered pair of two contenders ...
        assert len(set(followers.values())) == 1  # ... equally often


def _works_kept_then_released(ctx):
    """During each hand-written collective every exchange's Work objects stay alive (the next
    exchange would otherwise wait a kernel tick); when it returns they are all let go, so the
    tensor it was given is not kept alive by them."""
    import gc
    import importlib
    import weakref

    from ultrascale.comm import ring as ring_module
    from ultrascale.comm.halving_doubling import halving_doubling_all_reduce
    from ultrascale.comm.recursive import recursive_doubling_all_reduce

    report = {}
    kept_counts = []

    # The ring steps with ring_step (works returned, waited for later), the others with send_recv.
    for name, collective, step in (
        ("ring", ring_module.ring_all_reduce, "ring_step"),
        ("doubling", recursive_doubling_all_reduce, "send_recv"),
        ("halving", halving_doubling_all_reduce, "send_recv"),
    ):
        kept_counts.clear()
        module = importlib.import_module(collective.__module__)
        original = getattr(module, step)

        def spy(*args, original=original, **kwargs):
            result = original(*args, **kwargs)
            kept_counts.append(len(ring_module._kept_works))  # fails (TypeError) if nothing is kept
            return result

        setattr(module, step, spy)
        try:
            x = torch.ones(1 << 12, device=ctx.device)
            collective(x)
        finally:
            setattr(module, step, original)
        alive = weakref.ref(x)
        del x
        gc.collect()
        report[name] = (kept_counts[:], ring_module._kept_works is None, alive() is None)
    return report


def test_collectives_keep_their_exchanges_alive_until_they_return():
    # torch's own Works, not the strict point-to-point mode's stand-ins: what is kept and let go
    # here is the real process group's (the mode's streams are tested in test_strict_p2p.py)
    with Cluster(4, strict_p2p=False) as cluster:
        reports = cluster.run(_works_kept_then_released)
    for report in reports:
        for name, (kept, released, tensor_freed) in report.items():
            # each exchange posts a send and a receive: the kept list grows by two per step
            assert kept == list(range(2, 2 * len(kept) + 1, 2)) and len(kept) >= 2, (name, kept)
            assert released, f"{name}: Work objects still held after the collective returned"
            assert tensor_freed, f"{name}: the input tensor outlived the call"
