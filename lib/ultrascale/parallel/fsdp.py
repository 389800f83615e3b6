"""Per-parameter sharding, as PyTorch's FSDP2 (``fully_shard``) does it.

ZeRO-3 (``zero.py``) flattens a unit's parameters into one padded buffer and steps hidden
slices of it with an optimizer of its own. Here every parameter is sharded by itself:

* After ``apply_fsdp(model, group)`` each sharded parameter's data is this rank's rows of
  it (dim 0, cut as ``torch.chunk`` cuts: ``ceil(rows / N)`` rows per rank, the last ranks
  short or empty; FSDP2 cuts the same way, so our shards have its shapes). Its ``.grad``
  after backward is the averaged gradient of those rows, of the same shape. So any
  ``torch.optim`` optimizer steps ``model.parameters()`` as if nothing were sharded.
* A unit (each block, and the rest of the model) gathers its parameters with one
  all-gather before its forward, frees them after, gathers them again when backward
  reaches it, and reduce-scatters the gradients with one reduce-scatter after its backward.
  Shards are padded to equal rows only inside those two collectives.
* ``replicate``: parameters kept whole on every rank (norms, say), whose gradients are
  all-reduced instead: identical on every rank.
* ``mp_policy`` (torch's ``MixedPrecisionPolicy``): gather the weights in ``param_dtype``
  (bf16: half the bytes) while the shards, the masters, stay in their own dtype;
  reduce the gradients in ``reduce_dtype`` (default: the dtype they were computed in),
  then store them in the master's dtype for the optimizer.
* A 2-D torch ``DeviceMesh`` (replicate, shard) gives hybrid sharding (HSDP): shards over
  the second axis, and the sharded gradients are all-reduced over the first, as
  ``fully_shard`` does with a 2-D mesh.

Between forwards a rank holds only its shards; ``full_state_dict(model)`` gathers the whole
parameters (a collective) to save or compare them. No prefetch (each gather waits), and
no activation recomputation: the gathered weights would be needed inside backward.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm.functional import all_gather_into, reduce_scatter_into
from .mesh import Mesh, axis_group
from .zero import PLAN, units_of

__all__ = ["apply_fsdp", "full_state_dict", "fsdp_units", "pad_rows", "shard_rows"]


def shard_rows(rows: int, n: int, rank: int) -> tuple[int, int]:
    """``(start, length)`` of ``rank``'s rows out of ``rows`` cut over ``n`` ranks, as
    ``torch.chunk`` cuts: ``ceil(rows / n)`` each, the last ones short or empty."""
    per = -(-rows // n)
    start = min(rank * per, rows)
    return start, min(per, rows - start)


@dataclass
class Entry:
    """One parameter of a unit: the tensor the optimizer steps and where the module reads it."""

    param: nn.Parameter  # the shard (sharded) or the whole tensor (replicated)
    owners: list  # (module, attribute name): two for a tied weight
    full_shape: torch.Size
    sharded: bool
    rows: int = 0  # rows per rank inside the collectives (padded)


@dataclass
class Unit:
    """A module whose parameters are gathered together (one all-gather, one reduce-scatter)."""

    module: nn.Module
    entries: list = field(default_factory=list)
    fulls: list | None = None  # the gathered tensors while forward or backward needs them
    freed: bool = False  # gathered, then freed after forward: gather again in backward


class FSDP:
    """What ``apply_fsdp`` attaches to the model (``model.fsdp``): groups, policy, units."""

    def __init__(self, shard_group, replicate_group, mp_policy):
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.n = dist.get_world_size(shard_group)
        self.replicas = 1 if replicate_group is None else dist.get_world_size(replicate_group)
        self.param_dtype = getattr(mp_policy, "param_dtype", None)
        self.reduce_dtype = getattr(mp_policy, "reduce_dtype", None)
        self.cast_inputs = getattr(mp_policy, "cast_forward_inputs", True)
        self.units: list[Unit] = []
        self.entries: dict[int, Entry] = {}  # id(parameter) -> its entry

    def entry(self, param) -> Entry:
        """How ``param`` (a parameter of the model) is sharded."""
        if id(param) not in self.entries:
            raise ValueError("this parameter is not one of the model apply_fsdp sharded")
        return self.entries[id(param)]

    # ---- gathering ------------------------------------------------------------------
    def gather(self, unit: Unit, dtype=None, into=None) -> list:
        """The unit's whole parameters (sharded ones all-gathered in one collective, in
        ``dtype``; replicated ones copied), written ``into`` existing tensors if given."""
        sharded = [e for e in unit.entries if e.sharded]
        fulls = list(into) if into is not None else [None] * len(unit.entries)
        if sharded:
            flat = torch.cat(
                [pad_rows(e.param.detach(), e.rows).reshape(-1).to(dtype or e.param.dtype) for e in sharded]
            )
            gathered = flat.new_empty(self.n * flat.numel())
            all_gather_into(gathered, flat, self.shard_group)
            rank_major = gathered.view(self.n, -1)  # row r: rank r's padded shards, side by side
            offset = 0
            for i, e in enumerate(unit.entries):
                if e.sharded:  # every rank's rows of this parameter, one under the other, padding cut
                    size = e.rows * _row_numel(e.full_shape)
                    piece = rank_major[:, offset : offset + size].reshape(-1, *e.full_shape[1:])[: e.full_shape[0]]
                    fulls[i], offset = _refill(fulls[i], piece), offset + size
        for i, e in enumerate(unit.entries):
            if not e.sharded:
                fulls[i] = _refill(fulls[i], e.param.detach().to(dtype or e.param.dtype))
        return fulls

    # ---- reducing ---------------------------------------------------------------------
    def reduce_gradients(self, unit: Unit, grads) -> list:
        """The averaged gradient of each entry, in its parameter's dtype and shape: one
        reduce-scatter for the sharded ones (then an all-reduce over the replicas, HSDP),
        all-reduces for the replicated ones."""
        total = self.n * self.replicas
        out = [None] * len(unit.entries)
        sharded = [i for i, e in enumerate(unit.entries) if e.sharded]
        if sharded:
            dtype = self.reduce_dtype or grads[sharded[0]].dtype
            # rank r's padded rows of every gradient side by side: row r goes to rank r
            flat = torch.cat(
                [pad_rows(grads[i].to(dtype), unit.entries[i].rows * self.n).reshape(self.n, -1) for i in sharded],
                dim=1,
            )
            mine = flat.new_empty(flat.shape[1])
            reduce_scatter_into(mine, flat.reshape(-1), self.shard_group)
            if self.replicate_group is not None:
                dist.all_reduce(mine, group=self.replicate_group)
            mine.div_(total)
            offset = 0
            for i in sharded:
                e = unit.entries[i]
                size = e.rows * _row_numel(e.full_shape)
                local = mine[offset : offset + size].view(e.rows, *e.full_shape[1:])[: e.param.shape[0]]
                out[i], offset = local.to(e.param.dtype), offset + size
        for i, e in enumerate(unit.entries):
            if not e.sharded:
                g = grads[i].to(self.reduce_dtype or grads[i].dtype)  # a new tensor only if cast
                g = g.clone() if g is grads[i] else g
                dist.all_reduce(g, group=self.shard_group)  # None: all ranks
                if self.replicate_group is not None:
                    dist.all_reduce(g, group=self.replicate_group)
                out[i] = g.div_(total).to(e.param.dtype)
        return out

    # ---- the hooks on each unit --------------------------------------------------------
    def pre_forward(self, unit: Unit, args, kwargs):
        if self.cast_inputs and self.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.param_dtype)
        params = [e.param for e in unit.entries]
        unit.fulls = list(Unshard.apply(self, unit, *params))
        unit.freed = False
        for e, full in zip(unit.entries, unit.fulls):
            for module, name in e.owners:  # an instance attribute hides the registered shard
                module.__dict__[name] = full
        return args, kwargs

    def post_forward(self, unit: Unit, output):
        for e in unit.entries:  # outside forward, the module shows its shards again
            for module, name in e.owners:
                module.__dict__.pop(name, None)
        outputs = [t for t in _tensors(output) if t.requires_grad]
        if not (torch.is_grad_enabled() and outputs):
            self.free(unit)  # inference: nothing comes back
            return
        if unit is not self.units[0]:  # the root's backward starts at once: keep it gathered
            self.free(unit)
            unit.freed = True
            for t in outputs:  # fires when backward reaches this unit's output
                t.register_hook(lambda grad, u=unit: self.pre_backward(u))

    def pre_backward(self, unit: Unit):
        if unit.freed:  # refill the very tensors autograd saved in forward
            for e, full in zip(unit.entries, unit.fulls):
                if e.sharded:
                    full.untyped_storage().resize_(full.numel() * full.element_size())
            self.gather(unit, self.param_dtype, into=unit.fulls)
            unit.freed = False

    def free(self, unit: Unit):
        for e, full in zip(unit.entries, unit.fulls or []):
            if e.sharded:
                full.untyped_storage().resize_(0)


class Unshard(torch.autograd.Function):
    """Forward: a unit's shards -> its whole parameters (all-gather). Backward: the whole
    parameters' gradients -> the shards' (reduce-scatter); autograd adds them into each
    shard's ``.grad``, so accumulation over micro-batches just works."""

    @staticmethod
    def forward(ctx, fsdp, unit, *params):
        ctx.fsdp, ctx.unit = fsdp, unit
        return tuple(fsdp.gather(unit, fsdp.param_dtype))

    @staticmethod
    def backward(ctx, *grads):
        reduced = ctx.fsdp.reduce_gradients(ctx.unit, grads)
        ctx.fsdp.free(ctx.unit)  # backward is done with this unit's weights
        ctx.unit.fulls = None
        return (None, None, *reduced)


