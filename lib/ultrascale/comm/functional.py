"""Collectives that autograd can differentiate, for tensor, sequence and expert parallelism.

Inside a model a collective is one more operation of the forward pass, so backward needs
its derivative: the derivative of a communication is another communication. The
Ultra-Scale Playbook names the pairs of tensor and sequence parallelism:

==============  ===============================  =====================================
book name       forward                          backward
==============  ===============================  =====================================
``f``           identity                         all-reduce (sum)
``f_star`` f*   all-reduce (sum)                 identity
``g``           all-gather along ``dim``         reduce-scatter along ``dim``
``g_star`` g*   reduce-scatter along ``dim``     all-gather along ``dim``
==============  ===============================  =====================================

``f`` / ``f_star`` enclose a tensor-parallel block (column-parallel then row-parallel
linear); sequence parallelism replaces them by ``g`` / ``g_star`` (Megatron-LM's g and
g-bar), so that outside the block each rank keeps only its slice of the sequence.
``split_along_dim`` and ``gather_along_dim`` serve the edges of a tensor-parallel model,
and ``all_to_all`` routes tokens to experts (its backward routes the gradients back).

Rules of every collective hold here too: all ranks of ``group`` call the same functions
in the same order, with tensors of the same shape (but for ``all_to_all``'s splits).
Every call goes through ``dist.<name>`` looked up at call time, so a ``CommLogger``
opened around forward or backward sees it. The plain helpers at the end
(``all_gather_into``, ``reduce_scatter_into``, ``broadcast_parameters``) are the ones the
data-parallel and ZeRO chapters use.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


# ---- plain (non-autograd) helpers ----------------------------------------------------
def all_gather_into(output, shard, group=None, async_op=False):
    """Concatenate every rank's ``shard`` into ``output`` (all_gather_single in torch >= 2.13)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, shard, group=group, async_op=async_op)


def reduce_scatter_into(output, full, group=None, async_op=False):
    """Sum ``full`` over ranks and keep only this rank's slice in ``output``."""
    # gloo supports reduce-scatter on CPU in torch 2.13, so no all-reduce + slice fallback.
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, full, group=group, async_op=async_op)


def broadcast_parameters(module: nn.Module, group=None) -> None:
    """Copy rank 0's parameters and buffers to every rank, so all replicas start equal."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor, src=src, group=group)


def rank_and_size(group=None, who: str = "these functions") -> tuple[int, int]:
    """This rank's index and the size of ``group``, or a clear error outside a process group."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"torch.distributed is not initialized: {who} need a process group; call "
            "them inside cluster.run(...) (ultrascale.runtime.Cluster), under torchrun, "
            "or after dist.init_process_group()"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def piece_size(size: int, n: int, dim: int, what: str) -> int:
    """``size // n``, refusing sizes that do not split: a silent remainder would mis-shape."""
    if size % n:
        raise ValueError(
            f"{what}: length {size} along dim {dim} is not divisible by the group size {n} "
            f"(e.g. sequence length {size} with tp={n}): pad it to {-(-size // n) * n} or "
            "pick a length that divides"
        )
    return size // n


