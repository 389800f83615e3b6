"""Data parallelism (NB02): naive, overlapped and bucketed DP against single-process
training and PyTorch DDP, no_sync accumulation, hook order, timelines, the batch-size recipe.

Tolerances: ``ultrascale.parity.TOLERANCES`` (fp32, SGD), where the reason is written.
"""

import time

import matplotlib
import pytest
import torch
import torch.distributed as dist

from ultrascale.batch_size import global_batch_size, plan_batch, samples_per_step
from ultrascale.comm import CommLogger
from ultrascale.parallel import (
    BucketedDataParallel,
    NaiveDataParallel,
    OverlappedDataParallel,
    Timeline,
    build_buckets,
    covered_seconds,
    overlap_seconds,
)
from ultrascale.parity import assert_replicas_identical, assert_same, ddp
from ultrascale.train import train
from dp_common import CFG, DATA, STEPS, cluster, fresh_model  # noqa: F401  (cluster is a fixture)

# every technique test runs under a GPU node's rules, and on its GPUs in make test-gpu (conftest.py)
pytestmark = [pytest.mark.multigpu, pytest.mark.usefixtures("strict_modes")]

matplotlib.use("Agg")

BUCKET_MB = 0.02  # ~20 KB: the tiny model (110 KB of fp32 gradients) fills several buckets
WRAPPERS = {
    "naive": NaiveDataParallel,
    "overlap": OverlappedDataParallel,
    "bucket": lambda m, **kw: BucketedDataParallel(m, bucket_cap_mb=BUCKET_MB, **kw),
}


def single_process(world, grad_acc=1):
    """The reference: one process, the concatenated batch of every rank."""
    return train(fresh_model(), DATA.global_stream(world), STEPS, "sgd", grad_acc=grad_acc)


def _model_on_rank(ctx):
    # different on each rank: the wrapper's broadcast must fix it
    return fresh_model(0 if ctx.rank == 0 else 100 + ctx.rank).to(ctx.device)


def train_dp(ctx, kind, grad_acc, use_no_sync):
    model = _model_on_rank(ctx)
    timeline = Timeline(ctx.rank, device=ctx.device)
    dp = WRAPPERS[kind](model, timeline=timeline)
    timeline.instrument(model.blocks)
    with CommLogger() as log:
        params = train(
            model,
            DATA.rank_stream(ctx.rank, ctx.world_size),
            STEPS,
            "sgd",
            grad_acc=grad_acc,
            module=dp,
            no_sync=dp.no_sync if use_no_sync else None,
            after_backward=dp.finish_gradient_synchronization,
            device=ctx.device,
        )
    return {
        "params": params,
        "all_reduces": log.totals()["all_reduce"]["calls"],
        "syncs": dp.num_syncs,
        "order": getattr(dp, "ready_order", []),
        "rows": timeline.rows(),
    }


@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_dp_equals_single_process_on_concatenated_batch(cluster, kind):
    world = cluster.world_size
    results = cluster.run(train_dp, kind, 1, False)
    assert_same(results[0]["params"], single_process(world), f"{kind} DP vs one process")
    # the replicas stay identical: the same update everywhere
    assert_replicas_identical([r["params"] for r in results], kind)


@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_no_sync_accumulation_saves_grad_acc_minus_one_syncs(cluster, kind):
    grad_acc = 3
    with_no_sync = cluster.run(train_dp, kind, grad_acc, True)[0]
    every_micro = cluster.run(train_dp, kind, grad_acc, False)[0]
    reference = single_process(cluster.world_size, grad_acc)
    assert_same(with_no_sync["params"], reference, "no_sync")
    assert_same(every_micro["params"], reference, "sync every micro-batch")
    assert with_no_sync["syncs"] == STEPS and every_micro["syncs"] == STEPS * grad_acc
    per_sync = with_no_sync["all_reduces"] // STEPS
    assert every_micro["all_reduces"] - with_no_sync["all_reduces"] == STEPS * (grad_acc - 1) * per_sync


