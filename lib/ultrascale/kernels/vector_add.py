"""Vector addition: the "hello world" of GPU kernels.

One program instance (a CUDA *block*) handles BLOCK_SIZE consecutive elements.
The grid has ceil(n / BLOCK_SIZE) instances, so the last one usually runs past
the end of the vectors: the mask keeps it from reading or writing out of bounds
(the same job as the ``if (i < N)`` bounds check in the CUDA version).
"""

import torch
import triton
import triton.language as tl

from ultrascale.kernels._device import check_tensors


@triton.jit
def vector_add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(axis=0)  # which block of elements this instance owns
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements  # False for the lanes that fall past the end
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


def vector_add(x: torch.Tensor, y: torch.Tensor, block_size: int = 1024) -> torch.Tensor:
    """``x + y`` computed by the Triton kernel (any shape, same shape for both)."""
    if x.shape != y.shape:
        raise ValueError(f"vector_add needs equal shapes, got {tuple(x.shape)} and {tuple(y.shape)}")
    check_tensors(x, y)
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    grid = (triton.cdiv(n, block_size),)  # blocksPerGrid = (N + threads - 1) / threads
    vector_add_kernel[grid](x, y, out, n, BLOCK_SIZE=block_size)
    return out


def vector_add_reference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y