# Collectives work on whole contiguous buffers cut along dim 0. For any other dim we move
# it to the front, copy to a contiguous buffer, communicate, and move it back.
def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    _, n = rank_and_size(group)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((n * front.shape[0], *front.shape[1:]))
    all_gather_into(out, front, group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    _, n = rank_and_size(group)
    piece = piece_size(x.shape[dim], n, dim, "reduce_scatter_to_sequence_region (g*)")
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((piece, *front.shape[1:]))
    reduce_scatter_into(out, front, group)
    return out.movedim(0, dim).contiguous()


def _own_slice(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    r, n = rank_and_size(group)
    piece = piece_size(x.shape[dim], n, dim, "split_along_dim")
    return x.narrow(dim, r * piece, piece).contiguous()  # no communication at all


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    # Reduce a contiguous copy: the input may be saved for backward or be the caller's
    # tensor (e.g. the ``gradient`` given to ``backward``), so it must not change.
    out = torch.clone(x, memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


# ---- f and f*: tensor parallelism ----------------------------------------------------
class CopyToParallelRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward.

    Before a column-parallel linear every rank holds the same input x, and rank r uses
    it with its own slice of the weight. The loss depends on x through every rank, so
    dL/dx is the sum of all ranks' partial gradients: an all-reduce.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class ReduceFromParallelRegion(torch.autograd.Function):
    """f*: all-reduce forward, identity backward.

    After a row-parallel linear each rank holds a partial sum of the output; the sum
    y = sum_r y_r is needed on every rank. dy/dy_r is the identity, and the upstream
    gradient is already the same on every rank (all compute the same loss from the same
    y), so each rank just passes it on.
    """

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# ---- g and g*: sequence parallelism, and the edges of a tensor-parallel model ---------
def _conjugate_pair(name: str, forward_op, backward_op, doc: str):
    """An autograd Function that runs ``forward_op(x, dim, group)`` forward and
    ``backward_op(grad, dim, group)`` backward: the four below differ only in the pair."""

    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return forward_op(x, dim, group)

    def backward(ctx, grad):
        return backward_op(grad, ctx.dim, ctx.group), None, None

    return type(
        name,
        (torch.autograd.Function,),
        {"__doc__": doc, "forward": staticmethod(forward), "backward": staticmethod(backward)},
    )


GatherFromSequenceRegion = _conjugate_pair(
    "GatherFromSequenceRegion",
    _all_gather,
    _reduce_scatter,
    """
    g: all-gather along ``dim`` forward, reduce-scatter backward.

    Each rank holds a slice of the sequence; the tensor-parallel block after g needs all
    of it. Every rank uses the whole gathered tensor with different weights, so the
    gradient of rank r's slice is the sum over ranks of their gradients for that slice:
    a reduce-scatter.""",
)

ReduceScatterToSequenceRegion = _conjugate_pair(
    "ReduceScatterToSequenceRegion",
    _reduce_scatter,
    _all_gather,
    """
    g*: reduce-scatter along ``dim`` forward, all-gather backward.

    Rank r keeps slice r of the sum of all ranks' partial outputs. Every rank's input
    contributes to every slice with coefficient 1, so each input's gradient is the full
    upstream gradient, whose slices live on different ranks: an all-gather.""",
)

SplitAlongDim = _conjugate_pair(
    "SplitAlongDim",
    _own_slice,
    _all_gather,
    """
    Keep this rank's slice of a replicated tensor; backward all-gathers the slices'
    gradients, so every rank gets the gradient of the whole (replicated) tensor.""",
)

GatherAlongDim = _conjugate_pair(
    "GatherAlongDim",
    _all_gather,
    _own_slice,
    """
    All-gather the slices into the full tensor. The loss after it is computed the same
    way on every rank, so the upstream gradient is replicated: keep this rank's slice.""",
)


# ---- all-to-all: expert parallelism ----------------------------------------------------
def _all_to_all_rows(x, output_split_sizes, input_split_sizes, group) -> torch.Tensor:
    """Send rows ``input_split_sizes[j]`` of ``x`` to rank j; receive
    ``output_split_sizes[j]`` rows from rank j, stacked in rank order."""
    out = x.new_empty((sum(output_split_sizes), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes, input_split_sizes, group=group)
    return out


def _resolve_splits(x, output_split_sizes, input_split_sizes, group):
    """Both split lists as explicit lists of ``world_size`` row counts."""
    _, n = rank_and_size(group)
    if input_split_sizes is None:
        input_split_sizes = [piece_size(x.shape[0], n, 0, "all_to_all")] * n
        if output_split_sizes is None:  # equal pieces of same-shaped tensors both ways
            output_split_sizes = input_split_sizes
    input_split_sizes = list(input_split_sizes)
    if len(input_split_sizes) != n or sum(input_split_sizes) != x.shape[0]:
        raise ValueError(
            f"all_to_all: input_split_sizes {input_split_sizes} must have one "
            f"entry per rank ({n}) summing to x.shape[0] = {x.shape[0]}"
        )
    if output_split_sizes is None:
        # A rank knows how many rows it sends, not how many it will receive: ask the
        # senders with one small all-to-all of the counts (MoE layers do the same).
        counts = torch.tensor(input_split_sizes, dtype=torch.int64, device=x.device)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        output_split_sizes = received.tolist()
    return list(output_split_sizes), input_split_sizes


class AllToAll(torch.autograd.Function):
    """All-to-all along dim 0. Row i sent to rank j arrives at some row of j's output,
    so its gradient must travel back the same way: the same all-to-all with the
    input and output split sizes swapped."""

    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes, group):
        ctx.splits, ctx.group = (output_split_sizes, input_split_sizes), group
        return _all_to_all_rows(x, output_split_sizes, input_split_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        output_split_sizes, input_split_sizes = ctx.splits
        grad_x = _all_to_all_rows(grad, input_split_sizes, output_split_sizes, ctx.group)
        return grad_x, None, None, None


# ---- the functions to call -------------------------------------------------------------
def copy_to_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """f: identity forward, all-reduce (sum) of the gradient backward."""
    return CopyToParallelRegion.apply(x, group)


def reduce_from_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """f*: all-reduce (sum) forward, identity backward."""
    return ReduceFromParallelRegion.apply(x, group)


def gather_from_sequence_region(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """g: all-gather along ``dim`` (default 1, the sequence of (batch, seq, hidden))
    forward, reduce-scatter backward."""
    return GatherFromSequenceRegion.apply(x, dim % x.dim(), group)


def reduce_scatter_to_sequence_region(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """g*: reduce-scatter (sum) along ``dim`` forward, all-gather backward.
    ``x.shape[dim]`` must be divisible by the group size."""
    return ReduceScatterToSequenceRegion.apply(x, dim % x.dim(), group)


def split_along_dim(x: torch.Tensor, dim: int = -1, group=None) -> torch.Tensor:
    """Keep this rank's slice along ``dim`` forward, all-gather the gradient backward."""
    return SplitAlongDim.apply(x, dim % x.dim(), group)


def gather_along_dim(x: torch.Tensor, dim: int = -1, group=None) -> torch.Tensor:
    """All-gather along ``dim`` forward, keep this rank's slice of the gradient backward."""
    return GatherAlongDim.apply(x, dim % x.dim(), group)


def all_to_all(x: torch.Tensor, output_split_sizes=None, input_split_sizes=None, group=None) -> torch.Tensor:
    """Send ``input_split_sizes[j]`` rows of ``x`` (dim 0) to rank j and return the rows
    received, ``output_split_sizes[j]`` from rank j, in rank order. Splits may be uneven
    (and zero). Without ``input_split_sizes`` x is cut into equal pieces; without
    ``output_split_sizes`` the counts are first exchanged. Differentiable."""
    output_split_sizes, input_split_sizes = _resolve_splits(x, output_split_sizes, input_split_sizes, group)
    return AllToAll.apply(x, output_split_sizes, input_split_sizes, group)


# The book's short names.
f = copy_to_parallel_region
f_star = reduce_from_parallel_region
g = gather_from_sequence_region
g_star = reduce_scatter_to_sequence_region

__all__ = [
    "f",
    "f_star",
    "g",
    "g_star",
    "copy_to_parallel_region",
    "reduce_from_parallel_region",
    "gather_from_sequence_region",
    "reduce_scatter_to_sequence_region",
    "split_along_dim",
    "gather_along_dim",
    "all_to_all",
    "all_gather_into",
    "reduce_scatter_into",
    "broadcast_parameters",
    "rank_and_size",
    "CopyToParallelRegion",
    "ReduceFromParallelRegion",
    "GatherFromSequenceRegion",
    "ReduceScatterToSequenceRegion",
    "SplitAlongDim",
    "GatherAlongDim",
    "AllToAll",
]
