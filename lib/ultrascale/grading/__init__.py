"""Graded exercises: the in-notebook ``check``, the exercise generator and the grader.

* ``check(exercise_id, *objects, **kwargs)`` grades one exercise in a notebook.
* ``with skip_if_not_implemented():`` around a demo cell's work: an unwritten exercise
  prints "not implemented yet" instead of stopping "Run All" before the checks.
* ``@exercise("00.mean_across_ranks", points=1)`` registers a test (tests live in
  ``ultrascale.exercise_tests``).
* ``python -m ultrascale.grading.generate`` (``ultrascale-exercises``) writes
  exercises/ from solutions/.
* ``python -m ultrascale.grading.cli`` (``ultrascale-grade``) runs notebooks with
  papermill and prints a score table.
"""

from .check import FAIL, NOT_IMPLEMENTED, NOT_RUN, PASS, CheckResult, check
from .demo import skip_if_not_implemented
from .registry import Exercise, exercise, exercises_of_chapter, get_exercise

__all__ = [
    "check",
    "CheckResult",
    "skip_if_not_implemented",
    "exercise",
    "Exercise",
    "get_exercise",
    "exercises_of_chapter",
    "PASS",
    "FAIL",
    "NOT_IMPLEMENTED",
    "NOT_RUN",
]
