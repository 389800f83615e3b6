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
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GRADED_FOLDERS = ("solutions", "exercises")
GRADER_TIMEOUT = 1800  # seconds for one folder of notebooks (18 of them)
GRADER_JOBS = 2  # notebooks graded at a time, per folder


@dataclass
class GradedFolder:
    notebooks: list  # the grader's JSON rows, one per notebook
    table: str  # the grader's printed table (for failure messages)
    executed: Path  # the executed notebooks (the grader's --keep)


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
    paths = [folder] if names is None else [f"{folder}/{n}" for n in sorted(names) if (REPO / folder / n).is_file()]
    scores, keep = out / f"{folder}.json", out / folder
    if not paths:
        return lambda: GradedFolder([], "", keep)
    # exercises/ with --feedback: test_run_all reads each check's verdict in the executed cells, and
    # stubs cost nothing to test (no pass, so no second run); solutions/ as a teacher grades, each
    # test run once, in the grader's own process.
    feedback = ["--feedback"] if folder == "exercises" else []
    log = out / f"{folder}.log"  # a file, not a pipe: nobody reads the second grader's until the first ends
    # Both folders are graded under a GPU node's rules (strict-device and strict point-to-point modes,
    # ultrascale.runtime.strict_device and strict_p2p): no tensor left on the host, no send that waits
    # on a receive queued behind another, in every grader and every solution.
    env = {**os.environ, "ULTRASCALE_STRICT_DEVICE": "1", "ULTRASCALE_STRICT_P2P": "1"}
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ultrascale_grading.cli",
                *paths,
                "--json",
                str(scores),
                "--keep",
                str(keep),
                "--jobs",
                str(GRADER_JOBS),
                *feedback,
            ],
            cwd=REPO,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
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


# --------------------------------------------------------------------------- a GPU node's rules
STRICT_MODES = ("ULTRASCALE_STRICT_DEVICE", "ULTRASCALE_STRICT_P2P")


@pytest.fixture(scope="module")
def strict_modes():
    """A module's clusters under a GPU node's rules: while the module runs, ``shared_cluster``
    hands out ranks in the strict-device and strict point-to-point modes (CONTRIBUTING.md), so a
    tensor a test leaves on the host, or two ranks whose sends wait on each other, fail here as
    they would under NCCL. The technique tests use it (``pytestmark`` in each, listed in
    tests/test_strict_device.py). Where torch sees a GPU (``make test-gpu`` runs these tests,
    marked ``multigpu``) the modes are left as the environment has them: NCCL judges there."""
    import torch

    with pytest.MonkeyPatch.context() as patch:
        if not torch.cuda.is_available():
            for name in STRICT_MODES:
                if os.environ.get(name, "").strip() in ("", "0"):
                    patch.setenv(name, "1")
        yield


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


