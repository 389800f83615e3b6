"""Ulysses sequence parallelism (parallel.ulysses; DeepSpeed-Ulysses, arXiv 2309.14509):
attention by head groups after an all-to-all equals attention over the whole sequence,
forward and backward; the whole model under ``apply_cp(kind="ulysses")`` trains as one
process; the bytes it moves are the formula's, against the ring's; its limits are refused.

float64 and ``parity.TOLERANCES`` as in test_context_parallel: here the attention itself is
one process's (SDPA on whole heads), so only the order of the gradient sums differs.
"""

import pytest
import torch
import torch.nn.functional as F

from ultrascale.comm import CommLogger
from ultrascale.data import Batches, split
from ultrascale.model import GPT, GPTConfig, Llama, LlamaConfig
from ultrascale.parallel.context_parallel import apply_cp, context_parallel_attention, split_sequence
from ultrascale.parallel.mesh import init_mesh
from ultrascale.parallel.ulysses import ring_bytes, ulysses_attention, ulysses_bytes
from ultrascale.parity import assert_same
from ultrascale.runtime import shared_cluster

from test_context_parallel import first_step_then_train

# every technique test runs under a GPU node's rules, and on its GPUs in make test-gpu (conftest.py)
pytestmark = [pytest.mark.multigpu, pytest.mark.usefixtures("strict_modes")]

DT = torch.float64
MHA, GQA = (2, 4, 4, 24, 8), (2, 4, 2, 24, 8)  # (batch, heads, K/V heads, seq, head_dim)


