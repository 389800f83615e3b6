"""The book's pipeline schedules, as per-rank lists of compute actions.

Each ``<schedule>_rank(p, m, ..., rank)`` returns one rank's F/B/W list (what an exercise
asks for), and ``<schedule>(p, m, ...)`` the checked :class:`Schedule` of all ranks:

* ``naive``: one batch through the stages and back: ``afab`` with m = 1;
* ``afab``: all forwards, then all backwards (GPipe); m micro-batches' activations in flight;
* ``one_f_one_b``: p-1-rank forwards to fill the pipe, then one forward, one backward
  (PipeDream-Flush, Megatron-LM): the same bubble as AFAB, at most p activations in flight;
* ``interleaved_1f1b``: v chunks per rank, looping over the ranks (Megatron-LM's interleaved
  schedule): the bubble shrinks to (p-1)/(v m), communication grows v times. Micro-batches
  go through the chunks in rounds: depth-first (rounds of about p, Megatron) drains them
  early; breadth-first (one round of all m) fills the pipe first (Lamy-Poirier's
  "Breadth-First Pipeline"); Llama 3.1 tunes between the two;
* ``zb_h1``: 1F1B with the backward split into B (input gradients, on the critical path) and
  W (weight gradients), rank r deferring its W by r steps (Zero Bubble's ZB-H1): the bubble of
  1F1B with t_w taken out twice per stage, and 1F1B's highest peak memory (p micro-batches in
  flight) on every rank, where 1F1B's rank r holds only p - r;
* ``dualpipe_v``: DeepSeek's DualPipe folded onto p ranks as a V (rank r holds stages r and
  2p-1-r), as ``torch.distributed.pipelining.ScheduleDualPipeV`` builds it. DualPipe runs the
  forward of one micro-batch *while* the backward of another communicates; our simulator
  runs such a pair back to back, which keeps their order and dependencies.

The orders follow ``torch.distributed.pipelining``'s schedules, so the action lists can be
compared with theirs (see tests/test_pipeline_parallel.py).
"""

from __future__ import annotations

from .actions import Action, Schedule, ScheduleError


