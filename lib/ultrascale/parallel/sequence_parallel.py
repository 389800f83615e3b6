"""Sequence parallelism (SP): the work between the tensor-parallel regions split along the sequence.

Files, in reading order: ``tensor_parallel.py`` (``apply_tp(..., sequence_parallel=True)``
and the plain TP layers these subclass), ``vocab_parallel.py`` (the embedding and head these
subclass), this module, ``comm/functional.py`` (``g``, ``g*``); the tp group comes from
``mesh.py``. This module registers its layers as ``tensor_parallel.FORMS["sequence_parallel"]``
(:func:`sequence_parallel_layers`) when the package imports it.

Between the TP regions (norms, residual adds) the activations are identical on every tp
rank, so that work and memory are split along the sequence instead. ``f``/``f*`` become
``g`` (all-gather the sequence before a column-parallel layer) and ``g*`` (reduce-scatter
after a row-parallel one), which together move the bytes of the one all-reduce they
replace. ``apply_tp`` chooses the pieces of this module when ``sequence_parallel`` is on:

* :class:`SequenceParallelColumnLinear` and :class:`SequenceParallelRowLinear`: the
  column- and row-parallel linears with ``g`` and ``g*``; :class:`SequenceParallelEmbedding`
  and :class:`SequenceParallelVocabHead`, the vocabulary-parallel embedding (``g*``) and head
  (``g``); :func:`enter_region_with_g`: g applied once at the entrance of a TP region;
* :class:`RegatherInBackward`: the layers after ``g`` save only this rank's slice of their
  gathered input and all-gather it again in backward (as Megatron-LM does);
* a replicated parameter used on a slice of the sequence (norm weights, row-parallel biases)
  gets only that slice's gradient; :func:`sum_gradient_over_tp` hooks each such parameter
  so its gradient is all-reduced over the tp group as it is computed, inside backward (so
  accumulation over micro-batches stays right and nothing has to be called after backward);
* the blocks see ``seq/tp`` tokens, but the model computes default RoPE positions from the
  embedding output's length, which would then be wrong. Attention runs between ``g`` and
  ``g*`` on the whole sequence, so it needs positions ``0..seq-1``:
  :func:`fill_global_positions` registers a forward pre-hook on the model that passes them
  when the caller gives none. ``model.py`` is not changed.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm.functional import g, g_star, gather_along_dim
from .grad_sync import sync_in_backward
from .tensor_parallel import FORMS, ColumnParallelLinear, RowParallelLinear, TPLayers
from .vocab_parallel import VocabParallelEmbedding, VocabParallelHead

__all__ = [
    "SequenceParallelColumnLinear",
    "SequenceParallelRowLinear",
    "SequenceParallelEmbedding",
    "SequenceParallelVocabHead",
    "enter_region_with_g",
    "RegatherInBackward",
    "fill_global_positions",
    "sum_gradient_over_tp",
    "sum_norm_gradients",
    "sequence_parallel_layers",
    "enter_region_keeping_shard",
    "leave_region",
]


def sum_gradient_over_tp(param: nn.Parameter, group) -> None:
    """Under SP a replicated parameter sees only this rank's tokens: its full gradient is the
    sum over the tp ranks. The hook changes the gradient *before* it is accumulated into
    ``.grad``, so gradient accumulation over micro-batches is unaffected."""
    sync_in_backward([param], group, divide_by=1, keep_as="_tp_grad_sync")  # a sum: no division


class _Regathered:
    """What a saved-tensor hook keeps in place of (a view of) the gathered input: the slice."""

    __slots__ = ("shard", "size", "stride", "offset")

    def __init__(self, shard, t):
        self.shard, self.size, self.stride, self.offset = shard, t.size(), t.stride(), t.storage_offset()


class RegatherInBackward:
    """Saved-tensor hooks: keep this rank's slice of the sequence, not g's gathered output.

    With SP, the column-parallel layers after ``g`` save their input, the whole sequence
    ``(b, s, h)``, to compute their weight gradients: tp times what the rank holds between
    the regions. Megatron-LM keeps only the slice and all-gathers it again in backward,
    trading one more all-gather per region for ``b*s*h*(tp-1)/tp`` fewer saved elements;
    these hooks do the same for any layer inside the region (q, k and v save one tensor:
    it is gathered once, when the first of them needs it, and dropped after the last).
    Hooks already active (a checkpoint, a memory measurement) still see every saved
    tensor: the others unchanged, and the slice in place of the gathered input.
    """

    def __init__(self, shard, gathered, group):
        self.shard, self.group = shard.detach(), group
        self.storage = gathered.untyped_storage().data_ptr()
        self.packed = self.unpacked = 0
        self.full = None
        # Saved-tensor hooks do not nest on their own: the innermost pair is the only one
        # called, so ours hands every tensor on to the pair that was active before it.
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.outer_pack, self.outer_unpack = outer or (lambda t: t, lambda t: t)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t):
        if t.untyped_storage().data_ptr() != self.storage:
            return self.outer_pack(t)
        self.packed += 1
        return _Regathered(self.outer_pack(self.shard), t)

    def unpack(self, saved):
        if not isinstance(saved, _Regathered):
            return self.outer_unpack(saved)
        full = self.full
        if full is None:
            with torch.no_grad():
                full = gather_along_dim(self.outer_unpack(saved.shard), 1, self.group)
        self.unpacked += 1
        self.full = full if self.unpacked < self.packed else None  # drop it after the last use
        return full.as_strided(saved.size, saved.stride, saved.offset)


def enter_region_keeping_shard(module, x, group, regather=True):
    """Apply g (all-gather the sequence, dim 1); with ``regather``, push RegatherInBackward
    until :func:`leave_region` (the module's forward ends)."""
    gathered = g(x, 1, group)
    if regather and torch.is_grad_enabled():
        module._regather = RegatherInBackward(x, gathered, group)
        module._regather.hooks.__enter__()
    return gathered


def leave_region(module, *_):
    regather = module.__dict__.pop("_regather", None)
    if regather is not None:
        regather.hooks.__exit__(None, None, None)


def enter_region_with_g(module, group=None, regather=True):
    """Make ``module`` a TP region under SP: g once at its entrance for all the column-parallel
    layers inside (built with ``enter_region=False``); attention then sees the whole sequence,
    whose length it reads from its input."""
    module.register_forward_pre_hook(
        lambda mod, args: (enter_region_keeping_shard(mod, args[0], group, regather), *args[1:])
    )
    module.register_forward_hook(leave_region, always_call=True)


# --------------------------------------------------------------------------- the layers
class SequenceParallelColumnLinear(ColumnParallelLinear):
    """y_r = g(x) W_r^T + b_r: the input is this rank's slice of the sequence (dim 1), and
    ``g`` all-gathers it first. ``regather``: save only the slice and all-gather it again in
    backward (:class:`RegatherInBackward`); False saves the whole gathered input."""

    def __init__(self, weight, bias=None, group=None, enter_region=True, regather=True):
        super().__init__(weight, bias, group, enter_region)
        self.regather = regather

    def forward(self, x):
        if not self.enter_region:  # the region's entrance has gathered the input
            return F.linear(x, self.weight, self.bias)
        x = enter_region_keeping_shard(self, x, self.group, self.regather)
        try:
            return F.linear(x, self.weight, self.bias)
        finally:  # even if the matmul fails, the saved-tensor hooks come off
            leave_region(self)

    def extra_repr(self):
        return f"{super().extra_repr()}, sequence_parallel=True, regather={self.regather}"


class SequenceParallelRowLinear(RowParallelLinear):
    """y = g*(x_r W_r^T) + b: ``g*`` reduce-scatters the sum along the sequence (dim 1).

    The replicated bias is added to this rank's slice of the tokens only, so its gradient
    is summed over the tp ranks (:func:`sum_gradient_over_tp`)."""

    def __init__(self, weight, bias=None, group=None):
        super().__init__(weight, bias, group)
        if bias is not None:
            sum_gradient_over_tp(bias, group)

    def forward(self, x):
        y = g_star(F.linear(x, self.weight), 1, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return f"{super().extra_repr()}, sequence_parallel=True"


class SequenceParallelEmbedding(VocabParallelEmbedding):
    """The vocabulary-parallel embedding under SP: ``g*`` sums the ranks' lookups and leaves
    this rank its slice of the sequence (dim 1), where the blocks start."""

    sequence_parallel = True  # the pipeline reads it: the messages between stages are slices

    def forward(self, idx):
        return g_star(self.local_lookup(idx), 1, self.group)


class SequenceParallelVocabHead(VocabParallelHead, SequenceParallelColumnLinear):
    """The vocabulary-parallel LM head after ``g``: :class:`VocabParallelHead`'s logits from
    :class:`SequenceParallelColumnLinear`'s gathered input (its ``forward`` is the next in line)."""


def fill_global_positions(model, tp: int):
    """A forward pre-hook giving the model RoPE positions ``0..seq-1`` when the caller gives
    none. With SP the model would otherwise take them from the length of its (sequence-split)
    embedding output; attention sees the whole sequence. Also refuses a length tp does not divide."""

    def hook(module, args, kwargs):
        idx = args[0] if args else kwargs["idx"]
        tokens = idx.dim() == 2  # token ids: the whole sequence; hidden states: this rank's slice
        seq = idx.shape[1] if tokens else idx.shape[1] * tp
        if tokens and seq % tp:
            raise ValueError(
                f"sequence parallelism splits each sequence over tp={tp} ranks: {seq} tokens "
                f"do not split evenly; use a sequence length divisible by {tp} (or pad)"
            )
        if len(args) > 1 or kwargs.get("positions") is not None:
            return None  # the caller knows the global positions (e.g. context parallelism)
        return args, {**kwargs, "positions": torch.arange(seq, device=idx.device)}

    return model.register_forward_pre_hook(hook, with_kwargs=True)


# --------------------------------------------------------------------------- SP's form of TP
def sum_norm_gradients(module, group) -> None:
    """A norm run on this rank's slice of the tokens ("sequence_norm" in a plan): its
    parameters' gradients are summed over the tp group (:func:`sum_gradient_over_tp`)."""
    for p in module.parameters():
        sum_gradient_over_tp(p, group)


def sequence_parallel_layers(group, regather_in_backward, timeline) -> TPLayers:
    """What ``apply_tp(..., sequence_parallel=True)`` builds: the layers above, g at each
    region's entrance, norm gradients summed over tp, and RoPE positions for the whole sequence."""
    regather = regather_in_backward
    return TPLayers(
        partial(SequenceParallelColumnLinear.from_linear, regather=regather),
        SequenceParallelRowLinear.from_linear,
        SequenceParallelEmbedding.from_embedding,
        partial(SequenceParallelVocabHead.from_linear, regather=regather),
        partial(enter_region_with_g, group=group, regather=regather),
        sequence_norm=sum_norm_gradients,
        finish=fill_global_positions,
    )


FORMS["sequence_parallel"] = sequence_parallel_layers
