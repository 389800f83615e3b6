"""Asynchronous tensor parallelism: SP's all-gather and reduce-scatter cut into pieces that
overlap the matmuls they feed.

With sequence parallelism a column-parallel layer waits for ``g`` (all-gather the sequence)
before it multiplies, and ``g*`` (reduce-scatter) waits for the row-parallel matmul before
it sends: compute and communication take turns. Both collectives move the activation in
``tp`` pieces of ``seq/tp`` tokens, and both matmuls work token by token, so each can be cut
into the same ``tp`` pieces and interleaved with the ring that moves them:

* **all-gather + matmul** (:func:`all_gather_matmul`): the sequence shards travel round a
  ring of the tp ranks; while shard ``i+1`` is in flight, the rank multiplies the shard it
  already holds by its weight slices and writes the product into that shard's rows.
* **matmul + reduce-scatter** (:func:`matmul_reduce_scatter`): the rank computes its partial
  output for one destination shard at a time and passes the running sum to the next rank
  while it computes the next piece; after ``tp`` pieces the sum of its own shard arrives.

``tp - 1`` transfers of ``1/tp`` of the activation each, as in the ring collectives they
replace, so the bytes are the same; only one matmul piece (the last of an all-gather, the
first of a reduce-scatter) has no transfer beside it. This is the decomposition of Wang et al.,
"Overlap Communication with Dependent Computation via Decomposition in Large Deep Learning
Models" (ASPLOS 2023), which PyTorch implements for CUDA as micro-pipelined TP
(``torch.distributed._symmetric_memory``, "async TP" in torchtitan). Ours uses torch.distributed's
point-to-point sends (gloo on a laptop), so it needs no special hardware; whether it is
faster depends on the hardware (chapter 05, section 11).

Backward is decomposed the same way: the input gradient of all-gather + matmul is a matmul
+ reduce-scatter, and that of matmul + reduce-scatter an all-gather + matmul. The weight
gradient of a column-parallel layer needs the whole gathered input: we keep the one the
ring assembled in forward (Megatron-LM's regathering would add one more ring in backward;
simpler, at the cost of ``b*s*h*(tp-1)/tp`` more saved elements per region).

``apply_tp(model, group, sequence_parallel=True, async_tp=True)`` (``tensor_parallel.py``)
puts these layers in place: this module registers them as ``tensor_parallel.FORMS["async_tp"]``
(:func:`async_tp_layers`) when the package imports it. A TP region (attention, MLP) gathers its input once for all its
column-parallel layers (q, k and v read the same tokens): :func:`enter_async_region` runs one
all-gather + matmul with all their weights and hands each layer its output.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from ..comm.functional import piece_size, rank_and_size
from ..comm.ring import reduce_round_ring, ring_blocks
from .sequence_parallel import SequenceParallelRowLinear, sequence_parallel_layers
from .tensor_parallel import FORMS, ColumnParallelLinear, TPLayers
from .timeline import or_disabled

__all__ = [
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "AllGatherMatmul",
    "MatmulReduceScatter",
    "AsyncColumnParallelLinear",
    "AsyncRowParallelLinear",
    "enter_async_region",
    "enter_region_overlapped",
    "async_tp_layers",
]


# --------------------------------------------------------------------------- the ring
# Point-to-point sends, not one small collective per piece: a ring step is exactly "send to
# the next rank, receive from the previous one" (comm.ring.ring_step, which posts the two as
# NCCL needs them), and the rank computes while both are in flight.
def overlapped_all_gather(shard, group, use_piece, timeline, name="all_gather", phase="forward"):
    """Pass every rank's shard round the ring (``comm.ring.ring_blocks``): ``use_piece(c,
    shard_c)`` runs on each of the ``tp`` shards in turn, on the one in hand while the next
    one travels."""
    shard = shard.contiguous()
    blocks = ring_blocks(
        shard, group, lambda step, owner: torch.empty_like(shard), timeline=timeline, name=f"{name} step {{step}}"
    )
    for c, current in blocks:  # own shard first; each step brings the previous rank's shard
        with timeline.span(f"{phase} matmul piece {c}"):
            use_piece(c, current)


def overlapped_reduce_scatter(partial, group, timeline, name="reduce_scatter", phase="forward"):
    """``partial(c)``: this rank's contribution to shard ``c`` of a sum over ranks. Returns
    shard ``rank`` of the sum. Each rank adds its piece to the running sum it received and
    passes it on; the next piece is computed while the sum travels."""

    def term(c):  # computed while the previous running sum travels
        with timeline.span(f"{phase} matmul piece {c}"):
            return partial(c)  # a new tensor each time: the one sent last step stays unchanged

    return reduce_round_ring(term, group, torch.Tensor.add_, timeline=timeline, name=f"{name} step {{step}}")


# --------------------------------------------------------------------------- autograd functions
def _rows(c, piece):
    return slice(c * piece, (c + 1) * piece)


class AllGatherMatmul(torch.autograd.Function):
    """g then ``x W_i^T`` for every weight, in ``tp`` overlapped pieces. Returns the gathered
    input (a region's module reads shapes from it) and one output per weight."""

    @staticmethod
    def forward(ctx, x, group, timeline, *weights):
        _, n = rank_and_size(group, "asynchronous tensor parallelism")
        b, piece = x.shape[0], x.shape[1]
        gathered = x.new_empty(b, n * piece, *x.shape[2:])
        outs = [x.new_empty(b, n * piece, w.shape[0]) for w in weights]

        def multiply(c, shard):
            gathered[:, _rows(c, piece)] = shard
            for out, w in zip(outs, weights):
                out[:, _rows(c, piece)] = F.linear(shard, w)

        overlapped_all_gather(x, group, multiply, timeline, "all_gather", "forward")
        ctx.save_for_backward(gathered, *weights)
        ctx.group, ctx.timeline, ctx.piece = group, timeline, piece
        ctx.set_materialize_grads(False)  # an unused output (often the gathered input) has no gradient
        return (gathered, *outs)

    @staticmethod
    def backward(ctx, grad_gathered, *grad_outs):
        gathered, *weights = ctx.saved_tensors
        piece = ctx.piece

        def partial(c):  # this rank's share of dL/dx for shard c: a sum over ranks, reduce-scattered
            rows = _rows(c, piece)
            total = gathered.new_zeros(gathered.shape[0], piece, *gathered.shape[2:])
            if grad_gathered is not None:
                total += grad_gathered[:, rows]
            for grad, w in zip(grad_outs, weights):
                if grad is not None:
                    total += grad[:, rows] @ w
            return total

        grad_x = overlapped_reduce_scatter(partial, ctx.group, ctx.timeline, "reduce_scatter", "backward")
        flat = gathered.flatten(0, -2)
        grad_weights = [
            None if grad is None or not need else grad.flatten(0, -2).T @ flat
            for grad, need in zip(grad_outs, ctx.needs_input_grad[3:])
        ]
        return (grad_x, None, None, *grad_weights)


class MatmulReduceScatter(torch.autograd.Function):
    """``x W^T`` then g*, in ``tp`` overlapped pieces: this rank's shard of the summed output."""

    @staticmethod
    def forward(ctx, x, weight, group, timeline):
        _, n = rank_and_size(group, "asynchronous tensor parallelism")
        piece = piece_size(x.shape[1], n, 1, "matmul_reduce_scatter (async TP's g*)")
        y = overlapped_reduce_scatter(
            lambda c: F.linear(x[:, _rows(c, piece)], weight), group, timeline, "reduce_scatter", "forward"
        )
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.timeline, ctx.piece = group, timeline, piece
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_x, grad_w = torch.empty_like(x), torch.zeros_like(weight)

        def multiply(c, grad):  # the gradient of output shard c reached this rank: use it
            rows = _rows(c, ctx.piece)
            grad_x[:, rows] = grad @ weight
            grad_w.add_(grad.flatten(0, -2).T @ x[:, rows].flatten(0, -2))

        overlapped_all_gather(grad_y, ctx.group, multiply, ctx.timeline, "all_gather", "backward")
        return grad_x, grad_w, None, None


def all_gather_matmul(x, weights, group=None, timeline=None):
    """All-gather ``x`` (b, s/tp, h) along the sequence and multiply it by each weight
    (out_i, h), overlapped. Returns ``(gathered (b, s, h), [(b, s, out_i), ...])``."""
    gathered, *outs = AllGatherMatmul.apply(x, group, or_disabled(timeline), *weights)
    return gathered, outs


def matmul_reduce_scatter(x, weight, group=None, timeline=None):
    """``x W^T`` (x: (b, s, k), this rank's input features) summed over the tp ranks, and
    only this rank's ``s/tp`` tokens kept, overlapped: (b, s/tp, out)."""
    return MatmulReduceScatter.apply(x, weight, group, or_disabled(timeline))


# --------------------------------------------------------------------------- layers
class AsyncColumnParallelLinear(ColumnParallelLinear):
    """A column-parallel linear whose all-gather (SP's g) overlaps its matmul. Inside a TP
    region the region's hook has already computed this layer's output (:func:`enter_async_region`).
    ``timeline``: a bar for each matmul piece and ring step."""

    def __init__(self, weight, bias=None, group=None, enter_region=True, timeline=None):
        super().__init__(weight, bias, group, enter_region)
        self.timeline = timeline

    def forward(self, x):
        ready = self.__dict__.pop("_ready", None)
        if ready is not None and ready[0] is x:  # the gathered input the region handed on
            out = ready[1]
        elif self.enter_region:
            _, (out,) = all_gather_matmul(x, [self.weight], self.group, self.timeline)
        else:  # called with another, already whole, input
            out = F.linear(x, self.weight)
        return out if self.bias is None else out + self.bias


class AsyncRowParallelLinear(SequenceParallelRowLinear):
    """SP's row-parallel linear, its reduce-scatter (g*) overlapping its matmul."""

    def __init__(self, weight, bias=None, group=None, timeline=None):
        super().__init__(weight, bias, group)
        self.timeline = timeline

    def forward(self, x):
        y = matmul_reduce_scatter(x, self.weight, self.group, self.timeline)
        return y if self.bias is None else y + self.bias


def enter_async_region(module, x, group, timeline=None):
    """A TP region's entrance: one overlapped all-gather + matmul for all the region's
    column-parallel layers; each finds its output waiting. Returns the gathered input."""
    layers = [m for m in module.children() if isinstance(m, AsyncColumnParallelLinear)]
    gathered, outs = all_gather_matmul(x, [m.weight for m in layers], group, timeline)
    for layer, out in zip(layers, outs):
        layer._ready = (gathered, out)
    return gathered


def enter_region_overlapped(module, group=None, timeline=None):
    """Make ``module`` a TP region under async TP: :func:`enter_async_region` at its entrance."""
    module.register_forward_pre_hook(lambda mod, args: (enter_async_region(mod, args[0], group, timeline), *args[1:]))


def async_tp_layers(group, regather_in_backward, timeline) -> TPLayers:
    """What ``apply_tp(..., async_tp=True)`` builds: SP's form with the linears and the regions'
    entrances above. The timeline gets the matmul pieces and ring steps, not per-block bars
    (which would cover them)."""
    return sequence_parallel_layers(group, regather_in_backward, timeline)._replace(
        column=partial(AsyncColumnParallelLinear.from_linear, timeline=timeline),
        row=partial(AsyncRowParallelLinear.from_linear, timeline=timeline),
        enter_region=partial(enter_region_overlapped, group=group, timeline=timeline),
        block_bars=False,
    )


FORMS["async_tp"] = async_tp_layers
