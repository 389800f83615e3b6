"""Context parallelism (parallel.context_parallel, parallel.ring_attention): attention over a
sequence split across ranks equals attention over the whole sequence, forward and backward;
the ring really passes K/V point to point; the whole model trains as one process; the work
per rank under both layouts; the buffers against the memory model; the errors.

Why float64 and ``parity.TOLERANCES``: ring attention computes each block's softmax alone
and merges the blocks with their log-sum-exp, where one process normalises each row over all
keys at once, and dK/dV are summed over ranks in another order: the same numbers in exact
arithmetic, ~1e-16 apart in float64. The float64 tolerance (1e-10 relative) can only be met
by the right mathematics; a missing block, a wrong mask or a lost rescaling is off by far more.
Chapter 11's ``naive_attention`` computes in float32 internally, so it is compared with the
float32 tolerance.
"""

import pytest
import torch
import torch.nn.functional as F

from ultrascale.comm import CommLogger
from ultrascale.data import Batches, split
from ultrascale.kernels.tiled_attention import naive_attention
from ultrascale.memory import cp_kv_buffer_bytes
from ultrascale.model import GPT, GPTConfig, Llama, LlamaConfig
from ultrascale.parallel.context_parallel import (
    KVBufferMeter,
    apply_cp,
    causal_tile_counts,
    context_parallel_attention,
    split_sequence,
)
from ultrascale.parallel.mesh import init_mesh
from ultrascale.parallel.timeline import Timeline
from ultrascale.parity import assert_same, tolerance
from ultrascale.runtime import shared_cluster
from ultrascale.train import gradients, train

# every technique test runs under a GPU node's rules, and on its GPUs in make test-gpu (conftest.py)
pytestmark = [pytest.mark.multigpu, pytest.mark.usefixtures("strict_modes")]

DT = torch.float64
# (batch, heads, K/V heads, seq, head_dim): grouped-query attention, and 24 tokens cut into
# 2*cp equal chunks for every cp in {1, 2, 3, 4}.
SHAPE = (2, 4, 2, 24, 8)
LAYOUTS, KINDS = ("contiguous", "zigzag"), ("ring", "all_gather")


