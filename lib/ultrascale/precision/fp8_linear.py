"""An FP8 linear layer, applied to a model from outside: ``apply_fp8(model, recipe=...)``.

A linear layer runs three matrix multiplies per step, each with FP8 inputs and float32
accumulation (names from NVIDIA's Transformer Engine):

    Fprop   y  = x  @ W^T     (tokens, in)  x (in, out)      contracts over in-features
    Dgrad   dx = dy @ W       (tokens, out) x (out, in)      contracts over out-features
    Wgrad   dW = dy^T @ x     (out, tokens) x (tokens, in)   contracts over tokens

A scale can only be taken out of a dot product if it is constant along the dimension the
product sums over, so every operand is scaled along its *contraction* dimension:

* ``"tensorwise"``: one scale per tensor, recomputed from the current values at every call
  (dynamic scaling, as torchao's default). x and W in e4m3 (resolution), dy in e5m2 (the
  range gradients need). One quantised x serves Fprop and Wgrad, one dy Dgrad and Wgrad.
* ``"tilewise"``: DeepSeek-V3's fine-grained scaling, every tensor in e4m3. x and dy get
  1 x 128 tiles (per token, per 128 channels) for Fprop and Dgrad; W gets 128 x 128 blocks,
  which serve W in Fprop and W^T in Dgrad alike (a square block is a block both ways round).
  Wgrad sums over tokens, so there x and dy are quantised again with 128 x 1 tiles. Shapes
  that the tiles do not divide are padded with zeros (which change no tile's scale).

Per-tensor GEMMs run as real FP8 GEMMs with ``torch._scaled_mm`` on a GPU with FP8 tensor
cores, where the shapes allow (sizes that 16 divides). On a CPU, which has no FP8 arithmetic,
``_scaled_mm`` exists but runs as a slow reference loop (measured in the pinned PyTorch on 2
cores: 170-440 ms for a 256 x 64 x 256 product that float32 does in about 1 ms), so the same
product is computed from the FP8 values in float32: the product of two FP8 numbers is exact in
float32 (at most 4 significant bits each), the sums accumulate in float32 as the tensor cores'
do, and the two scales multiply the result once, as ``_scaled_mm`` does; only the order of the
additions differs (``tests/test_precision.py`` compares the two). Tile-wise GEMMs are simulated: the FP8 values are multiplied by their scales and
multiplied in float32, which is what an FP8 GEMM with per-tile scaling and float32
accumulation computes, up to the order of the float32 additions (``tile_scaled_matmul``
does it the hardware's way, one K-chunk at a time, for comparison).

What backward keeps from forward is the FP8 copies (1 byte per element), not x itself.
The weights stay float32 parameters (the master copy); the head and the embedding stay
in high precision, as DeepSeek-V3 keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..matching import match_plan
from .gemm_speed import fp8_gpu_refusal
from .scaling import E4M3, E5M2, expand_scales, quantize_per_tensor, quantize_tiles


@dataclass(frozen=True)
class FP8Recipe:
    """How a linear layer's GEMMs are scaled: per tensor, or per tile of ``block``."""

    name: str
    tiles: bool  # False: one scale per tensor; True: DeepSeek-V3 tiles
    forward_dtype: torch.dtype = E4M3  # activations and weights
    grad_dtype: torch.dtype = E5M2  # output gradients
    block: int = 128

    def activation_tile(self, along_tokens: bool = False):
        """1 x block (Fprop, Dgrad), or block x 1 when the GEMM sums over tokens (Wgrad)."""
        return None if not self.tiles else (self.block, 1) if along_tokens else (1, self.block)

    @property
    def weight_tile(self):
        return (self.block, self.block) if self.tiles else None


RECIPES = {
    "tensorwise": FP8Recipe("tensorwise", tiles=False, forward_dtype=E4M3, grad_dtype=E5M2),
    "tilewise": FP8Recipe("tilewise", tiles=True, forward_dtype=E4M3, grad_dtype=E4M3, block=128),
}


def get_recipe(recipe) -> FP8Recipe:
    if isinstance(recipe, FP8Recipe):
        return recipe
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r}: choose one of {sorted(RECIPES)} or pass an FP8Recipe")
    return RECIPES[recipe]


# --------------------------------------------------------------------------- quantised operands
@dataclass(frozen=True)
class Quantised:
    """An FP8 matrix ``q`` and its scales: one (``tile=None``) or one per ``tile`` block."""

    q: torch.Tensor
    scale: torch.Tensor
    tile: tuple | None

    @classmethod
    def of(cls, x: torch.Tensor, tile, dtype) -> "Quantised":
        if tile is None:
            return cls(*quantize_per_tensor(x, dtype), None)
        return cls(*quantize_tiles(x, tile, dtype, pad=True), tile)

    @property
    def T(self) -> "Quantised":
        if self.tile is None:
            return Quantised(self.q.t(), self.scale, None)
        return Quantised(self.q.t(), self.scale.t(), self.tile[::-1])

    def dequantize(self) -> torch.Tensor:
        if self.tile is None:
            return self.q.float() * self.scale
        return self.q.float() * expand_scales(self.scale, self.tile, self.q.shape)


