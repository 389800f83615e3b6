"""Tests of the A3 exercise on bucketed all-reduces (solutions/a3_overlap_math_exercises.ipynb);
the ratio exercises are tested in ``cha3.py``.

* ``a3.bucketed_exposure``: ``exposed_allreduce_time(backward_times, bucket_bytes, dp, peak_bw)``,
  how long a step waits after its backward for bucketed all-reduces that each start when their
  gradients are ready and the link is free (one link, buckets in order, the ring's
  2(dp-1)/dp). Computed here with exact fractions; hand-made schedules (everything hidden but
  the last bucket, a link slower than the backward, one bucket, an empty bucket, dp 1, a
  realistic 360 MB gradient over InfiniBand) and random ones; classic mistakes are named.

While the learner's code runs, ``ultrascale.overlap``'s own ratio functions refuse to be called
(``cha3.RATIO_FUNCTIONS``).
"""

from __future__ import annotations

import math
import random
from fractions import Fraction
from numbers import Real

from ultrascale_grading import exercise
from ultrascale_grading.exercise_tests.cha3 import RATIO_FUNCTIONS
from ultrascale_grading.guards import call_learner, without_library


# ---- a3.bucketed_exposure --------------------------------------------------------------


def reference_exposed(backward_times, bucket_bytes, dp, peak_bw, *, queue=True, ring=True, exposed=True):
    """The wait after the backward for the buckets' all-reduces, with exact fractions. ``queue=False``,
    ``ring=False`` and ``exposed=False`` give classic mistakes (for recognising them)."""
    ready = free = Fraction(0)
    factor = Fraction(2 * (dp - 1), dp) if ring else Fraction(1)
    for compute, nbytes in zip(backward_times, bucket_bytes):
        ready += Fraction(compute)
        start = max(ready, free) if queue else ready
        free = max(free, start + Fraction(nbytes) * factor / Fraction(peak_bw))
    return max(Fraction(0), free - ready) if exposed else free


def _exposure_mistakes(backward_times, bucket_bytes, dp, peak_bw) -> list:
    comm = [Fraction(b) * Fraction(2 * (dp - 1), dp) / Fraction(peak_bw) for b in bucket_bytes]
    backward = sum(Fraction(t) for t in backward_times)
    return [
        (
            reference_exposed(backward_times, bucket_bytes, dp, peak_bw, queue=False),
            "Every bucket's all-reduce started as soon as its gradients were ready, even while the previous one was "
            "still on the link: they share it, so a bucket starts when it is ready and the link is free",
        ),
        (
            reference_exposed(backward_times, bucket_bytes, dp, peak_bw, ring=False),
            "The factor 2(dp-1)/dp of the ring all-reduce is missing: a bucket of n bytes takes n·2(dp-1)/(dp·peak_bw)",
        ),
        (sum(comm), "That is all of the communication, as if none of it overlapped the backward"),
        (
            max(Fraction(0), sum(comm) - backward),
            "That assumes perfect overlap (communication minus backward): a bucket cannot start before its "
            "gradients exist, and the last one always starts at the end of the backward",
        ),
        (
            comm[-1] if comm else Fraction(0),
            "That is the last bucket's all-reduce alone: earlier ones may still "
            "be queued on the link when the backward ends",
        ),
        (
            reference_exposed(backward_times, bucket_bytes, dp, peak_bw, exposed=False),
            "That is when the communication ends, measured from the start of the backward: return the wait after "
            "the backward's end",
        ),
    ]


# (backward time of the segment that fills each bucket, in backward order; bucket bytes; dp; peak_bw)
EXPOSURE_CASES = [
    ([1, 1, 1, 1], [1, 1, 1, 1], 2, 1.0),  # each hides behind the next segment; the last shows
    ([1, 1, 1, 1], [2, 2, 2, 2], 2, 1.0),  # the link is slower than the backward: buckets queue
    ([2, 1, 3], [4, 4, 4], 4, 2.0),  # the ring factor 3/2
    ([10, 0.5, 0.5], [1, 1, 1], 2, 1.0),  # small late segments: the queue decides
    ([5], [8], 8, 1.0),  # one bucket: nothing overlaps
    ([3, 3], [0, 5], 3, 1.0),  # an empty bucket
    ([0.25, 4, 0.5], [3, 1, 1], 2, 1.0),  # the first bucket is long, the link catches up later
    ([2, 2], [5, 5], 1, 1.0),  # dp 1: nothing to all-reduce
    ([0.012, 0.011, 0.013, 0.010], [100_000_000] * 3 + [60_000_000], 64, 50e9),  # 360 MB of gradients, IB
]


def _exposure_cases(quick: bool):
    rng = random.Random(1)
    more = []
    for _ in range(20 if quick else 300):
        n = rng.randint(1, 10)
        more.append(
            (
                [rng.choice([0, rng.randint(1, 50) / 8]) for _ in range(n)],
                [rng.randint(0, 10**6) for _ in range(n)],
                rng.randint(1, 512),
                rng.choice([1e5, 2.5e5, 1e6]),
            )
        )
    return EXPOSURE_CASES + more


@exercise("a3.bucketed_exposure", points=1)
def test_bucketed_exposure(exposed_allreduce_time, quick: bool = True):
    """Exact waits (to 1e-9 relative) on hand-made bucket schedules and random ones."""
    learner = without_library(
        exposed_allreduce_time, RATIO_FUNCTIONS, "a3.bucketed_exposure", "write a bucket's all-reduce time yourself"
    )
    for backward, nbytes, dp, bw in _exposure_cases(quick):
        call = f"exposed_allreduce_time(backward_times={backward}, bucket_bytes={nbytes}, dp={dp}, peak_bw={bw:g})"
        expected = float(reference_exposed(backward, nbytes, dp, bw))
        got = call_learner(learner, list(backward), list(nbytes), dp, bw, call=call, expected=f"{expected:.6g} s")
        assert isinstance(got, Real) and not isinstance(got, bool), f"{call} returned {got!r}; return a number"
        if math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12):
            continue
        hint = " Or: ".join(
            why + "."
            for value, why in _exposure_mistakes(backward, nbytes, dp, bw)
            if math.isclose(got, float(value), rel_tol=1e-9, abs_tol=1e-12)
        )
        hint = " " + hint if hint else ""  # several mistakes may give the same number on one input
        raise AssertionError(
            f"{call}: expected {expected:.6g} s of communication after the backward, got {got:.6g}.{hint}"
        )