def qkv_and_upstream(dtype=DT, shape=SHAPE):
    b, h, kv, s, d = shape
    g = torch.Generator().manual_seed(0)
    q, grad_out = (torch.randn(b, h, s, d, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(b, kv, s, d, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, grad_out


def local(t, ctx, layout):
    """This rank's slice of a seeded host tensor, moved to its device."""
    return split_sequence(t, ctx.rank, ctx.world_size, layout, dim=2)[0].to(ctx.device)


def gather(per_rank, layout):
    """The whole sequence back from every rank's slice (dim 2), by the layout's positions."""
    n = len(per_rank)
    out = torch.empty(*per_rank[0].shape[:2], per_rank[0].shape[2] * n, per_rank[0].shape[3], dtype=per_rank[0].dtype)
    for r, t in enumerate(per_rank):
        out[:, :, split_sequence(out, r, n, layout, dim=2)[1]] = t
    return out


# --------------------------------------------------------------------------- attention alone
def attend_on_rank(ctx, causal, layout, kind, dtype=DT):
    q, k, v, grad_out = qkv_and_upstream(dtype)
    mine = [local(t, ctx, layout).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*mine, causal=causal, layout=layout, kind=kind)
    out.backward(local(grad_out, ctx, layout))
    return out.detach(), *(t.grad for t in mine)


def every_case(ctx):
    return {
        (causal, layout, kind): attend_on_rank(ctx, causal, layout, kind)
        for causal in (False, True)
        for layout in LAYOUTS
        for kind in KINDS
    }


def reference(causal, dtype=DT, attention="sdpa"):
    q, k, v, grad_out = qkv_and_upstream(dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    if attention == "sdpa":
        out = F.scaled_dot_product_attention(q, kr, vr, is_causal=causal)
    else:  # chapter 11's reference: the whole score matrix
        out = naive_attention(q, kr, vr, causal)[0]
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_attention_equals_full_attention_forward_and_backward(cp):
    per_rank = shared_cluster(cp).run(every_case)
    for (causal, layout, kind), _ in per_rank[0].items():
        got = [gather([rank[causal, layout, kind][i] for rank in per_rank], layout) for i in range(4)]
        for name, have, want in zip(("output", "dQ", "dK", "dV"), got, reference(causal)):
            assert_same(have, want, f"cp={cp} causal={causal} {layout} {kind}: {name} vs SDPA", optimizer=None)
    for rank in per_rank:  # the same blocks merged in the same order: the same bits
        for causal in (False, True):
            for layout in LAYOUTS:
                assert torch.equal(rank[causal, layout, "ring"][0], rank[causal, layout, "all_gather"][0])


@pytest.mark.parametrize("causal", [False, True])
def test_attention_equals_chapter_11_naive_attention(causal):
    per_rank = shared_cluster(3).run(attend_on_rank, causal, "zigzag", "ring", torch.float32)
    got = [gather([rank[i] for rank in per_rank], "zigzag") for i in range(4)]
    for name, have, want in zip(("output", "dQ", "dK", "dV"), got, reference(causal, torch.float32, "naive")):
        assert_same(have, want, f"causal={causal}: {name} vs naive_attention", optimizer=None)


# --------------------------------------------------------------------------- how K/V move
def logged(ctx, kind):
    q, k, v, grad_out = qkv_and_upstream()
    mine = [local(t, ctx, "zigzag").requires_grad_() for t in (q, k, v)]
    timeline = Timeline(ctx.rank, device=ctx.device)
    with CommLogger() as forward_log:
        out = context_parallel_attention(*mine, layout="zigzag", kind=kind, timeline=timeline)
    with CommLogger() as backward_log:
        out.backward(local(grad_out, ctx, "zigzag"))
    return forward_log.totals(), backward_log.totals(), timeline.rows()


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_passes_kv_point_to_point_while_computing(cp):
    b, h, kv, s, d = SHAPE
    block = b * kv * (s // cp) * d * 8  # one rank's K (or V) in float64
    for forward, backward, rows in shared_cluster(cp).run(logged, "ring"):
        assert set(forward) == {"batch_isend_irecv", "cp shape check"} == set(backward) | {"cp shape check"}
        # forward: K and V go cp-1 steps round the ring; backward: again, plus dK/dV's sums cp-1
        assert forward["batch_isend_irecv"]["bytes_sent"] == (cp - 1) * 2 * block
        assert backward["batch_isend_irecv"]["bytes_sent"] == 2 * (cp - 1) * 2 * block
        assert backward["batch_isend_irecv"]["bytes_received"] == backward["batch_isend_irecv"]["bytes_sent"]
        # each transfer is started before the block in hand is attended to, so they overlap
        rank = rows[0]["rank"]
        attends = [e for e in rows if e["name"].startswith("attend to")]
        receives = [e for e in rows if e["name"] == "receive K/V"]  # forward's, then backward's
        assert [e["name"] for e in attends] == [f"attend to K/V of rank {(rank - i) % cp}" for i in range(cp)]
        assert len(receives) == 2 * (cp - 1)
        assert all(rx["start"] <= at["start"] for rx, at in zip(receives[: cp - 1], attends))


def test_all_gather_variant_gathers_and_reduce_scatters():
    for forward, backward, _ in shared_cluster(2).run(logged, "all_gather"):
        ops = set(forward) | set(backward)
        assert not any("isend" in op for op in ops)
        assert any(op.startswith("all_gather") for op in forward)
        assert any(op.startswith("reduce_scatter") for op in backward)


def buffer_peaks(ctx, kind, dtype):
    q, k, v, grad_out = qkv_and_upstream(dtype, (2, 4, 2, 48, 8))
    mine = [local(t, ctx, "zigzag").requires_grad_() for t in (q, k, v)]
    with KVBufferMeter() as forward:
        out = context_parallel_attention(*mine, layout="zigzag", kind=kind)
    with KVBufferMeter() as backward:
        out.backward(local(grad_out, ctx, "zigzag"))
    return forward.peak, backward.peak


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_kv_buffer_peak_is_the_memory_model(cp):
    for kind in KINDS:
        for dtype, nbytes in ((torch.float32, 4), (torch.bfloat16, 2)):  # dK/dV accumulate in fp32
            forward, backward = shared_cluster(cp).run(buffer_peaks, kind, dtype)[0]
            model = dict(batch=2, kv_heads=2, seq=48, head_dim=8, cp=cp, kind=kind, bytes_per_element=nbytes)
            assert forward == cp_kv_buffer_bytes(**model), (kind, dtype)
            assert backward == cp_kv_buffer_bytes(**model, backward=True), (kind, dtype)
    # For a given sequence the ring's buffers (4 blocks of seq/cp) shrink as cp grows; the
    # all-gather's are the whole sequence's K and V whatever cp is.
    ring, gathered = ({cp: cp_kv_buffer_bytes(1, 8, 2**15, 128, cp, kind) for cp in (4, 8)} for kind in KINDS)
    assert ring[8] * 2 == ring[4] == 4 * (2**15 // 4) * 8 * 128 * 2
    assert gathered[8] == gathered[4] == 2 * 2**15 * 8 * 128 * 2


# --------------------------------------------------------------------------- work per rank
def test_zigzag_balances_the_causal_work_and_contiguous_does_not():
    assert causal_tile_counts(64, 4, "contiguous") == [3, 7, 11, 15]
    assert causal_tile_counts(64, 4, "zigzag") == [9, 9, 9, 9]
    for cp in (2, 3, 4, 8):
        contiguous, zigzag = causal_tile_counts(96 * cp, cp, "contiguous"), causal_tile_counts(96 * cp, cp, "zigzag")
        assert sum(contiguous) == sum(zigzag) == (2 * cp) * (2 * cp + 1) // 2  # every tile of the mask once
        assert len(set(zigzag)) == 1 and contiguous == sorted(set(contiguous))  # equal / growing with rank
    # rank 0, tiles of 2: chunk 0 is tiles 0-3 (1+2+3+4 key tiles), chunk 7 tiles 28-31 (29+...+32)
    assert causal_tile_counts(64, 4, "zigzag", tile=2) == [sum(range(1, 5)) + sum(range(29, 33))] * 4
    with pytest.raises(ValueError, match="tile=3 does not divide"):
        causal_tile_counts(64, 4, "zigzag", tile=3)


# --------------------------------------------------------------------------- the whole model
GPT_CFG = GPTConfig(vocab_size=64, hidden=32, heads=4, layers=2, seq_len=24)
LLAMA_CFG = LlamaConfig(vocab_size=64, hidden=32, heads=4, kv_heads=2, ffn=64, layers=2, seq_len=24)
CONFIGS = {"gpt": GPT_CFG, "llama": LLAMA_CFG}
STEPS = 3


def fresh_model(name, recompute="none"):
    torch.manual_seed(0)
    model = (GPT if name == "gpt" else Llama)(CONFIGS[name]).to(DT).set_recompute(recompute)
    with torch.no_grad():  # biases away from 0, norm weights away from 1
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def data(name):
    return Batches(CONFIGS[name], mbs=2, seed=0)


def first_step_then_train(model, batch, stream, steps=STEPS, device=None):
    """The first step's logits and gradients, then the weights after ``steps`` SGD steps;
    ``device``: where the batches go (a rank's ``ctx.device``; None: they stay on the host)."""
    batch = batch.to(device)
    logits = model(batch.inputs, batch.positions)
    batch.loss(model).backward()
    out = {"logits": logits.detach(), "grads": gradients(model)}
    model.zero_grad(set_to_none=True)
    return {**out, "weights": train(model, stream, steps, "sgd", device=device)}


def under_cp(ctx, name, layout, kind, recompute):
    mesh = init_mesh(ctx, cp=ctx.world_size)
    model = apply_cp(fresh_model(name, recompute).to(ctx.device), mesh, layout=layout, kind=kind)
    stream = data(name).rank_stream(ctx.rank, ctx.world_size, by="sequence", layout=layout)
    return first_step_then_train(model, stream(0), stream, device=ctx.device)


def one_process(name):
    model = fresh_model(name)
    return first_step_then_train(model, data(name).global_batch(0), data(name).global_stream(1))


CASES = [
    ("gpt", 2, "zigzag", "ring", "none"),
    ("gpt", 3, "contiguous", "ring", "none"),
    ("gpt", 4, "zigzag", "ring", "none"),
    ("gpt", 4, "contiguous", "all_gather", "none"),
    ("gpt", 2, "zigzag", "ring", "selective"),
    ("gpt", 2, "zigzag", "ring", "full"),
    ("llama", 2, "zigzag", "ring", "none"),
    ("llama", 4, "zigzag", "all_gather", "none"),
]


@pytest.mark.parametrize("name,cp,layout,kind,recompute", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_model_under_cp_trains_as_one_process(name, cp, layout, kind, recompute):
    want = one_process(name)
    for rank, got in enumerate(shared_cluster(cp).run(under_cp, name, layout, kind, recompute)):
        what = f"{name} cp={cp} {layout} {kind} recompute={recompute} rank {rank}"
        positions = split(data(name).global_batch(0), rank, cp, by="sequence", layout=layout).positions
        assert_same(got["logits"], want["logits"][:, positions], f"{what} logits", optimizer=None)
        assert_same(got["grads"], want["grads"], f"{what} gradients", optimizer=None)
        assert_same(got["weights"], want["weights"], f"{what} weights after {STEPS} SGD steps", optimizer="sgd")


def without_gradient_sync(ctx):
    model = apply_cp(fresh_model("gpt").to(ctx.device), None, sync_gradients=False)
    batch = data("gpt").rank_stream(ctx.rank, ctx.world_size, by="sequence", layout="zigzag")(0)
    batch.to(ctx.device).loss(model).backward()
    return gradients(model)


def test_without_the_gradient_average_parity_fails():
    want = one_process("gpt")["grads"]
    got = shared_cluster(2).run(without_gradient_sync)
    average = {n: (got[0][n] + got[1][n]) / 2 for n in want}
    assert_same(average, want, "the average of the ranks' gradients", optimizer=None)  # what the hooks do
    with pytest.raises(AssertionError):
        assert_same(got[0], want, "one rank's gradient", optimizer=None)


# --------------------------------------------------------------------------- errors
def _error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def refusals(ctx):
    r, n = ctx.rank, ctx.world_size
    q, k, v, _ = qkv_and_upstream()
    mine = [local(t, ctx, "contiguous") for t in (q, k, v)]
    shorter = [t[:, :, :-2] if r == 0 else t for t in mine]  # rank 0 holds 4 tokens, the others 6
    model = apply_cp(fresh_model("gpt").to(ctx.device), None, layout="zigzag")
    contiguous = split(data("gpt").global_batch(0), r, n, by="sequence").to(ctx.device)
    return {
        "lengths": _error(lambda: context_parallel_attention(*shorter)),
        "head_dim": _error(lambda: context_parallel_attention(mine[0], mine[1][..., :6], mine[2][..., :6])),
        "one rank": _error(
            lambda: context_parallel_attention(
                mine[0], mine[1][..., :6] if r == 1 else mine[1], mine[2][..., :6] if r == 1 else mine[2]
            )
        ),
        "odd zigzag": _error(lambda: context_parallel_attention(*(t[:, :, :-1] for t in mine), layout="zigzag")),
        "kind": _error(lambda: context_parallel_attention(*mine, kind="all_to_all")),
        "positions": _error(lambda: contiguous.loss(model)),
        "layout": _error(lambda: apply_cp(fresh_model("gpt").to(ctx.device), None, layout="striped")),
        "plan": _error(lambda: apply_cp(fresh_model("gpt").to(ctx.device), None, plan={"blocks.*.mlp": "ring"})),
        "works after": context_parallel_attention(*mine).shape,  # nobody is left stuck in the ring
    }


def test_bad_inputs_are_refused_on_every_rank_with_the_fix():
    out = shared_cluster(4).run(refusals)
    for rank, errors in enumerate(out):
        assert "sequence length from 4 to 6" in errors["lengths"] and "data.split" in errors["lengths"]
        assert "head_dim mismatch: q has head_dim 8, k and v 6" in errors["head_dim"]
        expected = "head_dim mismatch" if rank == 1 else "another rank of the cp group refused"
        assert expected in errors["one rank"]
        assert "zigzag layout gives every rank 2 equal chunks, but this rank holds 5 tokens" in errors["odd zigzag"]
        assert "kind='all_to_all'" in errors["kind"]
        assert f"rank {rank} got positions" in errors["positions"] and "layout='zigzag'" in errors["positions"]
        assert "layout='striped'" in errors["layout"]
        assert "'blocks.*.mlp' must match attention modules" in errors["plan"]
        assert errors["works after"] == (2, 4, 6, 8)


def test_sequences_that_do_not_cut_into_chunks_are_refused_not_padded():
    batch = data("gpt").global_batch(0)  # 24 tokens
    with pytest.raises(
        ValueError,
        match="24 tokens per sequence do not split evenly over 5 ranks in the zigzag "
        r"layout \(10 chunks, 2 per rank\): pad the sequence to 30 tokens",
    ):
        split(batch, 0, 5, by="sequence", layout="zigzag")
    with pytest.raises(
        ValueError,
        match="16 ranks need more chunks than a sequence of 24 tokens has in the zigzag "
        r"layout \(32 chunks, 2 per rank\): use at most 12 ranks",
    ):
        split(batch, 0, 16, by="sequence", layout="zigzag")
    with pytest.raises(ValueError, match="layout='striped'"):
        split(batch, 0, 2, by="sequence", layout="striped")
    assert tolerance(None, DT) == tolerance("sgd", DT)  # the tolerance these tests rely on
