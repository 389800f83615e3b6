"""A discrete-event simulator of pipeline schedules: timelines, bubble and memory.

Every rank runs its list of actions (``Schedule.actions(rank)``) in order, one at a time,
each as soon as it can:

* a compute action starts when the rank is free and its input is there. It takes
  ``t_f`` (F), ``t_b`` (a whole backward B), or ``t_b - t_w`` and ``t_w`` when the backward
  is split into B and W; each divided by v, since a chunk holds 1/v of the rank's layers;
* a send costs the rank nothing (it is an ``isend``); its message arrives ``t_comm`` later;
* a receive waits until its message has arrived.

Units. ``t_f`` and ``t_b`` are the forward and backward of **one micro-batch through one
rank's whole share of the layers** (one stage without interleaving). The book takes
``t_b = 2 t_f``, our default with ``t_f = 1``. The **bubble fraction** is the book's
``r_bubble = t_pb / t_id``: the time the ranks sit idle during a step over the time they
compute, ``t_id = m (t_f + t_b)``. So AFAB and 1F1B give ``(p-1)/m``, interleaving
``(p-1)/(v m)``, and the naive pipeline (one batch, m = 1) ``p-1``.

The simulator is also the validity check: an action whose input is produced later on the
same rank is a :class:`ScheduleError`, and ranks that all wait for messages no waiting rank
will ever send are a :class:`DeadlockError` naming every blocked action.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .ops import Action, ScheduleError

NAMES = {"F": "forward", "B": "backward", "W": "weight"}  # Timeline event names, by op


class DeadlockError(ScheduleError):
    """Every unfinished rank waits for a message that no running rank will send."""


@dataclass(frozen=True)
class Span:
    """One compute action as it ran: rank, action, start and end time."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass
