"""The course's grader: the in-notebook ``check``, the exercise generator and the grader, apart
from the library a learner reads (``ultrascale``), which it imports and which never imports it.

* ``check(exercise_id, *objects, **kwargs)`` grades one exercise in a notebook.
* ``with skip_if_not_implemented():`` around a demo cell's work: an unwritten exercise
  prints "not implemented yet" instead of stopping "Run All" before the checks.
* ``@exercise("00.mean_across_ranks", points=1)`` registers a test (tests live in
  ``ultrascale_grading.exercise_tests``).
* ``python -m ultrascale_grading.generate`` (``ultrascale-exercises``) writes
  exercises/ from solutions/.
* ``python -m ultrascale_grading.cli`` (``ultrascale-grade``) runs notebooks with
  papermill and prints a score table.
"""

# The library first, as when the grader was its subpackage: importing it checks the installed
# torch and lets idle OpenMP threads sleep (OMP_WAIT_POLICY) before anything loads torch.
import ultrascale  # noqa: F401

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
