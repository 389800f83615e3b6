"""Fused row softmax: one read and one write of the input, whatever the row length.

Unfused, ``softmax(x)`` in PyTorch eager is several kernels (max, subtract, exp,
sum, divide), each reading and writing the whole tensor in global memory. Here
one program instance loads a whole row into registers once, does all of those
steps there, and writes the result once. The row must fit on chip, so this
version is for rows up to a few tens of thousands of elements.
"""

import torch
import triton
import triton.language as tl

from ultrascale.kernels._device import check_tensors

MAX_FUSED_ROW = 65536  # beyond this one row no longer fits comfortably in registers/SRAM


@triton.jit
def softmax_kernel(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)  # one program instance per row
    cols = tl.arange(0, BLOCK_SIZE)  # BLOCK_SIZE is the next power of two >= n_cols
    mask = cols < n_cols
    # Padding lanes read -inf: exp(-inf) = 0, so they change neither the max nor the sum.
    x = tl.load(in_ptr + row * in_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)  # subtract the max so exp never overflows
    numerator = tl.exp(x)
    out = numerator / tl.sum(numerator, axis=0)
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block_size: int) -> int:
    # Longer rows get more warps so that each thread keeps a modest number of elements.
    if block_size >= 8192:
        return 16
    if block_size >= 2048:
        return 8
    return 4


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, computed by the fused Triton kernel."""
    check_tensors(x)
    n_cols = x.shape[-1]
    if n_cols > MAX_FUSED_ROW:
        raise ValueError(f"fused softmax keeps a row on chip; rows of {n_cols} > {MAX_FUSED_ROW} are too long")
    x2d = x.reshape(-1, n_cols).contiguous()
    out = torch.empty_like(x2d)
    block_size = triton.next_power_of_2(n_cols)
    softmax_kernel[(x2d.shape[0],)](
        out,
        x2d,
        x2d.stride(0),
        out.stride(0),
        n_cols,
        BLOCK_SIZE=block_size,
        num_warps=_num_warps(block_size),
    )
    return out.reshape(x.shape)


def softmax_reference(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.float(), dim=-1).to(x.dtype)
