"""The same training, three ways: ours on ranks, one process, and PyTorch's own.

Every distributed technique in the course is checked the same way. All three runs
start from the same weights, see the same seeded data, and must end with the same
numbers:

    data = Batches(config, mbs=2, seed=0)               # step t -> the same tokens everywhere
    reference = train(GPT(config), data.global_stream(world), steps=3, optimizer="sgd")
    # on every rank, inside cluster.run:
    mine = data.rank_stream(ctx.rank, ctx.world_size)   # this rank's rows of each step
    ours = train(model, mine, steps=3, optimizer="sgd", module=dp,
                 after_backward=dp.finish_gradient_synchronization)
    assert_same(ours, reference, optimizer="sgd")

* ``Batches`` makes the seeded global batch of every (step, micro-step) and slices it:
  by data (rows, for DP and ZeRO), by sequence (columns plus their global positions, for
  context parallelism) or into micro-batches (for pipelines).
* ``run_steps`` is the one training loop: forward, backward, gradient accumulation,
  optional ``no_sync``, a hook after backward, the step; ``train`` runs it and returns
  the final weights.
* ``assert_same`` compares outputs, gradients or weights with the tolerance stated for
  the dtype and optimizer in ``TOLERANCES`` (the reasons are written there).
* ``ddp``, ``fsdp2`` and ``dtensor_tp`` (``parallelize_module``) wrap a model the way
  PyTorch's production versions do, with the same units as ours, so the third run is one line.

The loss is always ``model.lm_loss`` (mean next-token cross-entropy): one definition for
every run, so a difference can only come from the technique.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch

from .model import auxiliary_loss, lm_loss

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

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "adam": (torch.optim.Adam, {"lr": 1e-3}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
}


def tolerance(optimizer: str | None = "sgd", dtype=torch.float32) -> dict:
    """``rtol``/``atol`` for comparing runs that used ``optimizer`` (None: no step) in ``dtype``."""
    family = None if optimizer is None else ("sgd" if optimizer == "sgd" else "adam")
    try:
        return dict(TOLERANCES[dtype, family])
    except KeyError:
        raise ValueError(f"no tolerance stated for {dtype} with {optimizer!r}; add one to "
                         "ultrascale.parity.TOLERANCES with the reason beside it") from None


def make_optimizer(params, optimizer: str = "sgd", **overrides):
    """A torch optimizer by course name ("sgd", "adam", "adamw") with its default settings."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: choose one of {sorted(OPTIMIZERS)}")
    cls, kwargs = OPTIMIZERS[optimizer]
    return cls(params, **{**kwargs, **overrides})


# --------------------------------------------------------------------------- data
@dataclass(frozen=True)
class Batch:
    """Token ids and next-token targets, plus the global positions when the sequence is split."""

    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor | None = None

    def to(self, device) -> "Batch":
        move = lambda t: None if t is None else t.to(device)   # noqa: E731
        return Batch(move(self.inputs), move(self.targets), move(self.positions))

    def loss(self, model) -> torch.Tensor:
        """Mean next-token cross-entropy of ``model`` on this batch (plus the load-balancing
        loss of its MoE layers, if they have one: ``ultrascale.model.auxiliary_loss``)."""
        if self.positions is None:
            return lm_loss(model(self.inputs), self.targets) + auxiliary_loss(model)
        return lm_loss(model(self.inputs, self.positions), self.targets) + auxiliary_loss(model)

    def rows(self, start: int, stop: int) -> "Batch":
        return replace(self, inputs=self.inputs[start:stop], targets=self.targets[start:stop])


@dataclass(frozen=True)
class Batches:
    """Seeded global batches: (step, micro-step) -> the same tokens in every process.

    A step's global batch has ``mbs`` rows per data-parallel rank. Nothing here depends
    on which process asks, so the reference and every rank agree without communicating.
    """

    config: object          # a model config: vocab_size and seq_len are used
    mbs: int = 2            # rows per rank and micro-step
    seed: int = 0

    def global_batch(self, step: int, world_size: int = 1, micro: int = 0) -> Batch:
        g = torch.Generator().manual_seed(1_000_003 * self.seed + 1000 * step + micro)
        shape = (self.mbs * world_size, self.config.seq_len + 1)
        tokens = torch.randint(0, self.config.vocab_size, shape, generator=g)
        return Batch(tokens[:, :-1], tokens[:, 1:])

    def rank_batch(self, rank: int, world_size: int, step: int, micro: int = 0, by: str = "data",
                   layout: str = "contiguous") -> Batch:
        return split(self.global_batch(step, world_size if by == "data" else 1, micro), rank, world_size, by,
                     layout)

    def global_stream(self, world_size: int = 1):
        """``(step, micro) -> Batch``: what one process trains on in place of ``world_size`` ranks."""
        return lambda step, micro=0: self.global_batch(step, world_size, micro)

    def rank_stream(self, rank: int, world_size: int, by: str = "data", layout: str = "contiguous"):
        """``(step, micro) -> Batch``: this rank's share of each step (``layout``: see ``split``)."""
        return lambda step, micro=0: self.rank_batch(rank, world_size, step, micro, by, layout)