class Simulation:
    """What :func:`simulate` returns: the spans, and the numbers the book reasons with."""

    schedule: object
    t_f: float
    t_b: float
    t_w: float
    t_comm: float
    spans: list = field(default_factory=list)
    peak_activations: list = field(default_factory=list)  # per rank, see simulate()

    @property
    def makespan(self) -> float:
        """From the first action to the last: the step's time (all ranks wait for the flush)."""
        return max((s.end for s in self.spans), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(s.end - s.start for s in self.spans if s.rank == rank)

    def idle(self, rank: int) -> float:
        """The rank's part of the bubble: time in the step it does not compute."""
        return self.makespan - self.busy(rank)

    @property
    def bubble_fraction(self) -> float:
        return bubble_fraction(self)

    def rows(self) -> list[dict]:
        """The spans as ``Timeline.rows()`` dicts, e.g. for ``viz.gantt.plot_gantt``."""
        return [
            dict(rank=s.rank, lane="compute", name=event_name(s.action), start=s.start, end=s.end, nbytes=0)
            for s in self.spans
        ]


def event_name(action: Action) -> str:
    """The Timeline name of a compute action, as the ranks log it: "forward 3 stage 1"."""
    return f"{NAMES[action.op]} {action.microbatch} stage {action.stage}"


def action_of(name: str) -> Action | None:
    """The action behind a Timeline event name, or None for any other event."""
    words = name.split()
    ops = {v: k for k, v in NAMES.items()}
    if len(words) != 4 or words[0] not in ops or words[2] != "stage":
        return None
    return Action(ops[words[0]], int(words[1]), int(words[3]))


# --------------------------------------------------------------------------- simulation
def simulate(schedule, t_f: float = 1.0, t_b: float = 2.0, t_w: float | None = None, t_comm: float = 0.0) -> Simulation:
    """Run ``schedule`` on simulated ranks; raises if it is invalid or deadlocks.

    ``t_w`` is the weight-gradient part of ``t_b`` (default ``t_b / 2``, so that B, W and F
    cost the same as in the Zero Bubble paper); it matters only for split backwards.
    ``peak_activations[r]``: the most (micro-batch, stage) pairs whose activations rank r
    held at once, from the start of their F to the end of their backward (W when split).
    """
    t_w = t_b / 2 if t_w is None else t_w
    if not 0 <= t_w <= t_b:
        raise ValueError(f"t_w={t_w} must lie between 0 and t_b={t_b}: it is a part of the backward")
    sim = Simulation(schedule, t_f, t_b, t_w, t_comm)
    _Run(schedule, sim).run()
    return sim


def duration(action: Action, schedule, t_f: float = 1.0, t_b: float = 2.0, t_w: float | None = None) -> float:
    """How long a compute action of ``schedule`` takes: F t_f, a whole B t_b, a split B t_b - t_w
    and W t_w (default t_b / 2), divided by v (a chunk is 1/v of the rank's layers)."""
    t_w = t_b / 2 if t_w is None else t_w
    split = (action.microbatch, action.stage) in schedule.split_backward
    seconds = {"F": t_f, "B": t_b - t_w if split else t_b, "W": t_w}[action.op]
    return seconds / schedule.chunks


class _Run:
    """The state of one simulated step."""

    def __init__(self, schedule, sim):
        self.s, self.sim = schedule, sim
        self.lists = [schedule.actions(r) for r in range(schedule.ranks)]
        self.pc = [0] * schedule.ranks  # next action of each rank
        self.clock = [0.0] * schedule.ranks  # when each rank is free
        self.messages = {}  # (kind, mb, receiving stage) -> arrival time
        self.ready = {}  # ("input"|"grad", mb, stage) -> time it is there
        self.done = {}  # compute action -> end time
        self.held = [0] * schedule.ranks
        sim.peak_activations = [0] * schedule.ranks

    def run(self) -> None:
        progress = True
        while progress:  # let each rank run until it blocks; stop when nobody can move
            progress = False
            for rank, actions in enumerate(self.lists):
                while self.pc[rank] < len(actions) and self.step(rank, actions[self.pc[rank]]):
                    self.pc[rank] += 1
                    progress = True
        blocked = [(r, self.pc[r], acts[self.pc[r]]) for r, acts in enumerate(self.lists) if self.pc[r] < len(acts)]
        if blocked:
            raise DeadlockError(_deadlock_message(self.s, blocked))

    def step(self, rank: int, a: Action) -> bool:
        """Run action ``a`` on ``rank`` if it can run now; False if it must wait for a message."""
        if a.op.startswith("recv"):
            key = _message(a)
            if key not in self.messages:
                return False
            self.clock[rank] = max(self.clock[rank], self.messages[key])
            self.ready[_data(a)] = self.clock[rank]
        elif a.op.startswith("send"):
            self.messages[_message(a)] = self.clock[rank] + self.sim.t_comm
        else:
            self.compute(rank, a)
        return True

    def compute(self, rank: int, a: Action) -> None:
        needs = _needs(a, self.s.stages)
        for need in needs:
            if need not in self.ready and need not in self.done:
                raise ScheduleError(
                    f"rank {rank} runs {a} before {_describe(need)}, which it needs and which "
                    f"rank {rank} itself produces later: move {a} after it"
                )
        start = max([self.clock[rank]] + [self.ready.get(n, self.done.get(n, 0.0)) for n in needs])
        end = start + self._cost(a)
        self.clock[rank] = self.done[a] = end
        self.sim.spans.append(Span(rank, a, start, end))
        self._track_memory(rank, a)
        # Data for a neighbouring stage on the same rank needs no message.
        nxt = a.stage + 1 if a.op == "F" else a.stage - 1
        if a.op != "W" and 0 <= nxt < self.s.stages and self.s.rank_of(nxt) == rank:
            self.ready[("input" if a.op == "F" else "grad", a.microbatch, nxt)] = end

    def _cost(self, a: Action) -> float:
        return duration(a, self.s, self.sim.t_f, self.sim.t_b, self.sim.t_w)

    def _track_memory(self, rank: int, a: Action) -> None:
        """Activations are kept from F until the backward that frees them is over."""
        frees = "W" if (a.microbatch, a.stage) in self.s.split_backward else "B"
        self.held[rank] += 1 if a.op == "F" else -1 if a.op == frees else 0
        self.sim.peak_activations[rank] = max(self.sim.peak_activations[rank], self.held[rank])


def _needs(a: Action, stages: int) -> list:
    """What a compute action waits for: data (by key) or an earlier action of the same rank."""
    mb, s = a.microbatch, a.stage
    if a.op == "F":
        return [("input", mb, s)] if s > 0 else []
    if a.op == "B":
        return [Action("F", mb, s)] + ([("grad", mb, s)] if s < stages - 1 else [])
    return [Action("B", mb, s)]


def _message(a: Action) -> tuple:
    """The message a send or receive action handles: (kind, micro-batch, receiving stage)."""
    if a.op == "send_F":
        return ("F", a.microbatch, a.stage + 1)
    if a.op == "send_B":
        return ("B", a.microbatch, a.stage - 1)
    return (a.op[-1], a.microbatch, a.stage)


def _data(a: Action) -> tuple:
    """What a receive makes available: the stage's input (recv_F) or its output's gradient (recv_B)."""
    return ("input" if a.op == "recv_F" else "grad", a.microbatch, a.stage)


def _describe(need) -> str:
    if isinstance(need, Action):
        return str(need)
    kind, mb, s = need
    return f"F{mb}s{s - 1} (the input of stage {s})" if kind == "input" else f"B{mb}s{s + 1} (its output's gradient)"


def _deadlock_message(schedule, blocked) -> str:
    lines = [f"{schedule.name} deadlocks: every unfinished rank waits for a message that no running rank will send."]
    for rank, index, a in blocked:
        kind, mb, stage = _message(a)
        source = stage - 1 if kind == "F" else stage + 1
        producer = Action(kind, mb, source)
        lines.append(f"  rank {rank} waits at action {index} ({a}) for {producer} from rank {schedule.rank_of(source)}")
    lines.append(
        "Reorder the compute actions so that each F comes after the F of the previous stage and each B "
        "after the B of the next stage can have run (e.g. 1F1B's warm-up of p-1-rank forwards)."
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------- the bubble
def bubble_fraction(timelines) -> float:
    """The book's ``r_bubble``: idle time over compute time, summed over the ranks.

    ``timelines``: a :class:`Simulation`, or measured ``Timeline.rows()`` (one flat list, or
    one list per rank as ``cluster.run`` returns them) whose compute events carry the names
    the pipeline logs ("forward 3 stage 1"; other events are ignored). The step runs from the
    first action to the last; a rank is idle whenever it is not computing in that window.
    """
    if isinstance(timelines, Simulation):
        rows = timelines.rows()
    else:
        rows = (
            [e for per_rank in timelines for e in per_rank]
            if timelines and isinstance(timelines[0], list)
            else list(timelines)
        )
    rows = [e for e in rows if e.get("lane", "compute") == "compute" and action_of(e["name"])]
    if not rows:
        raise ValueError("no pipeline compute events: expected names such as 'forward 3 stage 1'")
    start, end = min(e["start"] for e in rows), max(e["end"] for e in rows)
    busy = {}
    for r in {e["rank"] for e in rows}:
        busy[r] = covered_seconds([(e["start"], e["end"]) for e in rows if e["rank"] == r])
    compute = sum(busy.values())
    return (len(busy) * (end - start) - compute) / compute


def predicted_bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """The book's formula: ``(p-1)/(v m)`` (AFAB and 1F1B with v = 1; naive: m = 1, so p-1)."""
    return (p - 1) / (v * m)


def covered_seconds(intervals) -> float:
    """Length of the union of (start, end) intervals (a rank's overlapping events count once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
