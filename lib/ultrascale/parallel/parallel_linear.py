"""Megatron-LM's two tensor-parallel linear layers, and slicing a weight for this rank.

Files for basic tensor parallelism, in reading order: ``tensor_parallel.py`` (``apply_tp``),
this module, ``comm/functional.py`` (``f``, ``f*``) and ``mesh.py`` (the tp group).

* a **column-parallel** linear keeps a slice of the *output* features (rows of the weight).
  Its input must be whole on every rank: ``f`` (identity forward, all-reduce backward);
* a **row-parallel** linear keeps a slice of the *input* features (columns of the weight),
  takes the column-parallel output as it is, and sums the ranks' partial results: ``f*``
  (all-reduce forward). Its bias is added once, after the sum.

These are plain TP only. Sequence parallelism's versions (``g``/``g*`` in place of
``f``/``f*``) are subclasses in ``sequence_parallel.py``, async TP's in ``async_tp.py``.
Parameters sharded here carry ``tp_shard_dim`` and ``tp_group``, which
``tensor_parallel.full_weights`` reads to gather them back to full shapes.
``tensor_parallel.apply_tp`` swaps a model's layers for these.
"""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from ..comm.functional import f, f_star, rank_and_size

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "shard_parameter", "enter_region_with_f"]


def shard_parameter(tensor, dim, group, shared=None) -> nn.Parameter:
    """This rank's slice of ``tensor`` along ``dim`` as a new Parameter. ``shared`` maps an
    original parameter to its shard, so weights tied in the model stay tied (GPT's embedding)."""
    if shared is not None and id(tensor) in shared:
        return shared[id(tensor)]
    rank, n = rank_and_size(group, "tensor-parallel layers")
    if tensor.shape[dim] % n:
        raise ValueError(
            f"tp={n} does not divide the {tensor.shape[dim]} rows/columns (dim {dim}) of a "
            f"{tuple(tensor.shape)} weight: choose a tp that divides it"
        )
    piece = tensor.shape[dim] // n
    local = nn.Parameter(tensor.detach().narrow(dim, rank * piece, piece).clone(), requires_grad=tensor.requires_grad)
    local.tp_shard_dim, local.tp_group = dim, group
    if shared is not None:
        shared[id(tensor)] = local
    return local


class ColumnParallelLinear(nn.Module):
    """y_r = f(x) W_r^T + b_r: this rank's slice of the output features.

    The output stays split along the features. ``enter_region=False``: the module around
    this layer already applied f, once for all its column-parallel layers
    (:func:`enter_region_with_f`, ``apply_tp``'s "parallel_region" style)."""

    def __init__(self, weight, bias=None, group=None, enter_region=True):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group, self.enter_region = group, enter_region

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, enter_region=True, shared=None, **options):
        """Slice an existing ``nn.Linear`` (rows of its weight, its bias) for this rank;
        ``options`` go on to the constructor (a subclass's own arguments)."""
        bias = None if linear.bias is None else shard_parameter(linear.bias, 0, group, shared)
        return cls(shard_parameter(linear.weight, 0, group, shared), bias, group, enter_region, **options)

    def forward(self, x):
        if self.enter_region:
            x = f(x, self.group)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return (
            f"in_features={self.weight.shape[1]}, local out_features={self.weight.shape[0]}, "
            f"bias={self.bias is not None}, enter_region={self.enter_region}"
        )


class RowParallelLinear(nn.Module):
    """y = f*(x_r W_r^T) + b: this rank's input features; the partial products are summed.

    The bias is added after the sum: added on every rank before it, it would count tp times."""

    def __init__(self, weight, bias=None, group=None):
        super().__init__()
        self.weight, self.bias, self.group = weight, bias, group

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, shared=None, **options):
        """Slice an existing ``nn.Linear`` (columns of its weight) for this rank; the bias is kept whole."""
        bias = (
            None
            if linear.bias is None
            else nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        )
        return cls(shard_parameter(linear.weight, 1, group, shared), bias, group, **options)

    def forward(self, x):
        y = f_star(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return (
            f"local in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, "
            f"bias={self.bias is not None}"
        )


def enter_region_with_f(module, group=None):
    """Make ``module`` a TP region: f once at its entrance for all the column-parallel layers
    inside (built with ``enter_region=False``). q, k and v read the same input, so backward
    all-reduces its gradient once, not three times."""
    module.register_forward_pre_hook(lambda mod, args: (f(args[0], group), *args[1:]))