def train_ddp_and_ours(ctx, grad_acc):
    """DDP and our bucketed DP, same bucket cap, same data, no_sync accumulation."""
    out = {}
    for name in ("ddp", "ours"):
        model = _model_on_rank(ctx)
        if name == "ddp":
            wrapped, sync = ddp(model, bucket_cap_mb=BUCKET_MB), None
        else:
            wrapped = BucketedDataParallel(model, bucket_cap_mb=BUCKET_MB)
            sync = wrapped.finish_gradient_synchronization
        out[name] = train(
            model,
            DATA.rank_stream(ctx.rank, ctx.world_size),
            STEPS,
            "sgd",
            grad_acc=grad_acc,
            module=wrapped,
            no_sync=wrapped.no_sync,
            after_backward=sync,
            device=ctx.device,
        )
    return out


def test_bucketed_dp_matches_pytorch_ddp(cluster):
    out = cluster.run(train_ddp_and_ours, 2)[0]
    assert_same(out["ours"], out["ddp"], "bucketed DP vs DDP")


def test_hooks_fire_in_reverse_layer_order_and_overlap_backward(cluster):
    overlap = cluster.run(train_dp, "overlap", 1, False)[0]
    order = overlap["order"]  # the last step's: one name per parameter, however many steps ran
    assert sorted(order) == sorted(n for n, p in fresh_model().named_parameters() if p.requires_grad)
    blocks = [int(n.split(".")[1]) for n in order if n.startswith("blocks.")]
    assert blocks == sorted(blocks, reverse=True), "block gradients should arrive last layer first"
    assert order[-1] == "embed.weight"  # the (tied) embedding is the very first layer
    for kind, expect_inside in (("overlap", True), ("bucket", True), ("naive", False)):
        rows = cluster.run(train_dp, kind, 1, False)[0]["rows"]
        # the last step's backward, from the instrumented blocks' bars
        step_start = max(e["start"] for e in rows if e["name"] == f"forward block {CFG.layers - 1}")
        backward = [e for e in rows if e["name"].startswith("backward block") and e["start"] >= step_start]
        backward_end = max(e["end"] for e in backward)
        first_comm = min(e["start"] for e in rows if e["lane"] == "communication" and e["start"] >= step_start)
        # Overlapped versions launch their first all-reduce while backward still runs;
        # naive DP only starts after backward has returned.
        assert (first_comm < backward_end) is expect_inside, kind


def count_all_reduce_calls(ctx, kind):
    model = _model_on_rank(ctx)
    dp = WRAPPERS[kind](model)
    with CommLogger() as log:
        DATA.rank_batch(ctx.rank, ctx.world_size, 0).to(ctx.device).loss(dp).backward()
        dp.finish_gradient_synchronization()
    return log.totals()["all_reduce"]["calls"], len(getattr(dp, "buckets", []))


def test_bucketing_makes_fewer_larger_calls(cluster):
    n_params = len(list(fresh_model().parameters()))
    per_tensor, _ = cluster.run(count_all_reduce_calls, "overlap")[0]
    bucketed, n_buckets = cluster.run(count_all_reduce_calls, "bucket")[0]
    assert per_tensor == n_params and bucketed == n_buckets < n_params


def gradients_live_in_buckets(ctx):
    """Two steps, the second with zero_grad(set_to_none=False): where do the gradients live?"""
    model = _model_on_rank(ctx)
    dp = WRAPPERS["bucket"](model)
    storages = {b.buffer.untyped_storage().data_ptr() for b in dp.buckets}
    for step in range(2):
        model.zero_grad(set_to_none=step == 0)
        DATA.rank_batch(ctx.rank, ctx.world_size, step).to(ctx.device).loss(dp).backward()
        dp.finish_gradient_synchronization()
    return all(p.grad.untyped_storage().data_ptr() in storages for p in model.parameters())


def test_bucketed_gradients_are_views_of_the_buckets(cluster):
    """No second copy of the gradients: .grad points into the bucket that was all-reduced
    (what DDP's gradient_as_bucket_view does); the parity tests above check the values."""
    assert all(cluster.run(gradients_live_in_buckets))


