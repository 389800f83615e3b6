"""The registry of graded exercises: exercise id -> the test that grades it.

Tests live in the grader (``ultrascale_grading.exercise_tests.chNN``), not in the
notebooks, so a learner cannot weaken a test by editing a cell, and the same test
serves the in-notebook ``check`` and the command-line grader.

An exercise id is ``"<chapter>.<name>"``, e.g. ``"00.mean_across_ranks"``; the
chapter prefix names the modules that hold its test: ``exercise_tests/ch00.py``, and
``exercise_tests/ch00_<part>.py`` where a chapter's tests are split by exercise (so that no
test module is longer than the technique it grades).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

TESTS_PACKAGE = "ultrascale_grading.exercise_tests"


@dataclass(frozen=True)
class Exercise:
    """One graded exercise: its id, how many points it is worth, and its test.

    The test is called as ``test(*objects, **kwargs)`` with what the learner passed
    to ``check``. It passes by returning, fails by raising ``AssertionError`` with a
    message the learner can act on.
    """

    id: str
    points: float
    test: Callable

    @property
    def chapter(self) -> str:
        return chapter_of(self.id)


_REGISTRY: dict[str, Exercise] = {}


def chapter_of(exercise_id: str) -> str:
    """``"00.mean_across_ranks"`` -> ``"00"``."""
    return exercise_id.split(".", 1)[0]


def exercise(exercise_id: str, points: float = 1):
    """Decorator that registers a test function as the grader of ``exercise_id``."""
    if "." not in exercise_id:
        raise ValueError(f"exercise id {exercise_id!r} must look like '<chapter>.<name>', e.g. '00.mean_across_ranks'")
    if points <= 0:
        raise ValueError(f"exercise {exercise_id!r}: points must be positive, got {points}")

    def register(test: Callable) -> Callable:
        old = _REGISTRY.get(exercise_id)
        # Re-importing a module (autoreload, importlib.reload) registers the same
        # test again, which is fine; two different tests for one id are a bug.
        if old is not None and _origin(old.test) != _origin(test):
            raise ValueError(
                f"exercise {exercise_id!r} is registered twice: by {_origin(old.test)} and by {_origin(test)}"
            )
        _REGISTRY[exercise_id] = Exercise(exercise_id, points, _held_to_contract(test, exercise_id))
        return test

    return register


def _held_to_contract(test: Callable, exercise_id: str) -> Callable:
    """``test``, given the learner's functions wrapped by the contract every exercise shares
    (``grading.contract``: inputs unchanged, new storage, no state kept between calls), then,
    once its fixed cases pass, the exercise's property tried on drawn inputs
    (``grading.properties``, declared in ``exercise_tests.properties``)."""
    from .contract import guard_objects, run_deferred

    @functools.wraps(test)  # keeps the signature, which check() binds the learner's arguments to
    def test_under_contract(*objects, **kwargs):
        objects, kwargs = guard_objects(exercise_id, objects, kwargs)
        result = test(*objects, **kwargs)
        run_deferred(objects, kwargs)
        # by name, as the chapters' test modules are: the tests import grading, not the other way
        PROPERTIES = importlib.import_module(f"{TESTS_PACKAGE}.properties").PROPERTIES
        if exercise_id in PROPERTIES:
            from .properties import run, tried

            prop = PROPERTIES[exercise_id]
            run(exercise_id, prop, tried(prop, objects), quick=kwargs.get("quick", True))
        return result

    return test_under_contract


def _origin(fn: Callable) -> str:
    fn = getattr(fn, "__wrapped__", fn)
    return f"{fn.__module__}.{fn.__qualname__}"


def chapter_modules(chapter: str) -> list[str]:
    """The names of one chapter's test modules: ``ch<chapter>`` and its parts ``ch<chapter>_*``."""
    if not chapter.isalnum():
        return []  # not a chapter prefix (e.g. a notebook named without one)
    package = importlib.import_module(TESTS_PACKAGE)
    return sorted(
        info.name
        for info in pkgutil.iter_modules(package.__path__)
        if info.name == f"ch{chapter}" or info.name.startswith(f"ch{chapter}_")
    )


def _import_chapter(chapter: str) -> None:
    for name in chapter_modules(chapter):
        importlib.import_module(f"{TESTS_PACKAGE}.{name}")


def load_all() -> None:
    """Import every test module, so that every exercise is registered."""
    package = importlib.import_module(TESTS_PACKAGE)
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{TESTS_PACKAGE}.{info.name}")


def get_exercise(exercise_id: str) -> Exercise:
    """Find the exercise, importing its chapter's test module on first use."""
    if exercise_id not in _REGISTRY:
        _import_chapter(chapter_of(exercise_id))
    if exercise_id not in _REGISTRY:
        load_all()  # a test module named differently from its chapter
    try:
        return _REGISTRY[exercise_id]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise KeyError(f"no exercise called {exercise_id!r} (known exercises: {known})") from None


def exercises_of_chapter(chapter: str) -> list[Exercise]:
    """All registered exercises of one chapter, in id order."""
    _import_chapter(chapter)
    return [ex for key, ex in sorted(_REGISTRY.items()) if ex.chapter == chapter]


@functools.lru_cache(maxsize=None)
def declared_points() -> dict[str, float]:
    """{exercise id: points} as the test modules declare them, read from their source without
    importing them: every ``@exercise("NN.name", points=P)`` with a literal id and points.

    Why a second reading of the same decorators: the grader's table needs the points of every
    exercise of a notebook's chapter before it knows which to run, and importing a chapter's tests
    imports torch, 1.3 s of CPU in each process of the grader that only makes the table (the
    tests themselves run in the process that grades them again, which imports them).
    tests/test_grading.py checks that this reading and the registry agree on every exercise.
    """
    spec = importlib.util.find_spec(TESTS_PACKAGE)
    declared = {}
    for folder in spec.submodule_search_locations if spec else ():
        for source in sorted(Path(folder).glob("*.py")):
            for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"), str(source))):
                if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "exercise" and node.args):
                    continue
                points = next(
                    (k.value for k in node.keywords if k.arg == "points"),
                    node.args[1] if len(node.args) > 1 else ast.Constant(1),
                )
                declared[ast.literal_eval(node.args[0])] = ast.literal_eval(points)
    return declared
