"""Asynchronous TP (parallel.async_tp): the all-gather + matmul and matmul + reduce-scatter cut
into overlapped pieces give what the plain collectives around one matmul give.

Each autograd function is run on every rank beside its plain counterpart (``comm.functional``'s
g then ``F.linear``; ``F.linear`` then g*) on the same inputs, forward and backward, and a whole
model trained with ``apply_tp(..., async_tp=True)`` is set against plain TP+SP and one process.

Why float64 and ``parity.TOLERANCES`` (1e-10 relative for one backward and SGD, 1e-8 for Adam):
the pieces are the same products as the whole matmul, but the sums over ranks are added in ring
order where gloo's reduce-scatter chooses its own, and a weight gradient is a sum over pieces;
that reassociation costs ~1e-16 relative in float64, so only the right mathematics meets them.
The losses weight every output with a different random tensor per rank, so a wrong shard, a
missing sum over ranks or a sum counted twice fails.
"""

import pytest
import torch
import torch.nn.functional as F

from ultrascale.comm import CommLogger
from ultrascale.comm.functional import g, g_star
from ultrascale.comm.logger import base_op
from ultrascale.parallel.async_tp import all_gather_matmul, matmul_reduce_scatter
from ultrascale.parallel.mesh import init_mesh
from ultrascale.parallel.tensor_parallel import apply_tp, full_gradients, full_weights
from ultrascale.parallel.timeline import Timeline
from ultrascale.parallel.vocab_parallel import VocabParallelLogits
from ultrascale.parity import assert_same, first_step_and_train
from ultrascale.runtime import shared_cluster

from test_tensor_parallel import CONFIGS, GPT_CFG, STEPS, _error, assert_matches, data, fresh_model, ours, reference

# every technique test runs under a GPU node's rules, and on its GPUs in make test-gpu (conftest.py)
pytestmark = [pytest.mark.multigpu, pytest.mark.usefixtures("strict_modes")]

DT = torch.float64
B, PIECE, HIDDEN = 2, 3, 5  # each rank holds (2, 3, 5) of the sequence


def _randn(*shape, seed):
    return torch.randn(*shape, dtype=DT, generator=torch.Generator().manual_seed(seed))


def _randn_on(device):
    """``_randn`` for a rank: the same numbers, drawn on the host and moved to its device."""
    return lambda *shape, seed: _randn(*shape, seed=seed).to(device)


def _leaf(t):
    return t.clone().requires_grad_()