SEQUENCE_LAYOUTS = ("contiguous", "zigzag")


def sequence_positions(seq: int, rank: int, world_size: int, layout: str = "contiguous") -> torch.Tensor:
    """The global positions of the tokens that rank ``rank`` holds of a ``seq``-token sequence.

    * ``"contiguous"``: the sequence cut into ``world_size`` chunks; rank r holds chunk r;
    * ``"zigzag"``: cut into ``2 * world_size`` chunks; rank r holds chunks r and
      ``2 * world_size - 1 - r``. Under a causal mask an early chunk has few keys to attend
      to and a late one many, so pairing them gives every rank the same work (context
      parallelism's load balancing; with "contiguous" the last rank does the most).
    A rank's positions are ascending in both. A length that does not cut into equal chunks
    is refused, not padded (padding would need masking in attention and in the loss).
    """
    if layout not in SEQUENCE_LAYOUTS:
        raise ValueError(f"layout={layout!r}: choose one of {SEQUENCE_LAYOUTS}")
    per_rank = 2 if layout == "zigzag" else 1
    chunks = per_rank * world_size
    how = f" in the zigzag layout ({chunks} chunks, 2 per rank)" if layout == "zigzag" else ""
    if seq < chunks:
        raise ValueError(f"{world_size} ranks need more chunks than a sequence of {seq} tokens has{how}: use at "
                         f"most {seq // per_rank} ranks or a longer sequence")
    if seq % chunks:
        raise ValueError(f"{seq} tokens per sequence do not split evenly over {world_size} ranks{how}: pad the "
                         f"sequence to {-(-seq // chunks) * chunks} tokens or choose a length that {chunks} divides")
    size = seq // chunks
    ids = [rank] if layout == "contiguous" else [rank, chunks - 1 - rank]
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in ids])


def split(batch: Batch, rank: int, world_size: int, by: str = "data", layout: str = "contiguous") -> Batch:
    """Rank ``rank``'s share of ``batch``.

    * ``"data"``: rows ``rank*b .. (rank+1)*b`` (b = rows / world_size), as a sampler would;
    * ``"sequence"``: a slice of every row's tokens, with their global positions (RoPE must
      rotate a token by where it is in the whole sequence, not in the slice). ``layout``:
      ``"contiguous"`` (one slice per rank) or ``"zigzag"`` (two chunks per rank, balanced
      for causal attention), see ``sequence_positions``.
    The mean loss over equal shares, averaged over the ranks, is the mean loss of the batch:
    so shares must be equal, and an uneven split is an error rather than a silent bias.
    """
    if by not in ("data", "sequence"):
        raise ValueError(f"by={by!r}: choose 'data' or 'sequence' (micro_batches() cuts micro-batches)")
    if by == "sequence":
        positions = sequence_positions(batch.inputs.shape[1], rank, world_size, layout)
        return Batch(batch.inputs[:, positions], batch.targets[:, positions], positions)
    rows = batch.inputs.shape[0]
    if rows % world_size:
        raise ValueError(f"{rows} rows do not split evenly over {world_size} ranks: "
                         f"choose sizes that {world_size} divides")
    share = rows // world_size
    return batch.rows(rank * share, (rank + 1) * share)


def micro_batches(batch: Batch, n: int) -> list[Batch]:
    """Cut a batch into ``n`` equal micro-batches of rows (gradient accumulation, pipelines)."""
    rows = batch.inputs.shape[0]
    if rows % n:
        raise ValueError(f"{rows} rows do not make {n} equal micro-batches")
    size = rows // n
    return [batch.rows(i * size, (i + 1) * size) for i in range(n)]


# --------------------------------------------------------------------------- the loop
def train(model, batches, steps: int, optimizer="sgd", **options) -> dict:
    """``run_steps`` and then the final weights by name (see ``weights``)."""
    run_steps(model, batches, steps, optimizer, **options)
    return weights(model)


