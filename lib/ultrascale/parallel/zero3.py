"""ZeRO-3's parameter sharding: each unit's parameters gathered just before use and freed after.

A refinement of ``zero.py``'s stages 1 and 2, which registers itself with ``ZeRO``: importing
this module puts :class:`ParameterSharding` in ``zero.REFINEMENTS`` (``ultrascale.parallel``
imports it), and ``ZeRO(..., stage=3)`` builds one as its ``sharding``. ``zero.py`` never
imports this file, so stages 1 and 2 read without it.

What it adds: at stage 3 a rank keeps only its shard of every unit's flat parameters
(``unit.shard``). A unit's parameters are all-gathered just before its forward, freed after
it, gathered again when the gradient reaches the unit's output for its backward (FSDP).
``prefetch`` starts the next unit's all-gather (the previous one's, in backward) while the
current one computes. Every rank must run the same units' forwards (each one is a
collective). The root unit and the last unit stay gathered after forward: backward needs
them at once. A forward re-run inside backward (activation recomputation) keeps the
parameters. ``ZeRO`` calls ``reshard`` after backward and before writing new master
weights into the shards, and ``gathered()`` when someone reads the whole parameters.

``gather_dtype=torch.float8_e4m3fn`` gathers the copies that forward and backward use in FP8,
as FSDP2 does with torchao's float8 training: one small all-reduce of amaxes per unit agrees
on the scales, then 1 byte per element travels instead of 2 or 4 (``precision/fp8_gather.py``).
Reading the whole parameters (``gathered()``, ``full_state_dict``) still gathers them exactly.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_flatten

from ..precision.fp8_gather import start_fp8_gather
from .zero import REFINEMENTS

__all__ = ["ParameterSharding"]


class ParameterSharding:
    """ZeRO-3's part of a ``ZeRO`` (its ``sharding``): each unit keeps only its shard of the
    parameters, and hooks on every unit gather them before forward and backward, free them after.
    It reads the ZeRO's units and options and runs its collectives through ``zero.collective``."""

    def __init__(self, zero):
        self.zero = zero
        for unit in zero.all_units:  # from now on only this rank's slice lives between uses
            unit.shard = unit.full[unit.own].clone()
            unit.free_full()
        order, root = zero.all_units, zero.root
        for i, unit in enumerate(order):
            nxt = order[i + 1] if i + 1 < len(order) else None
            prev = order[i - 1] if i > 0 and order[i - 1] is not root else None
            keep = unit is root or unit is order[-1]  # needed again at once by backward
            unit.module.register_forward_pre_hook(lambda m, a, u=unit, n=nxt: self._pre_forward(u, n))
            unit.module.register_forward_hook(
                lambda m, a, out, u=unit, p=prev, k=keep: self._post_forward(u, p, k, out)
            )

    @contextlib.contextmanager
    def gathered(self):
        """Every unit's whole parameters while inside, to read them (a collective): the shards
        are all-gathered exactly (never in FP8), and freed again after."""
        for unit in self.zero.all_units:
            self._ensure_gathered(unit)
        try:
            yield
        finally:
            for unit in self.zero.all_units:
                self.reshard(unit)

    def _start_gather(self, unit, compute=False) -> None:
        """Start gathering a unit's parameters; ``compute``: for forward or backward, the
        only copies that may travel in ``gather_dtype`` (FP8)."""
        if unit is None or unit.gathered or unit.gather_work is not None:
            return
        unit.alloc_full()
        zero = self.zero
        if compute and zero.gather_dtype is not None:

            def collective(out, shard):
                return zero.collective("all_gather", unit, out, shard, async_op=True)

            unit.gather_work = start_fp8_gather(unit, collective, zero.gather_dtype, zero.group)
            return
        # Write through .data: autograd must not see this refill as an in-place edit of
        # tensors it saved in forward (they get back exactly the values forward used).
        unit.gather_work = zero.collective("all_gather", unit, unit.full.data, unit.shard, async_op=True)

    def _ensure_gathered(self, unit, compute=False) -> None:
        self._start_gather(unit, compute)
        if unit.gather_work is not None:
            unit.gather_work.wait()
            unit.gather_work = None
        unit.gathered = True

    def reshard(self, unit) -> None:
        """Free a unit's whole parameters (after waiting for a gather still in flight): after
        backward, and before new master weights go into its shard (a gathered copy would be stale)."""
        if unit.gather_work is not None:
            unit.gather_work.wait()
            unit.gather_work = None
        if unit.full.untyped_storage().nbytes():
            unit.free_full()

    def _pre_forward(self, unit, nxt) -> None:
        self._ensure_gathered(unit, compute=True)
        if self.zero.prefetch and not _in_backward():  # the next unit travels while this one computes
            self._start_gather(nxt, compute=True)

    def _post_forward(self, unit, prev, keep, output) -> None:
        if _in_backward():
            return  # a forward re-run inside backward (activation recomputation): keep the parameters
        training = torch.is_grad_enabled()
        tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
        for t in tensors:  # fires when the gradient reaches this unit's output
            t.register_hook(lambda g, u=unit, p=prev: self._pre_backward(u, p))
        if not (training and tensors):  # inference: nothing will come back for these
            for u in self.zero.all_units if unit is self.zero.root else [unit]:
                self.reshard(u)
        elif not keep:
            unit.free_full()

    def _pre_backward(self, unit, prev) -> None:
        if unit.backward_started:
            return
        unit.backward_started = True
        self._ensure_gathered(unit, compute=True)
        if self.zero.prefetch:  # backward walks the units in reverse
            self._start_gather(prev, compute=True)


def _in_backward() -> bool:
    """True while autograd's engine runs, e.g. when checkpointing re-runs a forward."""
    return torch._C._current_graph_task_id() != -1


REFINEMENTS["stage 3"] = ParameterSharding  # what ZeRO(..., stage=3) builds as its sharding