# --------------------------------------------------------------------------- the two functions
def _functions_on_rank(ctx, members):
    """Both decompositions and their plain counterparts on this rank's shards; ``members``:
    the ranks of the group (None: all). Returns {name: (async, plain)} tensors, or None off it."""
    group = None if members is None else ctx.new_group(members)  # every rank takes part in creating it
    if members is not None and ctx.rank not in members:
        return None
    r = ctx.rank if members is None else members.index(ctx.rank)
    n = ctx.world_size if members is None else len(members)
    out, randn = {}, _randn_on(ctx.device)

    # all-gather + matmul: two weights (q and k of one region), rows r of each; the gathered
    # input is used too, so its gradient joins the reduce-scatter.
    x_full = randn(B, n * PIECE, HIDDEN, seed=1)
    x_r = x_full[:, r * PIECE : (r + 1) * PIECE]
    w1, w2 = randn(4, HIDDEN, seed=10 + r), randn(2, HIDDEN, seed=20 + r)
    weights = [
        randn(B, n * PIECE, 4, seed=30 + r),
        randn(B, n * PIECE, 2, seed=40 + r),
        randn(B, n * PIECE, HIDDEN, seed=50 + r),
    ]
    results = []
    for decomposed in (True, False):
        x, a, b = _leaf(x_r), _leaf(w1), _leaf(w2)
        if decomposed:
            timeline = Timeline(ctx.rank, device=ctx.device)
            with CommLogger() as log:
                gathered, (y1, y2) = all_gather_matmul(x, [a, b], group, timeline)
                loss = (y1 * weights[0]).sum() + (y2 * weights[1]).sum() + (gathered * weights[2]).sum()
                forward_ops = len(log.events)
                loss.backward()
            out["gather pieces"] = (
                [base_op(e["op"]) for e in log.rows()],
                forward_ops,
                [e["bytes_sent"] for e in log.rows() if e["bytes_sent"]],
                [(e["lane"], e["name"]) for e in timeline.rows()],
            )
        else:
            gathered = g(x, 1, group)
            y1, y2 = F.linear(gathered, a), F.linear(gathered, b)
            loss = (y1 * weights[0]).sum() + (y2 * weights[1]).sum() + (gathered * weights[2]).sum()
            loss.backward()
        results.append(
            {
                "gathered": gathered.detach(),
                "y1": y1.detach(),
                "y2": y2.detach(),
                "dx": x.grad,
                "dw1": a.grad,
                "dw2": b.grad,
            }
        )
    out["all_gather_matmul"] = tuple(results)

    # matmul + reduce-scatter: input features split (6 per rank), the sum kept by tokens.
    h_r = randn(B, n * PIECE, 6, seed=60 + r)
    w = randn(HIDDEN, 6, seed=70 + r)
    weight_out = randn(B, PIECE, HIDDEN, seed=80 + r)
    results = []
    for decomposed in (True, False):
        h, v = _leaf(h_r), _leaf(w)
        timeline = Timeline(ctx.rank, device=ctx.device)
        with CommLogger() as log:
            y = matmul_reduce_scatter(h, v, group, timeline) if decomposed else g_star(F.linear(h, v), 1, group)
            (y * weight_out).sum().backward()
        if decomposed:
            out["scatter pieces"] = (
                [base_op(e["op"]) for e in log.rows()],
                None,
                [e["bytes_sent"] for e in log.rows() if e["bytes_sent"]],
                [(e["lane"], e["name"]) for e in timeline.rows()],
            )
        results.append({"y": y.detach(), "dh": h.grad, "dw": v.grad})
    out["matmul_reduce_scatter"] = tuple(results)
    return out


GROUPS = [(2, None), (3, None), (3, [1, 2])]


@pytest.mark.parametrize("world,members", GROUPS, ids=["2 ranks", "3 ranks", "ranks [1, 2] of 3"])
def test_decomposed_functions_equal_the_plain_collectives(world, members):
    results = shared_cluster(world).run(_functions_on_rank, members)
    n = len(members) if members else world
    for rank, out in enumerate(results):
        if members is not None and rank not in members:
            assert out is None
            continue
        for name in ("all_gather_matmul", "matmul_reduce_scatter"):
            decomposed, plain = out[name]
            for key in plain:
                assert_same(decomposed[key], plain[key], f"{name} {key}, rank {rank} of {n}", optimizer=None)
        # The communication really is in pieces: tp - 1 sends of one shard each way, forward
        # and backward, and a compute bar per piece (tp of them), named by phase.
        # With two ranks the next and the previous rank are one, and the pair is posted as one
        # batch (NCCL's rule, comm.ring.exchange); otherwise a send and a receive.
        ops, forward_ops, sent, bars = out["gather pieces"]
        per_step = ["batch_isend_irecv"] if n == 2 else ["isend", "irecv"]
        assert ops == per_step * (2 * (n - 1)) and forward_ops == len(per_step) * (n - 1)
        assert sent == [B * PIECE * HIDDEN * 8] * (2 * (n - 1))  # 1/tp of the gathered activation
        for phase, lane_names in (("forward", ("all_gather",)), ("backward", ("reduce_scatter",))):
            pieces = sorted(name for lane, name in bars if name.startswith(phase))
            assert pieces == [f"{phase} matmul piece {c}" for c in range(n)]
        steps = [name for lane, name in bars if lane == "communication"]
        assert sorted(steps) == sorted(
            [f"all_gather step {k}" for k in range(1, n)] + [f"reduce_scatter step {k}" for k in range(1, n)]
        )
        ops, _, sent, bars = out["scatter pieces"]
        assert ops == per_step * (2 * (n - 1))
        assert sent == [B * PIECE * HIDDEN * 8] * (2 * (n - 1))  # a running sum, then a gradient shard
        assert sum(lane == "compute" for lane, _ in bars) == 2 * n


