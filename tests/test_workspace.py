"""The learner's own copies in work/ (ultrascale.workspace) and their progress (grading.progress), issue 41.

* copies: made on the first run, links to results/ lib/ benchmarks/ so the notebooks' relative
  paths hold; a copy run and saved (outputs) is not an edit and is refreshed when the course
  changes it; an edited copy is kept, and the run says where the course's new version is;
* a learner's session leaves `git status` clean and a `git pull` of a commit changing the chapters
  succeeds (two temporary clones: the origin, and the learner's);
* the grading command each exercise notebook prints is `make grade NB=work/exercises/<that notebook>`:
  the learner's copy, which exists once the copies are made, and which make hands to the grader;
* progress: the command-line grader records a graded notebook of work/exercises (a solution,
  copied there: full points in `make progress`'s table); a line written by hand, changed after,
  signed with another key, or written by the notebook's own cells counts for nothing.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from ultrascale import workspace
from ultrascale_grading import progress
from ultrascale.workspace import content_hash

ROOT = Path(__file__).resolve().parent.parent
RUN = "a2_typical_scales.ipynb"  # run and saved, never edited: no cluster, quick
EDIT = "01_one_gpu.ipynb"  # edited by the learner


def _git(cwd: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def clones(tmp_path_factory):
    """(origin, learner): the course at HEAD, and the learner's clone of it."""
    where = tmp_path_factory.mktemp("clones")
    origin, learner = where / "origin", where / "learner"
    for source, target in ((ROOT, origin), (origin, learner)):
        done = _git(where, "clone", "-q", str(source), str(target))
        assert done.returncode == 0, done.stderr
    for repo in (origin, learner):
        _git(repo, "config", "user.email", "test@example.com")
        _git(repo, "config", "user.name", "test")
    if "/work/" not in (learner / ".gitignore").read_text():
        pytest.skip("HEAD's .gitignore does not ignore work/ yet")
    return origin, learner


def _add_markdown(path: Path, text: str) -> None:
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_markdown_cell(text))
    nbformat.write(nb, path)


def test_copies_made_with_working_relative_paths(clones):
    _, learner = clones
    outcome = workspace.refresh(learner, log=lambda line: None)
    work = learner / "work"
    for folder in ("chapters", "exercises"):
        for source in (learner / folder).glob("*.ipynb"):
            assert (work / folder / source.name).read_bytes() == source.read_bytes()
            assert outcome[f"{folder}/{source.name}"] in (workspace.MADE, workspace.UNCHANGED)
    # what the notebooks reach from work/chapters: ../results, ../exercises (the learner's copies), lib
    chapters = work / "chapters"
    assert (chapters / ".." / "results" / "README.md").is_file()
    assert (chapters / ".." / "exercises" / "00_orientation_exercises.ipynb").resolve().parent == (work / "exercises")
    assert (chapters / ".." / "lib" / "ultrascale" / "__init__.py").is_file()
    assert (work / "exercises" / ".." / "chapters" / "00_orientation.ipynb").is_file()
    again = workspace.refresh(learner, log=lambda line: None)
    assert set(again.values()) == {workspace.UNCHANGED}


CODE_SPAN_RE = re.compile(r"`([^`\n]*)`")  # the code spans of a markdown cell, in order


def test_each_exercise_prints_the_command_that_grades_its_copy(clones):
    """Issue 54: the command a notebook prints works as printed from the course's folder, and it
    grades the learner's copy in work/, not the course's untouched exercises/ (the old
    `ultrascale-grade exercises/...` was not on the PATH, and graded the wrong file)."""
    _, learner = clones
    workspace.refresh(learner, log=lambda line: None)
    notebooks = sorted((ROOT / "exercises").glob("*_exercises.ipynb"))
    assert len(notebooks) == len(list((ROOT / "solutions").glob("*_exercises.ipynb")))
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        printed = [
            span
            for cell in nb.cells
            if cell.cell_type == "markdown"
            for span in CODE_SPAN_RE.findall(cell.source)
            if re.search(r"\bgrade\b", span)
        ]
        assert printed == [f"make grade NB=work/exercises/{path.name}"], (path.name, printed)
        assert "ultrascale-grade" not in path.read_text(), path.name
        target = printed[0].split("NB=", 1)[1]
        assert (learner / target).is_file(), target
        # make's dry run (-n) shows the recipe without running it: the grader, on that very copy
        recipe = subprocess.run(
            ["make", "-n", *printed[0].split()[1:]], cwd=learner, capture_output=True, text=True, timeout=60
        )
        assert recipe.returncode == 0, recipe.stderr
        assert f"-m ultrascale_grading.cli {target} " in recipe.stdout, recipe.stdout


