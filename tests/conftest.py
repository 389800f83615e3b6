"""Fixtures shared by several test files.

``graded_course``: one grader run (papermill, a real kernel per notebook) serves both
tests/test_grading.py (the scores) and tests/test_run_all.py (the executed exercise
notebooks). The grader runs every exercise notebook exactly as a learner's Run All would
(``QUICK=True``, the notebook's folder as working directory, 300 s per cell); it only
keeps going after a cell that raises, and test_run_all asserts that no cell raised, which
is the same verdict as a run that stops at the first error. Before, each notebook of
exercises/ ran twice (once per file): about 15 s each on 2 cores.

Only the notebooks that the selected tests need are graded: ``-k 06`` grades chapter 06's,
while a test that needs the whole course (no ``notebook`` parameter) grades everything.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GRADED_FOLDERS = ("solutions", "exercises")
GRADER_TIMEOUT = 1800  # seconds for one folder of 17 notebooks
GRADER_JOBS = 2        # notebooks graded at a time, per folder


@dataclass
class GradedFolder:
    notebooks: list   # the grader's JSON rows, one per notebook
    table: str        # the grader's printed table (for failure messages)
    executed: Path    # the executed notebooks (the grader's --keep)


def _wanted(session) -> set | None:
    """Names of the notebooks the selected tests grade; None for all of them."""
    names = set()
    for item in session.items:
        if "graded_course" not in getattr(item, "fixturenames", ()):
            continue
        callspec = getattr(item, "callspec", None)
        notebook = callspec.params.get("notebook") if callspec else None
        if notebook is None:
            return None
        names.add(notebook)
    return names


def _start_grading(folder: str, names: set | None, out: Path):
    """Start the grader on ``folder`` in the background; returns a function that waits for its result."""
    paths = [folder] if names is None else [f"{folder}/{n}" for n in sorted(names)
                                            if (REPO / folder / n).is_file()]
    scores, keep = out / f"{folder}.json", out / folder
    if not paths:
        return lambda: GradedFolder([], "", keep)
    # exercises/ with --feedback: test_run_all reads each check's verdict in the executed cells, and
    # stubs cost nothing to test (no pass, so no second run); solutions/ as a teacher grades, each
    # test run once, in the grader's own process.
    feedback = ["--feedback"] if folder == "exercises" else []
    log = out / f"{folder}.log"   # a file, not a pipe: nobody reads the second grader's until the first ends
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ultrascale.grading.cli", *paths, "--json", str(scores), "--keep", str(keep),
             "--jobs", str(GRADER_JOBS), *feedback],
            cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, text=True,
        )

    def result() -> GradedFolder:
        try:
            proc.wait(timeout=GRADER_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"grading {folder}/ took over {GRADER_TIMEOUT} s:\n{log.read_text()[-4000:]}")
        output = log.read_text()
        assert proc.returncode == 0, output
        return GradedFolder(json.loads(scores.read_text())["notebooks"], output, keep)
    return result


@pytest.fixture(scope="session")
def graded_course(request, tmp_path_factory) -> dict:
    """{"solutions": GradedFolder, "exercises": GradedFolder}: one grader run per folder."""
    out = tmp_path_factory.mktemp("grade")
    names = _wanted(request.session)
    # both folders at once: most of a notebook's time is a kernel or a cluster starting, and ranks
    # waiting on each other, so the two graders (two notebooks each) share 2 cores well
    waiting = {folder: _start_grading(folder, names, out) for folder in GRADED_FOLDERS}
    return {folder: result() for folder, result in waiting.items()}


# --------------------------------------------------------------------------- solutions
def _solution_fixture(stem: str):
    @pytest.fixture(scope="module")
    def solution() -> dict:
        """The imports, functions and classes of solutions/<stem>_exercises.ipynb (test_grader_holes._load)."""
        from test_grader_holes import _load
        return _load(f"{stem}_exercises.ipynb")
    return solution


# One fixture per chapter, named as the grader tests take them: ``ch04`` is chapter 04's
# solution notebook, ``a1`` appendix A1's (each test module loads its own copy).
for _notebook in sorted((REPO / "solutions").glob("*_exercises.ipynb")):
    _stem = _notebook.name.removesuffix("_exercises.ipynb")
    _prefix = _stem.split("_")[0]
    globals()["ch" + _prefix if _prefix[0].isdigit() else _prefix] = _solution_fixture(_stem)
