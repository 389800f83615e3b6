"""Tests of the chapter 12 exercises (solutions/12_mixed_precision_exercises.ipynb).

* ``12.decode_float``: ``decode_float(x)`` returns the stored ``(sign, exponent, mantissa)``
  fields of a one-element tensor in any of the five formats, read from its bits; checked
  against ``ultrascale.precision.decode`` on normal, subnormal, zero, largest and infinite
  values of every format.
* ``12.quantize_per_tensor``: ``quantize_per_tensor(x, dtype)`` returns ``(q, scale)`` with
  ``x ~ q.float() * scale``: the scale must be ``max|x| / fp8_max`` and every element must
  be rounded to the nearest FP8 value (within half a step, ``precision.rounding_bound``).
* ``12.quantize_tiles``: ``quantize_tiles(x, tile_rows, tile_cols, dtype)``: one scale per
  tile, the same two conditions tile by tile, and a ValueError for a shape the tile does
  not divide.
* ``12.fp8_backward``: ``fp8_backward(x, weight, grad_output)`` returns Dgrad and Wgrad of
  a linear layer with per-tensor scaling (x and W in e4m3, the output gradient in e5m2),
  checked against float32 products of the dequantised operands.
* ``12.update_scale``: the dynamic loss scaler's update rule, checked step by step
  against PyTorch's own kernel (``torch._amp_update_scale_``, what ``GradScaler`` runs).

While the learner's function runs, the course library's implementation of the same thing
refuses to be called (``ultrascale_grading.guards``), so calling it is not an answer.
"""

from __future__ import annotations

import math

import torch

from ultrascale_grading import exercise
from ultrascale_grading.guards import call_learner, expect_value_error, without_library
from ultrascale.precision import fp8_linear, formats, loss_scaling, scaling
from ultrascale.precision.fp8_linear import Quantised
from ultrascale.precision.formats import DTYPES, decode, layout
from ultrascale.precision.scaling import E4M3, E5M2, fp8_max, rounding_bound

FORMATS = list(DTYPES.values())


def _values(dtype, quick: bool, seed: int) -> list:
    """Values of ``dtype`` to decode: special ones first, then random ones over its whole range."""
    lay = layout(dtype)
    special = [
        1.0,
        -1.5,
        0.0,
        -0.0,
        lay.max,
        -lay.max,
        lay.smallest_normal,
        lay.smallest_subnormal,
        -3 * lay.smallest_subnormal,
    ]
    if dtype != E4M3:
        special += [math.inf, -math.inf]
    g = torch.Generator().manual_seed(seed)
    n = 40 if quick else 200
    exponents = torch.randint(round(math.log2(lay.smallest_subnormal)), round(math.log2(lay.max)), (n,), generator=g)
    randoms = (torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(exponents.double())).tolist()
    out = []
    for v in special + randoms:
        t = torch.tensor([v], dtype=torch.float64).clamp(-lay.max, lay.max) if math.isfinite(v) else torch.tensor([v])
        out.append(t.float().to(dtype))
    return out


# ---- 12.decode_float -----------------------------------------------------------------


def _decode_hint(got, want, x) -> str:
    dtype = x.dtype
    lay = layout(dtype)
    if isinstance(got, tuple) and len(got) == 3 and got[0] in (-1,) and want[0] == 1:
        return (
            " The sign came out as -1: viewing the bits as a signed integer makes a negative number's "
            "pattern negative. Mask it to the format's width ((1 << bits) - 1) before shifting"
        )
    if dtype != torch.float32 and got == _float32_fields(x):
        return (
            " These are the fields of the value converted to float32. Read the bits of the tensor in its own "
            "dtype: x.view(<an integer dtype of the same width>)"
        )
    for other in FORMATS:
        o = layout(other)
        if other != dtype and o.bits == lay.bits and (o.exponent, o.mantissa) != (lay.exponent, lay.mantissa):
            if got == _fields_with(x, o.exponent, o.mantissa):
                return (
                    f" You split the bits as {o.exponent} exponent and {o.mantissa} mantissa bits, the layout of "
                    f"{other}; {dtype} has {lay.exponent} and {lay.mantissa}"
                )
    return ""


