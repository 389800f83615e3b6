"""The memory of published FP8 training recipes: bytes per parameter, and what they save.

A recipe says in which format each copy of a parameter lives. The book's table has five
copies (an "n/a" means the recipe keeps no such copy) and the precision of the GEMMs:

    master weights   the high-precision copy the optimizer updates
    accumulated grads  a high-precision buffer summing the gradients of micro-batches
    model weights    what forward and backward multiply with
    gradients        what backward produces
    optimizer states Adam's momentum and variance (two entries)

Bytes per parameter are the sum over the copies, and a recipe's saving is measured
against the first row, bf16 with fp32 mixed precision, 20 bytes. The rows are
``FP8_RECIPES``; ``memory_row`` adds the bytes, the sum written out and the reduction.
``state_bytes`` sorts the same bytes under the course's keys (``parameters``,
``gradients``, ``optimizer states``), as ``memory.model_state_bytes`` does: the master
copy belongs to the optimizer, the accumulation buffer to the gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
COPIES = ("master weights", "accumulated grads", "model weights", "gradients", "optimizer states")


@dataclass(frozen=True)
class MemoryRecipe:
    name: str
    gemm: str
    master_weights: str | None
    accumulated_grads: str | None
    model_weights: str
    gradients: str
    optimizer_states: tuple  # (momentum, variance)

    def formats(self) -> dict:
        """Each copy's format (None: not kept), in the book's column order."""
        return dict(
            zip(
                COPIES,
                (
                    self.master_weights,
                    self.accumulated_grads,
                    self.model_weights,
                    self.gradients,
                    self.optimizer_states,
                ),
            )
        )

    def terms(self) -> list:
        """The bytes of each kept copy, in column order (Adam's two states as two terms)."""
        out = []
        for fmt in self.formats().values():
            for f in fmt if isinstance(fmt, tuple) else (fmt,):
                if f is not None:
                    out.append(_bytes(f))
        return out

    def bytes_per_param(self) -> int:
        return sum(self.terms())


def _bytes(fmt: str) -> int:
    if fmt not in BYTES:
        raise ValueError(f"unknown format {fmt!r}: use one of {sorted(BYTES)}")
    return BYTES[fmt]


FP8_RECIPES = [
    MemoryRecipe("bf16 with fp32 mixed precision (baseline)", "bf16", "fp32", "fp32", "bf16", "bf16", ("fp32", "fp32")),
    MemoryRecipe("the same without fp32 grad accumulation", "bf16", "fp32", None, "bf16", "bf16", ("fp32", "fp32")),
    MemoryRecipe("Transformer Engine", "fp8", None, None, "fp32", "fp32", ("fp32", "fp32")),
    MemoryRecipe("FP8-LM O3", "fp8", "fp16", "fp16", "fp8", "fp8", ("fp8", "fp16")),
    MemoryRecipe("DeepSeek-V3", "fp8", "fp32", "fp32", "fp8", "bf16", ("bf16", "bf16")),
    MemoryRecipe("nanotron FP8", "fp8", "bf16", "fp32", "fp8", "fp8", ("fp8", "fp8")),
]
BASELINE = FP8_RECIPES[0]


def reduction(recipe: MemoryRecipe, baseline: MemoryRecipe = BASELINE) -> float:
    """The fraction of the baseline's bytes per parameter that ``recipe`` saves."""
    base = baseline.bytes_per_param()
    return (base - recipe.bytes_per_param()) / base  # exact for these integers: 4 / 20 is 0.2


def memory_row(recipe: MemoryRecipe, baseline: MemoryRecipe = BASELINE) -> dict:
    """One row of the book's table: formats, the sum written out, the total and the saving."""
    terms = recipe.terms()
    return {
        "recipe": recipe.name,
        "GEMM": recipe.gemm,
        **{
            copy: ("n/a" if f is None else "+".join(f) if isinstance(f, tuple) else f)
            for copy, f in recipe.formats().items()
        },
        "sum": f"{'+'.join(map(str, terms))} = {sum(terms)}",
        "bytes": sum(terms),
        "reduction": reduction(recipe, baseline),
    }


def state_bytes(recipe: MemoryRecipe, n_params: int = 1) -> dict:
    """The recipe's bytes under the course's keys, for ``n_params`` parameters."""
    f = recipe.formats()
    optimizer = sum(_bytes(s) for s in f["optimizer states"])
    return {
        "parameters": _bytes(f["model weights"]) * n_params,
        "gradients": (_bytes(f["gradients"]) + (_bytes(f["accumulated grads"]) if f["accumulated grads"] else 0))
        * n_params,
        "optimizer states": (optimizer + (_bytes(f["master weights"]) if f["master weights"] else 0)) * n_params,
    }
