"""Refusals, shown: every chapter ends with inputs the library must refuse, and prints why.

``refusal(fn)`` calls ``fn`` and returns the error it raised as ``"ValueError: <message>"``, the
way a traceback's last line reads. A call that is *not* refused raises ``AssertionError``, so a
chapter can never print a refusal that did not happen; an error of another type propagates
untouched (it is a bug, not a refusal).
"""

from __future__ import annotations

from typing import Callable


def refusal(fn: Callable[[], object], error: type[BaseException] = ValueError) -> str:
    """``"<ErrorType>: <message>"`` of the ``error`` that ``fn()`` raises."""
    try:
        fn()
    except error as err:
        return f"{type(err).__name__}: {err}"
    raise AssertionError(f"expected {error.__name__}, but the call was accepted")
