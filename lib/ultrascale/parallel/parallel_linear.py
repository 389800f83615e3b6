"""Megatron-LM's two tensor-parallel linear layers, and slicing a weight for this rank.

* a **column-parallel** linear keeps a slice of the *output* features (rows of the weight).
  Its input must be whole on every rank: ``f`` (identity forward, all-reduce backward);
* a **row-parallel** linear keeps a slice of the *input* features (columns of the weight),
  takes the column-parallel output as it is, and sums the ranks' partial results: ``f*``
  (all-reduce forward). Its bias is added once, after the sum.

With sequence parallelism (``sequence_parallel.py``) ``f``/``f*`` become ``g``/``g*``.
Parameters sharded here carry ``tp_shard_dim`` and ``tp_group``, which
``tensor_parallel.full_weights`` reads to gather them back to full shapes.
``tensor_parallel.apply_tp`` swaps a model's layers for these.
"""
from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from ..comm.functional import f_star, g_star, rank_and_size
from .sequence_parallel import enter_region_keeping_shard, leave_region, sum_gradient_over_tp

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "shard_parameter"]


def shard_parameter(tensor, dim, group, shared=None) -> nn.Parameter:
    """This rank's slice of ``tensor`` along ``dim`` as a new Parameter. ``shared`` maps an
    original parameter to its shard, so weights tied in the model stay tied (GPT's embedding)."""
    if shared is not None and id(tensor) in shared:
        return shared[id(tensor)]
    rank, n = rank_and_size(group, "tensor-parallel layers")
    if tensor.shape[dim] % n:
        raise ValueError(f"tp={n} does not divide the {tensor.shape[dim]} rows/columns (dim {dim}) of a "
                         f"{tuple(tensor.shape)} weight: choose a tp that divides it")
    piece = tensor.shape[dim] // n
    local = nn.Parameter(tensor.detach().narrow(dim, rank * piece, piece).clone(),
                         requires_grad=tensor.requires_grad)
    local.tp_shard_dim, local.tp_group = dim, group
    if shared is not None:
        shared[id(tensor)] = local
    return local



class ColumnParallelLinear(nn.Module):
    """y_r = f(x) W_r^T + b_r: this rank's slice of the output features.

    With ``sequence_parallel`` the input is this rank's slice of the sequence (dim 1) and
    ``g`` all-gathers it first. The output stays split along the features.
    ``enter_region=False``: the module around this layer already applied f (g), once for all
    its column-parallel layers (``apply_tp``'s "parallel_region" style). ``regather``: with
    SP, save only the input's slice and all-gather it again in backward (RegatherInBackward)."""

    def __init__(self, weight, bias=None, group=None, sequence_parallel=False, enter_region=True,
                 regather=True):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group, self.sequence_parallel, self.enter_region = group, sequence_parallel, enter_region
        self.regather = regather

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, sequence_parallel=False, enter_region=True, shared=None):
        """Slice an existing ``nn.Linear`` (rows of its weight, its bias) for this rank."""
        bias = None if linear.bias is None else shard_parameter(linear.bias, 0, group, shared)
        return cls(shard_parameter(linear.weight, 0, group, shared), bias, group, sequence_parallel, enter_region)

    def forward(self, x):
        if not self.enter_region:
            return F.linear(x, self.weight, self.bias)
        x = enter_region_keeping_shard(self, x, self.group, self.sequence_parallel, self.regather)
        try:
            return F.linear(x, self.weight, self.bias)
        finally:
            leave_region(self)

    def extra_repr(self):
        return (f"in_features={self.weight.shape[1]}, local out_features={self.weight.shape[0]}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}, "
                f"enter_region={self.enter_region}")


class RowParallelLinear(nn.Module):
    """y = f*(x_r W_r^T) + b: this rank's input features; the partial products are summed.

    The bias is added after the sum: added on every rank before it, it would count tp times.
    With ``sequence_parallel`` ``g*`` reduce-scatters the sum along the sequence (dim 1),
    and the replicated bias, added to a slice of the tokens, gets its gradient all-reduced."""

    def __init__(self, weight, bias=None, group=None, sequence_parallel=False):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group, self.sequence_parallel = group, sequence_parallel
        if sequence_parallel and bias is not None:
            sum_gradient_over_tp(bias, group)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, sequence_parallel=False, shared=None):
        """Slice an existing ``nn.Linear`` (columns of its weight) for this rank; the bias is kept whole."""
        bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                            requires_grad=linear.bias.requires_grad)
        return cls(shard_parameter(linear.weight, 1, group, shared), bias, group, sequence_parallel)

    def forward(self, x):
        y = F.linear(x, self.weight)
        y = g_star(y, 1, self.group) if self.sequence_parallel else f_star(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return (f"local in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")

