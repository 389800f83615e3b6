"""LayerNorm forward, one row per program instance.

    y = (x - mean) * rstd * w + b,   rstd = 1 / sqrt(var + eps)

Like RMSNorm it is memory bound: one read of x and one write of y per element.
Two reductions over the row (mean, then variance) both happen in registers.
"""

import torch
import triton
import triton.language as tl

from ultrascale.kernels._device import check_tensors


@triton.jit
def layer_norm_forward_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, row_stride, n_cols, eps, BLOCK_SIZE: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    # Zero the padding lanes again after centring, or they would add mean^2 to the variance.
    centred = tl.where(mask, x - mean, 0.0)
    var = tl.sum(centred * centred, axis=0) / n_cols  # biased variance, as nn.LayerNorm uses
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * row_stride + cols, (centred * rstd * w + b).to(y_ptr.dtype.element_ty), mask=mask)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5, return_stats=False):
    """LayerNorm over the last dimension (forward only). With ``return_stats`` also the per-row mean and rstd."""
    check_tensors(x, weight, bias)
    n_cols = x.shape[-1]
    if weight.shape != (n_cols,) or bias.shape != (n_cols,):
        raise ValueError(f"weight and bias must have shape ({n_cols},)")
    x2d = x.reshape(-1, n_cols).contiguous()
    n_rows = x2d.shape[0]
    y = torch.empty_like(x2d)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    layer_norm_forward_kernel[(n_rows,)](
        x2d, weight, bias, y, mean, rstd, x2d.stride(0), n_cols, eps, BLOCK_SIZE=triton.next_power_of_2(n_cols)
    )
    y = y.reshape(x.shape)
    return (y, mean, rstd) if return_stats else y


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5):
    return torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)