def test_build_buckets_closes_a_bucket_once_it_reaches_the_cap_as_ddp_does():
    params = [torch.zeros(n) for n in (10, 5, 10, 30, 5, 20, 20)]  # fp32: 40, 20, 40, 120, 20, 80, 80 bytes
    buckets = build_buckets(params, bucket_cap_bytes=80)
    # 40 + 20 + 40 passes 80 with its last parameter, 120 is over by itself, 20 + 80 passes it,
    # and the last 80 reaches it exactly
    assert [[p.numel() for p in b] for b in buckets] == [[10, 5, 10], [30], [5, 20], [20]]
    assert [p for b in buckets for p in b] == params
    # the same grouping as PyTorch DDP's own bucket assignment, on these and on random sizes
    gen = torch.Generator().manual_seed(0)
    cases = [(params, 80)] + [
        (
            [torch.zeros(int(n)) for n in torch.randint(1, 300, (25,), generator=gen)],
            int(torch.randint(4, 3000, (1,), generator=gen)),
        )
        for _ in range(20)
    ]
    for ps, cap in cases:
        ours = [[i for i, q in enumerate(ps) for p in b if p is q] for b in build_buckets(ps, cap)]
        theirs, _ = dist._compute_bucket_assignment_by_size(ps, [cap], [False] * len(ps))
        assert ours == [list(b) for b in theirs], (cap, [p.numel() for p in ps])


def test_build_buckets_never_mixes_dtypes():
    params = [torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16)]
    assert [[p.dtype for p in b] for b in build_buckets(params, 1000)] == [[torch.float32], [torch.bfloat16] * 2]


def test_bucket_scale_gives_the_bits_a_python_float_gives():
    """Each bucket keeps 1/N as a tensor made once (a Python float becomes a new tensor at every
    multiply). Scaling by it must give what multiplying by the float 1/N gives, bit for bit, as
    DDP does, for every gradient dtype and world size; a float32 factor would not for fp64."""
    from ultrascale.parallel.data_parallel import Bucket

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        grad = torch.randn(4096, generator=gen).to(dtype)
        for world in (2, 3, 5, 6, 7):
            bucket = Bucket(0, [grad], dtype, "cpu", scale=1.0 / world)
            view = bucket.view_of(grad)
            torch.mul(grad, bucket.scale, out=view)
            assert torch.equal(view, grad * (1.0 / world)), (dtype, world)


def test_timeline_interval_arithmetic():
    assert covered_seconds([(0, 2), (1, 3), (5, 6)]) == 4
    rows = [
        {"rank": 0, "lane": "compute", "start": 0.0, "end": 4.0},
        {"rank": 0, "lane": "communication", "start": 3.0, "end": 6.0},
        {"rank": 1, "lane": "communication", "start": 0.0, "end": 1.0},
    ]
    assert overlap_seconds(rows) == pytest.approx(1.0)
    tl = Timeline(rank=0)
    with tl.span("forward"):
        pass
    tl.mark("grad ready x")
    assert [e["name"] for e in tl.rows()] == ["forward", "grad ready x"]
    assert Timeline(enabled=False).rows() == []


class _FakeGPU:
    """A GPU as Timeline and wait_for_device see it, on a CPU: each CUDA event notes when it
    was recorded and finishes ``lag`` seconds later (work still queued) until the host waits
    for the device, which empties the queue; every wait is counted."""

    def __init__(self, lag: float):
        self.lag, self.waits, gpu = lag, 0, self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self, stream=None):
                self.at = time.perf_counter() + gpu.lag

            def synchronize(self):
                gpu.waits += 1

            def elapsed_time(self, end):
                return (end.at - self.at) * 1e3

        self.Event = Event

    def synchronize(self, device=None):
        self.waits += 1
        self.lag = 0.0


def test_timeline_on_a_gpu_reads_its_events_once_and_never_waits_while_recording(monkeypatch):
    gpu = _FakeGPU(lag=0.25)
    monkeypatch.setattr(torch.cuda, "Event", gpu.Event)
    monkeypatch.setattr(torch.cuda, "synchronize", gpu.synchronize)
    tl = Timeline(rank=0, device="cuda")
    before = time.perf_counter()
    with tl.span("forward"):
        time.sleep(0.01)
    with tl.span("backward"):
        pass
    assert gpu.waits == 0, "recording a bar must not make the host wait for the GPU"
    rows = tl.rows()
    assert gpu.waits == 2  # one synchronize, one reference event: once per read
    forward, backward = rows
    assert [r["name"] for r in rows] == ["forward", "backward"]
    # the bars are where the GPU ran them: 0.25 s after the host queued them, on the host's clock
    assert forward["start"] >= before + 0.25 - 1e-3 and forward["end"] - forward["start"] >= 0.01
    assert forward["end"] <= backward["start"] <= backward["end"]
    tl.rows()
    assert gpu.waits == 2  # nothing new to read: no wait


