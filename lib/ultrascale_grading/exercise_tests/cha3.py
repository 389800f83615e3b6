"""Tests of the A3 exercises (solutions/a3_overlap_math_exercises.ipynb).

* ``a3.dp_ratio``: ``dp_ratio(num_tokens, num_params, dp, peak_flops, peak_bw)``, the data-
  parallel overlap ratio derived from the book's two lines (whole gradient all-reduced
  against the whole backward), checked against ``overlap.dp_ratio`` on many inputs. The
  form printed in the book (``num_params`` times larger) is recognised and refused.
* ``a3.hiding_limits``: ``max_tp(h, peak_flops, peak_bw, bytes_per_element=1)``, the largest
  TP degree whose collectives still hide (TP ratio <= 1), and
  ``min_layers_per_stage(h, peak_flops, peak_bw, bytes_per_element=1)``, the fewest layers per
  pipeline stage that hide the activation sends (PP ratio <= 1); exact integers, computed
  here with exact fractions, including settings that sit exactly on the boundary.

While the learner's code runs, ``ultrascale.overlap``'s own ratio functions refuse to be called.
Bucketed all-reduces (``a3.bucketed_exposure``) are tested in ``cha3_bucketed_exposure.py``.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction
from numbers import Real

from ultrascale import overlap
from ultrascale_grading import exercise
from ultrascale_grading.guards import call_learner, without_library

RATIO_FUNCTIONS = [
    overlap.dp_comm_time,
    overlap.dp_compute_time,
    overlap.dp_ratio,
    overlap.dp_ratio_as_printed,
    overlap.zero3_ratio,
    overlap.tp_comm_time,
    overlap.tp_compute_time,
    overlap.tp_ratio,
    overlap.pp_comm_time,
    overlap.pp_compute_time,
    overlap.pp_ratio,
    overlap.overlap_ratios,
]


# ---- a3.dp_ratio -----------------------------------------------------------------------


def _dp_cases(quick: bool):
    fixed = [
        (4096, 8_030_261_248, 64, 989e12, 450e9),
        (64, 216_448, 4, 1.4e10, 4e7),
        (1, 1, 2, 1.0, 1.0),
        (8192, 70_553_706_496, 512, 989e12, 50e9),
        (128, 10**6, 3, 2e12, 2e11),
    ]
    rng = random.Random(0)
    more = [
        (
            rng.randint(1, 10**5),
            rng.randint(1, 10**11),
            rng.randint(2, 4096),
            10 ** rng.uniform(9, 15),
            10 ** rng.uniform(8, 12),
        )
        for _ in range(20 if quick else 200)
    ]
    return fixed + more


def _dp_hint(got, t, n, dp, f, b) -> str:
    right = overlap.dp_ratio(t, n, dp, f, b)
    if math.isclose(got, overlap.dp_ratio_as_printed(t, n, dp, f, b), rel_tol=1e-9):
        return (
            " That is the ratio as printed in the book. Derive it from the two lines instead: t_comm of the "
            "whole gradient (num_params elements, all-reduced) over t_compute of the backward "
            "(4 · num_tokens · num_params FLOPs). num_params cancels."
        )
    for factor, why in (
        (
            2,
            "the all-reduce moves 2(DP-1)/DP times the gradient, and the backward is 4TN, "
            "not 2TN (forward) or 6TN (forward and backward)",
        ),
        (
            Fraction(1, 2),
            "the all-reduce moves 2(DP-1)/DP times the gradient (bus bandwidth), and the backward is 4TN FLOPs",
        ),
        (Fraction(3, 2), "the all-reduce hides behind the backward (4TN), not the whole step (6TN)"),
        (Fraction(2, 3), "the all-reduce hides behind the backward (4TN), not the whole step (6TN)"),
    ):
        if math.isclose(got, right * float(factor), rel_tol=1e-9):
            return f" It is {float(factor):g} times the right value: {why}."
    if math.isclose(got, right * dp / (dp - 1), rel_tol=1e-9):
        return " The factor (DP-1)/DP of the ring all-reduce is missing."
    return ""


@exercise("a3.dp_ratio", points=1)
def test_dp_ratio(dp_ratio, quick: bool = True):
    """The derived ratio on realistic and random inputs; the printed form is refused."""
    dp_ratio = without_library(dp_ratio, RATIO_FUNCTIONS, "a3.dp_ratio", "write t_comm and t_compute and divide")
    for t, n, dp, f, b in _dp_cases(quick):
        call = f"dp_ratio(num_tokens={t}, num_params={n}, dp={dp}, peak_flops={f:.4g}, peak_bw={b:.4g})"
        expected = overlap.dp_ratio(t, n, dp, f, b)
        got = call_learner(dp_ratio, t, n, dp, f, b, call=call, expected=f"{expected:.6g}")
        assert isinstance(got, Real), f"{call} returned {got!r}; return a number"
        assert math.isclose(got, expected, rel_tol=1e-9), (
            f"{call}: expected {expected:.6g}, got {got:.6g}.{_dp_hint(got, t, n, dp, f, b)}"
        )


# ---- a3.hiding_limits ------------------------------------------------------------------


def reference_max_tp(h, peak_flops, peak_bw, bytes_per_element=1) -> int:
    # bytes (TP-1)/(2h) F/B <= 1  <=>  TP - 1 <= 2hB / (bytes F)
    return math.floor(Fraction(2 * h) * Fraction(peak_bw) / (Fraction(bytes_per_element) * Fraction(peak_flops))) + 1


def reference_min_layers(h, peak_flops, peak_bw, bytes_per_element=1) -> int:
    # bytes F / (32 h L B) <= 1  <=>  L >= bytes F / (32 h B)
    need = Fraction(bytes_per_element) * Fraction(peak_flops) / (Fraction(32 * h) * Fraction(peak_bw))
    return max(1, math.ceil(need))


# (h, peak_flops, peak_bw, bytes_per_element): spec-sheet-like settings, then exact boundaries
LIMIT_CASES = [
    (8192, 989e12, 450e9, 2),
    (4096, 989e12, 450e9, 2),
    (16384, 989e12, 450e9, 1),
    (8192, 989e12, 50e9, 2),
    (4096, 312e12, 300e9, 2),
    (2048, 1.4e10, 4e7, 4),
    (12288, 1979e12, 450e9, 1),
    (1024, 989e12, 25e9, 2),
    (1024, 989e12, 5e9, 2),
    (512, 1979e12, 12.5e9, 2),
    (4, 8.0, 1.0, 1),  # TP ratio exactly 1 at TP = 2: the boundary counts as hidden
    (4, 8.0, 1.0, 2),  # TP 1 only (TP = 2 would give 2)
    (1, 64.0, 1.0, 1),  # PP ratio exactly 1 at 2 layers per stage
    (64, 2048.0, 1.0, 1),  # exactly 1 at 1 layer
    (1, 1.0, 1.0, 1),  # everything hides: 1 layer, TP up to 3
]


def _check_int(call, got, expected, hint):
    assert got is not None, f"{call} returned None; return an integer"
    assert isinstance(got, Real) and float(got).is_integer(), f"{call} returned {got!r}; return a whole number"
    if got == expected:
        return
    extra = ""
    if got == expected + 1 or got == expected - 1:
        extra = hint
    raise AssertionError(f"{call}: expected {expected}, got {int(got)}.{extra}")


@exercise("a3.hiding_limits", points=1)
def test_hiding_limits(max_tp, min_layers_per_stage, quick: bool = True):
    """Exact integers on realistic settings and exactly on the boundary (ratio == 1 counts as hidden)."""
    max_tp = without_library(max_tp, RATIO_FUNCTIONS, "a3.hiding_limits", "use the TP ratio's closed form")
    min_layers_per_stage = without_library(
        min_layers_per_stage, RATIO_FUNCTIONS, "a3.hiding_limits", "use the PP ratio's closed form"
    )
    for h, f, b, nbytes in LIMIT_CASES:
        args = f"h={h}, peak_flops={f:.4g}, peak_bw={b:.4g}, bytes_per_element={nbytes}"
        expected = reference_max_tp(h, f, b, nbytes)
        call = f"max_tp({args})"
        got = call_learner(max_tp, h, f, b, bytes_per_element=nbytes, call=call, expected=str(expected))
        _check_int(
            call,
            got,
            expected,
            " Off by one: TP = 1 always hides (it sends nothing), and a ratio exactly 1 still hides "
            "(the condition is <= 1).",
        )
        expected = reference_min_layers(h, f, b, nbytes)
        call = f"min_layers_per_stage({args})"
        got = call_learner(min_layers_per_stage, h, f, b, bytes_per_element=nbytes, call=call, expected=str(expected))
        _check_int(
            call,
            got,
            expected,
            " Off by one: round the needed number of layers up, a ratio exactly 1 already hides (<= 1), "
            "and a stage has at least one layer.",
        )
    default_tp = call_learner(max_tp, 8192, 989e12, 450e9)
    assert default_tp == reference_max_tp(8192, 989e12, 450e9, 1), (
        "max_tp(8192, 989e12, 450e9) should default to bytes_per_element=1, as the book counts, and give "
        f"{reference_max_tp(8192, 989e12, 450e9, 1)}; got {default_tp}"
    )