# --------------------------------------------------------------------------- applying
def apply_fsdp(
    model: nn.Module, mesh_or_group=None, *, plan=None, timeline=None, replicate=(), mp_policy=None
) -> nn.Module:
    """Shard ``model``'s parameters per parameter over ``mesh_or_group`` and return it.

    ``mesh_or_group``: a process group (None: all ranks), a course ``Mesh`` (its dp axis), a
    1-D torch ``DeviceMesh``, or a 2-D one whose dims are (replicate, shard): hybrid sharding;
    the same two groups may come as a pair ``(replicate group or None, shard group)``.
    ``plan``: the units gathered together, {module-name pattern: "unit"} as ZeRO's (default
    each block; the model itself is the unit of the rest). ``timeline``: per-block compute bars.
    ``replicate``: name patterns (fnmatch) of parameters kept whole, e.g. ``("*norm*",)``.
    ``mp_policy``: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` (param and reduce dtypes).
    Every rank must start from the same weights (a seeded model, or ``broadcast_parameters``).
    """
    if getattr(model, "recompute", "none") != "none":
        raise ValueError(
            "apply_fsdp does not support activation recomputation (the recomputed forward would "
            "gather again inside backward): call model.set_recompute('none') first"
        )
    if getattr(mp_policy, "output_dtype", None) is not None:
        raise ValueError("mp_policy.output_dtype is not supported here: leave it None")
    shard_group, replicate_group = _groups(mesh_or_group)
    fsdp = FSDP(shard_group, replicate_group, mp_policy)
    names = {id(p): n for n, p in model.named_parameters()}
    modules = [model] + units_of(model, PLAN if plan is None else plan)
    owner_unit = {}  # each module belongs to the innermost unit around it
    for unit_module in modules:
        for m in unit_module.modules():
            owner_unit[m] = unit_module
    rank = dist.get_rank(shard_group)
    by_param, by_module = {}, {m: Unit(m) for m in modules}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is None:
                continue
            unit = by_module[owner_unit[module]]
            if id(p) in by_param:  # a tied weight: one more place that reads it
                entry, first = by_param[id(p)]
                if first is not unit:
                    raise ValueError(f"{names[id(p)]} is shared by modules of two units: put them in one")
                entry.owners.append((module, attr))
                continue
            entry = _shard(p, names[id(p)], replicate, fsdp.n, rank)
            entry.owners.append((module, attr))
            unit.entries.append(entry)
            by_param[id(p)] = entry, unit
            fsdp.entries[id(p)] = entry
    fsdp.units = [by_module[m] for m in modules]
    for unit in fsdp.units:
        unit.module.register_forward_pre_hook(lambda m, a, k, u=unit: fsdp.pre_forward(u, a, k), with_kwargs=True)
        unit.module.register_forward_hook(lambda m, a, out, u=unit: fsdp.post_forward(u, out))
    if timeline is not None and hasattr(model, "blocks"):
        timeline.instrument(model.blocks)
    model.fsdp = fsdp
    return model