def _scaled_mm_runs(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether an FP8 tensor core can take these operands (see the module docstring for the CPU)."""
    if a.dtype == E5M2 and b.dtype == E5M2:
        return False  # no FP8 tensor core takes two e5m2 operands
    if not a.is_cuda or fp8_gpu_refusal(a.device):  # no FP8 tensor cores: simulated, as on a CPU
        return False
    return all(n % 16 == 0 for n in (*a.shape, b.shape[1]))  # the GPU kernel's alignment


def fp8_gemm(a: Quantised, b: Quantised) -> torch.Tensor:
    """``a @ b`` in float32 from FP8 operands: for per-tensor scales a real FP8 GEMM on a GPU, and
    on a CPU the same product from the FP8 values in float32; simulated (dequantise, then a
    float32 matmul) for per-tile ones."""
    if a.tile is None and b.tile is None:
        if _scaled_mm_runs(a.q, b.q):
            # _scaled_mm wants a row-major and b column-major; it multiplies by both scales.
            return torch._scaled_mm(
                a.q.contiguous(),
                b.q.t().contiguous().t(),
                scale_a=a.scale.reshape(()),
                scale_b=b.scale.reshape(()),
                out_dtype=torch.float32,
            )
        if not a.q.is_cuda:
            return (a.q.float() @ b.q.float()) * (a.scale.reshape(()) * b.scale.reshape(()))
    return a.dequantize() @ b.dequantize()


def tile_scaled_matmul(a: Quantised, b: Quantised, block: int = 128) -> torch.Tensor:
    """``a @ b`` the way DeepSeek-V3's kernel does it: an FP8 product per ``block`` of the
    contraction dimension, each partial sum promoted to float32 and multiplied there by the
    two tiles' scales. ``a`` holds 1 x block tiles, ``b`` block x block (or block x 1) ones."""
    if a.tile is None or b.tile is None or a.tile[1] != block or b.tile[0] != block:
        raise ValueError(
            f"tile_scaled_matmul needs tiles of {block} along the contraction dimension, got {a.tile} and {b.tile}"
        )
    k = a.q.shape[1]
    out = torch.zeros(a.q.shape[0], b.q.shape[1], dtype=torch.float32, device=a.q.device)
    for chunk, start in enumerate(range(0, k, block)):
        part = a.q[:, start : start + block].float() @ b.q[start : start + block].float()  # exact products
        a_scale = a.scale[:, chunk : chunk + 1].repeat_interleave(a.tile[0], 0)[: part.shape[0]]
        b_scale = b.scale[chunk : chunk + 1].repeat_interleave(b.tile[1], 1)[:, : part.shape[1]]
        out += part * a_scale * b_scale
    return out


# --------------------------------------------------------------------------- the layer
class FP8Matmul(torch.autograd.Function):
    """``x @ W^T`` with Fprop, Dgrad and Wgrad in FP8 (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, recipe: FP8Recipe):
        with torch.autocast(x.device.type, enabled=False):  # FP8 is the precision here, not autocast's
            x2 = x.reshape(-1, x.shape[-1])
            xq = Quantised.of(x2, recipe.activation_tile(), recipe.forward_dtype)
            wq = Quantised.of(weight, recipe.weight_tile, recipe.forward_dtype)
            y = fp8_gemm(xq, wq.T)  # Fprop
        # Wgrad sums over tokens: per tensor, the same x; per tile, x with block x 1 tiles.
        x_wgrad = Quantised.of(x2, recipe.activation_tile(True), recipe.forward_dtype) if recipe.tiles else xq
        ctx.saved = (x_wgrad, wq)  # FP8 copies only (Quantised holds plain tensors)
        ctx.recipe, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = recipe, x.shape, x.dtype, weight.dtype
        return y.view(*x.shape[:-1], -1).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        recipe, (x_wgrad, wq) = ctx.recipe, ctx.saved
        with torch.autocast(dy.device.type, enabled=False):
            dy2 = dy.reshape(-1, dy.shape[-1])
            dyq = Quantised.of(dy2, recipe.activation_tile(), recipe.grad_dtype)
            dx = fp8_gemm(dyq, wq)  # Dgrad
            dy_wgrad = Quantised.of(dy2, recipe.activation_tile(True), recipe.grad_dtype) if recipe.tiles else dyq
            dw = fp8_gemm(dy_wgrad.T, x_wgrad)  # Wgrad
        del ctx.saved
        return dx.view(ctx.x_shape).to(ctx.x_dtype), dw.to(ctx.w_dtype), None


class FP8Linear(nn.Module):
    """A linear layer whose three GEMMs run in FP8; it shares the ``weight`` and ``bias``
    parameters of the ``nn.Linear`` it replaces, so their names and optimizer are unchanged.
    The bias is added after the GEMM, in the input's precision."""

    def __init__(self, weight: nn.Parameter, bias, recipe="tensorwise"):
        super().__init__()
        self.weight, self.bias, self.recipe = weight, bias, get_recipe(recipe)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe="tensorwise") -> "FP8Linear":
        return cls(linear.weight, linear.bias, recipe)

    def forward(self, x):
        y = FP8Matmul.apply(x, self.weight, self.recipe)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, recipe={self.recipe.name}"
        )


# The blocks' linears (q, k, v, out and the MLP's); the tied embedding/head stays as it is.
FP8_PLAN = {"blocks.*": "tensorwise"}


def apply_fp8(model: nn.Module, *, recipe=None, plan: dict | None = None) -> nn.Module:
    """Swap every ``nn.Linear`` of ``model`` whose name matches a pattern of ``plan``
    (glob pattern -> recipe; default ``FP8_PLAN``) for an ``FP8Linear``, in place, and
    return the model. ``recipe`` overrides the plan's recipes."""
    plan = dict(FP8_PLAN if plan is None else plan)
    if recipe is not None:
        plan = {pattern: recipe for pattern in plan}
    plan = {pattern: get_recipe(r) for pattern, r in plan.items()}
    # A pattern names a module and the linears inside it ("blocks.0": block 0's linears).
    for name, module, chosen in match_plan(model, plan, kind=nn.Linear, children=True):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FP8Linear.from_linear(module, chosen))
    return model