def _raw(x) -> int:
    bits = layout(x.dtype).bits
    as_int = {32: torch.int32, 16: torch.int16, 8: torch.uint8}[bits]
    return int(x.reshape(1).view(as_int).item()) & ((1 << bits) - 1)


def _fields_with(x, exponent_bits, mantissa_bits) -> tuple:
    raw = _raw(x)
    bits = 1 + exponent_bits + mantissa_bits
    return raw >> (bits - 1), (raw >> mantissa_bits) & ((1 << exponent_bits) - 1), raw & ((1 << mantissa_bits) - 1)


def _float32_fields(x) -> tuple:
    return _fields_with(x.float(), 8, 23)


@exercise("12.decode_float", points=1)
def test_decode_float(decode_float, quick: bool = True, seed: int = 0):
    decode_float = without_library(
        decode_float,
        [formats.decode],
        "12.decode_float",
        "view the tensor's bits as an integer and cut out the three fields",
    )
    for dtype in FORMATS:
        for x in _values(dtype, quick, seed):
            ref = decode(x)
            want = (ref.sign, ref.exponent, ref.mantissa)
            call = f"decode_float(torch.tensor([{x.float().item()!r}], dtype={dtype}))"
            got = call_learner(decode_float, x.clone(), call=call, expected=f"the fields {want}")
            assert isinstance(got, (tuple, list)) and len(got) == 3, (
                f"{call} returned {got!r}: return a tuple (sign, exponent, mantissa)"
            )
            try:
                got = tuple(int(v) for v in got)
            except (TypeError, ValueError, RuntimeError):
                raise AssertionError(f"{call} returned {got!r}: return three integers") from None
            if got != want:
                raise AssertionError(
                    f"{call}: expected (sign, exponent, mantissa) = {want} (bits {ref.bit_string()}), got {got}."
                    + _decode_hint(got, want, x)
                )


# ---- 12.quantize_per_tensor ------------------------------------------------------------


def _as_scale(scale, call) -> torch.Tensor:
    try:
        s = torch.as_tensor(scale, dtype=torch.float32).reshape(-1)
    except (TypeError, ValueError, RuntimeError):
        raise AssertionError(f"{call}: the scale must be a number or a one-element tensor, got {scale!r}") from None
    assert s.numel() == 1, f"{call}: one scale per tensor, got {s.numel()} values"
    return s[0]


def _check_rounding(x, q, scale, dtype, call, where=""):
    """Every element within half an FP8 step of x (in units of its scale): nearest rounding."""
    deq = q.float() * scale
    assert torch.isfinite(deq).all(), (
        f"{call}: the quantised values hold inf or NaN{where}. Clamp x / scale to [-fp8_max, fp8_max] before "
        "casting (e5m2 overflows to inf past 57,344)"
    )
    bound = rounding_bound(x, scale, dtype) * (1 + 1e-5) + 1e-30  # 1e-5: the float32 division x / scale
    bad = (deq - x.float()).abs() > bound
    if bad.any():
        i = bad.nonzero()[0].tolist()
        raise AssertionError(
            f"{call}: element {i}{where} is {x.float()[tuple(i)].item():.6g}, but q * scale is "
            f"{deq[tuple(i)].item():.6g}, more than half an FP8 step away. Divide by the scale, then cast: "
            "(x / scale).to(dtype) rounds to the nearest value"
        )


PER_TENSOR_CASES = [((16, 32), 1.0), ((3, 5, 7), 1e-3), ((64,), 1e4), ((1,), 1.0), ((8, 8), 1e-6)]


