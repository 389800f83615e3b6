"""``check``: grade one exercise from inside a notebook, and show the verdict.

``check`` runs the grader's test for the exercise on the learner's objects and
turns whatever happens into one of three verdicts a learner can act on:

* **pass**;
* **fail**, with the failing assertion's message (or the exception the learner's
  code raised, with its traceback);
* **not implemented yet**, when a ``NotImplementedError`` reaches it: the stub of a
  generated exercise notebook, raised locally or on a worker rank. A function that can do
  nothing but raise it (an untouched stub, read from its bytecode) is told so without running
  the test: a distributed test would start ranks only to watch it raise.

It never raises (an interrupt from the stop button excepted), so the rest of the
notebook still runs and the command-line grader sees every exercise.

Under the command-line grader (the environment variable ``ULTRASCALE_GRADE_FILE`` is
set), each verdict is also appended to that file as one JSON line, and what ``check``
was given (the learner's functions and classes, and the keyword arguments) is saved
beside it with cloudpickle. The grader does not take the verdicts' word for it: a
notebook can write anything into that file. It runs the registered test again, in a
process of its own, on the saved objects (``cli.regrade``), and scores that.

Since only that run counts, the grader also sets ``ULTRASCALE_GRADE_DEFER``: ``check``
then saves what it was given and records "submitted" without running the test, so each
test runs once per graded notebook instead of twice (the grader's ``--feedback`` keeps
the run in the notebook, for kept notebooks that show every verdict).
"""

from __future__ import annotations

import dis
import html
import inspect
import json
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from .registry import get_exercise

PASS = "pass"
FAIL = "fail"
NOT_IMPLEMENTED = "not implemented"
ERROR = "error"  # the check itself could not run: unknown id, wrong arguments
NOT_RUN = "not run"  # used by the command-line grader for checks never reached
SUBMITTED = "submitted"  # under the grader with DEFER_ENV set: saved for its own run, not run here

GRADE_FILE_ENV = "ULTRASCALE_GRADE_FILE"
DEFER_ENV = "ULTRASCALE_GRADE_DEFER"
_MAX_MESSAGE_IN_FILE = 4000  # keep the JSON lines readable; the notebook shows all


@dataclass
class CheckResult:
    """The verdict of one ``check`` call."""

    exercise: str
    status: str
    points: float
    max_points: float
    message: str = ""
    details: str = ""  # a traceback, shown folded in the notebook
    seconds: float = 0.0
    _shown_in: object = field(default=None, repr=False, compare=False)

    @property
    def passed(self) -> bool:
        return self.status == PASS

    def to_json(self) -> dict:
        return {
            "exercise": self.exercise,
            "status": self.status,
            "points": self.points,
            "max_points": self.max_points,
            "message": _shorten(self.message, _MAX_MESSAGE_IN_FILE),
        }

    # ---- how it looks -------------------------------------------------------
    def to_text(self) -> str:
        label = {
            PASS: "PASS",
            FAIL: "FAIL",
            NOT_IMPLEMENTED: "NOT IMPLEMENTED YET",
            ERROR: "ERROR",
            SUBMITTED: "SUBMITTED",
        }.get(self.status, self.status.upper())
        head = f"[{label}] {self.exercise} ({_num(self.points)}/{_num(self.max_points)} points)"
        return head + (f"\n{self.message}" if self.message else "")

    def to_html(self) -> str:
        colour, label = {
            PASS: ("#1a7f37", "&#10004; Passed"),
            FAIL: ("#cf222e", "&#10008; Failed"),
            NOT_IMPLEMENTED: ("#9a6700", "&#9998; Not implemented yet"),
            SUBMITTED: ("#0969da", "&#8599; Submitted to the grader"),
        }.get(self.status, ("#6e7781", "&#9888; Could not check"))
        parts = [
            f'<div style="border-left:4px solid {colour};padding:4px 10px;margin:4px 0">',
            f'<b style="color:{colour}">{label}</b> &nbsp;<code>{html.escape(self.exercise)}</code>'
            f" &nbsp;{_num(self.points)}/{_num(self.max_points)} points",
        ]
        if self.message:
            parts.append(f'<pre style="white-space:pre-wrap;margin:4px 0">{html.escape(self.message)}</pre>')
        if self.details:
            parts.append(
                "<details><summary>traceback</summary>"
                f'<pre style="white-space:pre-wrap;font-size:85%">{html.escape(self.details)}</pre></details>'
            )
        parts.append("</div>")
        return "".join(parts)

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"text/plain": self.to_text(), "text/html": self.to_html()}

    def _ipython_display_(self):
        # check() already showed this result in the current cell; when the call is
        # also the cell's last expression, IPython would show it a second time.
        if self._shown_in is not None and self._shown_in == _execution_count():
            return
        _display(self)

    def __str__(self) -> str:
        return self.to_text()


