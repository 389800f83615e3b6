"""Tests of the A1 exercises (solutions/a1_profiling_exercises.ipynb).

* ``a1.timed_median``: ``time_median(fn, warmup, repeats, synchronize, clock)`` returns the
  median duration of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones, each timed
  until the asynchronous work it started is finished. Graded on a simulated device with
  its own queue and an integer clock, so every right answer is exact and every classic
  mistake (no synchronisation, warm-up work leaking into the first timing, the mean or the
  minimum instead of the median) gives a recognisable wrong number.
* ``a1.communication_overlap``: ``communication_overlap(compute, communication)`` reads, from
  the complete events of a trace (section 3's backward operators and gloo transfers), the
  microseconds of communication that ran while something computed (hidden) and those that
  did not (exposed). Graded against the union of intervals (``covered_seconds``, refused
  while the learner's code runs) on hand-made traces (nested operators, two transfer threads,
  transfers touching an operator's edge or covered by two adjacent ones, empty lists,
  epoch timestamps with fractions) and random ones; classic mistakes are named.

Which operator launched each kernel (``a1.launched_by``) is tested in ``cha1_launched_by.py``.
"""

from __future__ import annotations

import math
import random
import statistics
from numbers import Real

from ultrascale_grading import exercise
from ultrascale_grading.guards import call_learner


# ---- a1.timed_median -------------------------------------------------------------------


class FakeDevice:
    """A device with a work queue and a host clock in whole microseconds.

    ``launch`` (the ``fn`` the learner times) costs the host ``launch_cost`` and queues the
    next of ``durations`` on the device, which runs queued work in order; ``synchronize``
    moves the host clock to the moment the device's queue is empty; ``clock`` reads it.
    """

    def __init__(self, durations, launch_cost: int = 1):
        self.durations = list(durations)
        self.launch_cost = launch_cost
        self.now = 0  # host clock
        self.free_at = 0  # when the device will have finished everything queued
        self.calls = 0

    def clock(self):
        return self.now

    def launch(self):
        if self.calls >= len(self.durations):
            raise AssertionError(f"fn was called more than warmup + repeats = {len(self.durations)} times")
        duration = self.durations[self.calls]
        self.calls += 1
        self.now += self.launch_cost
        self.free_at = max(self.now, self.free_at) + duration

    def synchronize(self):
        self.now = max(self.now, self.free_at)


# (warmup, repeats, durations of the warm-up calls then of the timed calls)
TIMING_CASES = [
    (3, 5, [500, 400, 300] + [10, 12, 11, 200, 10]),
    (2, 1, [1000, 1000] + [7]),
    (0, 4, [5, 9, 7, 100]),
    (1, 3, [50] + [30, 31, 29]),
    (4, 7, [90, 80, 70, 60] + [20, 22, 21, 400, 23, 19, 20]),
]


def _timed(
    fn,
    warmup,
    repeats,
    synchronize,
    clock,
    *,
    sync_after_warmup=True,
    sync_after_fn=True,
    time_warmup=False,
    summary=statistics.median,
):
    """The right procedure, or one of the classic mistakes (for recognising them in a wrong answer)."""
    times = []
    for _ in range(warmup):
        start = clock()
        fn()
        if time_warmup:
            synchronize()
            times.append(clock() - start)
    if sync_after_warmup:
        synchronize()
    for _ in range(repeats):
        start = clock()
        fn()
        if sync_after_fn:
            synchronize()
        times.append(clock() - start)
    return summary(times)


MISTAKES = [
    (
        dict(sync_after_fn=False),
        "That is only the time of the launch: the work was still queued when the clock "
        "was read. Call synchronize() after fn() and before reading the clock.",
    ),
    (
        dict(sync_after_warmup=False),
        "The first timing includes the warm-up calls' work, still running when it "
        "started. Synchronize after the warm-up, before the first clock reading.",
    ),
    (
        dict(summary=statistics.mean),
        "That is the mean: one slow outlier moves it. Return the median (statistics.median).",
    ),
    (dict(summary=min), "That is the minimum, not the median."),
    (dict(time_warmup=True), "The warm-up calls were timed too: time only the `repeats` calls after them."),
]


def _timing_hint(got, warmup, repeats, durations) -> str:
    for mistake, hint in MISTAKES:
        device = FakeDevice(durations)
        if got == _timed(device.launch, warmup, repeats, device.synchronize, device.clock, **mistake):
            return " " + hint
    device = FakeDevice(durations)
    right = _timed(device.launch, warmup, repeats, device.synchronize, device.clock)
    if got in (1000 * right, right / 1000):
        return " Return the duration in the clock's own units (do not convert to ms or seconds)."
    return ""


