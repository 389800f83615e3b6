"""The same training, three ways: ours on ranks, one process, and PyTorch's own.

Every distributed technique in the course is checked the same way. All three runs
start from the same weights, see the same seeded data (``ultrascale.data``), train with
the same loop (``ultrascale.train``) and must end with the same numbers:

    data = Batches(config, mbs=2, seed=0)               # step t -> the same tokens everywhere
    reference = train(GPT(config), data.global_stream(world), steps=3, optimizer="sgd")
    # on every rank, inside cluster.run:
    mine = data.rank_stream(ctx.rank, ctx.world_size)   # this rank's rows of each step
    ours = train(model, mine, steps=3, optimizer="sgd", module=dp,
                 after_backward=dp.finish_gradient_synchronization)
    assert_same(ours, reference, optimizer="sgd")

* ``assert_same`` compares outputs, gradients or weights with the tolerance stated for
  the dtype and optimizer in ``TOLERANCES`` (the reasons are written there).
* ``first_step`` and ``first_step_and_train`` collect what a model-parallel check compares
  (logits, loss, gradients, weights); ``perturbed`` moves every weight off its initial value.
* ``ddp``, ``fsdp2`` and ``dtensor_tp`` (``parallelize_module``) wrap a model the way
  PyTorch's production versions do, with the same units as ours, so the third run is one line.

* ``merge_ranks`` puts the whole model together from every rank's share, by name.

The parity runs of single techniques and of their composition live beside these checks:
``parity.pipeline_runs`` (a pipeline against gradient accumulation in one process, and
PyTorch's ``torch.distributed.pipelining`` on the same stages), ``parity.expert_runs``
(expert parallelism against one process) and ``parity.composition`` (5D parallelism
against one process).

Techniques import ``data`` and ``train``, never this package: checking is for chapters,
tests, exercise tests and benchmarks.
"""

from __future__ import annotations

import contextlib

import torch

from ..data import Batch, Batches
from ..model import auxiliary_loss, lm_loss
from ..train import cpu_copy, gradients, run_steps, weights

# --------------------------------------------------------------------------- tolerances
# Why the runs differ at all: each rank averages the loss over its own samples and the
# collective adds those averages, while one process averages the whole batch at once.
# That is the same number in exact arithmetic; in floating point the additions are
# associated differently, so gradients differ in the last bits (relative ~1e-7 in fp32,
# ~1e-16 in fp64). What the optimizer then does with that difference sets the tolerance:
# * SGD moves a weight by lr * gradient, linear in the difference: a few steps at lr 0.1
#   leave ~1e-8 in fp32 (measured). We allow 5e-6, far below one step's move (~1e-2), so
#   a missing division by N (an N times larger step) or a lost gradient fails by far.
# * Adam divides by sqrt(v), which magnifies a last-bit difference where a gradient is
#   nearly zero (1.8e-5 seen on rare-token embedding rows at 5 ranks), but it never moves
#   a weight by much more than lr (1e-3) per step. We allow 5e-5: 5% of one step.
#   Adam is blind to the gradient's *scale*, so every Adam check has an SGD twin.
# * fp64 shrinks the rounding by ~1e9: the same arguments give 1e-12 and 1e-10.
# * bf16 keeps 8 bits of mantissa: one rounding is 2^-8 = 0.4% relative.
TOLERANCES = {
    (torch.float32, "sgd"): dict(rtol=1e-5, atol=5e-6),
    (torch.float32, "adam"): dict(rtol=1e-4, atol=5e-5),
    (torch.float64, "sgd"): dict(rtol=1e-10, atol=1e-12),
    (torch.float64, "adam"): dict(rtol=1e-8, atol=1e-10),
    (torch.bfloat16, "sgd"): dict(rtol=1.6e-2, atol=1e-3),
    (torch.bfloat16, "adam"): dict(rtol=1.6e-2, atol=1e-3),
}
# Outputs and gradients of one forward/backward (no optimizer in between): rounding only.
TOLERANCES.update({(dtype, None): TOLERANCES[dtype, "sgd"] for dtype, _ in list(TOLERANCES)})


