"""A per-rank timeline of compute and communication, for drawing Gantt charts.

Overlap is the whole point of the data-parallel improvements in this chapter, and
the honest way to show it is to record when things really happened on each rank:

    tl = Timeline(rank=ctx.rank)
    with tl.span("forward"):
        loss = model(x)
    work = dist.all_reduce(grad, async_op=True)
    tl.communication("all_reduce", work)     # start now, end when the backend finishes
    tl.rows()                                # plain dicts: return them from cluster.run

Compute spans are measured around the code that runs them. An asynchronous
collective is recorded from its launch to the moment the backend completes it: we
attach a callback to the work's future, which the backend's own thread runs when
the transfer is done, so the end time is not delayed until someone calls wait().

Times come from ``time.perf_counter`` (CLOCK_MONOTONIC on Linux), which all
processes on one machine share, so the rows of several ranks line up on one axis.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import asdict, dataclass

COMPUTE, COMMUNICATION = "compute", "communication"


@dataclass
class Event:
    """One bar of the Gantt chart (or a mark, when start == end)."""

    rank: int
    lane: str     # "compute" or "communication"
    name: str     # "forward", "backward", "all_reduce bucket 3", ...
    start: float  # seconds, perf_counter clock
    end: float
    nbytes: int = 0


class Timeline:
    """Collects the events of one rank. ``enabled=False`` makes every call free."""

    def __init__(self, rank: int = 0, enabled: bool = True):
        self.rank, self.enabled = rank, enabled
        self.events: list[Event] = []
        self._lock = threading.Lock()   # comm callbacks arrive on the backend's thread

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def add(self, lane: str, name: str, start: float, end: float, nbytes: int = 0) -> None:
        if self.enabled:
            with self._lock:
                self.events.append(Event(self.rank, lane, name, start, end, nbytes))

    @contextlib.contextmanager
    def span(self, name: str, lane: str = COMPUTE, nbytes: int = 0):
        """Record the code inside the ``with`` block as one bar."""
        start = self.now()
        try:
            yield
        finally:
            self.add(lane, name, start, self.now(), nbytes)

    def mark(self, name: str, lane: str = COMPUTE) -> None:
        """An instant, e.g. the moment a gradient became ready."""
        t = self.now()
        self.add(lane, name, t, t)

    def communication(self, name: str, work, nbytes: int = 0, start: float | None = None):
        """Record an async collective from ``start`` (default: now) until it completes.

        ``work`` is what ``dist.*(..., async_op=True)`` returned. A blocking collective
        has no work object: wrap it in ``span(name, COMMUNICATION)`` instead.
        Returns ``work`` so the call can be chained.
        """
        start = self.now() if start is None else start
        if not self.enabled:
            return work
        try:
            future = work.get_future()
        except (AttributeError, RuntimeError):   # a backend without futures: end at launch
            self.add(COMMUNICATION, name, start, self.now(), nbytes)
            return work
        future.then(lambda _: self.add(COMMUNICATION, name, start, self.now(), nbytes))
        return work

    # ------------------------------------------------------------------ reading
    def clear(self) -> None:
        with self._lock:
            self.events.clear()

    def rows(self) -> list[dict]:
        """The events as plain dicts, sorted by start (picklable across ranks)."""
        with self._lock:
            return [asdict(e) for e in sorted(self.events, key=lambda e: e.start)]

    def busy_seconds(self, lane: str) -> float:
        """Total time covered by the bars of one lane (overlapping bars counted once)."""
        return covered_seconds([(e.start, e.end) for e in self.events if e.lane == lane])


def covered_seconds(intervals) -> float:
    """Length of the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def overlap_seconds(rows, lane_a: str = COMPUTE, lane_b: str = COMMUNICATION, rank: int | None = None) -> float:
    """How long lane_a and lane_b were busy at the same time (on one rank, or summed).

    This is the number the overlap diagrams are about: communication time hidden
    behind computation.
    """
    ranks = {r["rank"] for r in rows} if rank is None else {rank}
    total = 0.0
    for r in ranks:
        a = [(e["start"], e["end"]) for e in rows if e["rank"] == r and e["lane"] == lane_a]
        b = [(e["start"], e["end"]) for e in rows if e["rank"] == r and e["lane"] == lane_b]
        both = covered_seconds(a) + covered_seconds(b) - covered_seconds(a + b)
        total += max(both, 0.0)
    return total