@exercise("a1.timed_median", points=1)
def test_timed_median(time_median, quick: bool = True):
    """On a simulated asynchronous device: exact medians, call counts, and the usual mistakes."""
    cases = TIMING_CASES if not quick else TIMING_CASES[:4]
    for warmup, repeats, durations in cases:
        device = FakeDevice(durations)
        call = f"time_median(fn, warmup={warmup}, repeats={repeats}, synchronize=..., clock=...)"
        expected = statistics.median(device.launch_cost + d for d in durations[warmup:])
        got = call_learner(
            time_median,
            device.launch,
            warmup=warmup,
            repeats=repeats,
            synchronize=device.synchronize,
            clock=device.clock,
            call=call,
            expected=f"{expected} time units",
        )
        where = (
            f"{call} on a device whose calls take {durations[:warmup]} (warm-up) then "
            f"{durations[warmup:]} time units, plus {device.launch_cost} to launch"
        )
        assert got is not None, f"{where}: returned None; return the median duration"
        assert device.calls == warmup + repeats, (
            f"{where}: fn was called {device.calls} times; expected warmup + repeats = {warmup + repeats}"
        )
        assert isinstance(got, Real), f"{where}: returned {got!r}; return a number (the median duration)"
        assert got == expected, (
            f"{where}: expected a median of {expected} time units, got {got}."
            f"{_timing_hint(got, warmup, repeats, durations)}"
        )


# ---- a1.communication_overlap ----------------------------------------------------------


def _union(events) -> float:
    from ultrascale.schedule.simulate import covered_seconds

    return covered_seconds([(e["ts"], e["ts"] + e["dur"]) for e in events])


def reference_overlap(compute, communication):
    """(hidden, exposed): the union of the communication within, and outside, the union of the compute."""
    comm = _union(communication)
    hidden = _union(compute) + comm - _union(list(compute) + list(communication))
    return hidden, comm - hidden


def _overlap_mistakes(compute, communication) -> list:
    """(hidden, exposed) of classic mistakes, with what to say about each."""

    def pairwise(a, b):
        return sum(max(0, min(x["ts"] + x["dur"], y["ts"] + y["dur"]) - max(x["ts"], y["ts"])) for x in a for y in b)

    hidden, exposed = reference_overlap(compute, communication)
    summed = sum(e["dur"] for e in communication)
    contained = sum(
        c["dur"]
        for c in communication
        if any(o["ts"] <= c["ts"] and c["ts"] + c["dur"] <= o["ts"] + o["dur"] for o in compute)
    )
    return [  # the mistakes that fix both numbers first
        *(
            (
                reference_overlap(compute, [e for e in communication if keep(e["name"])]),
                "Events were left out by their name: the two lists are already the trace's compute and communication, "
                "and every event in them counts, whatever it is called (an NCCL kernel, another collective, a send)",
            )
            for keep in (lambda name: name == "gloo:all_reduce", lambda name: name.startswith("gloo"))
        ),
        (
            (pairwise(compute, communication), None),
            "Overlaps were added pair by pair: nested operators (one inside another) and transfers on two threads at "
            "once count the same microseconds several times. Merge each list into its union of intervals first",
        ),
        (
            (None, summed - hidden),
            "The exposed time counts twice what two communication threads did at the same time: take the union of the "
            "communication intervals, then remove the hidden part",
        ),
        (
            (contained, None),
            "Only transfers entirely inside one compute event were counted as hidden: a transfer that is partly covered "
            "is partly hidden, and one covered by two adjacent compute events is hidden too",
        ),
        (
            (min(_union(compute), _union(communication)), None),
            "That is the most that could hide, min(compute, communication): read the overlap from the intervals",
        ),
        ((exposed, hidden), "The two numbers are swapped: return (hidden, exposed)"),
    ]


