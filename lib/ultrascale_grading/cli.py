"""Command-line grader: run exercise notebooks with papermill and print a score table.

    python -m ultrascale_grading.cli exercises/ [--json scores.json] [--timeout 300] [--jobs 2]
    ultrascale-grade solutions/00_orientation_exercises.ipynb

Each notebook runs in a fresh kernel (``python3``) with ``QUICK=True`` injected into
its ``parameters`` cell. Cells keep running after an error, because an unfinished
exercise raises ``NotImplementedError`` and the checks after it must still run.
Every ``check`` call appends its verdict to the file named by
``ULTRASCALE_GRADE_FILE`` and saves what it was given beside it.

The notebook's word is not taken for a pass: its cells can write anything into that
file, or swap the tests in the kernel's registry. So the score is the grader's own.
For each exercise the notebook submitted (or says it passed), a fresh process of the
grader's (one per notebook; on Linux a fork of a process that has made the imports once,
zygote.py) looks the test up in the grader's registry, loads the saved objects and runs the
test on them; only a pass there scores, and it scores the
exercise's registered points. Because only that run counts, ``check`` in the graded
kernel does not run the test itself: it saves what it was given and records
"submitted" (``ULTRASCALE_GRADE_DEFER``), so each test runs once, not twice. With
``--feedback`` it runs there too, as in a learner's session, and the kept notebooks
show every verdict; a verdict other than a pass then scores 0 without a second run (a
notebook gains nothing by saying it failed). Ids that no test is registered under are
ignored. An exercise whose check never ran (deleted, or the kernel died first) scores
0 as "not run".

The learner's code does run in that process (it has to, to be tested), so a function
written to attack the test that calls it is beyond what this grader can stop; what a
notebook's cells write, or change in their own kernel, no longer counts.

``--jobs N`` grades N notebooks at a time, each in its own worker process (the kernel
finds its grade file through the environment, so two notebooks must not share one
process). A notebook spends much of its time starting a kernel and a cluster and
waiting on its ranks, so on 2 cores two at a time take about 60% as long (the course's
17 solution notebooks: 279 s one at a time, 170 s two at a time); the table keeps the
notebooks' order whatever order they finish in.

Each notebook graded from a course's ``work/exercises/`` (the learner's own copies, made by
``ultrascale.workspace``) is recorded, from this process and after its score is known, as one
signed line in ``work/.progress/grades.jsonl``: what ``make progress`` reads (progress.py says what
the signature guards against). ``--record FILE`` records every graded notebook there instead,
``--no-record`` none. A notebook's kernel records nothing.

The exit code is 0 whatever the scores (this is a grader, not a test); it is
non-zero only when a notebook could not be run at all (missing file, kernel that
would not start or died).
"""

from __future__ import annotations

import argparse
import ast
import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat

from .check import (
    DEFER_ENV,
    ERROR,
    FAIL,
    GRADE_FILE_ENV,
    NOT_IMPLEMENTED,
    NOT_RUN,
    PASS,
    SUBMITTED,
    CheckResult,
    one_line,
    grade_exercise,
    submission_path,
)
from . import progress
from ultrascale.workspace import content_hash
from .registry import chapter_of, declared_points, get_exercise
from . import zygote
from .sandbox import GiB, Limits, Outcome, Sandbox

# The course's own notebook folders: graded without a sandbox unless --sandbox is given.
COURSE = Path(__file__).resolve().parents[2]
COURSE_FOLDERS = (COURSE / "exercises", COURSE / "solutions", COURSE / "work" / "exercises")

# check("00.mean_across_ranks", ...) as written in a notebook cell
CHECK_CALL_RE = re.compile(r"""\bcheck\(\s*(['"])(?P<id>[\w.\-]+)\1""")


@dataclass
class NotebookReport:
    notebook: str
    status: str = "ok"  # "ok"; "stopped" at the sandbox's time limit; "infrastructure error" when it could not run
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


def is_course_notebook(nb_path: Path) -> bool:
    """A notebook of the course's own exercises/, solutions/ or work/exercises/ (the learner's own
    work, or ours)."""
    return nb_path.resolve().parent in COURSE_FOLDERS


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
    call scores "not run" rather than vanishing from the table. Ids without a
    registered test are left out: they are worth nothing.
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
    ids += sorted(e for e in declared_points() if chapter_of(e) == chapter)
    expected = {}
    for exercise_id in ids:
        if exercise_id in expected:
            continue
        points = registered_points(exercise_id)
        if points is not None:
            expected[exercise_id] = points
    return expected


