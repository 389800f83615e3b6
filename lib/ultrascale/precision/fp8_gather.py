"""FP8 all-gather of ZeRO-3's parameters, as PyTorch's FSDP2 does with float8 training.

At ZeRO-3 every forward and every backward all-gathers each unit's parameters: the largest
traffic of the technique (2 Psi elements per step against 1 Psi for the gradients). When the
GEMMs run in FP8 anyway, the weights can travel in FP8 too: one byte per element instead of
two (bf16) or four (fp32). torchao's float8 training does this for FSDP2
(``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``): each rank casts its shard of a
weight to FP8 *before* the all-gather, and the gathered bytes are already the GEMM's input.

The cast needs a scale, and every rank must use the *same* one, or the gathered tensor would
be pieced together from shards on different grids. A rank only sees its shard, so each rank
computes the amax of its part of every parameter, and one small all-reduce (MAX) over a
vector of one amax per parameter gives everyone the global amaxes: the scales of a cast of
the whole tensor (torchao's ``precompute_float8_dynamic_scale_for_fsdp`` batches the amaxes of
all weights the same way). The gathered copy is then exactly ``dequantize(quantize(W))`` with
one scale per parameter, what an FP8 linear with per-tensor scaling would compute from W.

Only the copy used by forward and backward is rounded to FP8. The master weights, the
optimizer states and the shard each rank keeps stay in high precision, and gradients are
reduce-scattered as before: an update smaller than one FP8 step is not lost, it accumulates
in the master weights until it moves the rounded copy.

Here (on CPU, with gloo, which knows no float8 dtype) the FP8 bytes travel as their uint8
view, and are dequantised right after the all-gather into the unit's compute-precision
buffer, since the course's linears are not FP8 ones; with FP8 GEMMs the dequantisation
would be folded into the GEMM's scale, as torchao does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.logger import labelled
from .scaling import MIN_AMAX, to_fp8, check_fp8, fp8_max

# Its name in a CommLogger's log: a few bytes per unit, kept apart from the flat buffers'
# all-gathers (and out of ``collective_elements``), as ZeRO's gradient flags are.
AMAX_ALL_REDUCE = "all_reduce (fp8 amax)"

__all__ = ["AMAX_ALL_REDUCE", "FP8Gather", "agreed_scales", "local_ranges", "quantize_shard", "start_fp8_gather"]


def local_ranges(unit) -> list:
    """(index, lo, hi) for each parameter with elements in this rank's shard, where
    ``shard[lo:hi]`` holds them. The padding belongs to no parameter (unlike
    ``owned_ranges``): it is zero and must not set any scale."""
    ranges = []
    for i, p in enumerate(unit.params):
        start, end = unit.offsets[p]
        lo, hi = max(start, unit.own.start), min(end, unit.own.stop)
        if lo < hi:
            ranges.append((i, lo - unit.own.start, hi - unit.own.start))
    return ranges


def agreed_scales(unit, dtype=torch.float8_e4m3fn, group=None) -> torch.Tensor:
    """One float32 scale per parameter of ``unit``, the same on every rank: the amax of each
    parameter over this rank's shard, maxed over the ranks in ONE all-reduce per unit."""
    amax = torch.zeros(len(unit.params), dtype=torch.float32, device=unit.shard.device)
    for i, lo, hi in local_ranges(unit):
        amax[i] = unit.shard[lo:hi].detach().abs().max().float()
    with labelled(AMAX_ALL_REDUCE):
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    # As quantize_per_tensor(W) computes it from the whole W: max of the shards' maxima.
    return amax.clamp(min=MIN_AMAX) / fp8_max(dtype)


def quantize_shard(unit, scales, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """This rank's shard in FP8, each parameter's part divided by its scale (clamped to the
    format's range, as ``to_format`` does); the padding stays zero."""
    q = torch.zeros(unit.shard_numel, dtype=dtype, device=unit.shard.device)
    for i, lo, hi in local_ranges(unit):
        q[lo:hi] = to_fp8(unit.shard[lo:hi].detach(), scales[i], dtype)
    return q


class FP8Gather:
    """An all-gather of FP8 bytes in flight: ``wait()`` waits for it, then writes the
    dequantised parameters into the unit's flat buffer (``unit.full``)."""

    def __init__(self, unit, work, gathered, scales, dtype):
        self.unit, self.work, self.gathered, self.scales, self.dtype = unit, work, gathered, scales, dtype

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        fp8 = self.gathered.view(self.dtype)
        full = self.unit.full.data  # through .data, as the plain gather: autograd must not see it
        for i, p in enumerate(self.unit.params):
            start, end = self.unit.offsets[p]
            full[start:end].copy_(fp8[start:end].float() * self.scales[i])


def start_fp8_gather(unit, collective, dtype=torch.float8_e4m3fn, group=None) -> FP8Gather:
    """Agree on the scales, cast this rank's shard to FP8 and start all-gathering its bytes
    with ``collective(output, shard)`` (ZeRO's, which puts the bar on its timeline).
    gloo has no float8 all-gather, so the bytes travel as uint8: the same bytes."""
    check_fp8(dtype)
    scales = agreed_scales(unit, dtype, group)
    q = quantize_shard(unit, scales, dtype)
    gathered = torch.empty(unit.padded, dtype=torch.uint8, device=q.device)
    work = collective(gathered, q.view(torch.uint8))
    return FP8Gather(unit, work, gathered, scales, dtype)
