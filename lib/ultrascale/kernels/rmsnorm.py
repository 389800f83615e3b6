"""RMSNorm, forward and backward, one row per program instance.

Forward:  y = x * rstd * w,   with rstd = 1 / sqrt(mean(x^2) + eps) per row.

Backward, with x_hat = x * rstd and g = dy * w (both per row):
    dx = rstd * (g - x_hat * mean(g * x_hat))
    dw = sum over rows of dy * x_hat
The forward saves ``rstd`` (one float per row) so the backward need not
recompute the row statistics; that is the whole of the saved state besides x.

dw is a sum over *all* rows, so many program instances contribute to each of
its elements. Rather than synchronising them with atomics, each instance walks
a strided subset of the rows, keeps its own partial dw in registers, and writes
one row of partial sums; a final (small) sum over those rows in PyTorch gives
dw. The result is deterministic, and the partial buffer is only
``n_programs x n_cols``.
"""

import torch
import triton
import triton.language as tl

from ultrascale.kernels._device import check_tensors, on_gpu


@triton.jit
def rms_norm_forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, row_stride, n_cols, eps, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # Padding lanes hold 0, so they add nothing to the sum; divide by the true n_cols.
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * row_stride + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_backward_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    n_rows,
    row_stride,
    n_cols,
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
    for row in range(pid, n_rows, n_programs):  # rows pid, pid + P, pid + 2P, ...
        offs = row * row_stride + cols
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        g = dy * w
        dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / n_cols))
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * x_hat
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw_acc, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6):
    """Returns ``(y, rstd)``; ``rstd`` has one fp32 value per row, for the backward."""
    check_tensors(x, weight)
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    x2d = _rows(x)
    n_rows, n_cols = x2d.shape
    y = torch.empty_like(x2d)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rms_norm_forward_kernel[(n_rows,)](
        x2d, weight, y, rstd, x2d.stride(0), n_cols, eps, BLOCK_SIZE=triton.next_power_of_2(n_cols)
    )
    return y.reshape(x.shape), rstd


def _backward_programs(n_rows: int) -> int:
    # Enough instances to fill the GPU (a few per SM); few in the interpreter, where each is a loop step.
    if on_gpu():
        return min(n_rows, 4 * torch.cuda.get_device_properties(0).multi_processor_count)
    return min(n_rows, 4)


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor):
    """Returns ``(dx, dweight)`` given the output gradient and what the forward saved."""
    check_tensors(dy, x, weight, rstd)
    x2d, dy2d = _rows(x), _rows(dy)
    n_rows, n_cols = x2d.shape
    dx = torch.empty_like(x2d)
    n_programs = _backward_programs(n_rows)
    dw_partial = torch.empty(n_programs, n_cols, dtype=torch.float32, device=x.device)
    rms_norm_backward_kernel[(n_programs,)](
        dy2d,
        x2d,
        weight,
        rstd,
        dx,
        dw_partial,
        n_rows,
        x2d.stride(0),
        n_cols,
        BLOCK_SIZE=triton.next_power_of_2(n_cols),
    )
    return dx.reshape(x.shape), dw_partial.sum(dim=0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """Connects the two kernels to autograd."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, weight, rstd)
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension with Triton kernels for forward and backward."""
    return RMSNormFunction.apply(x, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x32 * rstd * weight.float()).to(x.dtype)
