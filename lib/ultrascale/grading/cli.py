"""Command-line grader: run exercise notebooks with papermill and print a score table.

    python -m ultrascale.grading.cli exercises/ [--json scores.json] [--timeout 300]
    ultrascale-grade solutions/00_orientation_exercises.ipynb

Each notebook runs in a fresh kernel (``python3``) with ``QUICK=True`` injected into
its ``parameters`` cell. Cells keep running after an error, because an unfinished
exercise raises ``NotImplementedError`` and the checks after it must still run.
Every ``check`` call appends its verdict to the file named by
``ULTRASCALE_GRADE_FILE``; the grader reads those lines back. An exercise whose
check never ran (deleted, or the kernel died first) scores 0 as "not run".

The exit code is 0 whatever the scores (this is a grader, not a test); it is
non-zero only when a notebook could not be run at all (missing file, kernel that
would not start or died).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat

from .check import GRADE_FILE_ENV, NOT_RUN
from .registry import exercises_of_chapter, get_exercise

# check("00.mean_across_ranks", ...) as written in a notebook cell
CHECK_CALL_RE = re.compile(r"""\bcheck\(\s*(['"])(?P<id>[\w.\-]+)\1""")


@dataclass
class NotebookReport:
    notebook: str
    status: str = "ok"  # "ok", or "infrastructure error" when it could not be run
    error: str = ""
    cell_errors: int = 0  # cells that raised (expected in an unfinished notebook)
    seconds: float = 0.0
    exercises: list = field(default_factory=list)

    @property
    def points(self) -> float:
        return sum(e["points"] for e in self.exercises)

    @property
    def max_points(self) -> float:
        return sum(e["max_points"] for e in self.exercises)

    def to_json(self) -> dict:
        return {**asdict(self), "points": self.points, "max_points": self.max_points}


def find_notebooks(paths) -> list:
    """Notebooks named on the command line; a directory means its *.ipynb files."""
    found = []
    for p in map(Path, paths):
        if p.is_dir():
            found += sorted(q for q in p.glob("*.ipynb") if not q.name.endswith(".updated.ipynb"))
        else:
            found.append(p)
    return found


def expected_exercises(nb_path: Path) -> dict:
    """{exercise id: max points} this notebook should score.

    The ids the notebook checks, plus every registered exercise of its chapter
    (the ``00`` of ``00_orientation_exercises.ipynb``), so that deleting a check
    call scores "not run" rather than vanishing from the table.
    """
    ids = []
    try:
        nb = nbformat.read(nb_path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                ids += [m.group("id") for m in CHECK_CALL_RE.finditer(cell.source)]
    except Exception:
        pass  # unreadable: the run reports it
    chapter = nb_path.name.split("_", 1)[0]
    ids += [ex.id for ex in exercises_of_chapter(chapter)]
    expected = {}
    for exercise_id in ids:
        if exercise_id in expected:
            continue
        try:
            expected[exercise_id] = get_exercise(exercise_id).points
        except KeyError:
            expected[exercise_id] = 0  # check() will report the unknown id itself
    return expected


def _read_grades(path: Path) -> dict:
    """The last verdict of each exercise (a re-run check replaces the earlier one)."""
    grades = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
                grades[record["exercise"]] = record
            except (ValueError, KeyError):
                continue  # a torn line from a killed kernel: ignore it
    return grades


def grade_notebook(nb_path: Path, timeout: float, parameters: dict, keep_dir: Path | None = None) -> NotebookReport:
    """Execute one notebook and collect its verdicts."""
    import papermill
    from papermill.exceptions import PapermillExecutionError

    report = NotebookReport(str(nb_path))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ultrascale-grade-") as tmp:
        grade_file = Path(tmp) / "grades.jsonl"
        output = (keep_dir or Path(tmp)) / nb_path.name
        # The kernel inherits our environment; that is how check() finds the file.
        old = os.environ.get(GRADE_FILE_ENV)
        os.environ[GRADE_FILE_ENV] = str(grade_file)
        try:
            if not nb_path.is_file():
                raise FileNotFoundError(f"no such notebook: {nb_path}")
            executed = papermill.execute_notebook(
                str(nb_path), str(output),
                parameters=parameters,
                kernel_name="python3",
                cwd=str(nb_path.parent),
                progress_bar=False,
                execution_timeout=timeout,
                # nbclient options: keep going after a cell raises, and interrupt a
                # cell that passes the timeout instead of abandoning the notebook.
                allow_errors=True,
                interrupt_on_timeout=True,
            )
            report.cell_errors = _count_error_cells(executed)
        except PapermillExecutionError:
            # With allow_errors every cell ran; papermill still raises at the end to
            # say some of them failed. That is normal for an unfinished notebook.
            report.cell_errors = _count_error_cells(nbformat.read(output, as_version=4))
        except Exception as err:
            report.status = "infrastructure error"
            report.error = f"{type(err).__name__}: {err}"
        finally:
            if old is None:
                os.environ.pop(GRADE_FILE_ENV, None)
            else:
                os.environ[GRADE_FILE_ENV] = old
        grades = _read_grades(grade_file)
    report.seconds = time.perf_counter() - start

    for exercise_id, max_points in expected_exercises(nb_path).items():
        record = grades.pop(exercise_id, None) or {
            "exercise": exercise_id, "status": NOT_RUN, "points": 0, "max_points": max_points,
            "message": "its check() never ran",
        }
        report.exercises.append(record)
    report.exercises += grades.values()  # checks of other chapters, if a notebook has any
    return report


def _count_error_cells(nb) -> int:
    return sum(
        any(o.get("output_type") == "error" for o in cell.get("outputs", []))
        for cell in nb.cells if cell.cell_type == "code"
    )


def format_table(reports: list) -> str:
    rows = [("notebook", "exercise", "status", "points")]
    for r in reports:
        name = _short_path(r.notebook)
        if r.status != "ok":
            rows.append((name, "-", r.status, ""))
        for e in r.exercises:
            rows.append((name, e["exercise"], e["status"], f"{e['points']:g}/{e['max_points']:g}"))
        rows.append((name, "total", f"{r.cell_errors} cell(s) raised, {r.seconds:.0f} s", f"{r.points:g}/{r.max_points:g}"))
    total = sum(r.points for r in reports)
    total_max = sum(r.max_points for r in reports)
    rows.append(("ALL", "", "", f"{total:g}/{total_max:g}"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _short_path(path: str) -> str:
    """Relative to the current directory when possible: solutions/ and exercises/ share names."""
    try:
        return os.path.relpath(path)
    except ValueError:
        return path


def _parse_param(text: str):
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value  # a bare string


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ultrascale-grade", description="Run exercise notebooks and print their scores.")
    parser.add_argument("paths", nargs="+", metavar="NOTEBOOK_OR_DIR")
    parser.add_argument("--json", type=Path, help="also write the scores to this JSON file")
    parser.add_argument("--timeout", type=float, default=300, help="seconds allowed per cell (default 300)")
    parser.add_argument("-p", "--param", action="append", type=_parse_param, default=[],
                        help="extra notebook parameter NAME=VALUE (QUICK=True is always set unless overridden)")
    parser.add_argument("--keep", type=Path, help="save the executed notebooks in this directory")
    args = parser.parse_args(argv)

    notebooks = find_notebooks(args.paths)
    if not notebooks:
        print("ultrascale-grade: no notebooks found in " + ", ".join(args.paths), file=sys.stderr)
        return 2
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    parameters = {"QUICK": True, **dict(args.param)}

    reports = []
    for nb_path in notebooks:
        print(f"grading {nb_path} ...", flush=True)
        reports.append(grade_notebook(nb_path, args.timeout, parameters, args.keep))
        if reports[-1].status != "ok":
            print(f"  could not run it: {reports[-1].error}", file=sys.stderr)

    print()
    print(format_table(reports))
    if args.json:
        summary = {
            "notebooks": [r.to_json() for r in reports],
            "points": sum(r.points for r in reports),
            "max_points": sum(r.max_points for r in reports),
        }
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    broken = [r for r in reports if r.status != "ok"]
    return 2 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