def _check(p, m, v=1, minimum_m=1, why="") -> None:
    for name, value in (("p", p), ("m", m), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(
                f"{name}={value!r}: the number of ranks p, of micro-batches m and of chunks v must be integers >= 1"
            )
    if m < minimum_m:
        raise ScheduleError(f"m={m} micro-batches: {why} needs m >= {minimum_m}")


# --------------------------------------------------------------------------- AFAB and 1F1B
def afab_rank(p: int, m: int, rank: int) -> list[Action]:
    """All forwards, then all backwards, in micro-batch order."""
    return [Action("F", mb, rank) for mb in range(m)] + [Action("B", mb, rank) for mb in range(m)]


def afab(p: int, m: int) -> Schedule:
    _check(p, m)
    return Schedule("AFAB", [afab_rank(p, m, r) for r in range(p)], m)


def naive(p: int) -> Schedule:
    """The whole batch as one micro-batch: every rank but one idles at any time."""
    _check(p, 1)
    return Schedule("naive", [afab_rank(p, 1, r) for r in range(p)], 1)


def one_f_one_b_rank(p: int, m: int, rank: int) -> list[Action]:
    """Warm up with p-1-rank forwards, then alternate one forward and one backward, then drain."""
    forwards = [Action("F", mb, rank) for mb in range(m)]
    backwards = [Action("B", mb, rank) for mb in range(m)]
    return one_forward_one_backward(forwards, backwards, warmup=min(p - 1 - rank, m))


def one_f_one_b(p: int, m: int) -> Schedule:
    _check(p, m)
    return Schedule("1F1B", [one_f_one_b_rank(p, m, r) for r in range(p)], m)


def one_forward_one_backward(forwards, backwards, warmup: int, weight_lag: int | None = None) -> list[Action]:
    """The 1F1B pattern over given orders: ``warmup`` forwards, then F, B pairs, then the
    remaining backwards. With ``weight_lag`` the backwards are split: the W of the k-th B
    follows the (k + weight_lag)-th B, and the W still owed are run at the end."""
    out = list(forwards[:warmup])
    pairs = [[f, b] for f, b in zip(forwards[warmup:], backwards)]
    for k, b in enumerate(backwards):
        out += pairs[k] if k < len(pairs) else [b]
        if weight_lag is not None and k >= weight_lag:
            out.append(_weight(backwards[k - weight_lag]))
    if weight_lag is not None:
        out += [_weight(b) for b in backwards[max(len(backwards) - weight_lag, 0) :]]
    return out


def _weight(b: Action) -> Action:
    return Action("W", b.microbatch, b.stage)


# --------------------------------------------------------------------------- interleaved
ORDERS = ("depth-first", "breadth-first")


def round_sizes(m: int, rounds: int) -> list[int]:
    """m micro-batches in ``rounds`` rounds as equal as can be, the larger ones first."""
    q, extra = divmod(m, rounds)
    return [q + 1] * extra + [q] * (rounds - extra)


def interleaved_rank(p: int, m: int, v: int, rank: int, rounds: int) -> list[Action]:
    """Rank ``rank``'s chunks are stages rank, rank+p, ...; the micro-batches go through them in
    ``rounds`` rounds: the forwards of a round visit the chunks first to last, its backwards
    last to first. The warm-up fills the pipe for the first backward (Megatron-LM)."""
    stages = [c * p + rank for c in range(v)]
    sizes = round_sizes(m, rounds)
    starts = [sum(sizes[:i]) for i in range(rounds)]
    groups = [range(start, start + size) for start, size in zip(starts, sizes)]
    forwards = [Action("F", mb, s) for g in groups for s in stages for mb in g]
    backwards = [Action("B", mb, s) for g in groups for s in reversed(stages) for mb in g]
    warmup = (v - 1) * sizes[0] + 2 * (p - 1 - rank) if v > 1 else p - 1 - rank
    return one_forward_one_backward(forwards, backwards, min(warmup, m * v))


def interleaved_1f1b(p: int, m: int, v: int = 2, order: str = "depth-first", rounds: int | None = None) -> Schedule:
    """Interleaved 1F1B. ``order`` sets the number of rounds unless ``rounds`` is given:
    depth-first takes rounds of about p micro-batches (``m // p`` of them, as
    ``ScheduleInterleaved1F1B`` does; Megatron-LM needs m to be a multiple of p, we spread the
    rest over the rounds), breadth-first one round of all m. Every round must hold at least p
    micro-batches, or a rank would start a backward before the pipe is full: the simulator
    finds such schedules deadlocking. The bubble is (p-1)/(v m) for any m >= p."""
    _check(p, m, v)
    if order not in ORDERS:
        raise ScheduleError(f"order={order!r}: choose one of {ORDERS}")
    if rounds is None:
        rounds = max(1, m // p) if order == "depth-first" else 1
    if not 1 <= rounds <= max(1, m // p):
        raise ScheduleError(
            f"rounds={rounds}: with m={m} and p={p} choose 1 .. {max(1, m // p)} rounds "
            "(each round needs at least p micro-batches)"
        )
    name = f"interleaved 1F1B ({order})" if v > 1 else "1F1B"
    return Schedule(name, [interleaved_rank(p, m, v, r, rounds) for r in range(p)], m, chunks=v)


# --------------------------------------------------------------------------- Zero Bubble
def zb_h1_rank(p: int, m: int, rank: int) -> list[Action]:
    """1F1B with split backwards; rank r defers its weight gradients by r steps, which lets the
    B's travel back up the pipe sooner, and runs the deferred W's in the cool-down bubble."""
    forwards = [Action("F", mb, rank) for mb in range(m)]
    backwards = [Action("B", mb, rank) for mb in range(m)]
    return one_forward_one_backward(forwards, backwards, warmup=min(p - 1 - rank, m), weight_lag=rank)


def zb_h1(p: int, m: int) -> Schedule:
    _check(p, m)
    return Schedule("ZB-H1", [zb_h1_rank(p, m, r) for r in range(p)], m)


# --------------------------------------------------------------------------- DualPipeV
def dualpipe_v_rank(p: int, m: int, rank: int) -> list[Action]:
    """The eight phases of ScheduleDualPipeV for one rank (stages rank and 2p-1-rank)."""
    s0, s1 = rank, 2 * p - 1 - rank
    out, counters, owed = [], {}, []

    def add(stage, op, split=False):
        mb = counters.get((stage, op), 0)
        counters[stage, op] = mb + 1
        out.append(Action(op, mb, stage))
        if split:  # B computed only the input gradients: W is owed
            owed.append(Action("W", mb, stage))

    def add_owed_weight():
        if owed:
            out.append(owed.pop(0))

    for _ in range(2 * (p - rank - 1)):  # 1: fill the first chunk
        add(s0, "F")
    for _ in range(rank + 1):  # 2: both chunks forward
        add(s0, "F")
        add(s1, "F")
    for _ in range(p - rank - 1):  # 3: zero-bubble steps on the second chunk
        add(s1, "B", split=True)
        add_owed_weight()
        add(s1, "F")
    for _ in range(m - 2 * p + rank + 1):  # 4: the main loop, F of one chunk with B of the other
        add(s0, "F")
        add(s1, "B")
        add(s1, "F")
        add(s0, "B")
    for _ in range(p - rank - 1):  # 5
        add(s1, "B")
        add(s1, "F")
        add(s0, "B")
    split = False
    for i in range(rank + 1):  # 6: from the middle on, split the backwards
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        add(s1, "B", split)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        add(s0, "B", split)
    for _ in range(p - rank - 1):  # 7
        add_owed_weight()
        add(s0, "B", split)
    for _ in range(rank + 1):  # 8: the weight gradients still owed
        add_owed_weight()
    assert not owed, f"DualPipeV generator left {owed} without W"
    return out


def dualpipe_v(p: int, m: int) -> Schedule:
    _check(p, m, minimum_m=2 * p, why="DualPipeV (two stages per rank, each fed by its own stream)")
    return Schedule("DualPipeV", [dualpipe_v_rank(p, m, r) for r in range(p)], m, chunks=2, placement="v")


# --------------------------------------------------------------------------- by name
SCHEDULES = {
    "naive": lambda p, m=1, v=1: naive(p),
    "afab": lambda p, m, v=1: afab(p, m),
    "1f1b": lambda p, m, v=1: one_f_one_b(p, m),
    "interleaved": lambda p, m, v=2: interleaved_1f1b(p, m, v, "depth-first"),
    "interleaved-bf": lambda p, m, v=2: interleaved_1f1b(p, m, v, "breadth-first"),
    "zb-h1": lambda p, m, v=1: zb_h1(p, m),
    "dualpipe-v": lambda p, m, v=2: dualpipe_v(p, m),
}
CHUNKS = {"interleaved": 2, "interleaved-bf": 2, "dualpipe-v": 2}  # v when not given


def make_schedule(name: str, p: int, m: int, v: int | None = None) -> Schedule:
    """A schedule by name (see ``SCHEDULES``): ``make_schedule("1f1b", p=4, m=8)``."""
    key = name.lower()
    if key not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}: choose one of {sorted(SCHEDULES)}")
    v = CHUNKS.get(key, 1) if v is None else v
    if key in ("naive", "afab", "1f1b", "zb-h1") and v != 1:
        raise ScheduleError(f"{name} runs one stage per rank (v=1); use 'interleaved' for v={v} chunks")
    if key == "naive" and m != 1:
        raise ScheduleError(
            f"the naive pipeline runs the batch whole (m=1), got m={m}: use 'afab' or '1f1b' for micro-batches"
        )
    if key == "dualpipe-v" and v != 2:
        raise ScheduleError("DualPipeV holds exactly two stages per rank (v=2)")
    return SCHEDULES[key](p, m, v)
