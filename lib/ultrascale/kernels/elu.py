"""ELU activation: ``x`` for x >= 0, ``alpha * (exp(x) - 1)`` for x < 0.

This is the kernel that ``torch.compile`` generates for a ``torch.where`` ELU,
rewritten to be read: an element-wise kernel is a masked load, some arithmetic
on registers and a masked store, so its speed is set by memory traffic (one
read and one write per element), not by the exp.
"""

import torch
import triton
import triton.language as tl

from ultrascale.kernels._device import check_tensors


@triton.jit
def elu_kernel(x_ptr, out_ptr, n_elements, alpha, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(axis=0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    valid_mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=valid_mask).to(tl.float32)
    # tl.where computes both sides for every lane and then selects: no branch,
    # so lanes of a warp never diverge (see gpu_ideas.run_predicated).
    out = tl.where(x < 0, alpha * (tl.exp(x) - 1.0), x)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=valid_mask)


def elu(x: torch.Tensor, alpha: float = 1.0, block_size: int = 1024) -> torch.Tensor:
    """ELU computed by the Triton kernel, in fp32 registers, stored in ``x``'s dtype."""
    check_tensors(x)
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    elu_kernel[(triton.cdiv(n, block_size),)](x, out, n, alpha, BLOCK_SIZE=block_size)
    return out


def elu_reference(x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    return torch.where(x < 0, alpha * (torch.exp(x) - 1), x)