def test_asynchronous_transfers_on_a_gpu_end_when_the_device_says_so():
    class Work:  # NCCL's: wait() only orders streams
        def __init__(self):
            self.done_at, self.waited = time.perf_counter() + 0.05, 0

        def is_completed(self):
            return time.perf_counter() >= self.done_at

        def wait(self):
            self.waited += 1

    tl = Timeline(rank=0, device="cuda")
    work = Work()
    watched = tl.communication("all_reduce", work)
    watched.wait()
    (bar,) = tl.rows()
    assert bar["end"] >= work.done_at and work.waited == 1


def test_timed_collectives_wait_for_the_gpu_only_where_one_is_used(monkeypatch):
    from ultrascale.comm.logger import wait_for_device

    gpu = _FakeGPU(lag=0)
    monkeypatch.setattr(torch.cuda, "synchronize", gpu.synchronize)
    wait_for_device("cpu")
    wait_for_device(None)  # no GPU used by this process
    assert gpu.waits == 0
    wait_for_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    wait_for_device(None)
    assert gpu.waits == 2


def test_gantt_draws_one_bar_per_event():
    from ultrascale.viz.gantt import COLOURS, lane_summary, plot_gantt

    rows = [
        [
            {"rank": r, "lane": lane, "name": name, "start": s, "end": e, "nbytes": 0}
            for lane, name, s, e in (
                ("compute", "backward", 0.0, 0.004),
                ("communication", "all_reduce bucket 0", 0.002, 0.006),
                ("compute", "optimizer", 0.006, 0.007),
                ("compute", "backward", 0.007, 0.009),
            )
        ]
        for r in range(2)
    ]
    fig = plot_gantt(rows, title="test")
    # every event a bar, where its lane and colour say (one artist per lane and colour)
    bars = sorted(
        (
            round(path.get_extents().y0 + 0.4, 6),
            collection.get_facecolor()[0].round(3).tolist(),
            round(path.get_extents().x0, 6),
            round(path.get_extents().width, 6),
        )
        for collection in fig.axes[0].collections
        for path in collection.get_paths()
    )
    rgb = {
        k: [round(int(COLOURS[k][i : i + 2], 16) / 255, 3) for i in (1, 3, 5)] + [1.0]
        for k in ("backward", "all_reduce", "optimizer")
    }
    lanes = {(r, lane): 2 * r + (lane == "communication") for r in range(2) for lane in ("compute", "communication")}
    expected = sorted(
        (
            lanes[e["rank"], e["lane"]],
            rgb[e["name"].split()[0]],
            round(1e3 * e["start"], 6),
            round(1e3 * (e["end"] - e["start"]), 6),
        )
        for per_rank in rows
        for e in per_rank
    )
    assert bars == expected
    assert len(fig.axes[0].collections) == 6  # per rank: backward and optimizer lane, all_reduce lane
    summary = lane_summary(rows)
    assert summary[0]["overlapped"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="no events"):
        plot_gantt([])


def test_wrapper_needs_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        NaiveDataParallel(torch.nn.Linear(2, 2))


def test_batch_size_recipe_reproduces_the_book():
    assert global_batch_size(mbs=2, grad_acc=4, dp=128) == 1024
    assert samples_per_step(4e6, 4096) == 1024  # 976.6 rounds to the power of two 1024
    assert samples_per_step(4 * 2**20, 4096) == 1024
    assert plan_batch(4e6, 4096, mbs=2, dp=128).grad_acc == 4
    fast = plan_batch(4e6, 4096, mbs=2, dp=512)
    assert fast.grad_acc == 1 and fast.achieved_gbs == 1024 and fast.tokens_per_step == 1024 * 4096
    rich = plan_batch(4e6, 4096, mbs=2, dp=1024)  # 2048 samples per step > 1024
    assert rich.gpu_rich and len(rich.options) == 3
    assert "dp=512" in rich.options[0] and "2048" in rich.options[1] and "size to 1" in rich.options[2]
    with pytest.raises(ValueError):
        global_batch_size(mbs=0, grad_acc=1, dp=1)