@pytest.mark.timeout(600)
def test_run_save_and_pull(clones):
    origin, learner = clones
    workspace.refresh(learner, log=lambda line: None)
    chapters = learner / "work" / "chapters"

    # Run All and save, as the lab does, in the learner's copy (cwd: its folder)
    from nbclient import NotebookClient

    run = chapters / RUN
    nb = nbformat.read(run, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(chapters)}}).execute()
    nbformat.write(nb, run)
    ran = run.read_bytes()
    # an edit: a cell of the learner's own
    _add_markdown(chapters / EDIT, "My notes on chapter 01.")
    edited = (chapters / EDIT).read_bytes()

    status = _git(learner, "status", "--porcelain")
    assert status.returncode == 0 and status.stdout == "", status.stdout

    # the course changes both chapters upstream; the learner pulls
    for name in (RUN, EDIT):
        _add_markdown(origin / "chapters" / name, f"A new paragraph in {name}.")
    done = _git(origin, "commit", "-q", "-am", "the course changes two chapters")
    assert done.returncode == 0, done.stderr
    pulled = _git(learner, "pull", "-q", "--no-rebase")
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    assert "A new paragraph" in (learner / "chapters" / RUN).read_text()

    said = []
    outcome = workspace.refresh(learner, log=said.append)
    assert outcome[f"chapters/{RUN}"] == workspace.REFRESHED
    assert run.read_bytes() == (learner / "chapters" / RUN).read_bytes() != ran  # run only: refreshed
    assert outcome[f"chapters/{EDIT}"] == workspace.KEPT_NEWER
    assert (chapters / EDIT).read_bytes() == edited  # edited: kept
    assert len(said) == 1 and f"work/chapters/{EDIT}" in said[0] and f"is chapters/{EDIT}" in said[0], said
    assert _git(learner, "status", "--porcelain").stdout == ""
    # said once per change of the course, not on every start
    assert workspace.refresh(learner, log=said.append)[f"chapters/{EDIT}"] == workspace.KEPT_NEWER


# ---- progress ---------------------------------------------------------------------------------

FORGED = {
    "notebook": "work/exercises/01_one_gpu_exercises.ipynb",
    "chapter": "01",
    "sha256": "0" * 64,
    "time": "2026-01-01T00:00:00+0000",
    "status": "ok",
    "signature": "f" * 64,
    "exercises": [{"exercise": "01.count_parameters", "status": "pass", "points": 1, "max_points": 1}],
}

