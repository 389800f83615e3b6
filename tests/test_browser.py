"""The course as a learner meets it: JupyterLab in a real (headless) Chromium, driven with Selenium.

nbval and papermill run the notebooks' code, but never render a widget, draw a plot in a page
or see what a learner sees. These tests start the course's JupyterLab (launch/lab.sh, the one
``make lab`` runs) on a free localhost port with a token, over a copy of the notebooks in a
temporary folder (a Run All, typed code and autosave never reach the repository's notebooks),
and use it through the page: menus, clicks, keys.

* the landing page opens on chapter 00; Run All there shows no error, draws its figures as
  images, and replaces the live plot's image in place while the ranks train;
* chapter 01's memory widget redraws when DP and the ZeRO stage change, and shows its error
  text for an impossible head count;
* an exercise notebook, run as a learner who has written nothing, says "not implemented yet"
  at every check and reaches its end; a correct solution typed into the page passes, a wrong
  one fails and names the failing input;
* a widget whose callback raises is caught (the same check the memory widget passes);
* every chapter's first cells run in the browser: the chapters are read from chapters/*.ipynb,
  so a new chapter is covered as soon as its notebook exists.

Screenshots of each step go to out/browser/. Every process the server and the browser start
(kernels, ranks, chromium) is noted while it runs; the last test stops the browser and the
server by PID and fails if any of them is still there.

Needs Debian's chromium and chromium-driver (installed with apt-get when missing, as root) and
selenium (requirements-dev.txt); skips with the reason otherwise. About 3 minutes on 2 cores.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("selenium", reason="selenium is missing: pip install -r requirements-dev.txt")
pytest.importorskip("jupyterlab")

from browser.lab import ROOT, CourseCopy, Lab, Processes, Unavailable, browser_paths, start_browser  # noqa: E402
from browser.page import Learner  # noqa: E402

pytestmark = [
    pytest.mark.browser,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not (ROOT / ".venv/bin/jupyter").exists(), reason="no .venv (make setup)"),
]

SCREENSHOTS = ROOT / "out" / "browser"
ORIENTATION = "chapters/00_orientation.ipynb"
# Every chapter but 00 (which test_chapter_00_run_all runs whole): read from the folder, so a
# new chapter's notebook is covered by test_chapter_first_cells as soon as it exists.
CHAPTERS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "chapters").glob("*.ipynb")
                  if p.relative_to(ROOT).as_posix() != ORIENTATION)
FIRST_CELLS = 3          # code cells of each chapter run there: the parameters, the imports, one more
ONE_GPU = "chapters/01_one_gpu.ipynb"
EXERCISE = "exercises/00_orientation_exercises.ipynb"

# The exercise typed into the page: pipeline_stage_layers of exercises/00, right and wrong.
RIGHT = '''def pipeline_stage_layers(num_layers, pp_degree):
    """Layers held by each stage; the first stages take the remainder."""
    if not 1 <= pp_degree <= num_layers:
        raise ValueError(f"pp_degree must be in [1, {num_layers}], got {pp_degree}")
    base, extra = divmod(num_layers, pp_degree)
    return [base + 1] * extra + [base] * (pp_degree - extra)'''
WRONG = '''def pipeline_stage_layers(num_layers, pp_degree):
    return [num_layers // pp_degree] * pp_degree   # drops the remainder'''
WRONG_FIRST_FAILURE = "pipeline_stage_layers(3, 2)"   # the first case of the test's sweep it gets wrong


class Session:
    """One server, one browser, the processes they start, for the whole module."""

    def __init__(self, tmp: Path):
        browser, driver = browser_paths()   # Unavailable: the fixture skips
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        for old in SCREENSHOTS.glob("*.png"):
            old.unlink()
        self.processes = Processes()
        self.driver, self.stopped, self.left = None, False, {}
        self.used = set()   # what the tests started: "kernels", "ranks" (checked by the last test)
        self.course = CourseCopy(tmp / "course")
        self.lab = Lab(self.course, tmp / "lab.log")
        self.processes.add_root(self.lab.process.pid, session=True)
        try:
            self.lab.wait_ready()
            self.driver = start_browser(browser, driver, tmp / "chromium-profile", tmp / "chromedriver.log")
            self.processes.add_root(self.driver.service.process.pid)
        except BaseException:
            self.stop()
            raise
        self.learner = Learner(self.driver, self.lab, SCREENSHOTS)

    def notebook(self, path: str) -> dict:
        return self.course.notebook(path)

    def stop(self) -> dict[int, str]:
        """Quit the browser, stop the server by its PID; return what outlived them (then killed)."""
        if not self.stopped:
            self.stopped = True
            if self.driver is not None:
                self.driver.quit()
            self.lab.stop()   # SIGTERM: the server shuts its kernels down, they stop their ranks
            self.processes.stop_watching()
            self.left = self.processes.wait_gone(30)
            self.processes.kill(list(self.left))
        return self.left


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    try:
        started = Session(tmp_path_factory.mktemp("browser"))
    except Unavailable as why:
        pytest.skip(f"no browser for the browser tests: {why}")
    try:
        yield started
    finally:
        left = started.stop()
        assert not left, f"processes left behind (now killed): {left}"


@pytest.fixture
def learner(session):
    session.used.add("kernels")
    yield session.learner
    # One kernel at a time (each holds torch, and some their ranks): this test's kernels stop
    # while the next test opens its notebook.
    session.lab.shut_down_kernels(wait=False)


def _source(cell: dict) -> str:
    return "".join(cell["source"])


def _code_cells(notebook: dict) -> list[int]:
    return [i for i, cell in enumerate(notebook["cells"]) if cell["cell_type"] == "code"]


def _find(notebook: dict, text: str) -> int:
    found = [i for i in _code_cells(notebook) if text in _source(notebook["cells"][i])]
    assert len(found) == 1, f"{len(found)} code cells contain {text!r}"
    return found[0]


def _figure_cells(notebook: dict) -> list[int]:
    """The code cells whose saved outputs hold a figure (what Run All must draw again)."""
    return [i for i in _code_cells(notebook)
            if any("image/png" in output.get("data", {}) for output in notebook["cells"][i].get("outputs", []))]


def _assert_ran_to_the_end(learner, notebook: dict, what: str) -> None:
    prompts = learner.prompts()
    not_run = [i for i in _code_cells(notebook) if not re.fullmatch(r"\[\d+\]:", prompts[i])]
    assert not not_run, f"{what}: cells {not_run} did not run (prompts {[prompts[i] for i in not_run]})"
    assert not (errors := learner.errors()), f"{what}: cells show errors: {errors}"
    assert learner.log_entries() == 0, f"{what}: the log console got entries:\n{learner.log_console()[-3000:]}"


# ---- where there is no browser -----------------------------------------------------------------

def _no_debian_browser(monkeypatch, tmp_path, apt: bool, root: bool):
    import browser.lab as lab

    monkeypatch.setattr(lab, "_debian_paths", lambda: (tmp_path / "chromium", tmp_path / "chromedriver"))
    monkeypatch.setattr(lab.shutil, "which", lambda name: "/usr/bin/apt-get" if apt else None)
    monkeypatch.setattr(lab.os, "geteuid", lambda: 0 if root else 1000)
    monkeypatch.setattr(lab.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))


def test_without_apt_the_reason_says_so(monkeypatch, tmp_path):
    _no_debian_browser(monkeypatch, tmp_path, apt=False, root=True)
    with pytest.raises(Unavailable, match="no apt-get here"):
        browser_paths()


def test_without_root_the_reason_says_so(monkeypatch, tmp_path):
    _no_debian_browser(monkeypatch, tmp_path, apt=True, root=False)
    with pytest.raises(Unavailable, match="not root: run `sudo apt-get install chromium chromium-driver`"):
        browser_paths()


# ---- the landing page and chapter 00 -------------------------------------------------------

def test_landing_page_is_chapter_00(session, learner):
    session.driver.get(session.lab.url("/"))   # the bare server address, as printed without a path
    notebook = session.notebook(ORIENTATION)
    learner.wait(lambda: len(learner.cells()) == len(notebook["cells"]), 90, "chapter 00 to open")
    # (JupyterLab then rewrites the address to the file browser's folder, /lab/tree/work/chapters:
    # the landing page is the learner's own copy, which launch/lab.sh made in the course's copy)
    assert "/lab/tree/work/chapters" in session.driver.current_url, session.driver.current_url
    tab = learner.js("return document.querySelector('#jp-main-dock-panel .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel').innerText")
    assert tab == "00_orientation.ipynb"
    title = learner.js("return document.querySelector('.jp-RenderedMarkdown h1').innerText")
    assert "Orientation" in title, title
    learner.wait_idle(90, "chapter 00's kernel to start")
    learner.screenshot("01_landing_page")


def test_chapter_00_run_all(session, learner):
    notebook = session.notebook(ORIENTATION)
    learner.open(ORIENTATION, len(notebook["cells"]))
    learner.clear_outputs()   # so every output checked below is drawn by this run
    live = _find(notebook, "LivePlot(")
    learner.watch_images(live)
    session.used.add("ranks")   # the chapter starts a Cluster
    seconds = learner.run_all(240, while_running=lambda: learner.screenshot("02_chapter_00_running"))
    print(f"chapter 00: Run All took {seconds:.0f} s in the browser")
    _assert_ran_to_the_end(learner, notebook, "chapter 00")

    figures = _figure_cells(notebook)
    assert live in figures and len(figures) >= 2
    for index in figures:
        images = [size for output in learner.outputs(index) for size in output["images"]]
        assert images and all(w > 100 and h > 100 for w, h in images), f"cell {index}: figure not drawn: {images}"

    # The live plot: several frames, each replacing the last in the same output while the cell
    # ran (not one image per update, not only the final frame).
    frames = learner.frames()
    assert len(frames) >= 2, f"the live plot showed {len(frames)} image(s) during the run: {frames}"
    assert all(frame["running"] for frame in frames[:-1]), frames
    assert all(frame["images"] == 1 for frame in frames), f"the plot was appended, not redrawn: {frames}"
    assert len([s for o in learner.outputs(live) for s in o["images"]]) == 1
    learner.screenshot("03_chapter_00_live_plot", live)
    learner.screenshot("04_chapter_00_last_figure", figures[-1])


# ---- chapter 01's memory widget ----------------------------------------------------------------

def test_chapter_01_memory_widget(session, learner):
    notebook = session.notebook(ONE_GPU)
    learner.open(ONE_GPU, len(notebook["cells"]))
    widget = _find(notebook, "memory_widget()")
    learner.run_cell(_find(notebook, "import memory_figure, memory_widget"), 120)
    learner.run_cell(widget, 120)
    assert not learner.errors()
    learner.screenshot("05_chapter_01_memory_widget", widget)

    # DP first: at DP = 1 every ZeRO stage holds the same memory (nothing to shard over).
    readout = []
    learner.expect_redraw(widget, lambda: readout.append(learner.slide(widget, "DP", 3)), "DP 1 -> 8")
    assert readout == ["8"]
    learner.expect_redraw(widget, lambda: learner.choose(widget, "ZeRO stage", "3"), "ZeRO stage 0 -> 3")
    learner.screenshot("06_chapter_01_dp8_zero3", widget)

    # 4096 is not divisible by 7 heads: the widget says so, in red, and keeps the last plot
    last_plot = learner.settled_image(widget)   # what the widget shows once DP 8 / ZeRO-3 has drawn
    learner.enter_number(widget, "heads", 7)
    shown = learner.wait(lambda: [m for m in learner.widget_messages(widget) if m[0]], 30, "the widget's error text")
    text, colour = shown[0]
    assert "Cannot draw" in text and "heads=7" in text, text
    red, green, blue = map(int, re.findall(r"\d+", colour)[:3])
    assert red > green + 60 and red > blue + 60, f"error text not shown in red: {colour}"
    learner.screenshot("07_chapter_01_invalid_heads", widget)
    assert learner.widget_image(widget) == last_plot
    learner.enter_number(widget, "heads", 32)   # back to Llama 3 8B's: the text goes, the same plot stays
    learner.wait(lambda: not [m for m in learner.widget_messages(widget) if m[0]], 30, "the error text to go")
    assert learner.widget_image(widget) == last_plot
    assert learner.log_entries() == 0


# ---- an exercise notebook ----------------------------------------------------------------------

def test_exercise_notebook_as_a_learner(session, learner):
    notebook = session.notebook(EXERCISE)
    learner.open(EXERCISE, len(notebook["cells"]))
    learner.clear_outputs()
    learner.run_all(240)
    _assert_ran_to_the_end(learner, notebook, "the untouched exercise notebook")
    checks = [i for i in _code_cells(notebook) if _source(notebook["cells"][i]).startswith("check(")]
    assert len(checks) >= 2
    for index in checks:
        shown = " ".join(output["text"] for output in learner.outputs(index))
        assert "Not implemented yet" in shown, f"check cell {index} shows {shown!r}"
    learner.screenshot("08_exercise_not_implemented_yet", checks[-1])

    stub = _find(notebook, "def pipeline_stage_layers(")
    check = _find(notebook, 'check("00.pipeline_stage_layers"')
    for code, verdict, name in ((RIGHT, "Passed", "09_exercise_pass"), (WRONG, "Failed", "10_exercise_fail")):
        typed = learner.type_into(stub, code)
        assert typed == code, f"the editor holds:\n{typed}"
        learner.run_cell(stub, 60)
        learner.run_cell(check, 120)
        shown = " ".join(output["text"] for output in learner.outputs(check))
        assert verdict in shown and "00.pipeline_stage_layers" in shown, shown
        if verdict == "Failed":
            assert WRONG_FIRST_FAILURE in shown, f"the failing input is not shown: {shown}"
        learner.screenshot(name, stub)


# ---- a broken widget is caught -----------------------------------------------------------------

def test_a_broken_widget_callback_fails_the_check(session, learner):
    """The memory widget with its drawing broken after it is shown: the check that chapter 01's
    widget passes (expect_redraw) must fail, and say why."""
    import nbformat

    cells = [
        "from ultrascale.viz import memory_widget as mw\nwidget = mw.memory_widget()\nwidget",
        "def broken(fig):\n    raise RuntimeError('a deliberately broken callback')\n\n\nmw._png = broken",
    ]
    scratch = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    scratch.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(scratch, session.course.root / "broken_widget.ipynb")
    learner.open("broken_widget.ipynb", len(cells))
    learner.run_all(120)
    assert not learner.errors(), "the widget was broken too early: its first drawing failed"
    with pytest.raises(AssertionError, match="deliberately broken callback") as caught:
        learner.expect_redraw(0, lambda: learner.choose(0, "recompute", "full"), "recompute full")
    assert "callback raised" in str(caught.value)
    learner.screenshot("11_broken_widget_log_console")


# ---- every chapter's first cells ---------------------------------------------------------------

@pytest.mark.parametrize("chapter", CHAPTERS, ids=[Path(c).stem for c in CHAPTERS])
def test_chapter_first_cells(session, learner, chapter):
    notebook = session.notebook(chapter)
    code = _code_cells(notebook)
    first = code[:FIRST_CELLS]
    learner.open(chapter, len(notebook["cells"]))
    learner.clear_outputs()
    if len(code) > len(first):   # Run ▸ Run All Above Selected Cell, from the next code cell
        learner.run_all(120 + 30 * len(first), command="notebook:run-all-above", selected=code[len(first)])
    else:
        learner.run_all(300)
    prompts = learner.prompts()
    assert [prompts[i] for i in first] == [f"[{n}]:" for n in range(1, len(first) + 1)], prompts
    assert not (errors := learner.errors()), f"{chapter}: {errors}"
    assert learner.log_entries() == 0
    learner.screenshot(f"chapter_{Path(chapter).stem}", first[-1])


# ---- nothing left behind -----------------------------------------------------------------------

def test_every_process_stopped(session):
    """Last: quit the browser and stop the server by PID; every kernel, rank and chromium process
    noted during the tests must be gone (the ones still there are killed by PID, and named)."""
    noted = dict(session.processes.seen)
    commands = " ".join(command for _, command in noted.values())
    kinds = {"jupyter-lab", "chromium", "chromedriver"}
    kinds |= {"ipykernel_launcher"} if "kernels" in session.used else set()
    kinds |= {"multiprocessing.forkserver"} if "ranks" in session.used else set()   # the ranks' parent
    for kind in sorted(kinds):
        assert kind in commands, f"no {kind} process was noted: the watch missed it ({len(noted)} noted)"
    left = session.stop()
    assert not left, f"still running after the browser and the server stopped (now killed): {left}"