# --------------------------------------------------------------------------- two tests at a time
# `make test` runs pytest with pytest-xdist on two workers (launch/test.sh: -n 2). Most of the
# suite's time is not arithmetic but waiting: kernels and ranks starting, ranks waiting for each
# other, a browser rendering; so two tests side by side use 2 cores better than one. What the
# workers may split is decided here, by the units of work below (a unit runs on one worker, in
# collection order):
#  * a test file is one unit: its module fixtures (a cluster of ranks, a JupyterLab) start once,
#    and its tests never race each other; a chapter's nbval cells likewise share one kernel;
#  * the files of one session fixture are one unit (``graded_course``: test_grading and
#    test_run_all read one grader run), or each worker would run it;
#  * the benchmark smoke runs are independent subprocesses: each test is a unit of its own.
# Units start longest first (LONGEST_FIRST, from ``--durations`` of a full run), so that the last
# minutes are not one worker alone with a long unit; the others keep their collection order. The
# grader's sandbox tests go first of all, beside the graded course: they spend most of their 45 s
# waiting for notebooks that never end to reach their time limit, and started later (beside the
# browser tests) left a fifth of the two cores idle for that long; beside the grader, whose four
# notebooks at a time fill both cores, nothing waits.
# (A scheduler of our own rather than xdist's ``--dist loadgroup``: that one renames the tests'
# node ids, which pytest 9.2 no longer lets a plugin do, so its groups are silently ignored.)
# After those, the units that mostly wait (WAITING: one test at a time they keep the 2 cores
# under 1.1 busy on average; tests/cpu_report.py measures it) are spread evenly among the busy
# ones, so that the two workers rarely wait at once: run one after another on one worker beside
# the browser tests, they left a sixth of the cores idle for two minutes.
SHARED_SESSION = {"tests/test_grading.py": "graded_course", "tests/test_run_all.py": "graded_course"}
EACH_TEST_ALONE = {"tests/test_benchmarks.py"}
LONGEST_FIRST = [
    "tests/test_grader_sandbox.py",
    "graded_course",
    "tests/test_notebooks.py",
    "tests/test_browser.py",
    "tests/test_runtime_stops.py",
]
WAITING = {
    "tests/test_batch.py",
    "tests/test_runtime.py",
    "tests/test_workspace.py",
    "tests/test_slurm.py",
    "tests/test_grader_forgery.py",
    "tests/test_grader_zygote.py",
    "tests/test_warm_kernels.py",
    "chapters/07_pipeline_parallelism.ipynb",
}


def unit_of(nodeid: str) -> str:
    """The unit of work of the test ``nodeid`` (``tests/test_x.py::test_y[...]``)."""
    path = nodeid.split("::")[0]
    if path in EACH_TEST_ALONE:
        return nodeid
    return SHARED_SESSION.get(path, path)


def _waits(unit: str) -> bool:
    return unit in WAITING or unit.startswith("tests/test_benchmarks.py::")  # a benchmark times things


def unit_order(units: list) -> list:
    """LONGEST_FIRST's units first; then the others in the order given, the waiting ones spread
    evenly among the busy ones (a busy one first)."""
    first = [u for u in LONGEST_FIRST if u in units]
    waiting = [u for u in units if u not in first and _waits(u)]
    busy = [u for u in units if u not in first and not _waits(u)]
    order = list(busy)
    for i, unit in enumerate(waiting):  # after the busy unit (i + 1) / (len(waiting) + 1) of the way
        order.insert(round((i + 1) * len(busy) / (len(waiting) + 1)) + i, unit)
    return first + order


def pytest_collection_modifyitems(config, items):
    """Units in ``unit_order`` (a stable sort: within a unit, the collection order)."""
    units = list(dict.fromkeys(unit_of(item.nodeid) for item in items))
    rank = {unit: i for i, unit in enumerate(unit_order(units))}
    items.sort(key=lambda item: rank[unit_of(item.nodeid)])


@pytest.hookimpl(optionalhook=True)  # only with pytest-xdist (-n)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        """xdist's scheduler by scope, with ``unit_of`` as the scope, in collection order."""

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False  # keep LONGEST_FIRST's order, not "most tests first"
    return ByUnit(config, log)


# --------------------------------------------------------------------------- nbval's kernels
def pytest_configure(config):
    """nbval's kernels on unix sockets, as the course's papermill runs (``ultrascale.headless``):
    on TCP a kernel's port, chosen free by jupyter_client, can be taken by the suite's gloo
    connections before the kernel binds it, and the chapter fails with "Address already in use"."""
    try:
        import nbval.kernel
    except ImportError:
        return
    from jupyter_client.manager import KernelManager

    from ultrascale.headless import kernel_options

    if nbval.kernel.KernelManager is KernelManager:  # start_new_kernel makes one per notebook

        def unix_socket_kernel(**kwargs):
            return KernelManager(config=kernel_options()["config"], **kwargs)

        nbval.kernel.KernelManager = unix_socket_kernel
