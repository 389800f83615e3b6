"""FP8 quantisation with scales: one scale per tensor, or one per tile (DeepSeek-V3).

FP8 has so little range (e4m3: 2^-9 to 448) that values are stored *divided by a scale*
chosen so that the largest magnitude lands on the format's largest value:

    scale = amax / fp8_max,    q = fp8(x / scale),    x ~ q * scale.

``scale`` is the dequantisation factor here, as ``torch._scaled_mm``'s ``scale_a`` and
``scale_b`` are (the GEMM multiplies by them), so the stored number times the scale gives
the value back. Values too large after division are clamped to ``fp8_max`` (e5m2 would
otherwise overflow to inf).

**One scale per tensor** is cheap but fragile: one outlier sets ``amax`` for everybody, and
every ordinary value is pushed towards zero, where e4m3 has few or no values left (its
subnormals stop at 2^-9 = 448 / 229,376). **Tile-wise** scaling (DeepSeek-V3) gives each
small tile its own scale: 1 x 128 for activations (per token, per 128 channels) and
128 x 128 for weights, so an outlier only coarsens its own tile.

Tiles must cut the matrix evenly. A shape that the tile does not divide is refused with a
ValueError, unless ``pad=True``: the matrix is then padded with zeros to whole tiles (zeros
change no tile's maximum), quantised, and cut back to its shape; the scales cover the
padded grid, ``ceil(rows / tile_rows) x ceil(cols / tile_cols)``.
"""

from __future__ import annotations

import math

import torch

from .formats import check_dtype

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)
# A scale for an all-zero tensor or tile: any positive number works (0 / s = 0); this one
# keeps 1 / scale finite in float32.
MIN_AMAX = 1e-12

ACTIVATION_TILE = (1, 128)  # DeepSeek-V3: per token, per 128 channels
WEIGHT_TILE = (128, 128)  # DeepSeek-V3: 128 x 128 blocks of the weight


def check_fp8(dtype) -> torch.dtype:
    if check_dtype(dtype) not in FP8_DTYPES:
        raise ValueError(
            f"{dtype} is not an FP8 format: quantise to torch.float8_e4m3fn (more resolution) "
            "or torch.float8_e5m2 (more range)"
        )
    return dtype


def fp8_max(dtype) -> float:
    """The largest finite value of an FP8 format: 448 for e4m3, 57,344 for e5m2."""
    return torch.finfo(check_fp8(dtype)).max


def to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    limit = fp8_max(dtype)
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


# --------------------------------------------------------------------------- one scale per tensor
def quantize_per_tensor(x: torch.Tensor, dtype=E4M3) -> tuple:
    """``(q, scale)``: ``x`` in FP8 with one float32 scale, ``x ~ q.float() * scale``."""
    if not x.is_floating_point() or x.dtype in FP8_DTYPES:
        raise ValueError(f"quantise a float32, bfloat16 or float16 tensor, got {x.dtype}")
    scale = x.detach().abs().max().float().clamp(min=MIN_AMAX) / fp8_max(dtype)
    return to_fp8(x.detach(), scale, dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` in float32 (a per-tensor scale, or per-tile scales already expanded)."""
    return q.float() * scale


# --------------------------------------------------------------------------- one scale per tile
def tile_grid(shape, tile, pad: bool = False) -> tuple:
    """``(tiles along rows, tiles along columns)`` of a 2-D ``shape``; see the module docstring."""
    if len(shape) != 2:
        raise ValueError(
            f"tiles cut a 2-D matrix, got shape {tuple(shape)}: flatten the leading "
            "dimensions first (x.reshape(-1, x.shape[-1]))"
        )
    tr, tc = tile
    if tr < 1 or tc < 1:
        raise ValueError(f"a tile must have at least one row and one column, got {tile}")
    for size, t, what in ((shape[0], tr, "rows"), (shape[1], tc, "columns")):
        if size % t and not pad:
            raise ValueError(
                f"{size} {what} do not split into tiles of {t}: pad the matrix to "
                f"{math.ceil(size / t) * t} {what} (pad=True pads with zeros, which change no "
                f"tile's scale) or choose a size that {t} divides"
            )
    return math.ceil(shape[0] / tr), math.ceil(shape[1] / tc)


def quantize_tiles(x: torch.Tensor, tile=ACTIVATION_TILE, dtype=E4M3, pad: bool = False) -> tuple:
    """``(q, scales)``: ``x`` (2-D) in FP8 with one scale per ``tile = (rows, cols)`` block.

    ``scales[i, j]`` belongs to rows ``i*rows ... (i+1)*rows - 1`` and columns
    ``j*cols ...``: ``x ~ dequantize_tiles(q, scales, tile)``.
    """
    if not x.is_floating_point() or x.dtype in FP8_DTYPES:
        raise ValueError(f"quantise a float32, bfloat16 or float16 tensor, got {x.dtype}")
    gr, gc = tile_grid(x.shape, tile, pad)
    tr, tc = tile
    rows, cols = x.shape
    padded = torch.zeros(gr * tr, gc * tc, dtype=torch.float32, device=x.device)
    padded[:rows, :cols] = x.detach()
    blocks = padded.view(gr, tr, gc, tc)  # block (i, j) is blocks[i, :, j, :]
    scales = blocks.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX) / fp8_max(dtype)
    q = to_fp8(blocks, scales[:, None, :, None], dtype).view(gr * tr, gc * tc)
    return q[:rows, :cols], scales


def expand_scales(scales: torch.Tensor, tile, shape) -> torch.Tensor:
    """The per-tile scales repeated over each tile's elements, cut to ``shape``."""
    tr, tc = tile
    full = scales.repeat_interleave(tr, dim=0).repeat_interleave(tc, dim=1)
    return full[: shape[0], : shape[1]]


def dequantize_tiles(q: torch.Tensor, scales: torch.Tensor, tile) -> torch.Tensor:
    """``q * scale of its tile``, in float32."""
    return q.float() * expand_scales(scales, tile, q.shape)


def quantize(x: torch.Tensor, tile=None, dtype=E4M3, pad: bool = False) -> tuple:
    """Per tensor (``tile=None``) or per tile: ``(q, scales)`` and the float32 value they stand for."""
    if tile is None:
        q, scale = quantize_per_tensor(x, dtype)
        return q, scale, dequantize(q, scale)
    q, scales = quantize_tiles(x, tile, dtype, pad)
    return q, scales, dequantize_tiles(q, scales, tile)


def rounding_bound(x: torch.Tensor, scale, dtype=E4M3) -> torch.Tensor:
    """The largest error rounding to nearest may make on each element of ``x``.

    Where ``|x| / scale`` is a normal number the error is at most half a step, 2^-(M+1)
    relative (e4m3: 1/16); below the smallest normal the step is fixed, so the error is at
    most half the smallest subnormal, times the scale. ``scale``: a number, or per-element.
    """
    from .formats import layout

    lay = layout(check_fp8(dtype))
    relative = x.abs().float() * 2.0 ** -(lay.mantissa + 1)
    absolute = torch.as_tensor(scale, dtype=torch.float32) * lay.smallest_subnormal / 2
    return torch.maximum(relative, absolute)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact|| / ||exact||`` (Frobenius), in float64."""
    exact = exact.double()
    return ((approx.double() - exact).norm() / exact.norm()).item()
