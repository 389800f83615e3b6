"""A per-rank timeline of compute and communication, for drawing Gantt charts.

Overlap is the whole point of the data-parallel improvements in this chapter, and
the honest way to show it is to record when things really happened on each rank:

    tl = Timeline(rank=ctx.rank)
    with tl.span("forward"):
        loss = model(x)
    work = dist.all_reduce(grad, async_op=True)
    tl.communication("all_reduce", work)     # start now, end when the backend finishes
    tl.rows()                                # plain dicts: return them from cluster.run

Compute spans are measured around the code that runs them, or by hooks:
``tl.instrument(model.blocks)`` records every block's forward and backward as bars
("forward block 3", "backward block 3") without touching the training loop. An asynchronous
collective is recorded from its launch to the moment the backend completes it: we
attach a callback to the work's future, which the backend's own thread runs when
the transfer is done, so the end time is not delayed until someone calls wait().

Times come from ``time.perf_counter`` (CLOCK_MONOTONIC on Linux), which all
processes on one machine share, so the rows of several ranks line up on one axis.

On a GPU, kernels run after Python returns, so the host clock at the end of a span is when the
work was queued, not done. There a bar's ends are CUDA events recorded on the stream, read
(converted to the host clock) only when the timeline is read, so that recording never makes the
host wait for the GPU and the overlap it shows is the overlap that happened. An asynchronous
collective's bar ends when the backend reports the transfer done on the device
(``work.is_completed()``, polled by a helper thread), not when NCCL queued it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import asdict, dataclass

import torch

from ..schedule.simulate import covered_seconds  # pure Python: the pipeline simulator uses it too

COMPUTE, COMMUNICATION = "compute", "communication"


@dataclass
class Event:
    """One bar of the Gantt chart (or a mark, when start == end)."""

    rank: int
    lane: str  # "compute" or "communication"
    name: str  # "forward", "backward", "all_reduce bucket 3", ...
    start: float  # seconds, perf_counter clock
    end: float
    nbytes: int = 0


class Timeline:
    """Collects the events of one rank. ``enabled=False`` makes every call free."""

    def __init__(self, rank: int = 0, enabled: bool = True, device=None):
        self.rank, self.enabled = rank, enabled
        # On a GPU, kernels run after Python returns: a compute bar must wait for the
        # stream to finish, or it would end when the work was queued, not when it was done.
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self._resolved = True  # no CUDA event waits to be read (see _stamp)
        self.events: list[Event] = []
        self._started: dict = {}  # open bars of instrumented modules
        self._lock = threading.Lock()  # comm callbacks arrive on the backend's thread

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def _stamp(self):
        """Now, for a compute bar: the host clock on a CPU; on a GPU a CUDA event recorded on the
        current stream, which is done when the work queued before it is (read by ``_resolve``)."""
        if not self.cuda:
            return self.now()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._resolved = False
        return event

    def _resolve(self) -> None:
        """Turn the CUDA events of the bars into host-clock seconds: wait for the GPU once, then
        record a reference event, whose host time is known, and place each event by its GPU
        time before the reference."""
        if self._resolved:
            return
        torch.cuda.synchronize()
        reference = torch.cuda.Event(enable_timing=True)
        reference.record()
        reference.synchronize()
        host = self.now()
        at = lambda t: t if isinstance(t, float) else host - t.elapsed_time(reference) / 1e3  # noqa: E731
        for e in self.events:
            e.start, e.end = at(e.start), at(e.end)
        self._resolved = True

    def add(self, lane: str, name: str, start: float, end: float, nbytes: int = 0) -> None:
        if self.enabled:
            with self._lock:
                self.events.append(Event(self.rank, lane, name, start, end, nbytes))

    @contextlib.contextmanager
    def span(self, name: str, lane: str = COMPUTE, nbytes: int = 0):
        """Record the code inside the ``with`` block as one bar."""
        if not self.enabled:  # nothing to stamp (on a GPU a stamp is a CUDA event)
            yield
            return
        start = self._stamp()
        try:
            yield
        finally:
            self.add(lane, name, start, self._stamp(), nbytes)

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
        record = lambda *_: self.add(COMMUNICATION, name, start, self.now(), nbytes)  # noqa: E731
        if self.cuda:  # NCCL's future completes at launch: watch the transfer itself
            return WatchedWork(work, record, on_device=True)
        try:
            future = work.get_future()
        except (AttributeError, RuntimeError):  # no future (gloo's reduce-scatter): watch it
            return WatchedWork(work, record)
        future.then(record)
        return work

    def instrument(self, modules, prefix: str = "block"):
        """Record each module's forward and backward as compute bars, by hooks.

        ``modules``: a list (named ``f"{prefix} {i}"``) or a dict of name -> module, e.g.
        ``model.blocks``. Call it after applying a technique whose hooks gather
        parameters (ZeRO-3): hooks run in registration order, so waiting for a gather
        then happens before the bar starts and is not counted as compute.
        Returns the hook handles (``handle.remove()`` undoes it).
        """
        named = modules.items() if isinstance(modules, dict) else ((f"{prefix} {i}", m) for i, m in enumerate(modules))
        handles = []
        for name, module in named:
            handles.append(module.register_forward_pre_hook(lambda mod, args, n=name: self._before_forward(n, args)))
            handles.append(module.register_forward_hook(lambda mod, args, out, n=name: self._after_forward(n, out)))
        return handles

    def _before_forward(self, name, args):
        if not self.enabled:
            return None
        self._started["forward", name] = self._stamp()
        x = args[0] if args and torch.is_tensor(args[0]) else None
        if x is None or not (torch.is_grad_enabled() and x.requires_grad):
            return None
        # A fresh alias of the input, used only for its gradient: that gradient is complete
        # exactly when this module's backward is done, which ends the backward bar.
        x = x.view_as(x)
        x.register_hook(lambda grad: self._end_backward(name))
        return (x, *args[1:])

    def _after_forward(self, name, out):
        if not self.enabled or ("forward", name) not in self._started:
            return
        self.add(COMPUTE, f"forward {name}", self._started.pop(("forward", name)), self._stamp())
        if torch.is_tensor(out) and out.requires_grad:
            # The gradient reaching the output starts the backward bar.
            out.register_hook(lambda grad: self._started.__setitem__(("backward", name), self._stamp()))

    def _end_backward(self, name):
        start = self._started.pop(("backward", name), None)
        if start is not None:
            self.add(COMPUTE, f"backward {name}", start, self._stamp())

    # ------------------------------------------------------------------ reading
    def clear(self) -> None:
        with self._lock:
            self.events.clear()

    def rows(self) -> list[dict]:
        """The events as plain dicts, sorted by start (picklable across ranks)."""
        with self._lock:
            self._resolve()
            return [asdict(e) for e in sorted(self.events, key=lambda e: e.start)]

    def busy_seconds(self, lane: str) -> float:
        """Total time covered by the bars of one lane (overlapping bars counted once)."""
        with self._lock:
            self._resolve()
        return covered_seconds([(e.start, e.end) for e in self.events if e.lane == lane])


def or_disabled(timeline: Timeline | None) -> Timeline:
    """``timeline``, or one that records nothing: techniques take ``timeline=None`` from their
    caller and record into the result unconditionally, so no loop asks whether there is one."""
    return Timeline(enabled=False) if timeline is None else timeline


class WatchedWork:
    """An async collective whose backend offers no completion callback (gloo's
    reduce-scatter has no future): a helper thread waits for it and records its bar when
    the transfer really ends, instead of a zero-length mark at launch. Wait on this
    object instead of the work it wraps: the work is waited for once, by the thread (a
    gloo point-to-point work must not be waited for twice), and ``wait`` joins it."""

    def __init__(self, work, on_done, on_device: bool = False):
        self.work, self.error, self.on_device = work, None, on_device
        self.thread = threading.Thread(target=self._watch, args=(on_done,), daemon=True)
        self.thread.start()

    def _watch(self, on_done):
        try:
            if self.on_device:  # NCCL: ask the GPU without waiting on it (wait() only orders streams)
                while not self.work.is_completed():
                    time.sleep(50e-6)
            else:
                self.work.wait()
        except Exception as err:  # raised again in the rank's own thread, by wait()
            self.error = err
        on_done()

    def wait(self):
        self.thread.join()  # the bar is recorded before anyone reads the timeline
        if self.error is not None:
            raise self.error
        if self.on_device:  # the current stream waits for the transfer, as work.wait() does
            self.work.wait()
        return True


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