@exercise("12.quantize_per_tensor", points=1)
def test_quantize_per_tensor(quantize_per_tensor, quick: bool = True, seed: int = 0):
    quantize_per_tensor = without_library(
        quantize_per_tensor,
        [scaling.quantize_per_tensor, scaling.quantize],
        "12.quantize_per_tensor",
        "take the absolute maximum and divide",
    )
    g = torch.Generator().manual_seed(seed)
    cases = PER_TENSOR_CASES if quick else PER_TENSOR_CASES + [((128, 96), 3.0), ((5, 1), 1e2)]
    for dtype in (E4M3, E5M2):
        top = fp8_max(dtype)
        for shape, magnitude in cases:
            x = torch.randn(shape, generator=g, dtype=torch.float64).float() * magnitude
            x.view(-1)[0] *= 50  # an outlier sets the scale
            original = x.clone()
            call = f"quantize_per_tensor(x of shape {tuple(shape)}, {dtype})"
            got = call_learner(quantize_per_tensor, x, dtype, call=call)
            assert isinstance(got, (tuple, list)) and len(got) == 2, f"{call} returned {got!r}: return (q, scale)"
            q, scale = got
            assert torch.equal(x, original), f"{call} changed x: work on a copy"
            assert torch.is_tensor(q) and q.dtype == dtype, (
                f"{call}: q must be a tensor of dtype {dtype}, got "
                f"{q.dtype if torch.is_tensor(q) else type(q).__name__}"
            )
            assert q.shape == x.shape, f"{call}: q must have x's shape {tuple(x.shape)}, got {tuple(q.shape)}"
            s = _as_scale(scale, call)
            amax = x.abs().max().item()
            want = amax / top
            if not math.isclose(s.item(), want, rel_tol=1e-5):
                hint = ""
                if math.isclose(s.item(), top / amax, rel_tol=1e-5):
                    hint = (
                        " You returned fp8_max / amax, the factor that quantises. Return the one that "
                        "dequantises: x ~ q * scale, so scale = amax / fp8_max"
                    )
                elif dtype == E5M2 and math.isclose(s.item(), amax / 448, rel_tol=1e-5):
                    hint = " That is e4m3's largest value; e5m2's is 57,344 (torch.finfo(dtype).max)"
                raise AssertionError(
                    f"{call}: the scale should be max|x| / {top:g} = {want:.6g}, got {s.item():.6g}." + hint
                )
            _check_rounding(x, q, s, dtype, call)
        # all zeros: no division by zero
        call = f"quantize_per_tensor(torch.zeros(4, 4), {dtype})"
        got = call_learner(quantize_per_tensor, torch.zeros(4, 4), dtype, call=call)
        assert isinstance(got, (tuple, list)) and len(got) == 2, f"{call} returned {got!r}: return (q, scale)"
        q, scale = got
        s = _as_scale(scale, call)
        assert math.isfinite(s.item()) and s.item() > 0 and torch.equal(q.float(), torch.zeros(4, 4)), (
            f"{call}: max|x| is 0, so amax / fp8_max is 0 and x / 0 is NaN. Clamp amax to a tiny positive number "
            f"first (e.g. 1e-12): got scale {s.item()} and q {q.float().flatten()[:4].tolist()}..."
        )


# ---- 12.quantize_tiles -------------------------------------------------------------------

# (8, 12) in tiles of 2 x 4 also splits into 4 x 2 tiles: swapped tile sides give a wrong grid, not an
# error, so it comes first (the others refuse swapped sides with a ValueError that names no mistake).
TILE_CASES = [
    ((8, 12), (2, 4)),
    ((4, 256), (1, 128)),
    ((256, 384), (128, 128)),
    ((6, 9), (2, 3)),
    ((8, 6), (4, 1)),
    ((3, 5), (3, 5)),
]
REFUSED = [((4, 200), (1, 128)), ((5, 256), (2, 128)), ((6, 9), (4, 3))]