def run_steps(model, batches, steps: int, optimizer="sgd", *, grad_acc: int = 1, module=None,
              no_sync=None, after_backward=None, device=None, first_step: int = 0) -> list:
    """Train ``model`` for ``steps`` optimizer steps: the one training loop of the course.

    ``batches(step, micro)`` gives each micro-batch; losses are divided by ``grad_acc`` so
    the accumulated gradient is the mean over the step's micro-batches.
    ``optimizer``: a course name ("sgd", "adam", "adamw"), or an object with ``step`` and
    ``zero_grad`` (a torch optimizer, or ZeRO, which is its own optimizer). A name builds a
    fresh optimizer, so to go on over several calls pass the same object each time.
    ``module``: what to call for the forward, if not ``model`` (e.g. a DP wrapper).
    ``no_sync``: a context manager factory used for all micro-batches but the last
    (DDP's and our DP's ``no_sync``). ``after_backward``: called after every backward
    that is not inside ``no_sync`` (our DP's ``finish_gradient_synchronization``; DDP
    does that job inside backward by itself). ``first_step``: the index of the first
    step's data, to go on where an earlier call stopped. Returns the loss curve: each
    step's loss on this process (the mean over its micro-batches), as floats.
    """
    module = model if module is None else module
    opt = make_optimizer(model.parameters(), optimizer) if isinstance(optimizer, str) else optimizer
    losses = []
    for step in range(first_step, first_step + steps):
        loss = 0.0
        for micro in range(grad_acc):
            local = no_sync is not None and micro < grad_acc - 1
            with no_sync() if local else contextlib.nullcontext():
                batch = batches(step, micro)
                part = batch.to(device).loss(module) / grad_acc
                part.backward()
                loss += part.item()
            if after_backward is not None and not local:
                after_backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    return losses


def perturbed(model, scale: float = 0.05, seed: int = 0):
    """``model`` with every parameter moved by ``scale`` * N(0, 1), in place, and returned.

    Freshly built, biases are 0 and norm weights 1, so a bias added on every rank or a norm
    gradient left unsummed can hide behind them; after this they cannot."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator, dtype=p.dtype).to(p.device))
    return model


def first_step_and_train(model, data: "Batches", steps: int, optimizer="sgd", *, full_weights=None,
                         loss_context=None, **readers) -> dict:
    """``first_step`` on batch 0 of ``data``, then ``steps`` optimizer steps on its global
    batches, then the weights: ``{"logits", "loss", "grads", "weights"}``, what a parity
    check of a model-parallel technique compares. ``readers``: ``full_logits`` and
    ``full_gradients`` as in ``first_step``; ``full_weights`` reads the weights (default
    ``weights``). ``loss_context`` wraps the whole run (DTensor's ``loss_parallel``)."""
    with loss_context() if loss_context is not None else contextlib.nullcontext():
        out = first_step(model, data.global_batch(0), **readers)
        run_steps(model, data.global_stream(1), steps, optimizer)
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
    out = {"logits": (full_logits or _full)(logits).detach(), "loss": _full(loss),
           "grads": (full_gradients or gradients)(model)}
    model.zero_grad(set_to_none=True)
    return out


# --------------------------------------------------------------------------- reading and comparing
def _full(t: torch.Tensor, name: str = "") -> torch.Tensor:
    """A plain CPU copy; a DTensor (FSDP2, DTensor TP) is gathered first (a collective)."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    needed = (t.storage_offset() + t.numel()) * t.element_size()
    if t.numel() and t.untyped_storage().nbytes() < needed:
        # Reading a freed storage would crash the process, not raise.
        raise RuntimeError(f"{name}: its storage is freed (ZeRO-3 keeps only a shard between "
                           "forwards); read the weights with zero.full_state_dict() instead")
    return t.detach().cpu().clone()


def weights(model) -> dict:
    """Every parameter by name, as plain CPU tensors."""
    return {name: _full(p, name) for name, p in model.named_parameters()}


def gradients(model) -> dict:
    """Every gradient by name (None where a parameter has none), as plain CPU tensors."""
    return {name: None if p.grad is None else _full(p.grad, name) for name, p in model.named_parameters()}


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

    for unit in (model.blocks if units is None else units):
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
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    tied = model.head.weight is model.embed.weight
    sp = sequence_parallel
    residual = Shard(1) if sp else Replicate()   # the layout between the TP regions

    def region(args: int):   # Attention takes (x, cos, sin, recompute_core), the MLP just x
        return PrepareModuleInput(input_layouts=(residual,) + (None,) * (args - 1),
                                  desired_input_layouts=(Replicate(),) + (None,) * (args - 1),
                                  use_local_output=False)

    mlp = ("gate", "up", "down") if hasattr(model.blocks[0].mlp, "gate") else ("fc", "proj")
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual, use_local_output=not sp),
        "blocks.*.attn": region(4),
        "blocks.*.attn.q": ColwiseParallel(), "blocks.*.attn.k": ColwiseParallel(),
        "blocks.*.attn.v": ColwiseParallel(),
        "blocks.*.attn.out": RowwiseParallel(output_layouts=residual, use_local_output=not sp),
        "blocks.*.mlp": region(1),
        **{f"blocks.*.mlp.{name}": ColwiseParallel() for name in mlp[:-1]},
        f"blocks.*.mlp.{mlp[-1]}": RowwiseParallel(output_layouts=residual, use_local_output=not sp),
        "head": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        plan.update({"blocks.*.norm1": SequenceParallel(), "blocks.*.norm2": SequenceParallel(),
                     "norm": SequenceParallel()})
    parallelize_module(model, device_mesh, plan)
    if tied:
        model.head.weight = model.embed.weight
    return model
