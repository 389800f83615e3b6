"""ZeRO-1, ZeRO-2 and ZeRO-3, from scratch, applied from outside to any ``nn.Module``.

Files for the basic form (stages 1 and 2), in reading order: this module (``ZeRO``,
``apply_zero``), ``flat.py`` (the flat, padded buffers and their pieces), ``zero_state.py``
(the sharded state counted, saved and resumed), ``comm/functional.py`` (``all_gather_into``,
``reduce_scatter_into``) and ``mesh.py`` (the dp group). Stage 3 is a refinement in
``zero3.py``, which registers itself here (``REFINEMENTS``): this module never imports it.

Plain data parallelism keeps on every rank a full copy of everything: parameters,
gradients and the optimizer states (fp32 master weights, Adam's two moments).
ZeRO (Zero Redundancy Optimizer) removes that redundancy in three steps:

* stage 1 shards the optimizer states: rank r updates only its 1/N_d slice of the
  fp32 master weights. Gradients are reduce-scattered (each rank receives the
  average of its slice) and the updated slices are all-gathered back.
* stage 2 also shards the gradients: as soon as a unit's gradients are ready they
  are reduce-scattered and the full gradients are freed (in one fixed order of units,
  so that all ranks agree even when their data uses the units differently).
* stage 3 also shards the parameters: a unit's parameters are all-gathered just
  before its forward, freed after it, gathered again for its backward (FSDP).
  ``prefetch`` starts the next unit's all-gather while the current one computes.
  Every rank must run the same units' forwards (each one is a collective). Those hooks
  are their own idea, in ``zero3.py``: its ``ParameterSharding`` is the ``sharding`` a
  ``ZeRO`` holds at stage 3 (None below), which the few places that stage 3 changes
  (after backward, after the update, ``gathered``) call.

The model is cut into *units*: by default each block of ``model.blocks`` is one,
and everything else (embeddings, final norm, head) forms the root unit. A unit's
parameters live in one flat buffer, padded so that it splits into N_d equal
shards for any parameter count; the parameters become views into that buffer
(``flat.py``). Communication is per unit; the optimizer, though, must behave
exactly like the torch optimizer it wraps, run on one process over the whole batch:

* frozen parameters (``requires_grad=False`` when ZeRO is built) stay out of the
  flat buffers: ordinary, replicated, never updated (broadcast once, like the rest);
* a parameter that got no gradient on *any* rank since ``zero_grad`` is skipped by
  the step: no weight decay, no moment update, no step count, as torch skips a
  parameter whose ``.grad`` is None. One that got a gradient on some rank only
  counts as having one (the others add zeros): the concatenated batch used it.
  A zero in the summed gradient cannot say which, so every step the ranks also
  all-reduce one byte per parameter tensor (DDP's find_unused_parameters does the same);
* parameter groups (``param_groups=[{"params": [...], "weight_decay": 0.0}, ...]``,
  as for a torch optimizer) set the options of each parameter's elements.

For that the optimizer does not see whole flat shards but *pieces*: views into this
rank's master shard, each a run of consecutive parameters of one unit and one group
that is always stepped together. Elementwise optimizers (SGD, Adam, AdamW) then do
exactly what they do on whole tensors (one that needs whole tensors, like LAMB's
norms, cannot run on shards). Torch keeps a step count per tensor, so when a piece's
parameters stop agreeing on whether they have a gradient, the piece is split into
one piece per parameter, each with its slice of the state. Master weights are fp32
for 16-bit parameters and the parameters' own dtype for fp32 and fp64.

``stage=0`` runs the same machinery without sharding (all-reduce, full optimizer
state): the mixed-precision DP baseline of the memory formulas.

    zero = ZeRO(model, stage=2, lr=1e-3)        # also the optimizer
    model.loss(x, y).backward()
    zero.step(); zero.zero_grad()
    torch.save(zero.state_dict(), f"ckpt-rank{rank}.pt")   # this rank's shard of the state

Measuring this rank's share of the state (``state_bytes``, which ``memory.zero_formula_bytes``
gives the book's formula for), reading the whole parameters (``gathered``, ``full_state_dict``)
and saving and resuming the state (``state_dict`` / ``load_state_dict``) are in
``zero_state.py`` (``ShardedState``, the base class of ``ZeRO``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm.functional import all_gather_into, broadcast_parameters, reduce_scatter_into
from ..comm.logger import labelled
from ..matching import match_plan
from .flat import FlatUnit, coarse_pieces, parameter_owners, resolve_param_groups, split_piece
from .mesh import axis_group
from .timeline import COMMUNICATION, or_disabled
from .zero_state import ShardedState

GRADIENT_FLAGS = "all_reduce (gradient flags)"  # its name in a CommLogger's log

# Refinements that live in their own files and put their class here when imported, so that
# this file reads without them: "stage 3" is zero3.py's ParameterSharding. ``ultrascale.parallel``
# imports zero3.py, and Python runs a package's __init__ before any of its modules, so the
# entry is there whenever a ZeRO can be built.
REFINEMENTS = {}

__all__ = [
    "PLAN",
    "REFINEMENTS",
    "ZeRO",
    "FlatUnit",
    "apply_zero",
    "units_of",
    "all_gather_into",
    "reduce_scatter_into",
]


class ZeRO(ShardedState):
    """Shard a model's training state over the data-parallel ranks; also its optimizer.

    ``param_groups``: as the first argument of a torch optimizer, a list of dicts of the
    model's parameters and their options (``optimizer_kwargs`` are the defaults); every
    trainable parameter must be in one group. Read once, before the parameters are
    moved into flat buffers. ``params``: the parameters this ZeRO owns (default: every
    trainable one); the others stay ordinary parameters, for another ZeRO over another group
    (a composition's experts). ``divide_by``: what the summed gradient is divided by (default
    the group's size, the mean; an expert's replicas are fewer than the ranks with other data).
    ``gather_dtype`` (stage 3 only): ``torch.float8_e4m3fn`` all-gathers the parameters that
    forward and backward use in FP8 with one agreed scale per parameter, as FSDP2 with
    torchao's float8 all-gather (``zero3.py``); master weights, optimizer and gradients keep
    their precision. ``step()`` is ``reduce_gradients()`` then ``update()``; a composition may act between them.
    """

    def __init__(
        self,
        model,
        stage=1,
        optimizer_cls=torch.optim.Adam,
        units=None,
        param_dtype=None,
        prefetch=True,
        group=None,
        timeline=None,
        broadcast=True,
        param_groups=None,
        params=None,
        divide_by=None,
        gather_dtype=None,
        **optimizer_kwargs,
    ):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
        if gather_dtype is not None and stage != 3:
            raise ValueError(
                f"gather_dtype={gather_dtype} needs stage 3: only ZeRO-3 gathers the parameters "
                f"before each forward and backward (stage {stage} keeps them whole)"
            )
        if gather_dtype not in (None, torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(
                f"gather_dtype must be None (the parameters' own dtype) or an FP8 format, "
                f"torch.float8_e4m3fn or torch.float8_e5m2, got {gather_dtype}"
            )
        self.gather_dtype = gather_dtype
        if not dist.is_initialized():
            raise RuntimeError("ZeRO needs a process group: run it inside cluster.run(...) or torchrun")
        self.model, self.stage, self.prefetch, self.group = model, stage, prefetch, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.divide_by = divide_by or self.world_size
        self.owned = None if params is None else set(params)
        self.timeline = or_disabled(timeline)
        self.in_flight = []  # reduce-scatters not yet waited for
        self._sent = 0  # units of _send_order reduce-scattered in this backward
        self._callback_queued = False
        options, group_of = resolve_param_groups(model, param_groups)
        if broadcast:
            broadcast_parameters(model, group)
        self._build_units(model, units, param_dtype, group_of)
        self.pieces = [piece for unit in self.all_units for piece in coarse_pieces(unit)]
        self.optimizer = optimizer_cls(
            [dict(o, params=self._pieces_of_group(g)) for g, o in enumerate(options)], **optimizer_kwargs
        )
        for unit in self.all_units:
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda p, u=unit: self._on_grad_ready(u, p))
            if stage in (0, 1):  # the full gradient lives for the whole step
                unit.grad_full = torch.zeros_like(unit.full)
            if stage in (2, 3):  # only this rank's slice does
                unit.grad_shard = torch.zeros(unit.shard_numel, dtype=unit.full.dtype, device=unit.full.device)
        # Stage 3 shards the parameters too: zero3.py's part keeps each unit's shard and
        # hooks the units to gather their parameters before use and free them after.
        self.sharding = REFINEMENTS["stage 3"](self) if stage == 3 else None

    def _build_units(self, model, units, param_dtype, group_of):
        if units is None:
            units = units_of(model, PLAN if hasattr(model, "blocks") else {})
        trainable = lambda params: [
            p
            for p in params
            if p.requires_grad  # noqa: E731
            and (self.owned is None or p in self.owned)
        ]
        owners, taken, chosen = parameter_owners(model), set(), []
        for i, module in enumerate(units):  # decide every unit's parameters first...
            params = trainable(dict.fromkeys(module.parameters()))
            if taken.intersection(params):
                raise ValueError("a parameter is shared between two units; put both users in one unit")
            taken.update(params)
            if params:  # a frozen unit has nothing to shard
                chosen.append((f"unit {i}", module, params))
        rest = [p for p in trainable(model.parameters()) if p not in taken]
        build = lambda name, module, params: FlatUnit(  # noqa: E731  ...then flatten them
            name,
            module,
            params,
            owners,
            self.rank,
            self.world_size,
            self.stage > 0,
            param_dtype,
            groups=[group_of[p] for p in params],
        )
        self.units = [build(*choice) for choice in chosen]
        self.root = build("root", model, rest) if rest else None
        self.all_units = ([self.root] if self.root else []) + self.units
        self._send_order = self.units[::-1] + ([self.root] if self.root else [])  # backward's order

    # ------------------------------------------------------------------ collectives
    def collective(self, op, unit, output, source, async_op):
        """Run one collective on a unit's buffer and put its bar on the timeline.
        (Calls and bytes are counted by ``CommLogger``, as for every technique.)"""
        fn = {"all_gather": all_gather_into, "reduce_scatter": reduce_scatter_into}.get(op)
        start, nbytes = self.timeline.now(), unit.padded * output.element_size()
        if op == "all_reduce":
            work = dist.all_reduce(output, group=self.group, async_op=async_op)
        else:
            work = fn(output, source, group=self.group, async_op=async_op)
        name = f"{op} {unit.name}"
        if not async_op:
            self.timeline.add(COMMUNICATION, name, start, self.timeline.now(), nbytes)
            return None
        return self.timeline.communication(name, work, nbytes, start)

    # ------------------------------------------------------------------ gradients
    def _on_grad_ready(self, unit, p) -> None:
        """Move a finished gradient into its unit's flat buffer; reduce a complete unit."""
        if not self._callback_queued:  # run _on_backward_end once autograd is done
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            self._callback_queued = True
        if unit.grad_full is None:
            unit.grad_full = torch.zeros(unit.padded, dtype=p.grad.dtype, device=p.grad.device)
        unit.grad_view(p).add_(p.grad)
        p.grad = None  # the flat buffer is the only copy now
        unit.ready.add(p)
        unit.has_grad.add(p)  # (a zero in the buffer cannot say "no gradient")
        if self.stage >= 2 and unit.complete:
            self._send_gradients()

    def _send_gradients(self, all_units=False) -> None:
        """Reduce-scatter the complete units in one fixed order, backward's usual one.
        Collectives must come in the same order on every rank, and a unit used by some
        ranks' data only (or in another order) completes at different times on each:
        a unit complete early waits for the ones before it; at the end all go."""
        order = self._send_order
        while self._sent < len(order) and (all_units or order[self._sent].complete):
            self._reduce_scatter(order[self._sent])
            self._sent += 1

    def _reduce_scatter(self, unit) -> None:
        """Send a unit's gradients away: each rank receives the average of its slice."""
        if unit.grad_full is None:  # no gradient here for this unit: others may have some
            unit.grad_full = torch.zeros(unit.padded, dtype=unit.full.dtype, device=unit.full.device)
        unit.grad_full.div_(self.divide_by)  # the sum of averages is the average
        out = unit.grad_full.new_empty(unit.shard_numel)
        work = self.collective("reduce_scatter", unit, out, unit.grad_full, async_op=True)
        self.in_flight.append((unit, work, out, unit.grad_full))  # keep the input alive
        if self.stage >= 2:
            unit.grad_full = None  # ZeRO-2: the full gradient is not kept
        if self.stage == 3 and unit is not self.root:
            unit.free_full()  # done with this unit's parameters until the next forward
        while len(self.in_flight) > 2:  # bound the memory of gradients in transit
            self._finish_reduce_scatter()

    def _finish_reduce_scatter(self) -> None:
        unit, work, out, _ = self.in_flight.pop(0)
        work.wait()
        if unit.grad_shard is None:  # ZeRO-1: a temporary slice, for this step only
            unit.grad_shard = out
        else:  # add: micro-batches of one step accumulate
            unit.grad_shard.add_(out)

    def _on_backward_end(self) -> None:
        self._callback_queued = False
        if self.stage >= 2:
            # Parameters without a gradient contribute zeros, even in a unit that got
            # none on this rank: another rank may have some.
            self._send_gradients(all_units=True)
            self._sent = 0
            while self.in_flight:
                self._finish_reduce_scatter()
        if self.sharding is not None:
            for unit in self.all_units:  # including a prefetch nobody used: it would be stale
                self.sharding.reshard(unit)
        for unit in self.all_units:
            unit.ready.clear()
            unit.backward_started = False

    # ------------------------------------------------------------------ the step
    def step(self) -> None:
        """Average the gradients, update this rank's shard, share the new parameters."""
        self.reduce_gradients()
        self.update()

    def reduce_gradients(self) -> None:
        """The averaged gradients in place: whole in ``grad_full`` at stage 0, this rank's
        slice in ``grad_shard`` from stage 1 on."""
        if self.stage == 0:
            for unit in self.all_units:
                unit.grad_full.div_(self.divide_by)
                self.collective("all_reduce", unit, unit.grad_full, None, async_op=False)
        else:
            if self.stage == 1:  # ZeRO-1 reduces the kept full gradients only now
                for unit in self.all_units:
                    self._reduce_scatter(unit)
            while self.in_flight:
                self._finish_reduce_scatter()

    def update(self) -> None:
        """Step this rank's shard with the reduced gradients and share the new parameters."""
        has_grad = self._gradient_flags()
        self._split_mixed_pieces(has_grad)
        for piece in self.pieces:  # a piece without a gradient keeps grad None: skipped
            unit = piece.unit
            if has_grad[unit][piece.index[0]]:
                grad = unit.grad_full if self.stage == 0 else unit.grad_shard
                piece.tensor.grad = grad[piece.lo : piece.hi].to(unit.master.dtype)
        self.optimizer.step()
        self.publish_master()
        for piece in self.pieces:
            piece.tensor.grad = None
        if self.stage == 1:
            for unit in self.all_units:
                unit.grad_shard = None

    def _gradient_flags(self) -> dict:
        """For each unit, which of its parameters got a gradient on any rank.

        The summed gradients cannot tell "no gradient" from a zero one, so the ranks
        share one byte per parameter tensor (as DDP does with find_unused_parameters)."""
        local = [p in unit.has_grad for unit in self.all_units for p in unit.params]
        device = self.all_units[0].full.device if self.all_units else None
        flags, start = torch.tensor(local, dtype=torch.uint8, device=device), self.timeline.now()
        # Logged under its own name, so that the flat buffers' traffic (the 2Ψ and 3Ψ of
        # the book) stays apart from these few bytes.
        with labelled(GRADIENT_FLAGS):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)  # MAX of 0/1: any rank
        self.timeline.add(COMMUNICATION, "all_reduce gradient flags", start, self.timeline.now(), flags.numel())
        flags = iter(flags.tolist())
        return {unit: [bool(next(flags)) for _ in unit.params] for unit in self.all_units}

    def _split_mixed_pieces(self, has_grad) -> None:
        """Give each parameter of a piece whose parameters disagree a piece of its own."""
        pieces = []
        for piece in self.pieces:
            flags = {has_grad[piece.unit][i] for i in piece.index}
            pieces += split_piece(piece, self.optimizer.state) if len(flags) > 1 else [piece]
        if len(pieces) != len(self.pieces):
            self.use_pieces(pieces)

    def _pieces_of_group(self, g) -> list:
        """The tensors the optimizer steps for parameter group ``g``, in the order of ``self.pieces``."""
        return [piece.tensor for piece in self.pieces if piece.group == g]

    def use_pieces(self, pieces: list) -> None:
        """Step these pieces from now on (their optimizer state already in place): after a
        split, or when a checkpoint splits a piece whose parameters were saved with different
        step counts. The optimizer's groups list their tensors anew."""
        self.pieces = pieces
        for g, group in enumerate(self.optimizer.param_groups):
            group["params"] = self._pieces_of_group(g)

    def publish_master(self) -> None:
        """Write the fp32 master weights into the (low-precision) parameters: after each update,
        and after something else wrote into the master shards (``load_state_dict``, a DCP load in
        ``ultrascale.checkpoint``). A collective at stages 1 and 2."""
        works = []
        for unit in self.all_units:
            new = unit.master.to(unit.full.dtype)
            if self.stage == 0:
                unit.full.data.copy_(new)
            elif self.stage in (1, 2):  # every rank needs every slice: all-gather them
                works.append(self.collective("all_gather", unit, unit.full.data, new, async_op=True))
            else:  # stage 3 keeps only its slice until the next forward
                self.sharding.reshard(unit)  # (a full copy left from a forward would be stale)
                unit.shard.copy_(new)
        for work in works:
            work.wait()

    def zero_grad(self) -> None:
        for unit in self.all_units:
            unit.has_grad.clear()
            for buffer in (unit.grad_full, unit.grad_shard):
                if buffer is not None:
                    buffer.zero_()


