"""Checks that refuse to pass over nothing.

``all(...)`` of an empty collection is True, so an assertion over rows that were never made
passes, and the print after it claims success. In a notebook that happens whenever a cell that
fills a list or dict is interrupted (the stop button, an error) and the learner runs the next
one: chapter 09 once printed "every rank within 10% of the prediction" with no row behind it.
These helpers say so instead. tests/test_empty_checks.py finds the places that need them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sized


class EmptyInput(AssertionError):
    """A check was given nothing to check."""


def nonempty(items, what: str):
    """``items`` itself, refused when empty with a message that names ``what`` was missing."""
    if not isinstance(items, Sized):
        raise TypeError(f"nonempty needs a collection with a length (a list, dict, ...), got {type(items).__name__}")
    if len(items) == 0:
        raise EmptyInput(
            f"no {what} to check. In a notebook, the cell that makes them may have been "
            "interrupted or failed: run it again, then this one."
        )
    return items


def all_of(items: Iterable, what: str, holds: Callable[[object], bool] = bool) -> bool:
    """``all(holds(x) for x in items)``, except that no items at all is an error, not True."""
    items = list(items)
    return all(holds(item) for item in nonempty(items, what))