def registered_points(exercise_id: str):
    """The points the grader's tests declare for ``exercise_id``; None if it has no test. (Read
    from their source, not imported: registry.declared_points says why.)"""
    return declared_points().get(exercise_id)


def _read_grades(path: Path) -> dict:
    """The last verdict of each exercise (a re-run check replaces the earlier one)."""
    grades = {}
    if path.is_file() and not path.is_symlink():  # a sandboxed notebook could point it at any file
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a torn line from a killed kernel: ignore it
            if isinstance(record, dict) and isinstance(record.get("exercise"), str):
                grades[record["exercise"]] = record
    return grades


# jupyter_client's words for a kernel that never started. The usual cause is no fault of the notebook:
# the client picks free ports and hands them to the kernel, and another process (a rank's gloo
# connection, another kernel) may take one before the kernel binds it.
KERNEL_DID_NOT_START = ("Kernel didn't respond", "Kernel died before replying")


def grade_notebook(
    nb_path: Path,
    timeout: float,
    parameters: dict,
    keep_dir: Path | None = None,
    feedback: bool = False,
    sandbox: Sandbox | None = None,
) -> NotebookReport:
    """Execute one notebook, then score it: see the module's docstring. With ``sandbox``
    both run in it, on a copy of the notebook in a temporary folder (sandbox.py). A notebook
    whose kernel never started is graded once more (``KERNEL_DID_NOT_START``), and says so."""
    report = _grade_once(nb_path, timeout, parameters, keep_dir, feedback, sandbox)
    if report.status == "infrastructure error" and any(words in report.error for words in KERNEL_DID_NOT_START):
        print(f"  its kernel did not start ({report.error}): graded once more", file=sys.stderr, flush=True)
        first = report.seconds
        report = _grade_once(nb_path, timeout, parameters, keep_dir, feedback, sandbox)
        report.seconds += first
    return report


def _grade_once(nb_path, timeout, parameters, keep_dir, feedback, sandbox) -> NotebookReport:
    report = NotebookReport(str(nb_path))
    start = time.perf_counter()
    # ignore_cleanup_errors: a sandboxed notebook may leave files we cannot remove (chmod 000)
    with tempfile.TemporaryDirectory(prefix="ultrascale-grade-", ignore_cleanup_errors=True) as tmp:
        tmp = Path(tmp)
        if sandbox is None:
            grade_file = tmp / "grades.jsonl"
            _execute(
                nb_path, grade_file, (keep_dir or tmp) / nb_path.name, timeout, parameters, report, defer=not feedback
            )
            report.exercises = score(nb_path, grade_file, timeout)
        else:
            grade_file = tmp / "grading" / "grades.jsonl"
            _execute_sandboxed(nb_path, tmp, grade_file, keep_dir, timeout, parameters, report, not feedback, sandbox)
            report.exercises = score(nb_path, grade_file, timeout, cwd=tmp, sandbox=sandbox)
    report.seconds = time.perf_counter() - start
    return report