# --------------------------------------------------------------------------- a whole model
def async_tp(ctx, name, optimizer):
    model = apply_tp(
        fresh_model(CONFIGS[name]).to(ctx.device),
        init_mesh(ctx, tp=ctx.world_size),
        sequence_parallel=True,
        async_tp=True,
    )
    return first_step_and_train(
        model,
        data(CONFIGS[name]),
        STEPS,
        optimizer,
        full_gradients=full_gradients,
        full_logits=VocabParallelLogits.full_tensor,
        full_weights=full_weights,
        device=ctx.device,
    )


# Llama's MLP has two column-parallel layers (gate, up) in one region; GPT's attention three.
MODELS = [("gpt", 2, "adam"), ("gpt", 3, "sgd"), ("llama", 2, "sgd")]


@pytest.mark.parametrize("name,tp,optimizer", MODELS, ids=[f"{n}-tp{t}-{o}" for n, t, o in MODELS])
def test_async_tp_trains_as_plain_tp_sp_and_one_process(name, tp, optimizer):
    cluster = shared_cluster(tp)
    overlapped = cluster.run(async_tp, name, optimizer)
    plain = cluster.run(ours, name, True, optimizer)
    for rank, (got, want) in enumerate(zip(overlapped, plain)):
        assert_matches(got, reference(name, optimizer), f"async TP {name} tp={tp} rank {rank}", optimizer)
        assert_matches(got, want, f"async TP against TP+SP {name} tp={tp} rank {rank}", optimizer)


# --------------------------------------------------------------------------- refusals and bars
def refusals_and_bars(ctx):
    n = ctx.world_size
    untouched = fresh_model(GPT_CFG).to(ctx.device)
    out = {"no sp": _error(lambda: apply_tp(untouched, async_tp=True))}
    out["untouched"] = type(untouched.blocks[0].attn.q).__name__  # a refusal swaps nothing
    x = torch.zeros(2, 13, 4, dtype=DT, device=ctx.device)  # 13 tokens: tp=2 does not divide them
    out["sequence"] = _error(lambda: matmul_reduce_scatter(x, torch.zeros(3, 4, dtype=DT, device=ctx.device)))
    timeline = Timeline(ctx.rank, device=ctx.device)
    model = apply_tp(fresh_model(GPT_CFG).to(ctx.device), sequence_parallel=True, async_tp=True, timeline=timeline)
    batch = data(GPT_CFG).global_batch(0).to(ctx.device)
    out["model sequence"] = _error(lambda: model(batch.inputs[:, : n + 1]))
    batch.loss(model).backward()
    out["bars"] = sorted({(row["lane"], row["name"]) for row in timeline.rows()})
    return out


def test_refusals_and_the_pieces_on_the_timeline():
    out = shared_cluster(2).run(refusals_and_bars)[0]
    assert "pass sequence_parallel=True" in out["no sp"] and "async_tp=True" in out["no sp"]
    assert out["untouched"] == "Linear"
    assert "length 13 along dim 1 is not divisible by the group size 2" in out["sequence"]
    assert "pad it to 14" in out["sequence"]
    assert "3 tokens do not split evenly" in out["model sequence"] and "divisible by 2" in out["model sequence"]
    # Pieces, not blocks: every matmul piece and every ring step of both phases.
    assert out["bars"] == sorted(
        [("compute", f"{phase} matmul piece {c}") for phase in ("forward", "backward") for c in (0, 1)]
        + [("communication", f"{op} step 1") for op in ("all_gather", "reduce_scatter")]
    )
