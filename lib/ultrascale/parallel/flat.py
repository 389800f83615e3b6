"""Flat, padded parameter buffers: the storage layout under ``ZeRO`` (see ``zero.py``).

A *unit* (a block of the model, or the root: everything left over) keeps its trainable
parameters in one flat buffer, padded so that it splits into N_d equal shards for any
parameter count; each parameter becomes a view into that buffer. One collective per
unit then moves all of its parameters or gradients at once.

Only trainable parameters (``requires_grad=True`` when ZeRO is built) are flattened.
A frozen parameter stays an ordinary parameter of its module: replicated on every
rank, never updated, never communicated after the initial broadcast.

The optimizer steps *pieces* of a unit's master shard (``Piece``): views of runs of
consecutive parameters of one parameter group, so each element gets its group's
options and a parameter without a gradient can be left out of a step.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle


def parameter_owners(model):
    """Map each parameter to every (module, attribute) that registers it."""
    owners = defaultdict(list)
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                owners[p].append((module, attr))
    return owners


def _carry_over(p, view) -> None:
    """What other techniques hung on ``p`` goes on to its view: attributes (TP's ``tp_shard_dim``)
    and gradient hooks (SP's norms summed over tp, for one), re-registered, with their handles
    kept under the same names. Without it, those hooks would silently stop running."""
    handles = {key: view.register_hook(hook) for key, hook in (p._backward_hooks or {}).items()}
    for name, value in vars(p).items():
        setattr(
            view, name, handles.get(getattr(value, "id", None), value) if isinstance(value, RemovableHandle) else value
        )


class FlatUnit:
    """The trainable parameters of one unit as a flat buffer, cut into N_d equal shards."""

    def __init__(self, name, module, params, owners, rank, world_size, sharded, param_dtype, groups=None):
        self.name, self.module = name, module
        self.groups = groups or [0] * len(params)  # each parameter's optimizer group
        self.numel = sum(p.numel() for p in params)
        self.shard_numel = -(-self.numel // world_size)  # ceil: pad the tail
        self.padded = self.shard_numel * world_size
        own = rank * self.shard_numel
        self.own = slice(own, own + self.shard_numel) if sharded else slice(0, self.padded)
        dtype = param_dtype or params[0].dtype
        self.full = torch.zeros(self.padded, dtype=dtype, device=params[0].device)
        self.offsets, self.params, offset = {}, [], 0
        for p in params:
            self.full[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
            view = nn.Parameter(self.full[offset : offset + p.numel()].view(p.shape))
            _carry_over(p, view)
            for module_, attr in owners[p]:  # every place the parameter is registered (tied weights)
                module_._parameters[attr] = view
            self.offsets[view] = (offset, offset + p.numel())
            self.params.append(view)
            offset += p.numel()
        # fp32 master weights for 16-bit parameters; fp64 parameters keep fp64 (never round down).
        master_dtype = torch.promote_types(dtype, torch.float32)
        self.master = self.full[self.own].detach().to(master_dtype, copy=True)  # this rank's shard
        self.shard = None  # stage 3: this rank's slice of the parameters
        self.grad_full = None  # full flat gradient (stages 0, 1; transient in 2, 3)
        self.grad_shard = None  # this rank's slice of the averaged gradient (stages 2, 3)
        self.ready: set = set()  # parameters whose gradient arrived in this backward
        self.has_grad: set = set()  # parameters that got a gradient since the last zero_grad
        self.gathered, self.gather_work = True, None
        self.backward_started = False

    def grad_view(self, p):
        start, end = self.offsets[p]
        return self.grad_full[start:end].view(p.shape)

    def owned_ranges(self):
        """(index, lo, hi) for each parameter that overlaps this rank's shard, where
        ``master[lo:hi]`` holds that overlap. The padding counts as part of the last
        parameter: its gradient is always zero and its value is never read, so stepping
        it changes nothing, and whole shards keep the memory of the formulas exact."""
        ranges = []
        for i, p in enumerate(self.params):
            start, end = self.offsets[p]
            end = self.padded if i == len(self.params) - 1 else end
            lo, hi = max(start, self.own.start), min(end, self.own.stop)
            if lo < hi:
                ranges.append((i, lo - self.own.start, hi - self.own.start))
        return ranges

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)

    def free_full(self) -> None:
        # Shrinking the storage frees the memory while every parameter view (and any
        # tensor autograd saved from them) keeps pointing at the same storage object,
        # so refilling it before backward makes the saved tensors valid again.
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def alloc_full(self) -> None:
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())


def resolve_param_groups(model, param_groups):
    """Torch-style parameter groups -> (each group's options, each trainable parameter's group)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if param_groups is None:
        return [{}], {p: 0 for p in trainable}
    param_groups = list(param_groups)
    if param_groups and not isinstance(param_groups[0], dict):  # a plain list of parameters
        param_groups = [{"params": param_groups}]
    known, seen, group_of, options = set(model.parameters()), set(), {}, []
    for g, group in enumerate(param_groups):
        params = [group["params"]] if torch.is_tensor(group["params"]) else list(group["params"])
        for p in params:
            if p not in known:
                raise ValueError(
                    f"parameter group {g} holds a tensor that is not a parameter of the "
                    "model (build the groups before ZeRO replaces the parameters)"
                )
            if p in seen:
                raise ValueError("some parameters appear in more than one parameter group")
            seen.add(p)
            if p.requires_grad:  # a frozen parameter is never stepped anyway
                group_of[p] = g
        options.append({k: v for k, v in group.items() if k != "params"})
    names = {p: n for n, p in model.named_parameters()}
    missing = [names[p] for p in trainable if p not in group_of]
    if missing:
        raise ValueError(
            f"trainable parameters in no parameter group: {missing}; ZeRO owns every "
            "trainable parameter, so each needs a group (freeze the others)"
        )
    return options, group_of


class Piece:
    """Consecutive parameters of one unit and one group, inside this rank's shard,
    that the optimizer steps as one tensor: a view into the unit's master shard."""

    def __init__(self, unit, ranges, group):
        self.unit, self.group = unit, group
        self.index = [i for i, _, _ in ranges]  # the unit's parameters it covers
        self.lo, self.hi = ranges[0][1], ranges[-1][2]  # its range in unit.master
        self.tensor = unit.master[self.lo : self.hi]


def coarse_pieces(unit) -> list:
    """This rank's shard of a unit as few pieces as possible: one per run of parameters
    of the same group."""
    pieces, run = [], []
    for r in unit.owned_ranges():
        if run and unit.groups[r[0]] != unit.groups[run[-1][0]]:
            pieces.append(Piece(unit, run, unit.groups[run[0][0]]))
            run = []
        run.append(r)
    if run:
        pieces.append(Piece(unit, run, unit.groups[run[0][0]]))
    return pieces


def split_piece(piece, state: dict) -> list:
    """One piece per parameter of ``piece``, each taking its slice of the optimizer
    ``state``: torch counts steps per tensor, and these parameters stopped agreeing."""
    ranges = {r[0]: r for r in piece.unit.owned_ranges()}
    parts = [Piece(piece.unit, [ranges[i]], piece.group) for i in piece.index]
    old = state.pop(piece.tensor, {})
    for part in parts:  # elementwise state (Adam's moments) is sliced, the rest copied
        cut = slice(part.lo - piece.lo, part.hi - piece.lo)
        if old:
            state[part.tensor] = {
                k: v[cut].clone() if torch.is_tensor(v) and v.shape == piece.tensor.shape else copy.deepcopy(v)
                for k, v in old.items()
            }
    return parts
