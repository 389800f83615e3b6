"""Floating-point formats: their bit layouts, ranges and resolution, read from real tensors.

A binary float stores three fields: a **sign** bit, an **exponent** of E bits and a
**mantissa** (fraction) of M bits. A normal number is

    (-1)^sign * 2^(exponent - bias) * (1 + mantissa / 2^M),      bias = 2^(E-1) - 1,

and when the exponent field is 0 the leading 1 is dropped and the exponent is pinned at
``1 - bias``: those *subnormal* numbers fill the gap between the smallest normal number and 0.
E sets the **range** (how many powers of two fit), M the **resolution** (how many values lie
between two powers of two: 2^M, so a step of 2^-M relative, the machine epsilon).

Nothing here is typed in by hand except the book's table: ``layout`` derives each format's
field widths from ``torch.finfo`` (eps = 2^-M and the total bits), and ``decode`` reads the
fields of a value from the bits of a real tensor, so a test can hold the book to them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The book's formats table: (total bits, sign, exponent, mantissa). "bfloat16": the b is for
# Brain (Google Brain), which introduced it for TPUs.
BOOK_TABLE = {
    "float32": (32, 1, 8, 23),
    "float16": (16, 1, 5, 10),
    "bfloat16": (16, 1, 8, 7),
    "float8 (e4m3)": (8, 1, 4, 3),
    "float8 (e5m2)": (8, 1, 5, 2),
}
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8 (e4m3)": torch.float8_e4m3fn,  # "fn": finite, no infinities (see ``decode``)
    "float8 (e5m2)": torch.float8_e5m2,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
# Same-width unsigned integers, to read a float's bits without changing them.
_BITS_AS = {32: torch.int32, 16: torch.int16, 8: torch.uint8}


def check_dtype(dtype) -> torch.dtype:
    """``dtype`` if it is one of the five formats of this chapter, else a clear ValueError."""
    if dtype not in NAMES:
        supported = ", ".join(str(d).replace("torch.", "") for d in NAMES)
        raise ValueError(
            f"{dtype} is not a format this module handles: use one of {supported} "
            "(float64 and the integer types have no place in the book's table)"
        )
    return dtype


@dataclass(frozen=True)
class Layout:
    """The field widths of one format, and the numbers they imply."""

    name: str
    dtype: torch.dtype
    bits: int
    sign: int
    exponent: int
    mantissa: int

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent - 1) - 1

    @property
    def eps(self) -> float:
        """Machine epsilon: the gap between 1 and the next value, 2^-M."""
        return 2.0**-self.mantissa

    @property
    def max(self) -> float:
        return torch.finfo(self.dtype).max

    @property
    def smallest_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def smallest_subnormal(self) -> float:
        """The smallest positive value: one unit in the last place below the smallest normal."""
        return self.smallest_normal * self.eps

    def decades(self, subnormals: bool = False) -> float:
        """Orders of magnitude from the smallest (normal) positive value to the largest."""
        low = self.smallest_subnormal if subnormals else self.smallest_normal
        return math.log10(self.max / low)


def layout(dtype) -> Layout:
    """The field widths of ``dtype``, derived from ``torch.finfo`` (bits, and eps = 2^-M)."""
    info = torch.finfo(check_dtype(dtype))
    mantissa = round(-math.log2(info.eps))
    return Layout(NAMES[dtype], dtype, info.bits, 1, info.bits - 1 - mantissa, mantissa)


def layouts() -> list:
    """Every format of the book's table, in its order."""
    return [layout(dtype) for dtype in DTYPES.values()]


@dataclass(frozen=True)
class Fields:
    """The three stored fields of one value, and what they mean."""

    dtype: torch.dtype
    sign: int  # 0 or 1
    exponent: int  # the stored (biased) exponent field
    mantissa: int  # the stored fraction field, M bits
    kind: str  # "normal", "subnormal", "zero", "inf" or "nan"
    value: float  # the number the fields encode, recomputed from them

    def bit_string(self) -> str:
        """``"s eeeee mmmmmmmmmm"``: the fields as bits, most significant first."""
        lay = layout(self.dtype)
        return f"{self.sign} {self.exponent:0{lay.exponent}b} {self.mantissa:0{lay.mantissa}b}"