def trace_event(name, ts, dur, tid=1, pid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": {}}


def overlap_traces():
    """(what, compute events, communication events): hand-made traps first."""
    engine = "autograd::engine::evaluate_function: AddmmBackward0"
    nested = [
        trace_event(engine, 0, 100),
        trace_event("aten::mm", 10, 30),
        trace_event("aten::mm", 50, 40),
        trace_event(engine, 130, 70),
        trace_event("aten::mm", 140, 50),
    ]
    two_threads = [
        trace_event("gloo:all_reduce", 20, 60, tid=5),
        trace_event("gloo:all_reduce", 40, 70, tid=6),
        trace_event("gloo:all_reduce", 190, 40, tid=5),
    ]
    return [
        ("nested backward operators and two gloo threads", nested, two_threads),
        (
            "a transfer covered by two adjacent operators",
            [trace_event("a", 0, 50), trace_event("b", 50, 50)],
            [trace_event("gloo:all_reduce", 30, 40, tid=5)],
        ),
        (
            "transfers touching the compute's edges",
            [trace_event("a", 100, 50)],
            [trace_event("gloo:all_reduce", 60, 40, tid=5), trace_event("gloo:all_reduce", 150, 10, tid=5)],
        ),
        (
            "a transfer before the backward and one after it",
            [trace_event("a", 100, 50)],
            [trace_event("gloo:all_reduce", 10, 20, tid=5), trace_event("gloo:all_reduce", 140, 30, tid=5)],
        ),
        ("no communication", [trace_event("a", 0, 10)], []),
        (
            "no compute",
            [],
            [trace_event("gloo:all_reduce", 0, 10, tid=5), trace_event("gloo:all_reduce", 5, 10, tid=6)],
        ),
        (
            "real-trace timestamps (microseconds since the epoch, with fractions)",
            [trace_event(engine, 1_732_000_000_000.5, 80.25), trace_event("aten::mm", 1_732_000_000_010.75, 20.5)],
            [trace_event("gloo:all_reduce", 1_732_000_000_050.125, 60.5, tid=5)],
        ),
    ]


def random_overlap_trace(seed: int):
    """Nested compute on the training thread, transfers on two threads, integer microseconds."""
    rng = random.Random(seed)
    compute, communication, t = [], [], 0
    for _ in range(rng.randint(1, 6)):
        dur = rng.randint(5, 80)
        compute.append(trace_event("autograd::engine", t, dur))
        for _ in range(rng.randint(0, 3)):  # operators inside it
            start = t + rng.randint(0, dur - 1)
            compute.append(trace_event("aten::op", start, rng.randint(1, t + dur - start)))
        t += dur + rng.choice([0, 0, rng.randint(1, 30)])
    for _ in range(rng.randint(0, 6)):
        communication.append(
            trace_event("gloo:all_reduce", rng.randint(-20, t + 20), rng.randint(1, 60), tid=rng.choice([5, 6]))
        )
    rng.shuffle(compute)
    rng.shuffle(communication)
    return compute, communication


def check_overlap(communication_overlap, compute, communication, what):
    call = f"communication_overlap(<{what}>)"
    expected = reference_overlap(compute, communication)
    got = call_learner(
        communication_overlap,
        [dict(e) for e in compute],
        [dict(e) for e in communication],
        call=call,
        expected=f"(hidden, exposed) = {expected}",
    )
    assert isinstance(got, (tuple, list)) and len(got) == 2, (
        f"{call} returned {got!r}; return a pair (hidden, exposed) of microseconds"
    )
    assert all(isinstance(x, Real) for x in got), f"{call} returned {got!r}; both must be numbers"
    if all(math.isclose(g, e, rel_tol=1e-12, abs_tol=1e-6) for g, e in zip(got, expected)):
        return
    hint = ""
    for wrong, why in _overlap_mistakes(compute, communication):
        if all(w is None or math.isclose(g, w, rel_tol=1e-12, abs_tol=1e-6) for g, w in zip(got, wrong)):
            hint = f" {why}."
            break
    raise AssertionError(
        f"{call}: compute {[(e['ts'], e['dur']) for e in compute]}, communication "
        f"{[(e['ts'], e['dur']) for e in communication]} (ts, dur): expected (hidden, exposed) = "
        f"{expected}, got {tuple(got)}.{hint}"
    )


@exercise("a1.communication_overlap", points=1)
def test_communication_overlap(communication_overlap, quick: bool = True):
    """Hand-made traces with nested operators and concurrent transfers, then random ones."""
    from ultrascale_grading.guards import without_library
    from ultrascale.parallel.timeline import overlap_seconds
    from ultrascale.schedule.simulate import covered_seconds

    learner = without_library(
        communication_overlap,
        [covered_seconds, overlap_seconds],
        "a1.communication_overlap",
        "merge the intervals yourself",
    )
    for what, compute, communication in overlap_traces():
        check_overlap(learner, compute, communication, what)
    for seed in range(20 if quick else 300):
        compute, communication = random_overlap_trace(seed)
        check_overlap(learner, compute, communication, f"random trace {seed}")
