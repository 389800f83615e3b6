"""Mixed precision: number formats, loss scaling, BF16 training, FP8 with per-tensor and
tile-wise scaling, and the memory of FP8 recipes (chapter 12).

* ``formats``: the bit layout of float32, float16, bfloat16 and the two FP8 formats, read
  from ``torch.finfo`` and from real tensors' bits; range and resolution.
* ``scaling``: FP8 quantisation with one scale per tensor or per tile (DeepSeek-V3's 1 x 128
  and 128 x 128), with the rule for shapes the tiles do not divide.
* ``fp8_linear``: a linear layer whose Fprop, Dgrad and Wgrad run in FP8, and
  ``apply_fp8(model, recipe=...)`` that swaps a model's linears from outside.
* ``loss_scaling``: the dynamic loss scaler (GradScaler's rule, written out).
* ``training``: ``train_losses``, the course loop (``train.run_steps``) under autocast or
  a loss scaler, returning every step's loss.
* ``recipes``: the bytes per parameter of published FP8 recipes.
* ``gemm_speed``: FP8 against bf16 GEMMs on a GPU, checked first (bench_fp8 and chapter 12);
  imported from there, since it needs Triton's timer on a GPU.
"""

from .formats import (
    BOOK_TABLE,
    DTYPES,
    Fields,
    Layout,
    check_dtype,
    decode,
    distinct_inside,
    layout,
    layouts,
    round_to,
    to_format,
)
from .fp8_linear import (
    FP8_PLAN,
    RECIPES,
    FP8Linear,
    FP8Matmul,
    FP8Recipe,
    Quantised,
    apply_fp8,
    fp8_gemm,
    get_recipe,
    tile_scaled_matmul,
)
from .loss_scaling import DynamicLossScaler, ScaledOptimizer, update_scale
from .recipes import BASELINE, FP8_RECIPES, MemoryRecipe, memory_row, reduction, state_bytes
from .scaling import (
    ACTIVATION_TILE,
    E4M3,
    E5M2,
    WEIGHT_TILE,
    dequantize,
    dequantize_tiles,
    expand_scales,
    fp8_max,
    quantize,
    quantize_per_tensor,
    quantize_tiles,
    relative_error,
    rounding_bound,
    tile_grid,
)
from .training import Autocast, LoggedBatches, train_losses

__all__ = [
    "BOOK_TABLE",
    "DTYPES",
    "Fields",
    "Layout",
    "check_dtype",
    "decode",
    "distinct_inside",
    "layout",
    "layouts",
    "round_to",
    "to_format",
    "FP8_PLAN",
    "RECIPES",
    "FP8Linear",
    "FP8Matmul",
    "FP8Recipe",
    "Quantised",
    "apply_fp8",
    "fp8_gemm",
    "get_recipe",
    "tile_scaled_matmul",
    "DynamicLossScaler",
    "ScaledOptimizer",
    "update_scale",
    "BASELINE",
    "FP8_RECIPES",
    "MemoryRecipe",
    "memory_row",
    "reduction",
    "state_bytes",
    "ACTIVATION_TILE",
    "E4M3",
    "E5M2",
    "WEIGHT_TILE",
    "dequantize",
    "dequantize_tiles",
    "expand_scales",
    "fp8_max",
    "quantize",
    "quantize_per_tensor",
    "quantize_tiles",
    "relative_error",
    "rounding_bound",
    "tile_grid",
    "Autocast",
    "LoggedBatches",
    "train_losses",
]
