"""ZeRO-1, ZeRO-2 and ZeRO-3, from scratch, applied from outside to any ``nn.Module``.

Plain data parallelism keeps on every rank a full copy of everything: parameters,
gradients and the optimizer states (fp32 master weights, Adam's two moments).
ZeRO (Zero Redundancy Optimizer) removes that redundancy in three steps:

* stage 1 shards the optimizer states: rank r updates only its 1/N_d slice of the
  fp32 master weights. Gradients are reduce-scattered (each rank receives the
  average of its slice) and the updated slices are all-gathered back.
* stage 2 also shards the gradients: as soon as a unit's gradients are ready they
  are reduce-scattered and the full gradients are freed.
* stage 3 also shards the parameters: a unit's parameters are all-gathered just
  before its forward, freed after it, gathered again for its backward (FSDP).
  ``prefetch`` starts the next unit's all-gather while the current one computes.

The model is cut into *units*: by default each block of ``model.blocks`` is one,
and everything else (embeddings, final norm, head) forms the root unit. A unit's
parameters live in one flat buffer, padded so that it splits into N_d equal
shards for any parameter count; the parameters become views into that buffer.

``stage=0`` runs the same machinery without sharding (all-reduce, full optimizer
state): the mixed-precision DP baseline of the memory formulas.

    zero = ZeRO(model, stage=2, lr=1e-3)        # also the optimizer
    model.loss(x, y).backward()
    zero.step(); zero.zero_grad()
"""
from __future__ import annotations

import threading
from collections import Counter, defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from ..memory import zero_bytes_per_rank
from .data_parallel import broadcast_parameters
from .timeline import COMMUNICATION, Timeline


def all_gather_into(output, shard, group=None, async_op=False):
    """Concatenate every rank's ``shard`` into ``output`` (all_gather_single in torch >= 2.13)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, shard, group=group, async_op=async_op)


def reduce_scatter_into(output, full, group=None, async_op=False):
    """Sum ``full`` over ranks and keep only this rank's slice in ``output``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, full, group=group, async_op=async_op)


class _WatchedWork:
    """An async collective whose backend offers no completion callback (gloo's
    reduce-scatter has no future): a helper thread waits for it and puts its bar on the
    timeline when the transfer really ends, instead of a zero-length mark at launch."""

    def __init__(self, work, on_done):
        self.work = work
        self.thread = threading.Thread(target=self._watch, args=(on_done,), daemon=True)
        self.thread.start()

    def _watch(self, on_done):
        self.work.wait()
        on_done()

    def wait(self):
        self.work.wait()
        self.thread.join()   # the bar is recorded before anyone reads the timeline
        return True