def _execute(
    nb_path: Path,
    grade_file: Path,
    output: Path,
    timeout: float,
    parameters: dict,
    report: NotebookReport,
    defer: bool = True,
) -> None:
    """Run the notebook with papermill; its check() calls write into ``grade_file``."""
    import papermill
    from papermill.exceptions import PapermillExecutionError

    from ultrascale.headless import kernel_options

    # The kernel inherits our environment; that is how check() finds the file.
    old = {name: os.environ.get(name) for name in (GRADE_FILE_ENV, DEFER_ENV)}
    os.environ[GRADE_FILE_ENV] = str(grade_file)
    if defer:
        os.environ[DEFER_ENV] = "1"
    else:
        os.environ.pop(DEFER_ENV, None)
    try:
        if not nb_path.is_file():
            raise FileNotFoundError(f"no such notebook: {nb_path}")
        executed = papermill.execute_notebook(
            str(nb_path),
            str(output),
            parameters=parameters,
            kernel_name="python3",
            cwd=str(nb_path.parent),
            progress_bar=False,
            execution_timeout=timeout,
            # nbclient options: keep going after a cell raises, and interrupt a
            # cell that passes the timeout instead of abandoning the notebook.
            allow_errors=True,
            interrupt_on_timeout=True,
            **kernel_options(),  # the kernel's log without its two harmless messages (ultrascale.headless)
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
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# ---- a submission in the sandbox -------------------------------------------------------

_EXECUTE = "import sys; from ultrascale_grading.cli import execute_main; sys.exit(execute_main(sys.argv[1]))"


def _execute_sandboxed(
    nb_path: Path,
    work: Path,
    grade_file: Path,
    keep_dir: Path | None,
    timeout: float,
    parameters: dict,
    report: NotebookReport,
    defer: bool,
    sandbox: Sandbox,
) -> None:
    """``_execute`` in the sandbox, on a copy of the notebook in ``work`` (its only writable folder)."""
    if not nb_path.is_file():
        report.status, report.error = "infrastructure error", f"FileNotFoundError: no such notebook: {nb_path}"
        return
    copy, output, result = work / nb_path.name, work / "executed" / nb_path.name, work / "execution.json"
    shutil.copyfile(nb_path, copy)
    grade_file.parent.mkdir()
    output.parent.mkdir()
    spec = work / "execute.json"
    spec.write_text(
        json.dumps(
            {
                "notebook": str(copy),
                "grade_file": str(grade_file),
                "output": str(output),
                "timeout": timeout,
                "parameters": parameters,
                "defer": defer,
                "report": str(result),
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if k not in (GRADE_FILE_ENV, DEFER_ENV)}
    outcome = sandbox.run([sys.executable, "-c", _EXECUTE, str(spec)], work, env, sandbox.limits.seconds)
    said = {}
    try:  # written by the sandboxed process: informative only, the score does not depend on it
        said = json.loads(result.read_text()) if result.is_file() and not result.is_symlink() else {}
        report.cell_errors = int(said.get("cell_errors", 0))
        report.status, report.error = str(said.get("status", "ok")), str(said.get("error", ""))[:2000]
    except (ValueError, TypeError, AttributeError):
        said = {}
    if outcome.timed_out:
        report.status, report.error = "stopped", f"killed at the time limit ({sandbox.limits.seconds:g} s)"
    elif not said and outcome.returncode:
        report.status, report.error = "infrastructure error", _trouble(outcome, sandbox.limits.seconds)
    if outcome.survivors:
        report.status, report.error = "infrastructure error", f"{outcome.survivors} of its processes survived the kill"
    if keep_dir and output.is_file() and not output.is_symlink():  # a link could point at any file of ours
        shutil.copyfile(output, keep_dir / nb_path.name)


def execute_main(spec_path: str) -> int:
    """In the sandbox: run the notebook as ``_execute`` does, and say how it went in a file."""
    spec = json.loads(Path(spec_path).read_text())
    report = NotebookReport(spec["notebook"])
    _execute(
        Path(spec["notebook"]),
        Path(spec["grade_file"]),
        Path(spec["output"]),
        spec["timeout"],
        spec["parameters"],
        report,
        spec["defer"],
    )
    Path(spec["report"]).write_text(
        json.dumps({"status": report.status, "error": report.error, "cell_errors": report.cell_errors})
    )
    return 0


def score(
    nb_path: Path, grade_file: Path, timeout: float, cwd: Path | None = None, sandbox: Sandbox | None = None
) -> list:
    """One row per registered exercise the notebook has or checks, scored by the grader."""
    claims = _read_grades(grade_file)
    exercises = expected_exercises(nb_path)
    for exercise_id in claims:  # checks of other chapters, if a notebook has any
        points = registered_points(exercise_id)
        if exercise_id not in exercises and points is not None:
            exercises[exercise_id] = points
    claimed = [e for e in exercises if claims.get(e, {}).get("status") in (PASS, SUBMITTED)]
    verdicts = regrade(cwd or nb_path.parent, {e: submission_path(grade_file, e) for e in claimed}, timeout, sandbox)
    return [_row(e, points, claims.get(e), verdicts.get(e)) for e, points in exercises.items()]


def _row(exercise_id: str, max_points: float, claim: dict | None, verdict: dict | None) -> dict:
    """The table's row: points are the registry's, and only for the grader's own pass."""

    def row(status: str, message: str) -> dict:
        return {
            "exercise": exercise_id,
            "status": status,
            "points": max_points if status == PASS else 0,
            "max_points": max_points,
            "message": message,
        }

    def status_of(record: dict | None, allowed=(FAIL, NOT_IMPLEMENTED, ERROR)) -> str:
        # a status outside the known ones (or none at all) counts as a failure
        return record["status"] if record and record.get("status") in allowed else FAIL

    if claim is None:
        return row(NOT_RUN, "its check() never ran")
    message = str(verdict.get("message", "")) if verdict else "no verdict"
    if claim.get("status") == SUBMITTED:  # the grader's run is the only one: its verdict as it is
        return row(status_of(verdict, (PASS, FAIL, NOT_IMPLEMENTED, ERROR)), message)
    if claim.get("status") != PASS:
        return row(status_of(claim), str(claim.get("message", ""))[:4000])
    if verdict is not None and verdict.get("status") == PASS:
        return row(PASS, "")
    return row(
        status_of(verdict), f"check() passed in the notebook, but not when the grader ran the test itself: {message}"
    )


# ---- the grader's own run of the tests ------------------------------------------------

_REGRADE = "import sys; from ultrascale_grading.cli import regrade_main; sys.exit(regrade_main(sys.argv[1]))"
# Variables of the kernel's environment that belong to Jupyter, not to the notebook's code.
_KERNEL_ONLY_ENV = ("MPLBACKEND", GRADE_FILE_ENV, DEFER_ENV, "JPY_PARENT_PID", "JPY_SESSION_NAME")


def regrade(cwd: Path, submissions: dict, timeout: float, sandbox: Sandbox | None = None) -> dict:
    """{exercise id: verdict} from a fresh process that runs each registered test on what
    the notebook's check() was given (``submissions``: id -> saved file). It runs the
    learner's functions, so with ``sandbox`` it runs there, in ``cwd`` (the notebook's copy)."""
    if not submissions:
        return {}
    limit = timeout * len(submissions) + 120  # what the cells got, plus a start-up
    with tempfile.TemporaryDirectory(
        prefix="ultrascale-regrade-", dir=cwd if sandbox else None, ignore_cleanup_errors=True
    ) as tmp:
        spec, results = Path(tmp) / "spec.json", Path(tmp) / "verdicts.jsonl"
        spec.write_text(
            json.dumps({"results": str(results), "submissions": {e: str(p) for e, p in submissions.items()}})
        )
        env = {k: v for k, v in os.environ.items() if k not in (GRADE_FILE_ENV, DEFER_ENV)}
        argv = [sys.executable, "-c", _REGRADE, str(spec)]
        if sandbox is not None:
            trouble = _trouble(sandbox.run(argv, cwd, env, limit), limit)
        elif zygote.available():  # a fork of a process that has imported the tests once (zygote.py)
            trouble = _run_forked(spec, cwd, env, limit)
        else:
            try:
                proc = subprocess.run(
                    argv,
                    cwd=cwd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                    errors="replace",
                    timeout=limit,
                )
                trouble = f"it exited with code {proc.returncode}: {proc.stderr[-2000:]}" if proc.returncode else ""
            except subprocess.TimeoutExpired:
                trouble = f"it did not finish within {limit:g} s"
        verdicts = _read_grades(results)
    for exercise_id in submissions:
        verdicts.setdefault(
            exercise_id,
            {
                "status": FAIL,
                "message": f"the grader's run of the test gave no verdict ({trouble or 'no reason given'})",
            },
        )
    return verdicts


_zygote: zygote.Zygote | None = None  # this process's, started by its first unsandboxed run


def _run_forked(spec: Path, cwd: Path, env: dict, limit: float) -> str:
    """``regrade_main(spec)`` in a fork of this process's zygote; what went wrong, in words ("" if nothing).
    A zygote started with another environment than ``env`` is replaced (what a module reads from the
    environment when it is imported must be what a new interpreter would read)."""
    global _zygote
    if _zygote is None or not _zygote.alive() or _zygote.env != env:
        if _zygote is not None:
            _zygote.close()
        else:
            atexit.register(lambda: _zygote and _zygote.close())
        _zygote = zygote.Zygote.start(env)
    try:
        code, stderr = _zygote.run(spec, cwd, env, limit)
    except (RuntimeError, OSError, ValueError) as err:  # the zygote died (a test killed its parent?)
        _zygote.close()
        return f"the grader's process for the tests stopped: {err}"
    if code is None:
        return f"it did not finish within {limit:g} s"
    return f"it exited with code {code}: {stderr[-2000:]}" if code else ""


def _trouble(outcome: Outcome, limit: float) -> str:
    """What went wrong in a sandboxed run, in words ("" if nothing)."""
    if outcome.timed_out:
        return f"it did not finish within {limit:g} s and was killed"
    if outcome.returncode:
        return f"it exited with code {outcome.returncode}: {outcome.stderr[-2000:]}"
    return ""


def regrade_main(spec_path: str) -> int:
    """In the grader's process: each exercise's registered test on what check() was given."""
    spec = json.loads(Path(spec_path).read_text())
    # Every test is looked up before any learner object is loaded: the registry as the
    # library defines it judges them, whatever the notebook did to its own kernel's.
    tests = {exercise_id: _lookup(exercise_id) for exercise_id in spec["submissions"]}
    _fork_server_early(spec["submissions"].values())
    with open(spec["results"], "a", encoding="utf-8") as out:
        for exercise_id, path in spec["submissions"].items():
            result = _regrade_one(exercise_id, tests[exercise_id], Path(path))
            out.write(json.dumps(result.to_json()) + "\n")
            out.flush()  # a later test that kills the process leaves the earlier verdicts
    return 0


def _fork_server_early(paths) -> None:
    """If the notebook's kernel had ranks, start the ranks' fork server now, as a fork of this process
    (runtime.start_fork_server(forked=True)): it then shares the torch this process has imported
    instead of importing its own (about 1 s of CPU per notebook). Only now is that safe: a fork of a
    process is sound where torch has started no threads yet, and nothing has run a tensor operation
    here before the first test. The kernel's environment variables are applied first, so the ranks
    have them as they would have had them from a server started by the first test."""
    first = next(iter(paths), None)
    if first is None or sys.platform != "linux":
        return
    if _apply_context(Path(first).with_suffix(".json")).get("ranks"):
        from ultrascale.runtime import start_fork_server

        start_fork_server(forked=True)


def _lookup(exercise_id: str):
    try:
        return get_exercise(exercise_id)
    except KeyError:
        return None


def _regrade_one(exercise_id: str, ex, path: Path) -> CheckResult:
    if ex is None:
        return CheckResult(exercise_id, ERROR, 0, 0, "no test is registered under this id")
    if not path.is_file():
        return CheckResult(
            exercise_id,
            ERROR,
            0,
            ex.points,
            "no copy of what check() was given was saved: check() did not run under the "
            "grader, or what it was given could not be pickled (see the notebook's output)",
        )
    try:
        _apply_context(path.with_suffix(".json"))
        import cloudpickle

        objects, kwargs = cloudpickle.loads(path.read_bytes())
        objects, kwargs = tuple(objects), dict(kwargs)
        _give_kernels_triton_language([*objects, *kwargs.values()])
    except Exception as err:  # noqa: BLE001 - whatever the file holds, it scores 0
        return CheckResult(
            exercise_id, ERROR, 0, ex.points, f"the grader could not load what check() was given: {one_line(err)}"
        )
    return grade_exercise(ex, objects, kwargs)


# The name under which a kernel's globals get triton.language back; one no notebook uses.
_TRITON_LANGUAGE_GLOBAL = "_ultrascale_triton_language"


def _give_kernels_triton_language(objects) -> None:
    """A Triton kernel sees ``triton.language`` among its globals again, as it did in the notebook.

    cloudpickle saves a notebook's function with only the globals its code names, and Triton's
    interpreter (``TRITON_INTERPRET=1``) refuses to launch a kernel that has no ``triton.language``
    among its globals. A kernel the learner has not written yet (its body is the stub's
    ``raise NotImplementedError``) names no ``tl``, so without this its test failed with
    "triton.language must be visible from within jit'd function" instead of reaching the stub and
    reporting "not implemented", as the notebook's own check() does (issue 54)."""
    if "triton" not in sys.modules:  # nothing loaded from the submission is a Triton kernel
        return
    import triton.language as tl

    for obj in objects:
        fn = obj
        for _ in range(4):  # @triton.jit wraps the function (.fn); @triton.autotune wraps that in turn
            fn = getattr(fn, "fn", None)
            scope = getattr(fn, "__globals__", None)
            if isinstance(scope, dict):
                if not any(value is tl or value is tl.core for value in scope.values()):
                    scope[_TRITON_LANGUAGE_GLOBAL] = tl
                break


def _apply_context(path: Path) -> dict:
    """The kernel's environment variables and import path, as check() saved them; returns the context."""
    try:
        context = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(context, dict):
        return {}
    environ = context.get("environ")
    for key, value in (environ or {}).items():
        if isinstance(key, str) and isinstance(value, str) and key not in _KERNEL_ONLY_ENV:
            os.environ[key] = value
    for entry in context.get("sys_path") or []:
        if isinstance(entry, str) and entry not in sys.path:
            sys.path.append(entry)  # after ours: a notebook's folder must not shadow the library
    return context


def _count_error_cells(nb) -> int:
    return sum(
        any(o.get("output_type") == "error" for o in cell.get("outputs", []))
        for cell in nb.cells
        if cell.cell_type == "code"
    )


def format_table(reports: list) -> str:
    rows = [("notebook", "exercise", "status", "points")]
    for r in reports:
        name = _short_path(r.notebook)
        if r.status != "ok":
            rows.append((name, "-", r.status, ""))
        for e in r.exercises:
            rows.append((name, e["exercise"], e["status"], f"{e['points']:g}/{e['max_points']:g}"))
        rows.append(
            (name, "total", f"{r.cell_errors} cell(s) raised, {r.seconds:.0f} s", f"{r.points:g}/{r.max_points:g}")
        )
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


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text}")
    return value


def grade_all(
    notebooks: list,
    timeout: float,
    parameters: dict,
    keep_dir: Path | None,
    feedback: bool,
    jobs: int = 1,
    sandboxes: list | None = None,
) -> list:
    """``grade_notebook`` on each notebook, ``jobs`` at a time; the reports in the notebooks' order.
    ``sandboxes``: one per notebook, a Sandbox or None (none: run as it is)."""

    def announce(nb_path: Path, report: NotebookReport) -> NotebookReport:
        print(f"graded {nb_path} in {report.seconds:.0f} s", flush=True)
        if report.status != "ok":
            print(f"  could not run it: {report.error}", file=sys.stderr)
        return report

    arguments = (timeout, parameters, keep_dir, feedback)
    sandboxes = sandboxes or [None] * len(notebooks)
    if jobs == 1 or len(notebooks) == 1:
        return [announce(nb, grade_notebook(nb, *arguments, box)) for nb, box in zip(notebooks, sandboxes)]
    import concurrent.futures
    import multiprocessing

    # spawn: a fresh interpreter per worker, nothing inherited from this one's threads
    with concurrent.futures.ProcessPoolExecutor(
        min(jobs, len(notebooks)), mp_context=multiprocessing.get_context("spawn")
    ) as pool:
        futures = [pool.submit(grade_notebook, nb, *arguments, box) for nb, box in zip(notebooks, sandboxes)]
        return [announce(nb, future.result()) for nb, future in zip(notebooks, futures)]


def _sandboxes(notebooks: list, args) -> list:
    """A Sandbox for each notebook that is not the course's own (or for all with --sandbox,
    none with --trusted); one line says how far it protects, or that nothing is sandboxed."""
    wanted = [not args.trusted and (args.sandbox or not is_course_notebook(nb)) for nb in notebooks]
    if not any(wanted):
        print(
            "no sandbox: "
            + ("--trusted" if args.trusted else "the course's own exercises/, solutions/ and work/exercises/")
            + " run with your rights (--sandbox to sandbox them)",
            flush=True,
        )
        return [None] * len(notebooks)
    limits = Limits(args.time_limit, int(args.memory_limit * GiB), args.max_processes)
    sandbox = Sandbox.probe(limits)
    print(sandbox.describe(), flush=True)
    return [sandbox if want else None for want in wanted]


def _hash_or_none(nb_path: Path):
    try:
        return content_hash(nb_path)
    except Exception:  # noqa: BLE001 - missing or unreadable: its report says so
        return None


def _record(notebooks: list, hashes: list, reports: list, record_file: Path | None) -> None:
    """One signed line per graded notebook in the learner's records (progress.py), from this process."""
    written = set()
    for nb_path, notebook_hash, report in zip(notebooks, hashes, reports):
        target = record_file or progress.records_for(nb_path)
        if target is None:
            continue
        progress.record(target, nb_path, notebook_hash, report.status, report.exercises)
        written.add(str(target))
    for target in sorted(written):
        shown = _short_path(target)
        print(f"recorded in {target if shown.startswith('..') else shown} (make progress shows it)")


def _parse_param(text: str):
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value  # a bare string


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="ultrascale-grade", description="Run exercise notebooks and print their scores."
    )
    parser.add_argument("paths", nargs="+", metavar="NOTEBOOK_OR_DIR")
    parser.add_argument("--json", type=Path, help="also write the scores to this JSON file")
    parser.add_argument("--timeout", type=float, default=300, help="seconds allowed per cell (default 300)")
    parser.add_argument(
        "-p",
        "--param",
        action="append",
        type=_parse_param,
        default=[],
        help="extra notebook parameter NAME=VALUE (QUICK=True is always set unless overridden)",
    )
    parser.add_argument("--keep", type=Path, help="save the executed notebooks in this directory")
    parser.add_argument(
        "--jobs",
        type=_positive_int,
        default=1,
        metavar="N",
        help="grade N notebooks at a time, each in its own process (default 1)",
    )
    parser.add_argument(
        "--feedback",
        action="store_true",
        help="also run each test inside the notebook, so the kept notebooks show every verdict "
        "(the tests that pass then run twice: there and in the grader's own process)",
    )
    trust = parser.add_mutually_exclusive_group()
    trust.add_argument(
        "--sandbox", action="store_true", help="sandbox every notebook, the course's own exercises/ and solutions/ too"
    )
    trust.add_argument(
        "--trusted",
        action="store_true",
        help="sandbox none: run every notebook with your rights (only for code you trust)",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=Limits.seconds,
        metavar="S",
        help=f"sandbox: seconds per notebook, all its cells together (default {Limits.seconds:g})",
    )
    parser.add_argument(
        "--memory-limit",
        type=float,
        default=Limits.memory_bytes / GiB,
        metavar="GiB",
        help=f"sandbox: memory per process (default {Limits.memory_bytes / GiB:g})",
    )
    parser.add_argument(
        "--max-processes",
        type=_positive_int,
        default=Limits.processes,
        metavar="N",
        help=f"sandbox: processes and threads of a notebook, all together (default {Limits.processes})",
    )
    recording = parser.add_mutually_exclusive_group()
    recording.add_argument(
        "--record",
        type=Path,
        metavar="FILE",
        help="record every graded notebook in this file (default: only those of "
        "work/exercises/, in work/.progress/grades.jsonl; make progress reads it)",
    )
    recording.add_argument("--no-record", action="store_true", help="record no graded notebook")
    args = parser.parse_args(argv)

    notebooks = find_notebooks(args.paths)
    if not notebooks:
        print("ultrascale-grade: no notebooks found in " + ", ".join(args.paths), file=sys.stderr)
        return 2
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    parameters = {"QUICK": True, **dict(args.param)}

    # hashed before grading: the record names the notebook as it was graded
    hashes = [_hash_or_none(nb) for nb in notebooks]
    reports = grade_all(
        notebooks, args.timeout, parameters, args.keep, args.feedback, args.jobs, _sandboxes(notebooks, args)
    )
    if not args.no_record:
        _record(notebooks, hashes, reports, args.record)

    print()
    print(format_table(reports))
    if args.json:
        summary = {
            "notebooks": [r.to_json() for r in reports],
            "points": sum(r.points for r in reports),
            "max_points": sum(r.max_points for r in reports),
        }
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    broken = [r for r in reports if r.status == "infrastructure error"]
    return 2 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