@exercise("12.quantize_tiles", points=2)
def test_quantize_tiles(quantize_tiles, quick: bool = True, seed: int = 0):
    quantize_tiles = without_library(
        quantize_tiles,
        [scaling.quantize_tiles, scaling.quantize, scaling.tile_grid],
        "12.quantize_tiles",
        "reshape into tiles and take each one's maximum",
    )
    g = torch.Generator().manual_seed(seed)
    # Both formats even in QUICK: only e5m2 tells fp8_max of the dtype from a hard-coded 448.
    for dtype in (E4M3, E5M2):
        top = fp8_max(dtype)
        for (rows, cols), (tr, tc) in TILE_CASES:
            x = torch.randn(rows, cols, generator=g, dtype=torch.float64).float()
            x *= torch.exp2(torch.randint(-8, 8, (rows, 1), generator=g).float())  # tiles of different sizes
            x[0, 0] = 1e4  # an outlier in the first tile only
            call = f"quantize_tiles(x of shape {(rows, cols)}, {tr}, {tc}, {dtype})"
            got = call_learner(quantize_tiles, x.clone(), tr, tc, dtype, call=call)
            assert isinstance(got, (tuple, list)) and len(got) == 2, f"{call} returned {got!r}: return (q, scales)"
            q, scales = got
            assert torch.is_tensor(q) and q.dtype == dtype and q.shape == x.shape, (
                f"{call}: q must be a {dtype} tensor of x's shape {(rows, cols)}, got "
                + (f"{q.dtype} of shape {tuple(q.shape)}" if torch.is_tensor(q) else type(q).__name__)
                + (": cast to the dtype asked for" if torch.is_tensor(q) and q.dtype != dtype else "")
            )
            grid = (rows // tr, cols // tc)
            assert torch.is_tensor(scales) and tuple(scales.shape) == grid, (
                f"{call}: scales must have one entry per tile, shape {grid} (tiles down, tiles across), got "
                f"{tuple(scales.shape) if torch.is_tensor(scales) else type(scales).__name__}"
                + _grid_hint(scales, grid, (rows // tc, cols // tr))
            )
            want = x.view(grid[0], tr, grid[1], tc).abs().amax(dim=(1, 3)) / top
            if not torch.allclose(scales.float(), want, rtol=1e-5, atol=0):
                i, j = ((scales.float() - want).abs() > 1e-5 * want).nonzero()[0].tolist()
                hint = ""
                if torch.allclose(scales.float(), torch.full_like(want, x.abs().max().item() / top), rtol=1e-5):
                    hint = " Every tile got the whole tensor's scale: take each tile's own maximum"
                first_rows = x.view(rows, grid[1], tc).abs().amax(-1)[::tr] / top
                if tr > 1 and torch.allclose(scales.float(), first_rows, rtol=1e-5):
                    hint = f" Only the first row of each tile was used: a tile is {tr} rows by {tc} columns"
                consecutive = x.reshape(grid[0], grid[1], tr * tc).abs().amax(-1) / top
                if torch.allclose(scales.float(), consecutive, rtol=1e-5):
                    hint = (
                        f" Each 'tile' was {tr * tc} consecutive elements of a row, not a {tr} x {tc} block: "
                        f"reshape to (rows // {tr}, {tr}, cols // {tc}, {tc}) and reduce over dims 1 and 3"
                    )
                if dtype != E4M3 and torch.allclose(scales.float(), want * top / fp8_max(E4M3), rtol=1e-5):
                    hint = (
                        f" You divided by 448, e4m3's largest value; {dtype}'s is {top:,g}: take "
                        "torch.finfo(dtype).max of the dtype you were given"
                    )
                raise AssertionError(
                    f"{call}: tile ({i}, {j}) (rows {i * tr}..{(i + 1) * tr - 1}, "
                    f"columns {j * tc}..{(j + 1) * tc - 1}) should have scale max|tile| / {top:g} = "
                    f"{want[i, j].item():.6g}, got {scales[i, j].item():.6g}." + hint
                )
            per_element = want.repeat_interleave(tr, 0).repeat_interleave(tc, 1)
            _check_rounding(x, q, per_element, dtype, call, where=" (scaled by its tile's scale)")
        for (rows, cols), (tr, tc) in REFUSED:
            why = (
                f"{rows} x {cols} does not split into tiles of {tr} x {tc}: refuse it (or the caller pads) "
                "rather than silently dropping or mis-scaling the last rows or columns"
            )
            expect_value_error(
                quantize_tiles,
                torch.randn(rows, cols, generator=g),
                tr,
                tc,
                dtype,
                why=why,
                call=f"quantize_tiles(x of shape {(rows, cols)}, {tr}, {tc}, {dtype})",
            )


def _grid_hint(scales, grid, swapped) -> str:
    if not torch.is_tensor(scales):
        return ""
    if tuple(scales.shape) == grid[::-1]:
        return " (transposed?)"
    if tuple(scales.shape) == swapped:
        return " (tile_rows and tile_cols swapped? a tile is tile_rows rows down by tile_cols columns across)"
    return ""


# ---- 12.fp8_backward -----------------------------------------------------------------------


def reference_fp8_backward(x, weight, grad_output) -> tuple:
    xq, wq = Quantised.of(x, None, E4M3), Quantised.of(weight, None, E4M3)
    dyq = Quantised.of(grad_output, None, E5M2)
    return dyq.dequantize() @ wq.dequantize(), dyq.dequantize().t() @ xq.dequantize()


def _backward_variants(x, weight, dy) -> dict:
    """Plausible mistakes and what they compute: (dx, dW)."""
    deq = lambda t, dtype: Quantised.of(t, None, dtype).dequantize()  # noqa: E731
    return {
        "no FP8 at all": (dy @ weight, dy.t() @ x),
        "the gradient in e4m3": (deq(dy, E4M3) @ deq(weight, E4M3), deq(dy, E4M3).t() @ deq(x, E4M3)),
        "x and W left unquantised": (deq(dy, E5M2) @ weight, deq(dy, E5M2).t() @ x),
    }


HINTS = {
    "no FP8 at all": (
        "these are the float32 gradients: quantise dy, W and x first, then multiply the dequantised values"
    ),
    "the gradient in e4m3": (
        "this is dy quantised to e4m3; the tensorwise recipe stores gradients in e5m2, the format "
        "with the range they need"
    ),
    "x and W left unquantised": "dy is quantised, but W (Dgrad) and x (Wgrad) must be e4m3 too",
}

BACKWARD_CASES = [(32, 48, 64), (96, 64, 80), (7, 5, 3)]


@exercise("12.fp8_backward", points=2)
def test_fp8_backward(fp8_backward, quick: bool = True, seed: int = 0):
    forbidden = [
        fp8_linear.fp8_gemm,
        fp8_linear.FP8Matmul.forward,
        fp8_linear.FP8Matmul.backward,
        fp8_linear.FP8Linear.forward,
    ]
    fp8_backward = without_library(
        fp8_backward, forbidden, "12.fp8_backward", "quantise the operands and multiply them yourself"
    )
    g = torch.Generator().manual_seed(seed)
    cases = BACKWARD_CASES if quick else BACKWARD_CASES + [(256, 128, 192)]
    for tokens, fin, fout in cases:
        x = torch.randn(tokens, fin, generator=g, dtype=torch.float64).float()
        weight = torch.randn(fout, fin, generator=g, dtype=torch.float64).float() * 0.05
        dy = torch.randn(tokens, fout, generator=g, dtype=torch.float64).float() * 1e-3
        call = f"fp8_backward(x {tuple(x.shape)}, weight {tuple(weight.shape)}, grad_output {tuple(dy.shape)})"
        got = call_learner(fp8_backward, x.clone(), weight.clone(), dy.clone(), call=call)
        assert isinstance(got, (tuple, list)) and len(got) == 2, f"{call} returned {got!r}: return (dx, dW)"
        want = reference_fp8_backward(x, weight, dy)
        variants = _backward_variants(x, weight, dy)
        for k, (name, shape) in enumerate((("dx (Dgrad)", x.shape), ("dW (Wgrad)", weight.shape))):
            have = got[k]
            assert torch.is_tensor(have), f"{call}: {name} must be a tensor, got {type(have).__name__}"
            assert have.shape == shape, (
                f"{call}: {name} must have the shape of {'x' if k == 0 else 'the weight'}, {tuple(shape)}, got "
                f"{tuple(have.shape)}" + ("; dW = dy^T @ x" if k == 1 else "; dx = dy @ W")
            )
            scale = want[k].abs().max().item()
            if not torch.allclose(have.float(), want[k], rtol=1e-5, atol=1e-5 * scale):  # float32 sums only
                hint = next(
                    (
                        HINTS[v]
                        for v, out in variants.items()
                        if torch.allclose(have.float(), out[k], rtol=1e-5, atol=1e-5 * scale)
                    ),
                    "",
                )
                raise AssertionError(
                    f"{call}: {name} differs from the FP8 reference by up to "
                    f"{(have.float() - want[k]).abs().max().item():.3g} (its values reach {scale:.3g})"
                    + (
                        f": {hint}"
                        if hint
                        else ". Quantise x and W to e4m3 and dy to e5m2, each with one scale, "
                        "and multiply the dequantised values in float32"
                    )
                )


# ---- 12.update_scale -----------------------------------------------------------------------

UPDATE_SETTINGS = [
    dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
    dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=1),
    dict(growth_factor=4.0, backoff_factor=0.25, growth_interval=5),
    dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=2000),
]


def _update_hint(found_inf, scale, tracker, got, want, interval) -> str:
    if found_inf:
        if got[1] != 0:
            return " After an overflow the count of good steps starts again from 0"
        return " After an overflow, multiply the scale by backoff_factor"
    if want[1] == 0 and want[0] == scale:
        return (
            " Growing would take the scale past float32's largest value (about 3.4e38, GradScaler keeps it "
            "in a float32): keep the scale and reset the count"
        )
    if want[1] == 0:
        if got[1] != 0 and got[0] == want[0]:
            return " After growing, the count of good steps starts again from 0"
        return f" This is good step number {interval} in a row: the scale grows by growth_factor now"
    if got[0] != scale:
        return f" Only {want[1]} good steps in a row, fewer than growth_interval = {interval}: the scale stays"
    return " Count this good step: growth_tracker + 1"


@exercise("12.update_scale", points=1)
def test_update_scale(update_scale, quick: bool = True, seed: int = 0):
    update_scale = without_library(
        update_scale, [loss_scaling.update_scale], "12.update_scale", "write the two rules yourself"
    )
    g = torch.Generator().manual_seed(seed)
    steps = 60 if quick else 400
    starts = [2.0**16, 2.0**125]  # the second one grows into float32's limit
    for settings in UPDATE_SETTINGS:
        for start in starts:
            scale, tracker = start, 0
            s, t = torch.tensor([start]), torch.tensor([0], dtype=torch.int32)
            history = []
            for found in (torch.rand(steps, generator=g) < 0.15).tolist():
                options = ", ".join(f"{k}={v!r}" for k, v in settings.items())
                call = f"update_scale({scale!r}, {tracker}, {found}, {options})"
                got = call_learner(update_scale, scale, tracker, found, call=call, **settings)
                torch._amp_update_scale_(
                    s,
                    t,
                    torch.tensor([float(found)]),
                    settings["growth_factor"],
                    settings["backoff_factor"],
                    settings["growth_interval"],
                )
                want = (s.item(), t.item())
                assert isinstance(got, (tuple, list)) and len(got) == 2, (
                    f"{call} returned {got!r}: return (new scale, new growth_tracker)"
                )
                if (float(got[0]), int(got[1])) != want:
                    hint = _update_hint(found, scale, tracker, got, want, settings["growth_interval"])
                    raise AssertionError(
                        f"{call} returned {tuple(got)}; torch.amp.GradScaler's rule gives {want} (the steps before: "
                        f"{history[-4:]} as (found_inf, scale after)).{hint}"
                    )
                history.append((found, want[0]))
                scale, tracker = want