def full_state_dict(model: nn.Module) -> dict:
    """Every parameter whole, by name, as CPU tensors in its own dtype (a collective: every
    rank of the model's groups calls it)."""
    fsdp: FSDP = model.fsdp
    whole = {}
    for unit in fsdp.units:
        for e, full in zip(unit.entries, fsdp.gather(unit)):
            whole[id(e.param)] = full
    return {name: whole[id(p)].cpu() for name, p in model.named_parameters()}


def fsdp_units(model: nn.Module) -> list:
    """The units of a model ``apply_fsdp`` sharded, root first."""
    return model.fsdp.units


# --------------------------------------------------------------------------- helpers
def _shard(p: nn.Parameter, name: str, replicate, n: int, rank: int) -> Entry:
    """Cut ``p`` to this rank's rows in place (unless ``replicate`` names it)."""
    if p.ndim == 0 or any(fnmatch.fnmatch(name, pattern) for pattern in replicate):
        return Entry(p, [], p.shape, sharded=False)
    start, length = shard_rows(p.shape[0], n, rank)
    entry = Entry(p, [], p.shape, sharded=True, rows=-(-p.shape[0] // n))
    p.data = p.data.narrow(0, start, length).clone()  # a storage of the shard's size only
    return entry


def _groups(mesh_or_group):
    """(shard group, replicate group or None) from a group, a 1-D or 2-D DeviceMesh, or the
    two groups of a 2-D mesh as a pair (replicate group or None, shard group)."""
    if isinstance(mesh_or_group, tuple):  # compose's HSDP: the groups of Mesh.split_groups
        replicate_group, shard_group = mesh_or_group
        return shard_group, replicate_group
    if mesh_or_group is None or isinstance(mesh_or_group, (dist.ProcessGroup, Mesh)):
        return axis_group(mesh_or_group, "dp"), None
    if mesh_or_group.ndim == 1:
        return mesh_or_group.get_group(), None
    if mesh_or_group.ndim == 2:
        return mesh_or_group.get_group(1), mesh_or_group.get_group(0)
    raise ValueError(
        f"apply_fsdp takes a group or a DeviceMesh of 1 or 2 dims (replicate, shard); got {mesh_or_group.ndim} dims"
    )


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (dim 0)."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _row_numel(shape) -> int:
    return int(torch.Size(shape[1:]).numel())


def _refill(target, value):
    """``value`` as a tensor of its own, or copied into ``target`` (which autograd may have saved)."""
    if target is None:
        return value.clone(memory_format=torch.contiguous_format)
    target.data.copy_(value)  # through .data: not an in-place edit autograd would object to
    return target


def _tensors(output) -> list:
    """The tensors in a module's output (a tensor, or tuples, lists, dicts of them)."""
    if torch.is_tensor(output):
        return [output]
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return [t for item in items for t in _tensors(item)]


def _cast_floats(tree, dtype):
    """``tree`` with its floating-point tensors cast to ``dtype`` (FSDP2's cast_forward_inputs)."""
    if torch.is_tensor(tree):
        return tree.to(dtype) if tree.is_floating_point() else tree
    if isinstance(tree, dict):
        return {k: _cast_floats(v, dtype) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(_cast_floats(v, dtype) for v in tree)
    return tree
