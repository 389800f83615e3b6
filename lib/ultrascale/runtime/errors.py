"""Errors a call on the ranks can end with, each carrying what each rank was doing."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RankFailure:
    """One rank's share of a failed call."""

    rank: int
    type_name: str  # e.g. "ValueError", or "died" when the process exited
    traceback: str  # the remote traceback (or stack, for a hang), as text
    exception: BaseException | None = None  # the original exception when it could travel


class RankError(RuntimeError):
    """Some ranks raised. ``failures`` maps rank -> RankFailure; ``stuck`` lists ranks
    that were still running when the call was given up, with their stacks."""

    def __init__(self, summary: str, failures: dict, stuck: dict | None = None):
        self.failures = failures
        self.stuck = stuck or {}
        super().__init__(_render(summary, failures, self.stuck))

    @property
    def type_names(self) -> set:
        return {f.type_name for f in self.failures.values()}


class CallTimeout(RankError, TimeoutError):
    """A call passed its timeout, typically a hang such as mismatched collectives."""


class Stopped(KeyboardInterrupt):
    """The stop button ended a call. Its message is the one line a learner needs: what was
    stopped, whether the ranks were restarted, and what the next call finds. In a notebook
    only that line shows (``magic.register`` installs the handler); ``%tb`` shows the rest.
    A KeyboardInterrupt, so code that catches the stop button keeps catching it."""


def _render(summary: str, failures: dict, stuck: dict) -> str:
    parts = [summary]
    for rank in sorted(failures):
        f = failures[rank]
        parts.append(f"\n--- rank {rank} raised {f.type_name}:\n{f.traceback.rstrip()}")
    for rank in sorted(stuck):
        parts.append(f"\n--- rank {rank} was still running, here:\n{stuck[rank].rstrip()}")
    return "\n".join(parts)