def decode(x, dtype=None) -> Fields:
    """Read the sign, exponent and mantissa of one value from a real tensor's bits.

    ``x`` is a one-element tensor (its dtype is the format) or a Python number rounded to
    ``dtype`` first. The value is then rebuilt from the fields by the formula of the module
    docstring, so ``decode(x).value == float(x)`` is a check of the formula, not a copy.
    e4m3 ("fn") has no infinities: its all-ones exponent still holds normal numbers (up to
    448), and only the all-ones exponent *and* mantissa is NaN.
    """
    if not torch.is_tensor(x):
        if dtype is None:
            raise ValueError("decode(number) needs dtype=, the format to round the number to")
        x = to_format(torch.tensor(float(x)), dtype)
    if x.numel() != 1:
        raise ValueError(f"decode reads one value, got a tensor of shape {tuple(x.shape)}")
    lay = layout(x.dtype)
    raw = int(x.reshape(1).view(_BITS_AS[lay.bits]).item()) & ((1 << lay.bits) - 1)
    mantissa = raw & ((1 << lay.mantissa) - 1)
    exponent = (raw >> lay.mantissa) & ((1 << lay.exponent) - 1)
    sign = raw >> (lay.bits - 1)
    all_ones = (1 << lay.exponent) - 1
    finite_only = x.dtype == torch.float8_e4m3fn
    if exponent == all_ones and finite_only and mantissa == (1 << lay.mantissa) - 1:
        kind, value = "nan", math.nan
    elif exponent == all_ones and not finite_only:
        kind, value = ("inf", (-1) ** sign * math.inf) if mantissa == 0 else ("nan", math.nan)
    elif exponent == 0:
        kind = "zero" if mantissa == 0 else "subnormal"
        value = (-1) ** sign * 2.0 ** (1 - lay.bias) * (mantissa / 2**lay.mantissa)
    else:
        kind = "normal"
        value = (-1) ** sign * 2.0 ** (exponent - lay.bias) * (1 + mantissa / 2**lay.mantissa)
    return Fields(x.dtype, sign, exponent, mantissa, kind, value)


def to_format(values, dtype) -> torch.Tensor:
    """``values`` stored in ``dtype``: rounded to nearest (ties to even); beyond the largest
    value, infinity where the format has one and the largest value itself where it has none.

    e4m3 ("fn") has no infinity, and what a plain ``.to(torch.float8_e4m3fn)`` gives past 464
    (the largest value 448 plus half a step) depends on the torch: NaN up to 2.12, the largest
    value from 2.13 (chapter 12 shows which this torch does). So the course clamps first, as
    FP8 training recipes do anyway, and no result of its depends on the version.
    """
    x = torch.as_tensor(values, dtype=torch.float32)
    if check_dtype(dtype) == torch.float8_e4m3fn:
        largest = layout(dtype).max
        x = x.clamp(-largest, largest)  # NaN stays NaN
    return x.to(dtype)


def round_to(values, dtype) -> torch.Tensor:
    """``values`` rounded to ``dtype`` (see ``to_format``) and read back as float32."""
    return to_format(values, dtype).float()


def distinct_inside(dtype, low: float = 1.0, high: float = 2.0, points: int = 10_000) -> torch.Tensor:
    """The distinct values strictly inside (low, high) that ``points`` evenly spaced points
    in [low, high] become when rounded to ``dtype``.

    Between two powers of two a format has 2^M values, so (1, 2) holds 2^M - 1 of them:
    7 for e4m3 and 3 for e5m2. Float32 has 2^23 - 1, far more than the points: then every
    point stays itself, and the count is the number of points inside.
    """
    rounded = round_to(torch.linspace(low, high, points), dtype).unique()
    return rounded[(rounded > low) & (rounded < high)]
