"""The parity runs of expert parallelism, shared by its tests, chapter 08, its exercises and
its benchmark: the same MoE model trained on one process and on expert-parallel ranks.

Both start from the same weights (``moe_model``: seeded, then ``parity.perturbed`` so that
no bias or norm weight hides at its initial value) and see the same seeded tokens
(``data.Batches``): one process the whole global batch of each step, rank r its rows
r*mbs .. (r+1)*mbs - 1, as data parallelism would. The ranks here are all data ranks: a
plain group, or a mesh of dp and ep only (dp outer, so a rank's data index is its rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import CommLogger
from ..data import Batches
from ..model import build_model
from ..parallel.expert_parallel import apply_ep, dispatch_plan, dispatch_volume, exchange_counts, rank_load
from ..parallel.mesh import init_mesh
from ..train import run_steps, weights
from . import assert_same, first_step, merge_ranks, perturbed

__all__ = ["moe_model", "one_process_run", "ep_rank_run", "merged", "assert_ep_matches", "layer_traffic"]


def moe_model(config, seed: int = 0, selection_bias=None, device=None):
    """The model every run starts from: the same weights in every process. ``selection_bias``
    (E numbers): every router's ``selection_bias``, e.g. to skew the routing. ``device``: where
    it goes (``ctx.device`` on a rank); built on the host from the seed, then moved."""
    torch.manual_seed(seed)
    model = perturbed(build_model(config).to(device), seed=seed)
    if selection_bias is not None:
        for name, buffer in model.named_buffers():
            if name.endswith("router.selection_bias"):
                buffer.copy_(torch.as_tensor(selection_bias, dtype=buffer.dtype))
    return model


def _train(model, first, stream, steps: int, optimizer, device=None) -> dict:
    out = first_step(model, first.to(device))
    out["losses"] = run_steps(model, stream, steps, optimizer, first_step=1, device=device)
    out["weights"] = weights(model)
    return out


def one_process_run(
    config, world_size: int, steps: int = 2, optimizer: str = "sgd", mbs: int = 2, seed: int = 0, selection_bias=None
) -> dict:
    """The reference: logits, loss and gradients of step 0's global batch, then ``steps`` steps."""
    data = Batches(config, mbs=mbs, seed=seed)
    return _train(
        moe_model(config, seed, selection_bias),
        data.global_batch(0, world_size),
        data.global_stream(world_size),
        steps,
        optimizer,
    )


def ep_rank_run(
    ctx,
    config,
    steps: int = 2,
    optimizer: str = "sgd",
    mbs: int = 2,
    seed: int = 0,
    mesh_sizes: dict | None = None,
    apply=apply_ep,
    selection_bias=None,
) -> dict:
    """On every rank: the same run with ``apply(model, mesh_or_group)`` (default ``apply_ep``).
    ``mesh_sizes``: e.g. ``{"dp": 2, "ep": 2}`` (None: ep over all ranks, a plain group)."""
    mesh = None
    if mesh_sizes:
        mesh = init_mesh(ctx, joint=[("dp", "ep")] if len(mesh_sizes) > 1 else (), **mesh_sizes)
    model = apply(moe_model(config, seed, selection_bias, device=ctx.device), mesh)
    data = Batches(config, mbs=mbs, seed=seed)
    return _train(
        model,
        data.rank_batch(ctx.rank, ctx.world_size, 0),
        data.rank_stream(ctx.rank, ctx.world_size),
        steps,
        optimizer,
        device=ctx.device,
    )


def merged(per_rank: list) -> dict:
    """One run from every rank's: the logits of all rows in data order, the whole model's
    gradients and weights (a dense tensor must be bit-identical on every rank)."""
    return {
        "logits": torch.cat([r["logits"] for r in per_rank]),
        "grads": merge_ranks([r["grads"] for r in per_rank]),
        "weights": merge_ranks([r["weights"] for r in per_rank]),
        "loss": torch.stack([r["loss"] for r in per_rank]).mean(),
        "losses": [sum(c) / len(c) for c in zip(*(r["losses"] for r in per_rank))],
    }


def assert_ep_matches(per_rank: list, reference: dict, optimizer: str = "sgd", what: str = "EP") -> dict:
    """Logits, loss, gradients and weights of the ranks equal the one-process run's
    (``parity.TOLERANCES``). Returns the merged run."""
    ours = merged(per_rank)
    assert_same(ours["logits"], reference["logits"], f"{what} logits", optimizer=None)
    assert_same(ours["loss"], reference["loss"], f"{what} loss", optimizer=None)
    assert_same(ours["grads"], reference["grads"], f"{what} gradients", optimizer=None)
    assert_same(ours["weights"], reference["weights"], f"{what} weights", optimizer=optimizer)
    return ours


def layer_traffic(moe, x) -> dict:
    """One forward and backward of the expert-parallel MoE layer ``moe`` on this rank's tokens
    ``x`` (T, h), under ``CommLogger``: the bytes this rank sent per label of its all-to-alls,
    ``"logged"`` [forward, backward], the prediction ``dispatch_volume`` makes from the split
    sizes, ``"predicted"``, the split sizes ``"send"`` and the choices per rank ``"load"``.
    Other collectives (a gradient hook's all-reduce) are left out: they are not EP's traffic."""
    dispatch = moe.experts_forward
    weights, chosen, _ = moe.router(x)
    plan = dispatch_plan(chosen, weights, dispatch.ep, dispatch.per_rank)
    receive = exchange_counts(plan.send_counts, dispatch.group, x.device)
    with CommLogger() as forward:
        y = dispatch(x, chosen, weights)
    with CommLogger() as backward:
        y.square().sum().backward()
    ep_ops = lambda log: {
        op: t["bytes_sent"]
        for op, t in log.totals().items()  # noqa: E731
        if op.startswith("ep ") or op.startswith("all_to_all")
    }
    rank, (hidden, k) = dist.get_rank(dispatch.group), (x.shape[-1], chosen.shape[1])
    return {
        "logged": [ep_ops(forward), ep_ops(backward)],
        "predicted": [
            dispatch_volume(plan.send_counts, receive, rank, hidden, k, x.element_size(), backward=b)
            for b in (False, True)
        ],
        "send": plan.send_counts,
        "load": rank_load(chosen, moe.num_experts, dispatch.ep).tolist(),
    }