# appended to the graded notebook: its kernel writes a pass for chapter 01 into the records
FORGING_CELL = f"""
import json, pathlib
records = pathlib.Path.cwd().parent / ".progress" / "grades.jsonl"
records.parent.mkdir(parents=True, exist_ok=True)
with open(records, "a") as f:
    f.write(json.dumps({FORGED!r}) + "\\n")
"""


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """solutions/00, copied into a course's work/exercises/ with a forging cell, graded by the CLI."""
    course = tmp_path_factory.mktemp("course")
    exercises = course / "work" / "exercises"
    exercises.mkdir(parents=True)
    nb = nbformat.read(ROOT / "solutions" / "00_orientation_exercises.ipynb", as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(FORGING_CELL))
    notebook = exercises / "00_orientation_exercises.ipynb"
    nbformat.write(nb, notebook)
    done = subprocess.run(
        [sys.executable, "-m", "ultrascale_grading.cli", str(notebook), "--trusted"],
        cwd=course,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return course, notebook, done.stdout


def _table(records: Path) -> str:
    return subprocess.run(
        [sys.executable, "-m", "ultrascale_grading.progress", "--records", str(records)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout


@pytest.mark.timeout(900)
def test_the_grader_records_full_points(graded):
    course, notebook, out = graded
    records = course / "work" / ".progress" / "grades.jsonl"
    assert "recorded in" in out
    result = progress.progress(records)
    row = next(r for r in result["chapters"] if r["chapter"] == "00")
    assert (row["passed"], row["points"]) == (row["total"], row["max_points"]) == (3, 3)
    assert not row["edited_since"]
    entry = progress.read_records(records)[0][0]
    assert entry["notebook"] == "work/exercises/00_orientation_exercises.ipynb"
    assert entry["sha256"] == content_hash(notebook)
    line = next(line for line in _table(records).splitlines() if line.startswith("00 "))
    assert line.split()[1:3] == ["3/3", "3/3"], line
    # run in the course, as `make progress` is, it reads that course's records by itself
    here = subprocess.run(
        [sys.executable, "-m", "ultrascale_grading.progress"],
        cwd=course,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert next(line for line in here.splitlines() if line.startswith("00 ")).split()[1:3] == ["3/3", "3/3"]


@pytest.mark.timeout(900)
def test_what_the_notebook_wrote_counts_for_nothing(graded):
    course, _, _ = graded
    records = course / "work" / ".progress" / "grades.jsonl"
    lines = records.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["chapter"] == "01"  # the notebook's line, then the grader's
    result = progress.progress(records)
    assert result["ignored"] == 1 and result["graded"] == 1
    assert next(r for r in result["chapters"] if r["chapter"] == "01")["passed"] == 0
    assert "1 line(s) of the records were ignored" in _table(records)


def _forge(tmp_path: Path, graded, change) -> dict:
    """The grader's records and key, copied; ``change(lines)`` alters the lines."""
    course, _, _ = graded
    progress_dir = tmp_path / "work" / ".progress"
    progress_dir.mkdir(parents=True)
    source = course / "work" / ".progress"
    (progress_dir / "key").write_text((source / "key").read_text())
    lines = [json.loads(line) for line in (source / "grades.jsonl").read_text().splitlines()][1:]
    change(lines)
    (progress_dir / "grades.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return progress.progress(progress_dir / "grades.jsonl")


@pytest.mark.timeout(900)
def test_lines_changed_or_written_by_hand_count_for_nothing(graded, tmp_path):
    def points(result):
        return sum(r["points"] for r in result["chapters"])

    assert points(_forge(tmp_path / "as is", graded, lambda lines: None)) == 3

    def raise_another(lines):  # a chapter 01 pass, copied from a real line, re-labelled
        forged = json.loads(json.dumps(lines[0]))
        forged["chapter"] = "01"
        forged["exercises"] = FORGED["exercises"]
        lines.append(forged)

    result = _forge(tmp_path / "relabelled", graded, raise_another)
    assert (points(result), result["ignored"]) == (3, 1)

    def wrong_hash(lines):  # the notebook's hash changed by hand: the signature no longer holds
        lines[0]["sha256"] = "0" * 64

    result = _forge(tmp_path / "hash", graded, wrong_hash)
    assert (points(result), result["ignored"]) == (0, 1)

    def another_key(lines):  # signed, but with another learner's key
        lines[0]["signature"] = progress._signature(lines[0], b"another learner's key")

    result = _forge(tmp_path / "key", graded, another_key)
    assert (points(result), result["ignored"]) == (0, 1)


@pytest.mark.timeout(900)
def test_edited_since_graded_is_marked(graded, tmp_path):
    course, notebook, _ = graded
    copy = tmp_path / "course"
    (copy / "work").mkdir(parents=True)
    for name in (".progress", "exercises"):
        subprocess.run(["cp", "-r", str(course / "work" / name), str(copy / "work" / name)], check=True)
    _add_markdown(copy / "work" / "exercises" / notebook.name, "changed after grading")
    result = progress.progress(copy / "work" / ".progress" / "grades.jsonl")
    row = next(r for r in result["chapters"] if r["chapter"] == "00")
    assert row["edited_since"] and row["points"] == 3
    assert "(edited since graded)" in progress.format_progress(result)


def test_no_records_says_how_to_get_some(tmp_path):
    result = progress.progress(tmp_path / "work" / ".progress" / "grades.jsonl")
    assert result["graded"] == 0
    assert progress.format_progress(result) == progress.NONE_YET


def test_only_work_exercises_are_recorded_by_default(tmp_path):
    assert (
        progress.records_for(tmp_path / "work" / "exercises" / "x.ipynb")
        == tmp_path / "work" / ".progress" / "grades.jsonl"
    )
    for other in ("exercises", "solutions", "submissions"):
        assert progress.records_for(tmp_path / other / "x.ipynb") is None