# The plan for the course GPT and Llama: each transformer block is a unit (gathered and
# freed as one at stage 3); what no unit claims (embedding, final norm, head) is the root.
PLAN = {"blocks.*": "unit"}


def units_of(model, plan: dict) -> list:
    """The modules a plan names as units (``match_plan``'s rules: ``"blocks.*"`` is every
    block); a module inside a unit already taken is part of it. A pattern may match nothing:
    what no unit claims is the root unit."""
    matched = match_plan(model, plan, outermost=True, may_match_nothing=True)
    for name, _, style in matched:
        if style != "unit":
            raise ValueError(f"ZeRO plans know one style, 'unit'; got {style!r} for {name}")
    return [module for _, module, _ in matched]


def apply_zero(model, mesh_or_group=None, *, stage=1, plan=None, timeline=None, **options) -> nn.Module:
    """ZeRO over the ``dp`` axis of a mesh (or over a group). Returns the model, changed in
    place as every ``apply_*`` does (its parameters become views into flat buffers; at stage
    3, hooks gather and free each unit's weights). ZeRO is also the optimizer: it is the
    model's ``zero_optimizer``, the object to ``step()``, since only it knows which shard of
    the optimizer states this rank keeps. ``plan``: the units as {module-name pattern:
    "unit"} (default ``PLAN``). ``options`` go to ``ZeRO`` (optimizer_cls, param_groups,
    prefetch, lr, ...).

        model = apply_zero(model, mesh, stage=2)
        optimizer = model.zero_optimizer
    """
    units = units_of(model, PLAN if plan is None else plan)
    model.zero_optimizer = ZeRO(
        model, stage, units=units, group=axis_group(mesh_or_group, "dp"), timeline=timeline, **options
    )
    return model