def tolerance(optimizer: str | None = "sgd", dtype=torch.float32) -> dict:
    """``rtol``/``atol`` for comparing runs that used ``optimizer`` (None: no step) in ``dtype``."""
    family = None if optimizer is None else ("sgd" if optimizer == "sgd" else "adam")
    try:
        return dict(TOLERANCES[dtype, family])
    except KeyError:
        raise ValueError(
            f"no tolerance stated for {dtype} with {optimizer!r}; add one to "
            "ultrascale.parity.TOLERANCES with the reason beside it"
        ) from None


# --------------------------------------------------------------------------- what a check compares
def perturbed(model, scale: float = 0.05, seed: int = 0):
    """``model`` with every parameter moved by ``scale`` * N(0, 1), in place, and returned.

    Freshly built, biases are 0 and norm weights 1, so a bias added on every rank or a norm
    gradient left unsummed can hide behind them; after this they cannot."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator, dtype=p.dtype).to(p.device))
    return model


def first_step_and_train(
    model, data: "Batches", steps: int, optimizer="sgd", *, full_weights=None, loss_context=None, device=None, **readers
) -> dict:
    """``first_step`` on batch 0 of ``data``, then ``steps`` optimizer steps on its global
    batches, then the weights: ``{"logits", "loss", "grads", "weights"}``, what a parity
    check of a model-parallel technique compares. ``readers``: ``full_logits`` and
    ``full_gradients`` as in ``first_step``; ``full_weights`` reads the weights (default
    ``weights``). ``loss_context`` wraps the whole run (DTensor's ``loss_parallel``).
    ``device``: where the batches go, the model's device (a rank's ``ctx.device``; None:
    they stay where ``data`` makes them, on the host)."""
    with loss_context() if loss_context is not None else contextlib.nullcontext():
        out = first_step(model, data.global_batch(0).to(device), **readers)
        run_steps(model, data.global_stream(1), steps, optimizer, device=device)
    return {**out, "weights": (full_weights or weights)(model)}


def first_step(model, batch: Batch, *, full_logits=None, full_gradients=None, loss_context=None) -> dict:
    """Logits, loss and every gradient of one forward and backward on ``batch``, the first
    things a parity check compares; the gradients are cleared afterwards.

    ``full_logits`` / ``full_gradients`` read a sharded model whole (TP's
    ``VocabParallelLogits.full_tensor`` and ``full_gradients``; a DTensor is gathered by
    default). ``loss_context``: e.g. DTensor's ``loss_parallel`` for vocabulary-sharded logits.
    """
    with loss_context() if loss_context is not None else contextlib.nullcontext():
        logits = model(batch.inputs)
        loss = lm_loss(logits, batch.targets) + auxiliary_loss(model)
        loss.backward()
    out = {
        "logits": (full_logits or cpu_copy)(logits).detach(),
        "loss": cpu_copy(loss),
        "grads": (full_gradients or gradients)(model),
    }
    model.zero_grad(set_to_none=True)
    return out


# --------------------------------------------------------------------------- comparing
def max_difference(got, expected) -> float:
    """Largest absolute difference over matching entries of two dicts of tensors (or two tensors)."""
    if torch.is_tensor(expected):
        return (got.double() - expected.double()).abs().max().item()
    return max(max_difference(got[n], expected[n]) for n in expected)


def assert_same(got, expected, what: str = "", *, optimizer: str | None = "sgd", dtype=None, tol=None):
    """Assert that ``got`` equals ``expected`` within the stated tolerance.

    Both are tensors, or dicts of them by name (weights, gradients). The tolerance is
    ``tol`` if given, else ``tolerance(optimizer, dtype)`` with the dtype of the data.
    The failure message names the entry and the largest difference.
    """
    if torch.is_tensor(expected):
        got, expected = {"": got}, {"": expected}
    missing, extra = expected.keys() - got.keys(), got.keys() - expected.keys()
    assert not missing and not extra, f"{what}: missing {sorted(missing)}, unexpected {sorted(extra)}"
    for name, want in expected.items():
        have = got[name]
        if want is None or have is None:
            assert want is None and have is None, f"{what} {name}: one is None, the other is not"
            continue
        t = tol or tolerance(optimizer, dtype or want.dtype)
        torch.testing.assert_close(have, want, **t, msg=lambda m, n=name: f"{what} {n}: {m}".strip())


def merge_ranks(per_rank: list) -> dict:
    """The whole model's tensors from every rank's ``weights()`` or ``gradients()``. A tensor two
    ranks hold (the tied embedding) must be bit-identical on both."""
    out = {}
    for rank, tensors in enumerate(per_rank):
        for name, t in tensors.items():
            if name in out and not (t is None and out[name] is None or torch.equal(t, out[name])):
                raise AssertionError(f"{name} differs between rank {rank} and an earlier rank")
            out[name] = t
    return out


def assert_replicas_identical(per_rank: list, what: str = "") -> None:
    """Every rank holds bit-identical tensors: they applied the very same update."""
    for rank, tensors in enumerate(per_rank[1:], start=1):
        for name, t in tensors.items():
            assert torch.equal(t, per_rank[0][name]), f"{what}: rank {rank} differs from rank 0 on {name}"


# --------------------------------------------------------------------------- PyTorch's own
def ddp(model, **kwargs):
    """PyTorch's DistributedDataParallel around ``model`` (e.g. ``bucket_cap_mb=...``)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, **kwargs)


