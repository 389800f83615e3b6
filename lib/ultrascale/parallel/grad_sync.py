"""Combining gradients over the ranks that saw other data: the one helper every technique uses.

Whenever ranks hold the same parameter but compute its gradient from different tokens,
each rank's gradient is only part of the story. Context parallelism (other slices of the
sequence), sequence parallelism's norms (other slices, under TP), expert parallelism
(other batches) and data parallelism all end the same way: **all-reduce the gradient over
the group of those ranks, then divide** (by the group's size for a mean; by 1 for a sum, as
SP's norms need; by the number of ranks with other data for an EP expert, whose replicas
are fewer than those ranks).

* ``reduce_gradient(grad, group, divide_by)``: that, on one tensor, returned as a new one.
* ``sync_in_backward(params, group, divide_by=..., keep_as=...)``: the same as a hook on
  each parameter (``Tensor.register_hook``). It runs *before* autograd adds the gradient
  into ``.grad``, so accumulating over micro-batches stays right, and nothing has to be
  called after backward. The handle is kept on the parameter (``p._cp_grad_sync``, ...),
  so that a chapter can remove the hook and look at the unsynchronised gradients.
* ``average_gradients(params, group, divide_by=...)``: the same after backward, on ``.grad``.

``group`` follows torch's convention (None: all ranks). A group of one rank has nothing to
sum, so no collective is sent; ``NO_REPLICAS`` says that no other rank holds the parameter
at all (an expert under EP without data parallelism), so it is only divided.

Not here: data parallelism's overlapped and bucketed hooks (``data_parallel``), which
launch asynchronous all-reduces from ``register_post_accumulate_grad_hook`` and wait for
them at the end of backward: how to overlap is what chapter 02 teaches. Nor ZeRO's, which
reduce-scatter into flat buffers.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["DATA_AXES", "NO_REPLICAS", "reduce_gradient", "sync_in_backward", "average_gradients"]

NO_REPLICAS = "no replicas"  # a group argument: no other rank holds the parameter

# The mesh axes whose ranks compute a parameter's gradient from different data, so that the
# gradient must be averaged over them: dp (other rows), ep (other rows too: EP borrows its ranks
# from DP) and cp (other tokens of the same rows). An expert lives on one ep rank, so its
# gradient already holds every ep rank's tokens (the all-to-all brought them): it averages over
# dp and cp only. tp and pp ranks hold different parameters (or, for TP's replicated norms, the
# same gradient already): nothing is averaged over them. Each technique averages over its own
# axis unless told ``sync_gradients=False``; a composition averages once over these.
DATA_AXES = {"dense": ("dp", "ep", "cp"), "expert": ("dp", "cp")}


def _group_size(group) -> int:
    return 1 if group is NO_REPLICAS else dist.get_world_size(group)


def reduce_gradient(grad: torch.Tensor, group=None, divide_by: int = 1) -> torch.Tensor:
    """``grad`` summed over ``group``, divided by ``divide_by``, as a new tensor."""
    grad = grad.clone()  # the incoming gradient may be used elsewhere in backward
    if _group_size(group) > 1:
        dist.all_reduce(grad, group=group)
    return grad if divide_by == 1 else grad.div_(divide_by)


def _parameters(params) -> list:
    return list(params.parameters()) if isinstance(params, nn.Module) else list(params)


def sync_in_backward(params, group=None, *, divide_by: int | None = None, keep_as: str) -> None:
    """Hook every trainable parameter of ``params`` (parameters or a module) so that its
    gradient is summed over ``group`` and divided by ``divide_by`` (None: the group's size,
    a mean) while backward computes it. The hook's handle is kept as ``p.<keep_as>``."""
    divide_by = _group_size(group) if divide_by is None else divide_by
    hook = functools.partial(reduce_gradient, group=group, divide_by=divide_by)
    for p in _parameters(params):
        if p.requires_grad:
            setattr(p, keep_as, p.register_hook(hook))


def average_gradients(params, group=None, *, divide_by: int | None = None) -> None:
    """After backward: every ``.grad`` of ``params`` (parameters or a module) summed over
    ``group`` and divided by ``divide_by`` (None: the group's size, the mean), in place.
    The one-line version of naive data parallelism, for use without a wrapper."""
    divide_by = _group_size(group) if divide_by is None else divide_by
    for p in _parameters(params):
        if p.grad is not None:
            p.grad.copy_(reduce_gradient(p.grad, group, divide_by))