def qkv_and_upstream(shape, dtype=DT):
    b, h, kv, s, d = shape
    g = torch.Generator().manual_seed(0)
    q, grad_out = (torch.randn(b, h, s, d, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(b, kv, s, d, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, grad_out


def local(t, ctx):
    """This rank's slice of a seeded host tensor, moved to its device."""
    return split_sequence(t, ctx.rank, ctx.world_size, "contiguous", dim=2)[0].to(ctx.device)


# --------------------------------------------------------------------------- attention alone
def attend_on_rank(ctx, shape, causal):
    q, k, v, grad_out = qkv_and_upstream(shape)
    mine = [local(t, ctx).requires_grad_() for t in (q, k, v)]
    out = ulysses_attention(*mine, causal=causal)
    out.backward(local(grad_out, ctx))
    return [t.detach() for t in (out, *(m.grad for m in mine))]


def reference(shape, causal):
    q, k, v, grad_out = (t.requires_grad_() for t in qkv_and_upstream(shape))
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=causal
    )
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("cp,shape", [(2, MHA), (4, MHA), (2, GQA)], ids=["cp2", "cp4", "cp2-gqa"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_equals_full_attention_forward_and_backward(cp, shape, causal):
    per_rank = shared_cluster(cp).run(attend_on_rank, shape, causal)
    for i, (name, want) in enumerate(zip(("output", "dQ", "dK", "dV"), reference(shape, causal))):
        got = torch.cat([rank[i] for rank in per_rank], dim=2)  # contiguous: rank order is sequence order
        assert_same(got, want, f"cp={cp} {shape} causal={causal}: {name}", optimizer=None)


# --------------------------------------------------------------------------- the whole model
GPT_CFG = GPTConfig(vocab_size=64, hidden=32, heads=4, layers=2, seq_len=24)
LLAMA_CFG = LlamaConfig(vocab_size=64, hidden=32, heads=4, kv_heads=2, ffn=64, layers=2, seq_len=24)
CONFIGS = {"gpt": GPT_CFG, "llama": LLAMA_CFG}
STEPS = 2


def fresh_model(name):
    torch.manual_seed(0)
    model = (GPT if name == "gpt" else Llama)(CONFIGS[name]).to(DT)
    with torch.no_grad():  # biases away from 0, norm weights away from 1
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def under_ulysses(ctx, name):
    model = apply_cp(
        fresh_model(name).to(ctx.device), init_mesh(ctx, cp=ctx.world_size), layout="contiguous", kind="ulysses"
    )
    stream = Batches(CONFIGS[name], mbs=2, seed=0).rank_stream(
        ctx.rank, ctx.world_size, by="sequence", layout="contiguous"
    )
    return first_step_then_train(model, stream(0), stream, STEPS, device=ctx.device)


@pytest.mark.parametrize("name,cp", [("gpt", 2), ("gpt", 4), ("llama", 2)])
def test_model_under_ulysses_trains_as_one_process(name, cp):
    data = Batches(CONFIGS[name], mbs=2, seed=0)
    want = first_step_then_train(fresh_model(name), data.global_batch(0), data.global_stream(1), STEPS)
    for rank, got in enumerate(shared_cluster(cp).run(under_ulysses, name)):
        what = f"{name} cp={cp} ulysses rank {rank}"
        positions = split(data.global_batch(0), rank, cp, by="sequence", layout="contiguous").positions
        assert_same(got["logits"], want["logits"][:, positions], f"{what} logits", optimizer=None)
        assert_same(got["grads"], want["grads"], f"{what} gradients", optimizer=None)
        assert_same(got["weights"], want["weights"], f"{what} weights after {STEPS} SGD steps", optimizer="sgd")


# --------------------------------------------------------------------------- the bytes
def logged_bytes(ctx, shape, kind):
    q, k, v, grad_out = qkv_and_upstream(shape)
    mine = [local(t, ctx).requires_grad_() for t in (q, k, v)]
    attend = ulysses_attention if kind == "ulysses" else context_parallel_attention
    with CommLogger() as forward:
        out = attend(*mine)
    with CommLogger() as backward:
        out.backward(local(grad_out, ctx))
    return [
        {op: (row["calls"], row["bytes_sent"], row["bytes_received"]) for op, row in log.totals().items()}
        for log in (forward, backward)
    ]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("shape", [MHA, GQA], ids=["mha", "gqa"])
def test_logged_bytes_are_the_formulas(cp, shape):
    if shape[2] % cp:
        pytest.skip("Ulysses refuses K/V heads that cp does not divide (tested below)")
    b, h, kv, s, d = shape
    for forward, backward in shared_cluster(cp).run(logged_bytes, shape, "ulysses"):
        assert set(forward) == {"all_to_all_single", "cp shape check"} and set(backward) == {"all_to_all_single"}
        # q, k, v there and the output back; backward: dO there, dQ, dK, dV back
        want = ulysses_bytes(b, h, kv, s, d, cp, 8)
        assert forward["all_to_all_single"] == backward["all_to_all_single"] == (4, want, want)
    for forward, backward in shared_cluster(cp).run(logged_bytes, shape, "ring"):
        assert forward["batch_isend_irecv"][1] == ring_bytes(b, kv, s, d, cp, 8)
        assert backward["batch_isend_irecv"][1] == ring_bytes(b, kv, s, d, cp, 8, backward=True)


def test_ulysses_bytes_fall_with_cp_and_the_rings_do_not():
    # Llama 3 8B's attention at 128k tokens, bf16: per rank and per layer, forward.
    shape = dict(batch=1, kv_heads=8, seq=2**17, head_dim=128, bytes_per_element=2)
    ulysses = {cp: ulysses_bytes(heads=32, cp=cp, **shape) for cp in (8, 16, 32)}
    ring = {cp: ring_bytes(cp=cp, **shape) for cp in (8, 16, 32)}
    assert ulysses[8] > ulysses[16] > ulysses[32]  # ~ n*d/P
    assert ring[8] < ring[16] < ring[32] < 2 * 2**17 * 8 * 128 * 2  # ~ n*d_kv: (P-1)/P of all K/V
    # with full multi-head attention (kv = heads) Ulysses sends less than the ring for every cp > 2
    mha = dict(shape, kv_heads=32)
    for cp in (2, 4, 8):
        u, r = ulysses_bytes(heads=32, cp=cp, **mha), ring_bytes(cp=cp, **mha)
        assert (u < r) if cp > 2 else (u == r)


# --------------------------------------------------------------------------- refusals
def _error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def refusals(ctx, shape):
    q, k, v, _ = qkv_and_upstream(shape)
    mine = [local(t, ctx) for t in (q, k, v)]
    return {
        "attention": _error(lambda: ulysses_attention(*mine)),
        "zigzag": _error(lambda: ulysses_attention(*mine, layout="zigzag")),
        "model": _error(
            lambda: apply_cp(fresh_model("llama").to(ctx.device), None, layout="contiguous", kind="ulysses")
        ),
        "model zigzag": _error(lambda: apply_cp(fresh_model("gpt").to(ctx.device), None, kind="ulysses")),
        "ring works after": context_parallel_attention(*mine).shape,  # nobody left waiting
    }


def test_heads_that_do_not_split_are_refused_on_every_rank_with_what_to_do():
    for errors in shared_cluster(3).run(refusals, (2, 4, 4, 24, 8)):  # 4 heads over 3 ranks
        assert "4 heads do not split over 3 ranks" in errors["attention"] and "kind='ring'" in errors["attention"]
        assert "4 heads do not split over 3 ranks" in errors["model"]
        assert errors["ring works after"] == (2, 4, 8, 8)
    for errors in shared_cluster(4).run(refusals, GQA):  # 2 K/V heads over 4 ranks
        assert "grouped-query attention's K/V heads (2) do not split over 4 ranks" in errors["attention"]
        assert "repeat each K/V head 2 times" in errors["attention"]
        assert "K/V heads (2)" in errors["model"]
        assert "use layout='contiguous'" in errors["zigzag"]
        assert "kind='ulysses' with layout='zigzag'" in errors["model zigzag"]
        assert errors["ring works after"] == (2, 4, 6, 8)