class FlatUnit:
    """The parameters of one unit as a flat buffer, cut into N_d equal shards."""

    def __init__(self, name, module, params, owners, rank, world_size, sharded, param_dtype):
        self.name, self.module = name, module
        self.numel = sum(p.numel() for p in params)
        self.shard_numel = -(-self.numel // world_size)          # ceil: pad the tail
        self.padded = self.shard_numel * world_size
        own = rank * self.shard_numel
        self.own = slice(own, own + self.shard_numel) if sharded else slice(0, self.padded)
        dtype = param_dtype or params[0].dtype
        self.full = torch.zeros(self.padded, dtype=dtype, device=params[0].device)
        self.offsets, self.params, offset = {}, [], 0
        for p in params:
            self.full[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            view = nn.Parameter(self.full[offset:offset + p.numel()].view(p.shape))
            for module_, attr in owners[p]:   # every place the parameter is registered (tied weights)
                module_._parameters[attr] = view
            self.offsets[view] = (offset, offset + p.numel())
            self.params.append(view)
            offset += p.numel()
        self.master = self.full[self.own].detach().float().clone()   # fp32 master weights (shard)
        self.shard = None            # stage 3: this rank's slice of the parameters
        self.grad_full = None        # full flat gradient (stages 0, 1; transient in 2, 3)
        self.grad_shard = None       # this rank's slice of the averaged gradient (stages 2, 3)
        self.ready: set = set()      # parameters whose gradient arrived in this backward
        self.gathered, self.gather_work = True, None
        self.backward_started = False

    def grad_view(self, p):
        start, end = self.offsets[p]
        return self.grad_full[start:end].view(p.shape)

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


def _parameter_owners(model):
    """Map each parameter to every (module, attribute) that registers it."""
    owners = defaultdict(list)
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                owners[p].append((module, attr))
    return owners


class ZeRO:
    """Shard a model's training state over the data-parallel ranks; also its optimizer."""

    def __init__(self, model, stage=1, optimizer_cls=torch.optim.Adam, units=None, param_dtype=None,
                 prefetch=True, group=None, timeline=None, broadcast=True, **optimizer_kwargs):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
        if not dist.is_initialized():
            raise RuntimeError("ZeRO needs a process group: run it inside cluster.run(...) or torchrun")
        self.model, self.stage, self.prefetch, self.group = model, stage, prefetch, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.timeline = timeline or Timeline(dist.get_rank(), enabled=False)
        self.stats = Counter()          # calls and elements per collective
        self.in_flight = []             # reduce-scatters not yet waited for
        self._callback_queued = False
        if broadcast:
            broadcast_parameters(model, group)
        self._build_units(model, units, param_dtype)
        self.optimizer = optimizer_cls([u.master for u in self.all_units], **optimizer_kwargs)
        for unit in self.all_units:
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda p, u=unit: self._on_grad_ready(u, p))
            if stage in (0, 1):         # the full gradient lives for the whole step
                unit.grad_full = torch.zeros_like(unit.full)
            if stage in (2, 3):         # only this rank's slice does
                unit.grad_shard = torch.zeros(unit.shard_numel, dtype=unit.full.dtype, device=unit.full.device)
        if stage == 3:
            for unit in self.all_units:
                unit.shard = unit.full[unit.own].clone()
                unit.free_full()
            self._register_stage3_hooks()

    def _build_units(self, model, units, param_dtype):
        if units is None:
            units = list(model.blocks) if hasattr(model, "blocks") else []
        owners, taken, groups = _parameter_owners(model), set(), []
        for module in units:                 # decide every unit's parameters first...
            params = list(dict.fromkeys(module.parameters()))
            if taken.intersection(params):
                raise ValueError("a parameter is shared between two units; put both users in one unit")
            taken.update(params)
            groups.append((module, params))
        rest = [p for p in model.parameters() if p not in taken]
        build = lambda name, module, params: FlatUnit(   # noqa: E731  ...then flatten them
            name, module, params, owners, self.rank, self.world_size, self.stage > 0, param_dtype)
        self.units = [build(f"unit {i}", m, ps) for i, (m, ps) in enumerate(groups)]
        self.root = build("root", model, rest) if rest else None
        self.all_units = ([self.root] if self.root else []) + self.units

    # ------------------------------------------------------------------ collectives
    def _collective(self, op, unit, output, source, async_op):
        """Run one collective on a unit's buffer, counting calls and Ψ-equivalent elements."""
        fn = {"all_gather": all_gather_into, "reduce_scatter": reduce_scatter_into}.get(op)
        self.stats[op] += 1
        # A ring all-reduce is a reduce-scatter plus an all-gather: count it twice.
        self.stats[op + " elements"] += unit.padded
        self.stats["elements"] += unit.padded * (2 if op == "all_reduce" else 1)
        start, nbytes = self.timeline.now(), unit.padded * output.element_size()
        if op == "all_reduce":
            work = dist.all_reduce(output, group=self.group, async_op=async_op)
        else:
            work = fn(output, source, group=self.group, async_op=async_op)
        name = f"{op} {unit.name}"
        if not async_op:
            self.timeline.add(COMMUNICATION, name, start, self.timeline.now(), nbytes)
            return None
        if self.timeline.enabled and not _has_future(work):
            return _WatchedWork(work, lambda: self.timeline.add(COMMUNICATION, name, start,
                                                                self.timeline.now(), nbytes))
        return self.timeline.communication(name, work, nbytes, start)

    # ------------------------------------------------------------------ gradients
    def _on_grad_ready(self, unit, p) -> None:
        """Move a finished gradient into its unit's flat buffer; reduce a complete unit."""
        if not self._callback_queued:   # run _on_backward_end once autograd is done
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            self._callback_queued = True
        if unit.grad_full is None:
            unit.grad_full = torch.zeros(unit.padded, dtype=p.grad.dtype, device=p.grad.device)
        unit.grad_view(p).add_(p.grad)
        p.grad = None                   # the flat buffer is the only copy now
        unit.ready.add(p)
        if self.stage >= 2 and unit.complete:
            self._reduce_scatter(unit)

    def _reduce_scatter(self, unit) -> None:
        """Send a unit's gradients away: each rank receives the average of its slice."""
        unit.grad_full.div_(self.world_size)            # the sum of averages is the average
        out = unit.grad_full.new_empty(unit.shard_numel)
        work = self._collective("reduce_scatter", unit, out, unit.grad_full, async_op=True)
        self.in_flight.append((unit, work, out, unit.grad_full))   # keep the input alive
        if self.stage >= 2:
            unit.grad_full = None       # ZeRO-2: the full gradient is not kept
        if self.stage == 3 and unit is not self.root:
            unit.free_full()            # done with this unit's parameters until the next forward
        while len(self.in_flight) > 2:  # bound the memory of gradients in transit
            self._finish_reduce_scatter()

    def _finish_reduce_scatter(self) -> None:
        unit, work, out, _ = self.in_flight.pop(0)
        work.wait()
        if unit.grad_shard is None:     # ZeRO-1: a temporary slice, for this step only
            unit.grad_shard = out
        else:                           # add: micro-batches of one step accumulate
            unit.grad_shard.add_(out)

    def _on_backward_end(self) -> None:
        self._callback_queued = False
        if self.stage >= 2:
            for unit in self.all_units:  # parameters without a gradient contribute zeros
                if unit.ready and not unit.complete:
                    self._reduce_scatter(unit)
            while self.in_flight:
                self._finish_reduce_scatter()
        if self.stage == 3:
            for unit in self.all_units:   # including a prefetch nobody used: it would be stale
                self._reshard(unit)
        for unit in self.all_units:
            unit.ready.clear()
            unit.backward_started = False

    # ------------------------------------------------------------------ the step
    def step(self) -> None:
        """Average the gradients, update this rank's shard, share the new parameters."""
        if self.stage == 0:
            for unit in self.all_units:
                unit.grad_full.div_(self.world_size)
                self._collective("all_reduce", unit, unit.grad_full, None, async_op=False)
                unit.master.grad = unit.grad_full.float()
        else:
            if self.stage == 1:          # ZeRO-1 reduces the kept full gradients only now
                for unit in self.all_units:
                    self._reduce_scatter(unit)
            while self.in_flight:
                self._finish_reduce_scatter()
            for unit in self.all_units:
                unit.master.grad = unit.grad_shard.float()
        self.optimizer.step()
        self._publish_parameters()
        for unit in self.all_units:
            unit.master.grad = None
            if self.stage == 1:
                unit.grad_shard = None

    def _publish_parameters(self) -> None:
        """Write the updated fp32 master weights back into the (low-precision) parameters."""
        works = []
        for unit in self.all_units:
            new = unit.master.to(unit.full.dtype)
            if self.stage == 0:
                unit.full.data.copy_(new)
            elif self.stage in (1, 2):   # every rank needs every slice: all-gather them
                works.append(self._collective("all_gather", unit, unit.full.data, new, async_op=True))
            else:                        # stage 3 keeps only its slice until the next forward
                self._reshard(unit)          # (a full copy left from a forward would be stale)
                unit.shard.copy_(new)
        for work in works:
            work.wait()

    def zero_grad(self) -> None:
        for unit in self.all_units:
            for buffer in (unit.grad_full, unit.grad_shard):
                if buffer is not None:
                    buffer.zero_()

    # ------------------------------------------------------------------ stage 3
    def _register_stage3_hooks(self) -> None:
        order = self.all_units
        for i, unit in enumerate(order):
            nxt = order[i + 1] if i + 1 < len(order) else None
            prev = order[i - 1] if i > 0 and order[i - 1] is not self.root else None
            keep = unit is self.root or unit is order[-1]   # needed again at once by backward
            unit.module.register_forward_pre_hook(lambda m, a, u=unit, n=nxt: self._pre_forward(u, n))
            unit.module.register_forward_hook(
                lambda m, a, out, u=unit, p=prev, k=keep: self._post_forward(u, p, k, out))

    def _start_gather(self, unit) -> None:
        if unit is None or unit.gathered or unit.gather_work is not None:
            return
        unit.alloc_full()
        # Write through .data: autograd must not see this refill as an in-place edit of
        # tensors it saved in forward (they get back exactly the values forward used).
        unit.gather_work = self._collective("all_gather", unit, unit.full.data, unit.shard, async_op=True)

    def _ensure_gathered(self, unit) -> None:
        self._start_gather(unit)
        if unit.gather_work is not None:
            unit.gather_work.wait()
            unit.gather_work = None
        unit.gathered = True

    def _reshard(self, unit) -> None:
        if unit.gather_work is not None:
            unit.gather_work.wait()
            unit.gather_work = None
        if unit.full.untyped_storage().nbytes():
            unit.free_full()

    def _pre_forward(self, unit, nxt) -> None:
        self._ensure_gathered(unit)
        if self.prefetch and not _in_backward():   # the next unit travels while this one computes
            self._start_gather(nxt)

    def _post_forward(self, unit, prev, keep, output) -> None:
        if _in_backward():
            return   # a forward re-run inside backward (activation recomputation): keep the parameters
        training = torch.is_grad_enabled()
        tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
        for t in tensors:               # fires when the gradient reaches this unit's output
            t.register_hook(lambda g, u=unit, p=prev: self._pre_backward(u, p))
        if not (training and tensors):  # inference: nothing will come back for these
            for u in (self.all_units if unit is self.root else [unit]):
                self._reshard(u)
        elif not keep:
            unit.free_full()

    def _pre_backward(self, unit, prev) -> None:
        if unit.backward_started:
            return
        unit.backward_started = True
        self._ensure_gathered(unit)
        if self.prefetch:               # backward walks the units in reverse
            self._start_gather(prev)

    # ------------------------------------------------------------------ inspection
    @property
    def num_parameters(self) -> int:
        return sum(u.numel for u in self.all_units)

    def state_bytes(self) -> dict:
        """Bytes this rank holds now: parameters, gradients, optimizer (fp32 master + states)."""
        nbytes = lambda t: 0 if t is None else t.untyped_storage().nbytes()   # noqa: E731
        units = self.all_units
        params = sum(nbytes(u.full) + nbytes(u.shard) for u in units)
        grads = sum(nbytes(u.grad_full) + nbytes(u.grad_shard) for u in units)
        grads += sum(nbytes(p.grad) for u in units for p in u.params)
        states = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        optimizer = sum(nbytes(u.master) for u in units) + sum(nbytes(t) for t in states)
        return {"parameters": params, "gradients": grads, "optimizer states": optimizer}

    def formula_bytes(self, k: float = 12) -> dict:
        """The book's per-rank formula at this run's byte widths (k: optimizer bytes per parameter)."""
        width = self.all_units[0].full.element_size()
        return zero_bytes_per_rank(self.num_parameters, self.stage, self.world_size, k, width, width)

    def full_state_dict(self) -> dict:
        """Every parameter in full on every rank (a collective: call it on all ranks)."""
        if self.stage == 3:
            for unit in self.all_units:
                self._ensure_gathered(unit)
        state = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        if self.stage == 3:
            for unit in self.all_units:
                unit.free_full()
        return state


def _has_future(work) -> bool:
    try:
        work.get_future()
    except RuntimeError:   # "Work::getFuture not implemented"
        return False
    return True


def _in_backward() -> bool:
    """True while autograd's engine runs, e.g. when checkpointing re-runs a forward."""
    return torch._C._current_graph_task_id() != -1
