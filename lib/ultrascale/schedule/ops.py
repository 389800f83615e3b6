"""What a rank's list is made of: the ops, one ``Action``, and the error of a list that cannot run.

Both ``actions`` (which builds a ``Schedule`` and, to check it, simulates it) and ``simulate``
(which runs one) need these, so they live here, below both: ``simulate`` takes them from this module, not
from ``actions``, and ``actions`` can import ``simulate`` without an import circle.
"""

from __future__ import annotations

from typing import NamedTuple

COMPUTE_OPS = ("F", "B", "W")
COMM_OPS = ("recv_F", "send_F", "recv_B", "send_B")


class ScheduleError(ValueError):
    """A schedule that cannot run: an action missing, repeated, misplaced or out of order."""


class Action(NamedTuple):
    """One step of a rank's list: ``op`` on micro-batch ``microbatch`` of stage ``stage``."""

    op: str
    microbatch: int
    stage: int = 0

    def __str__(self) -> str:  # F3s1: forward of micro-batch 3 through stage 1
        return f"{self.op}{self.microbatch}s{self.stage}"

    __repr__ = __str__
