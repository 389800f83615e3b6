"""Every chapter runs headless through its `parameters` cell at a WORLD_SIZE other than
the one its committed outputs were made with (nbval re-runs it at the default).

A chapter must be right for any sensible world size, so this is where an assumption
like "the world size divides 4" gets caught. Which other size, and which chapters:

* 3 ranks for a chapter whose default is 2 or 4: odd, so it divides neither (uneven
  shards, ZeRO's padding, a TP degree below the world size), and on 2 cores cheaper
  than a chapter's usual 4. A chapter whose default is already 3 runs at 2 instead:
  the smallest group, where a ring's previous and next rank are the same rank.
* A chapter whose code never reads WORLD_SIZE (outside its parameters cell and its
  asserts) gets no second run: it starts no ranks, so the run would repeat nbval's to
  the bit. Which chapters those are is read from the notebooks (``reads_world_size``),
  so a chapter that starts using WORLD_SIZE gets its run back by itself.

Set ULTRASCALE_NB_WORLD_SIZES=2,3,5 to run every chapter at each of those sizes instead.

These runs are also the chapters' runs under a GPU node's rules: the strict-device and strict
point-to-point modes (ULTRASCALE_STRICT_DEVICE=1, ULTRASCALE_STRICT_P2P=1;
``ultrascale.runtime.strict_device`` and ``strict_p2p``). Every rank function of every chapter
that starts ranks is held to what NCCL with one GPU per rank requires: no tensor left on the
host, no send that waits on a receive queued behind another send. nbval's runs stay in the
plain mode, as a learner runs the chapters.

The runs the selected tests need go two at a time, each a papermill process of its own
(``papermill_runs``): a chapter spends much of its time starting a kernel and ranks and
in ranks waiting on each other, so on 2 cores two at a time take little more than one.
Each test then reports its own run. A chapter's assertions hold on a busy machine, a second
chapter's ranks beside it included (issue 55: ``make busy-check`` runs the chapters that
measure times five times each beside another chapter's run), so a run that fails beside
another fails its test: there is no second run alone.
"""

import ast
import os
import pathlib
import subprocess
import sys
import time

import nbformat
import pytest
from IPython.core.inputtransformer2 import TransformerManager

CHAPTERS = pathlib.Path(__file__).resolve().parent.parent / "chapters"
NOTEBOOKS = sorted(p.name for p in CHAPTERS.glob("*.ipynb"))


def _code_cells(notebook: str):
    """(is the parameters cell, the cell's code as Python: magics turned into calls)."""
    to_python = TransformerManager().transform_cell
    for cell in nbformat.read(CHAPTERS / notebook, as_version=4).cells:
        if cell.cell_type == "code":
            yield "parameters" in cell.metadata.get("tags", []), ast.parse(to_python(cell.source))


def default_world_size(notebook: str):
    for is_parameters, tree in _code_cells(notebook):
        for node in tree.body if is_parameters else ():
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "WORLD_SIZE" for t in node.targets):
                return ast.literal_eval(node.value)
    return None


def reads_world_size(notebook: str) -> bool:
    """Does any code cell but the parameters cell read WORLD_SIZE, outside an assert?"""
    for is_parameters, tree in _code_cells(notebook):
        if is_parameters:
            continue
        in_asserts = {id(n) for a in ast.walk(tree) if isinstance(a, ast.Assert) for n in ast.walk(a)}
        if any(isinstance(n, ast.Name) and n.id == "WORLD_SIZE" and id(n) not in in_asserts for n in ast.walk(tree)):
            return True
    return False


def _runs():
    override = os.environ.get("ULTRASCALE_NB_WORLD_SIZES")
    for notebook in NOTEBOOKS:
        if override:
            yield from ((notebook, int(w)) for w in override.split(","))
        elif reads_world_size(notebook):
            yield notebook, 2 if default_world_size(notebook) == 3 else 3


RUNS_AT_ONCE = 2
RUN_TIMEOUT = 900  # seconds for one chapter's run


# papermill's Python API, as launch/batch.py calls it, with the course's kernel options
# (ultrascale.headless: an encrypted kernel, and no harmless shutdown message in the log), so
# that a failing run's log shows what matters. Its command line cannot pass those options.
RUN_ONE = """
import sys, papermill
from ultrascale.headless import kernel_options
notebook, out, cwd, world_size = sys.argv[1:]
papermill.execute_notebook(notebook, out, cwd=cwd, kernel_name="python3", progress_bar=False,
                           parameters={"WORLD_SIZE": int(world_size), "QUICK": True, "SEED": 0},
                           **kernel_options())
"""