def device_mesh_1d(ctx):
    """One flat torch DeviceMesh over all ranks, built once per rank and kept on ``ctx``."""
    from torch.distributed.device_mesh import init_device_mesh

    if "parity.mesh_1d" not in ctx.state:
        ctx.state["parity.mesh_1d"] = init_device_mesh(ctx.device.type, (ctx.world_size,))
    return ctx.state["parity.mesh_1d"]


def fsdp2(model, mesh, units=None):
    """PyTorch's FSDP2: ``fully_shard`` each unit (default: each block), then the rest.

    These are the same units as our ZeRO-3, so both gather and free the same parameters.
    """
    from torch.distributed.fsdp import fully_shard

    for unit in model.blocks if units is None else units:
        fully_shard(unit, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def dtensor_tp(model, device_mesh, sequence_parallel: bool = False):
    """PyTorch's tensor (and sequence) parallelism on the course GPT or Llama, with the same
    layout as ``parallel.tensor_parallel.apply_tp``: ``parallelize_module`` with
    ColwiseParallel q, k, v, fc (gate, up), RowwiseParallel out, proj (down), the embedding
    RowwiseParallel over vocabulary rows and the head ColwiseParallel over the vocabulary,
    its logits left as a DTensor sharded on the vocabulary. So train it (forward *and*
    backward) inside ``torch.distributed.tensor.parallel.loss_parallel()``, which makes
    ``F.cross_entropy`` (hence ``lm_loss``) the parallel cross-entropy.

    The attention and MLP modules get ``PrepareModuleInput``: their input becomes one
    replicated DTensor (an all-gather of the sequence with SP) that q, k and v share, as
    our ``parallel_region`` style does. With ``sequence_parallel`` the norms get
    ``SequenceParallel`` and the residual stream stays a DTensor sharded on the sequence;
    DTensor shapes are global, so the model computes its RoPE positions from the full length
    without help. GPT's tied embedding and head are tied again after sharding (both are
    sharded by vocabulary rows, ``Shard(0)``).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tied = model.head.weight is model.embed.weight
    sp = sequence_parallel
    residual = Shard(1) if sp else Replicate()  # the layout between the TP regions

    def region(args: int):  # Attention takes (x, cos, sin, recompute_core), the MLP just x
        return PrepareModuleInput(
            input_layouts=(residual,) + (None,) * (args - 1),
            desired_input_layouts=(Replicate(),) + (None,) * (args - 1),
            use_local_output=False,
        )

    mlp = ("gate", "up", "down") if hasattr(model.blocks[0].mlp, "gate") else ("fc", "proj")
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual, use_local_output=not sp),
        "blocks.*.attn": region(4),
        "blocks.*.attn.q": ColwiseParallel(),
        "blocks.*.attn.k": ColwiseParallel(),
        "blocks.*.attn.v": ColwiseParallel(),
        "blocks.*.attn.out": RowwiseParallel(output_layouts=residual, use_local_output=not sp),
        "blocks.*.mlp": region(1),
        **{f"blocks.*.mlp.{name}": ColwiseParallel() for name in mlp[:-1]},
        f"blocks.*.mlp.{mlp[-1]}": RowwiseParallel(output_layouts=residual, use_local_output=not sp),
        "head": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        plan.update(
            {"blocks.*.norm1": SequenceParallel(), "blocks.*.norm2": SequenceParallel(), "norm": SequenceParallel()}
        )
    parallelize_module(model, device_mesh, plan)
    if tied:
        model.head.weight = model.embed.weight
    return model
