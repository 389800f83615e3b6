"""Guards the exercise tests put around a learner's code, so that a wrong answer cannot pass.

* :func:`without_library` wraps a learner's function so that, while it runs, calling
  the course library's own implementation of the exercise (``count_params`` for the
  parameter count, ...) fails with a clear message, however it was imported.
* :func:`expect_value_error` calls a learner's function on an input it must refuse,
  and names that input and what was expected when something else happens.
* :func:`call_learner` calls a learner's function and, when it raises, names the input.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterable


class ForbiddenCall(AssertionError):
    """Raised inside a learner's code when it calls a library function the exercise forbids.

    An ``AssertionError``, so that ``check`` reports it as a failed exercise with its message.
    """


def _refusing_code(message: str):
    # The code object runs with the library function's globals, where this module's names are
    # unknown: the exception class is imported by name, and the message is a constant.
    source = ("def refuse(*args, **kwargs):\n"
              "    raise __import__('ultrascale.grading.guards', fromlist=['ForbiddenCall'])"
              f".ForbiddenCall({message!r})\n")
    namespace: dict = {}
    exec(source, namespace)  # noqa: S102 (a constant template, no learner input)
    return namespace["refuse"].__code__


def _forbidden_message(fn: Callable, exercise_id: str, hint: str) -> str:
    where = f"{fn.__module__}.{fn.__name__}"
    return (f"{exercise_id}: your code called the course library's {where} (directly, or through another "
            f"library function that uses it). This exercise asks you to compute it yourself"
            + (f": {hint}" if hint else "."))


@contextlib.contextmanager
def forbid_library(functions: Iterable[Callable], exercise_id: str, hint: str = ""):
    """While the context is open, calling any of ``functions`` raises :class:`ForbiddenCall`.

    The function objects themselves are changed (their code is swapped for one that
    raises, and put back on exit), so the refusal reaches every name they are known
    by: ``from ultrascale.model import count_params`` in a notebook included. Only
    plain module-level functions (no closure) can be forbidden.
    """
    saved = []
    try:
        for fn in dict.fromkeys(functions):
            if fn.__closure__ is not None:
                raise TypeError(f"cannot forbid {fn.__qualname__}: it is a closure")
            saved.append((fn, fn.__code__))
            fn.__code__ = _refusing_code(_forbidden_message(fn, exercise_id, hint))
        yield
    finally:
        for fn, code in reversed(saved):
            fn.__code__ = code


def without_library(learner_fn: Callable, functions: Iterable[Callable], exercise_id: str,
                    hint: str = "") -> Callable:
    """``learner_fn``, with ``functions`` forbidden while each call of it runs."""
    functions = tuple(functions)

    @functools.wraps(learner_fn)
    def guarded(*args, **kwargs):
        with forbid_library(functions, exercise_id, hint):
            return learner_fn(*args, **kwargs)

    return guarded


def _call_text(name: str, args: tuple, kwargs: dict) -> str:
    parts = [repr(a) if isinstance(a, str) else str(a) for a in args]
    parts += [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{name}({', '.join(parts)})"


def _reraise_untouched(err: BaseException) -> bool:
    # A stub not filled in yet (check reports "not implemented"), a failed check or a
    # forbidden call already says what is wrong.
    return isinstance(err, (NotImplementedError, AssertionError))


def call_learner(fn: Callable, *args, call: str | None = None, expected: str = "",
                 passthrough: tuple = (), **kwargs):
    """``fn(*args, **kwargs)``; when it raises, say on which input and what was expected.

    Exceptions of the types in ``passthrough`` (e.g. an expected ``ValueError``) are
    re-raised as they are, for the caller to judge.
    """
    try:
        return fn(*args, **kwargs)
    except Exception as err:
        if _reraise_untouched(err) or isinstance(err, passthrough):
            raise
        call = call or _call_text(getattr(fn, "__name__", "your function"), args, kwargs)
        raise AssertionError(f"{call} raised {type(err).__name__}: {err}"
                             + (f"; expected {expected}" if expected else "")) from err


def expect_value_error(fn: Callable, *args, why: str, call: str | None = None, **kwargs) -> None:
    """``fn(*args, **kwargs)`` must raise ``ValueError``; ``why`` says why this input is invalid."""
    call = call or _call_text(getattr(fn, "__name__", "your function"), args, kwargs)
    try:
        result = fn(*args, **kwargs)
    except ValueError:
        return
    except Exception as err:
        if _reraise_untouched(err):
            raise
        raise AssertionError(f"{call} raised {type(err).__name__}: {err}; expected a ValueError, because "
                             f"{why}. Check the input first and `raise ValueError(...)` with a message that "
                             "says what is wrong") from err
    raise AssertionError(f"{call} returned {result!r}; it should raise ValueError, because {why}")