def check(exercise_id: str, *objects, **kwargs) -> CheckResult:
    """Grade exercise ``exercise_id`` on ``objects`` and show the verdict.

    ``kwargs`` go to the test too (e.g. ``world_size=WORLD_SIZE, quick=QUICK``).
    Returns a :class:`CheckResult`; never raises.
    """
    saved = _save_submission(exercise_id, objects, kwargs)  # before the test runs: as the learner gave them
    try:
        ex = get_exercise(exercise_id)
    except KeyError as err:
        result = CheckResult(exercise_id, ERROR, 0, 0, str(err.args[0]))
    except Exception as err:  # a test module that does not import: not the learner's fault
        result = CheckResult(
            exercise_id, ERROR, 0, 0, f"the checker itself failed: {one_line(err)}", details=traceback.format_exc()
        )
    else:
        result = _argument_error(ex, objects, kwargs)
        if result is None:
            if saved and os.environ.get(DEFER_ENV):
                result = CheckResult(
                    exercise_id,
                    SUBMITTED,
                    0,
                    ex.points,
                    "saved for the grader, which runs the test in a process of its own",
                )
            else:
                result = grade_exercise(ex, objects, kwargs)
    _record(result)
    _show(result)
    return result


def grade_exercise(ex, objects: tuple, kwargs: dict) -> CheckResult:
    """Run the test of exercise ``ex`` on the learner's objects; never raises (but KeyboardInterrupt)."""
    start = time.perf_counter()
    try:
        result = _grade(ex, objects, kwargs)
    except Exception as err:  # a bug in the grading code itself must not stop the notebook
        result = CheckResult(
            ex.id, ERROR, 0, ex.points, f"the checker itself failed: {one_line(err)}", details=traceback.format_exc()
        )
    result.seconds = time.perf_counter() - start
    return result


def _argument_error(ex, objects: tuple, kwargs: dict) -> CheckResult | None:
    """Wrong arguments to check() are the learner's slip, not a failed exercise: say what the
    test expects instead of reporting a TypeError from deep inside. None when they fit."""
    try:
        inspect.signature(ex.test).bind(*objects, **kwargs)
    except TypeError as err:
        return CheckResult(
            ex.id,
            ERROR,
            0,
            ex.points,
            f"check({ex.id!r}, ...) was called with the wrong arguments ({err}); it expects {_signature_hint(ex.test)}",
        )
    return None


def _grade(ex, objects: tuple, kwargs: dict) -> CheckResult:
    exercise_id = ex.id

    def verdict(status: str, message: str = "", details: str = "") -> CheckResult:
        points = ex.points if status == PASS else 0
        return CheckResult(exercise_id, status, points, ex.points, message, details)

    wrong_arguments = _argument_error(ex, objects, kwargs)
    if wrong_arguments is not None:
        return wrong_arguments
    stubs = [message for message in map(_stub_message, objects) if message is not None]
    if stubs:
        return verdict(NOT_IMPLEMENTED, _not_implemented_hint(NotImplementedError(stubs[0])))

    try:
        ex.test(*objects, **kwargs)
    except AssertionError as err:
        return verdict(FAIL, _assertion_message(err), traceback.format_exc())
    except Exception as err:
        if is_not_implemented(err):
            return verdict(NOT_IMPLEMENTED, _not_implemented_hint(err))
        if getattr(err, "stuck", None):
            # A hang (typically mismatched collectives): where each rank was stuck
            # is the whole diagnosis, so show it unfolded.
            return verdict(FAIL, f"your code did not finish: {err}", traceback.format_exc())
        return verdict(FAIL, f"your code raised {one_line(err)}", traceback.format_exc())
    return verdict(PASS)


# ---- recognising a stub that was not filled in --------------------------------

# What an untouched stub's bytecode may hold: ``raise NotImplementedError("exercise: ...")``
# and nothing else (no argument read, nothing returned). Bookkeeping opcodes differ by version.
_STUB_OPS = {"RESUME", "NOP", "CACHE", "PUSH_NULL", "PRECALL", "CALL", "LOAD_GLOBAL", "LOAD_CONST", "RAISE_VARARGS"}


def _stub_message(obj) -> str | None:
    """The message of a function whose only possible outcome is ``raise NotImplementedError(message)``
    (an exercise's stub, as generated), read from its bytecode; None for anything else."""
    if not inspect.isfunction(obj) or obj.__code__.co_names != ("NotImplementedError",):
        return None
    ops = list(dis.get_instructions(obj))
    if not ops or ops[-1].opname != "RAISE_VARARGS" or any(op.opname not in _STUB_OPS for op in ops):
        return None
    return "".join(op.argval for op in ops if op.opname == "LOAD_CONST" and isinstance(op.argval, str))


def is_not_implemented(err: BaseException) -> bool:
    """True if a NotImplementedError caused ``err``, here or on a worker rank."""
    for exc in error_chain(err):
        if isinstance(exc, NotImplementedError):
            return True
        # The runtime's RankError lists each failing rank with its exception type.
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            for f in failures.values():
                if getattr(f, "type_name", "") == "NotImplementedError" or isinstance(
                    getattr(f, "exception", None), NotImplementedError
                ):
                    return True
    # Last resort for other remote-error types: the remote traceback as text.
    return any(line.startswith("NotImplementedError") for line in str(err).splitlines())