def _papermill(notebook: str, world_size: int, out: pathlib.Path, log: pathlib.Path) -> subprocess.Popen:
    command = [sys.executable, "-c", RUN_ONE, str(CHAPTERS / notebook), str(out), str(CHAPTERS), str(world_size)]
    env = {
        **os.environ,
        "ULTRASCALE_STRICT_DEVICE": "1",
        "ULTRASCALE_STRICT_P2P": "1",
    }  # the kernel's clusters inherit it
    with log.open("w") as sink:
        return subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def _run_all(runs: list, folder: pathlib.Path, at_once: int = RUNS_AT_ONCE) -> dict:
    """{(notebook, world_size): (exit code, log)}, ``at_once`` papermill processes at a time."""
    waiting, running, results = list(runs), {}, {}
    while waiting or running:
        while waiting and len(running) < at_once:
            notebook, world_size = run = waiting.pop(0)
            log = folder / f"{notebook}-{world_size}.log"
            running[run] = (
                _papermill(notebook, world_size, folder / f"{world_size}-{notebook}", log),
                log,
                time.monotonic(),
            )
        for run, (proc, log, started) in list(running.items()):
            if proc.poll() is None and time.monotonic() - started > RUN_TIMEOUT:
                proc.kill()
                proc.wait()
            if proc.poll() is not None:
                results[run] = (proc.returncode, log.read_text(errors="replace"))
                del running[run]
        time.sleep(0.2)
    return results


@pytest.fixture(scope="session")
def papermill_runs(request, tmp_path_factory) -> dict:
    """The selected tests' papermill runs, made together (see the module's docstring)."""
    wanted = [
        tuple(item.callspec.params[k] for k in ("notebook", "world_size"))
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_chapter_runs_with_papermill"
    ]
    return _run_all(wanted, tmp_path_factory.mktemp("papermill"))


@pytest.mark.timeout(3600)  # the first test waits for all the runs (papermill_runs)
@pytest.mark.parametrize("notebook, world_size", list(_runs()))
def test_chapter_runs_with_papermill(notebook, world_size, papermill_runs):
    returncode, log = papermill_runs[notebook, world_size]
    assert returncode == 0, (
        f"{notebook} at WORLD_SIZE={world_size} failed (exit code {returncode}, "
        f"{RUN_TIMEOUT} s allowed):\n{log[-6000:]}"
    )
    for noise in ("Kernel is running over TCP without encryption", "KeyboardInterrupt caught in kernel"):
        assert noise not in log, f"a command-line run printed the kernel's {noise!r} (ultrascale.headless)"


def test_every_chapter_source_has_its_notebook():
    sources = {p.stem for p in CHAPTERS.glob("*.py")}
    notebooks = {p.stem for p in CHAPTERS.glob("*.ipynb")}
    assert sources == notebooks, "run `make notebooks` after adding or removing a chapter source"


def fixed_cluster_sizes(notebook: str) -> list:
    """The size of every cluster the notebook starts, when it is a number written in the notebook
    (``Cluster(2)``, or ``Cluster(N)`` after ``N = 2``); None for one that could be anything."""
    cells = list(_code_cells(notebook))
    trees = [tree for _, tree in cells]
    # numbers written in the chapter, not its parameters (WORLD_SIZE is one: papermill sets it)
    constants = {
        t.id: n.value.value
        for is_parameters, tree in cells
        if not is_parameters
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, int)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    sizes = []
    for call in (n for tree in trees for n in ast.walk(tree) if isinstance(n, ast.Call)):
        if getattr(call.func, "id", getattr(call.func, "attr", None)) in ("Cluster", "shared_cluster"):
            size = call.args[0] if call.args else None
            sizes.append(size.value if isinstance(size, ast.Constant) else constants.get(getattr(size, "id", None)))
    return sizes


def test_the_chapters_left_out_start_no_ranks_whose_number_depends_on_world_size():
    """The static reading above, on what it must find: every chapter has a default, and those it
    leaves out start no cluster, or only clusters of a size written in the chapter (chapter 12's
    FP8 all-gather runs on 2 ranks whatever WORLD_SIZE says): another WORLD_SIZE changes nothing."""
    for notebook in NOTEBOOKS:
        assert isinstance(default_world_size(notebook), int), f"{notebook}: no WORLD_SIZE in its parameters cell"
        if not reads_world_size(notebook):
            assert None not in fixed_cluster_sizes(notebook), notebook


def test_the_static_reading_of_cluster_sizes():
    assert fixed_cluster_sizes("12_mixed_precision.ipynb") == [2]
    assert None in fixed_cluster_sizes("02_data_parallelism.ipynb")  # Cluster(WORLD_SIZE)