def _not_implemented_hint(err: BaseException) -> str:
    """What to do, with the stub's hint (``exercise: <hint>``) wherever it was raised."""
    message = ""
    for exc in error_chain(err):
        if isinstance(exc, NotImplementedError) and str(exc):
            message = str(exc)
            break
    else:
        for line in reversed(str(err).splitlines()):
            if line.startswith("NotImplementedError:"):
                message = line.split(":", 1)[1].strip()
                break
    todo = "Replace the `raise NotImplementedError(...)` line with your code, run that cell, then this one again."
    if message.startswith("exercise:"):
        return f"{todo}\nHint: {message[len('exercise:') :].strip()}"
    return f"{todo}\n(NotImplementedError: {message})" if message else todo


def error_chain(err: BaseException):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


# ---- messages -------------------------------------------------------------------


def _assertion_message(err: AssertionError) -> str:
    if str(err):
        return str(err)
    # A bare ``assert``: show the line of the test that failed.
    frames = traceback.extract_tb(err.__traceback__)
    if frames:
        last = frames[-1]
        return f"assertion failed: {last.line} ({os.path.basename(last.filename)}, line {last.lineno})"
    return "assertion failed"


def one_line(err: BaseException) -> str:
    """``Type: first line``; for an error from the ranks, what each rank raised."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        # The runtime's RankError: the last line of a remote traceback names the
        # exception, which tells the learner far more than "2 of 3 ranks failed".
        by_error = {}
        for rank in sorted(failures):
            lines = getattr(failures[rank], "traceback", "").strip().splitlines()
            by_error.setdefault(lines[-1] if lines else failures[rank].type_name, []).append(rank)
        return "; ".join(f"{error} (on rank {', '.join(map(str, ranks))})" for error, ranks in by_error.items())
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def _signature_hint(fn) -> str:
    return f"check(exercise_id, {str(inspect.signature(fn))[1:-1]})"


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 20] + "\n... (shortened)"


def _num(x: float) -> str:
    return f"{x:g}"


# ---- where the verdict goes -------------------------------------------------------


def submission_path(grade_file, exercise_id: str) -> Path:
    """Where ``check`` saves what it was given for ``exercise_id`` (a cloudpickle of
    ``(objects, kwargs)``), beside the grade file; ``.json`` beside it holds the context."""
    safe = re.sub(r"[^\w.\-]", "_", exercise_id)
    return Path(f"{grade_file}.submissions") / f"{safe}.pkl"


def _save_submission(exercise_id: str, objects: tuple, kwargs: dict) -> bool:
    """Under the grader: save what check() was given, for the grader to test again itself (True if saved).

    The kernel's environment variables and import path go along (as JSON), because a
    notebook may set some that its code needs, e.g. ``TRITON_INTERPRET=1`` for Triton's
    CPU interpreter."""
    path = os.environ.get(GRADE_FILE_ENV)
    if not path:
        return False
    target = submission_path(path, exercise_id)
    context = {"environ": dict(os.environ), "sys_path": list(sys.path), "ranks": _has_ranks()}
    try:
        import cloudpickle

        target.parent.mkdir(parents=True, exist_ok=True)
        _write_whole(target, cloudpickle.dumps((objects, kwargs)))
        _write_whole(target.with_suffix(".json"), json.dumps(context).encode())
    except Exception as err:  # noqa: BLE001 - the notebook goes on; the grader scores it 0
        target.unlink(missing_ok=True)
        print(
            f"ultrascale_grading: what check({exercise_id!r}, ...) was given cannot be saved for the grader "
            f"({type(err).__name__}: {err}); the grader cannot test it again, so it will score 0"
        )
        return False
    return True


def _has_ranks() -> bool:
    """Whether this kernel has made a Cluster (``current_cluster``, running or since closed): then the
    notebook's tests most likely start ranks too, and the grader's run of them starts its fork server
    before they run (cli.regrade_main)."""
    runtime = sys.modules.get("ultrascale.runtime")
    if runtime is None:
        return False
    try:
        runtime.current_cluster()  # raises when none runs
    except RuntimeError:
        return False
    return True


def _write_whole(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # a later check() of the same exercise replaces it whole


def _record(result: CheckResult) -> None:
    path = os.environ.get(GRADE_FILE_ENV)
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(result.to_json()) + "\n")
    except OSError as err:  # grading infrastructure trouble: say so, keep the notebook going
        print(f"ultrascale_grading: could not append to {GRADE_FILE_ENV}={path}: {err}")


def _execution_count():
    ip = _ipython()
    return getattr(ip, "execution_count", None) if ip is not None else None


def _ipython():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def _display(result: CheckResult) -> None:
    if _ipython() is None:
        print(result.to_text())
        return
    from IPython.display import display

    # Both representations: HTML in Jupyter, plain text in a terminal IPython.
    display(result._repr_mimebundle_(), raw=True)


def _show(result: CheckResult) -> None:
    try:
        _display(result)
        result._shown_in = _execution_count()
    except Exception:  # display trouble must not turn into an exception in the notebook
        print(result.to_text())
