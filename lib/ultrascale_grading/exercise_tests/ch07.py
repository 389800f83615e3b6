"""Tests of the chapter 7 exercises (solutions/07_pipeline_parallelism_exercises.ipynb):
pipeline parallelism's pieces, one at a time.

* ``07.one_f_one_b``: ``one_f_one_b_list(p, m, rank)``, rank ``rank``'s compute actions under
  1F1B (``"F3"``/``"B3"`` strings or ``schedule.Action``s). Graded by the simulator: the lists
  of all ranks must build a valid :class:`~ultrascale.schedule.Schedule` (one F and one B per
  micro-batch, no deadlock), whose simulated bubble is (p-1)/m and whose ranks hold at most
  ``min(p - rank, m)`` micro-batches at once. An AFAB list (same bubble, m in flight), a
  warm-up one too long or too short, and lists that ignore the rank are named.
* ``07.bubble_fraction``: ``bubble(spans)``, the book's r_bubble from per-rank compute spans
  ``[[(start, end), ...], ...]``: idle time over compute time, summed over the ranks, the step
  running from the first start to the last end. Graded against ``schedule.bubble_fraction`` on
  simulated timelines of every schedule (with P2P latency, shifted in time, Zero Bubble and
  DualPipeV, where the formula (p-1)/m does not hold); idle over the step's time, per-rank
  windows and the formula itself are named.
* ``07.stage_step``: ``forward_step`` and ``backward_step`` of one rank's stage with
  ``send``/``recv``. The test drives them on real ranks (2, 3 and the notebook's
  ``WORLD_SIZE``) in the 1F1B and AFAB orders and compares every gradient with gradient
  accumulation in one process (float64, ``parity.assert_same``). Sends must be ``isend``s
  returned to the caller, not waited for inside a step: with NCCL a send completes only when
  the receiver posts its receive, and in 1F1B neighbours send to each other at the same time.
* ``07.split_backward``: ``backward_input`` (Zero Bubble's B: the input's gradient only, the
  graph kept) and ``backward_weight`` (W: the weights' gradients, added to ``.grad``), run in the
  deferred order B0 B1 W0 W1 on a stage of the course GPT and compared with whole backwards after
  every W. Tensor hooks show B computing weight gradients or W the input's; B must leave
  grad_output, which W uses again, unchanged.

While the learner's code runs the library's own answers refuse to run
(``grading.guards.forbid_library``). Tolerances: the simulator adds exact multiples, so
bubbles are compared to 1e-9; gradients with ``parity.TOLERANCES`` in float64.
"""

from __future__ import annotations

import functools
import importlib
import math

import torch
import torch.distributed as dist

from ultrascale_grading.exercise_tests.ch06_ring_step import P2PTracker
from ultrascale_grading import exercise

EXACT = 1e-9


# ---- 07.one_f_one_b ---------------------------------------------------------------------


def _as_actions(got, rank: int, call: str):
    from ultrascale.schedule import Action, parse

    if not isinstance(got, (list, tuple)):
        raise AssertionError(f"{call} returned {type(got).__name__}; return a list such as ['F0', 'F1', 'B0', ...]")
    out = []
    for item in got:
        if isinstance(item, str):
            try:
                actions = parse(item, stage=rank)
            except ValueError as err:  # e.g. 'B-3': a micro-batch counted from a negative start
                raise AssertionError(f"{call}: {err}") from None
            if len(actions) != 1:
                raise AssertionError(f"{call}: {item!r} is not one action; write one per item, e.g. 'F3'")
            out.append(actions[0])
        elif isinstance(item, tuple) and len(item) in (2, 3):
            out.append(Action(*item))
        else:
            raise AssertionError(f"{call}: {item!r} is not an action; use strings like 'F3' and 'B3'")
    return out


def _one_f_one_b_cases(quick: bool):
    # (6, 2) has fewer micro-batches than ranks 0..3's warm-up: a warm-up of p - 1 - rank forwards
    # not capped at m asks for micro-batches that do not exist, and only such a case shows it.
    cases = [(2, 4), (3, 5), (4, 8), (4, 3), (4, 4), (1, 3), (6, 2)]
    return cases if quick else cases + [(5, 7), (8, 32)]


@exercise("07.one_f_one_b", points=1)
def test_one_f_one_b(one_f_one_b_list, world_size: int = 4, quick: bool = True, seed: int = 0, timeout: float = 60):
    from ultrascale_grading.guards import call_learner, forbid_library
    from ultrascale.schedule import Schedule, ScheduleError, generators, simulate

    assert callable(one_f_one_b_list), f"pass your function, got {one_f_one_b_list!r}"
    forbidden = [
        generators.one_f_one_b_rank,
        generators.one_f_one_b,
        generators.one_forward_one_backward,
        generators.interleaved_rank,
        generators.interleaved_1f1b,
        generators.zb_h1_rank,
        generators.make_schedule,
    ]
    for p, m in dict.fromkeys(_one_f_one_b_cases(quick) + [(world_size, world_size + 1)]):
        lists = []
        for rank in range(p):
            call = f"one_f_one_b_list(p={p}, m={m}, rank={rank})"
            with forbid_library(forbidden, "07.one_f_one_b", "write the warm-up, the F/B pairs and the drain"):
                got = call_learner(one_f_one_b_list, p, m, rank, call=call)
            lists.append(_as_actions(got, rank, call))
        where = f"p={p}, m={m}"
        beyond = [
            f"rank {rank}: {a.op}{a.microbatch}"
            for rank, actions in enumerate(lists)
            for a in actions
            if not 0 <= a.microbatch < m
        ]
        if beyond:
            raise AssertionError(
                f"{where}: {beyond[0]}, but there are only m={m} micro-batches (0..{m - 1}). "
                "With fewer micro-batches than stages the warm-up is cut short: it cannot run "
                "more forwards than there are micro-batches"
            )
        try:
            schedule = Schedule("your 1F1B", lists, m)
        except ScheduleError as err:
            raise AssertionError(f"{where}: your lists are not a schedule that can run: {err}") from None
        sim = simulate(schedule)
        want = [min(p - r, m) for r in range(p)]
        if sim.peak_activations == [m] * p and p > 1 and m > 1:
            raise AssertionError(
                f"{where}: every rank holds all m={m} micro-batches at once: that is AFAB (all "
                "forwards, then all backwards). 1F1B starts a backward as soon as the pipe is full: "
                "p - 1 - rank forwards, then one forward and one backward in turn, then the rest"
            )
        if abs(sim.bubble_fraction - (p - 1) / m) > EXACT:
            raise AssertionError(
                f"{where}: the simulated bubble is {sim.bubble_fraction:.4f}, not (p-1)/m = "
                f"{(p - 1) / m:.4f}: some rank waits longer than 1F1B makes it (too short a "
                "warm-up, or backwards out of order: oldest micro-batch first)"
            )
        if sim.peak_activations != want:
            raise AssertionError(
                f"{where}: your ranks hold {sim.peak_activations} micro-batches at once; 1F1B holds "
                f"{want} (min(p - rank, m)). The warm-up of rank r is p - 1 - rank forwards"
            )


# ---- 07.bubble_fraction -----------------------------------------------------------------


def _bubble_cases(seed: int) -> dict:
    """name -> (Simulation, shift in seconds, how the ranks' span lists are arranged).

    In every simulated timeline rank 0 starts first and ends last, and each rank's spans come in
    time order; the last two cases break both, so that only the first start and the last end
    over all spans make the step."""
    from ultrascale.schedule import afab, dualpipe_v, interleaved_1f1b, naive, one_f_one_b, simulate, zb_h1

    as_simulated = list
    return {
        "naive, p=3": (simulate(naive(3)), 0.0, as_simulated),
        "AFAB, p=4, m=8": (simulate(afab(4, 8)), 0.0, as_simulated),
        "1F1B, p=4, m=6, t_b = 3 t_f, starting at t = 100": (simulate(one_f_one_b(4, 6), t_b=3.0), 100.0, as_simulated),
        "1F1B, p=3, m=5, messages taking 0.3 t_f": (simulate(one_f_one_b(3, 5), t_comm=0.3), 0.0, as_simulated),
        "interleaved, p=4, m=8, v=2": (simulate(interleaved_1f1b(4, 8, 2)), 0.0, as_simulated),
        "ZB-H1, p=4, m=6": (simulate(zb_h1(4, 6)), 0.0, as_simulated),
        "DualPipeV, p=2, m=5": (simulate(dualpipe_v(2, 5)), 7.5 + seed, as_simulated),
        "1F1B, p=4, m=6, the ranks listed last to first (the first start and the last end on the last list)": (
            simulate(one_f_one_b(4, 6), t_b=3.0),
            0.0,
            lambda spans: spans[::-1],
        ),
        "AFAB, p=3, m=4, each rank's spans listed newest first": (
            simulate(afab(3, 4), t_comm=0.2),
            0.0,
            lambda spans: [r[::-1] for r in spans],
        ),
    }


def _spans(sim, shift: float) -> list:
    ranks = sim.schedule.ranks
    return [[(s.start + shift, s.end + shift) for s in sim.spans if s.rank == r] for r in range(ranks)]


def _judge_bubble(got, spans, want, sim) -> str | None:
    if isinstance(got, bool) or not isinstance(got, (int, float)) and not (torch.is_tensor(got) and got.numel() == 1):
        return f"return a number, got {type(got).__name__}"
    got = float(got)
    if math.isclose(got, want, rel_tol=EXACT, abs_tol=EXACT):
        return None
    start = min(a for r in spans for a, _ in r)
    end = max(b for r in spans for _, b in r)
    busy = sum(b - a for r in spans for a, b in r)
    idle = len(spans) * (end - start) - busy
    s = sim.schedule
    if math.isclose(got, idle / (len(spans) * (end - start)), rel_tol=1e-6):
        return (
            f"{got:.4f} is the idle share of the step's time. The book's r_bubble divides the idle time by "
            f"the compute time, t_pb / t_id: expected {want:.4f}"
        )
    if math.isclose(got, (s.ranks - 1) / (s.chunks * s.microbatches), rel_tol=1e-6):
        return (
            f"{got:.4f} is the formula (p-1)/(v m), which holds only when t_b = 2 t_f and messages cost "
            f"nothing: measure the spans instead (expected {want:.4f})"
        )
    # Windows read off the lists' positions instead of the times: rank 0's first and last span,
    # or each rank's first and last span.
    windows = [(spans[0][0][0], spans[0][-1][1]), (min(r[0][0] for r in spans), max(r[-1][1] for r in spans))]
    if any(
        math.isclose(got, (len(spans) * (b - a) - busy) / busy, rel_tol=1e-6)
        for a, b in windows
        if (a, b) != (start, end)
    ):
        return (
            "the step must run from the earliest start to the latest end over *all* spans, wherever they "
            "stand in the lists: here the first to start or the last to end is not the first span of rank 0 "
            f"or the last one of a rank (use min and max over every span; expected {want:.4f})"
        )
    own = sum(max(b for _, b in r) - min(a for a, _ in r) for r in spans) - busy
    if math.isclose(got, own / busy, rel_tol=1e-6):
        return (
            "each rank's idle time counted from its own first to its own last action: a rank that starts late "
            f"or ends early idles from the step's start to its end too (expected {want:.4f})"
        )
    return f"{got:.4f}, expected {want:.4f}: idle time (ranks x step - compute) over compute time"


@exercise("07.bubble_fraction", points=1)
def test_bubble_fraction(bubble, world_size: int = 4, quick: bool = True, seed: int = 0, timeout: float = 60):
    from ultrascale_grading.guards import call_learner, forbid_library

    simulate_module = importlib.import_module("ultrascale.schedule.simulate")  # the package has a function so named

    assert callable(bubble), f"pass your function, got {bubble!r}"
    forbidden = [
        simulate_module.bubble_fraction,
        simulate_module.covered_seconds,
        simulate_module.predicted_bubble_fraction,
    ]
    for name, (sim, shift, arrange) in _bubble_cases(seed).items():
        spans = arrange(_spans(sim, shift))
        want = simulate_module.bubble_fraction(sim)
        with forbid_library(forbidden, "07.bubble_fraction", "sum the spans and the idle time yourself"):
            got = call_learner(bubble, [list(r) for r in spans], call=f"bubble(spans of {name})")
        problem = _judge_bubble(got, spans, want, sim)
        if problem:
            raise AssertionError(f"{name}: {problem}")


# ---- 07.stage_step ----------------------------------------------------------------------

NOT_IMPLEMENTED = "not implemented: "
CFG_KW = dict(vocab_size=64, hidden=16, heads=2, seq_len=8)
DT = torch.float64


def _model(layers: int, seed: int, device=None):
    """Seeded and perturbed on the host, then moved to ``device`` (a rank's ``ctx.device``)."""
    from ultrascale.model import GPT, GPTConfig
    from ultrascale.parity import perturbed

    torch.manual_seed(seed)
    return perturbed(GPT(GPTConfig(layers=layers, **CFG_KW)).to(DT), seed=seed).to(device)


def _micro(m: int, seed: int):
    from ultrascale.model import GPTConfig
    from ultrascale.data import Batches, micro_batches

    return micro_batches(Batches(GPTConfig(layers=1, **CFG_KW), mbs=m, seed=seed).global_batch(0), m)


def _reference(p: int, m: int, seed: int) -> dict:
    """Gradient accumulation in one process over the m micro-batches: the gradients."""
    from ultrascale.parity.pipeline_runs import one_process

    batches = _micro(m, seed)
    fresh = functools.partial(_model, p, seed)
    return one_process(fresh(), lambda step, micro: batches[micro], m, 0, fresh=fresh)["grads"]


class _DeferredSend:
    """A send's work whose ``wait`` inside a step is noted but does not block: a step that waits
    for its own send would otherwise hang the ranks (the receive comes in a later action), and
    the learner would see a timeout instead of the reason. ``finish`` waits for real."""

    def __init__(self, work):
        self.work, self.waited = work, False

    def wait(self, *args, **kwargs):
        self.waited = True
        return True

    def finish(self):
        return self.work.wait()


STAGE_PEERS = (
    "stage r sends its activations to the group's rank r + 1 and receives them from r - 1, and the "
    "gradients go the other way (no wrap-around: the first stage receives no activations, the last "
    "sends none), r being this rank's place in the pipeline's group, not its global rank"
)


class _SendTracker(P2PTracker):
    """Chapter 6's tracker, with the works of ``isend`` deferred (see ``_DeferredSend``) and the group of
    every transfer noted."""

    def __init__(self, ranks):
        super().__init__(ranks, STAGE_PEERS, "the pipeline")
        self.sends, self.groups = [], []

    def _wrap(self, name, original):
        counted = super()._wrap(name, original)
        if name == "batch_isend_irecv":
            return counted

        @functools.wraps(original)
        def wrapped(*args, **kwargs):  # send/recv(tensor, peer, group=None, ...): note the group
            self.groups.append(kwargs.get("group", args[2] if len(args) > 2 else None))
            return counted(*args, **kwargs)

        if name != "isend":
            return wrapped

        @functools.wraps(original)
        def isend(*args, **kwargs):
            work = wrapped(*args, **kwargs)
            if work is not None:
                work = _DeferredSend(work)
                self.sends.append(work)
            return work

        return isend


def _stage_on_rank(ctx, forward_step, backward_step, order: str, m: int, seed: int) -> dict:
    """Run the learner's steps in ``order`` on this rank; this rank's gradients, or a problem."""
    from ultrascale_grading.guards import ForbiddenCall, forbid_library
    from ultrascale.model import lm_loss
    from ultrascale.parallel import pipeline_parallel as pp_module
    from ultrascale.parallel.pipeline_messages import twin_group
    from ultrascale.parallel.pipeline_parallel import apply_pp
    from ultrascale.schedule import afab_rank, one_f_one_b_rank

    r, p = ctx.rank, ctx.world_size
    pipe = apply_pp(_model(p, seed, ctx.device), schedule="1f1b", microbatches=m)  # this rank's stage and names
    # forward_step's messages go down the ranks on the world group, backward_step's up on its
    # twin: under NCCL a receive queued behind a send the other way would wait forever
    # (pipeline_messages' module docstring), in 1F1B where neighbours send to each other first
    groups = {"F": ctx.group, "B": twin_group(ctx.group)}
    chunk = pipe.chunks[str(r)]
    batches = [batch.to(ctx.device) for batch in _micro(m, seed)]
    shape = (*batches[0].inputs.shape, CFG_KW["hidden"])
    actions = (one_f_one_b_rank if order == "1F1B" else afab_rank)(p, m, r)
    held, pending = {}, []
    forbidden = [
        pp_module.Pipeline.step,
        pp_module.Pipeline._F,
        pp_module.Pipeline._B,
        pp_module.Pipeline._send,
        pp_module.Pipeline._receive,
    ]

    def stage_for(mb):
        if r < p - 1:
            return chunk
        return lambda x: lm_loss(chunk(x), batches[mb].targets) / m  # the last stage ends in the loss

    for a in actions:
        what = (
            f"{order}, p={p}, m={m}, rank {r}, {'forward_step' if a.op == 'F' else 'backward_step'} of "
            f"micro-batch {a.microbatch}"
        )
        tracker = _SendTracker(range(p))
        try:
            with tracker, forbid_library(forbidden, "07.stage_step", "send and receive with dist.isend / dist.recv"):
                if a.op == "F":
                    got = forward_step(
                        stage_for(a.microbatch), batches[a.microbatch].inputs, groups["F"], r, p, shape, DT
                    )
                else:
                    got = backward_step(*held.pop(a.microbatch), groups["B"], r, p)
        except ForbiddenCall as err:
            problem = str(err)
        except NotImplementedError as err:  # a stub: check reports "not implemented yet"
            problem = f"{NOT_IMPLEMENTED}{err}"
        except Exception as err:  # judged here, so that this rank reports instead of hanging the others
            problem = f"raised {type(err).__name__}: {err}"
            pending += _stand_in_send(a.op, r, p, tracker, shape, groups[a.op], ctx.device)
        else:
            problem = _judge_transfers(a.op, r, p, tracker, got, groups[a.op])
        if problem is None and a.op == "F":
            if isinstance(got, (tuple, list)) and len(got) == 3:
                held[a.microbatch] = got[:2]
            else:
                problem = "return (stage_input, output, works)"
        if problem is None:
            pending += list((got[2] if a.op == "F" else got) or [])
        # Every rank runs 2m actions, and in the 1F1B and AFAB orders no receive of action k waits for a
        # send of a later action: so all ranks can agree after each one whether to go on, and a rank
        # that found a problem does not leave the others waiting for its messages.
        flag = torch.tensor([0.0 if problem is None else 1.0], device=ctx.device)
        dist.all_reduce(flag, group=ctx.group)
        if flag.item():
            if problem is not None and problem.startswith(NOT_IMPLEMENTED):
                return {"problem": problem}
            return {"problem": None if problem is None else f"{what}: {problem}"}
    for work in pending:
        work.finish() if isinstance(work, _DeferredSend) else work.wait()
    if pipe.tied_peer is not None:
        pipe._add_tied_gradients()
    return {"grads": pipe.gradients()}


def _stand_in_send(op: str, r: int, p: int, tracker, shape, group, device):
    """A step that raised before its send (a send to the wrong rank raises before it is posted)
    leaves its neighbour in a blocking receive that nothing answers, so the ranks would never meet to
    agree to stop. Zeros are sent in its place (the run fails anyway): the neighbour finishes its step
    and hears of the problem. The sends' works: none where this step sends nothing or its send was posted."""
    peer = r + 1 if op == "F" else r - 1
    if not 0 <= peer < p or tracker.posted["isend"] + tracker.posted["send"]:
        return []
    zeros = torch.zeros(shape, dtype=DT, device=device)
    return [dist.isend(zeros, dst=dist.get_global_rank(group, peer), group=group)]


def _judge_transfers(op: str, r: int, p: int, tracker, got, group) -> str | None:
    posted = tracker.posted
    if any(g is not group for g in tracker.groups):
        return (
            "a send or receive without group=group. Each step is given its group (forward_step the one for "
            "messages down the pipeline, backward_step the one for messages up); beside data or tensor "
            "parallelism it is a subgroup, and a transfer on another group never meets its partner: pass "
            "group=group to every dist.isend / dist.recv"
        )
    # torch's blocking send/recv post an isend/irecv and wait for it: count each transfer once.
    sends = max(posted["isend"], posted["send"])
    recvs = max(posted["irecv"], posted["recv"])
    sends_out = (op == "F" and r < p - 1) or (op == "B" and r > 0)
    receives = (op == "F" and r > 0) or (op == "B" and r < p - 1)
    if posted["send"]:
        return (
            "a blocking dist.send: use dist.isend and return its work. With NCCL a send completes only when "
            "the receiver posts its receive, and in 1F1B neighbours send to each other at the same time "
            "(activations down, gradients up): two blocking sends wait for each other forever"
        )
    if sends != int(sends_out):
        return (
            f"{sends} send(s); this step sends {int(sends_out)}: "
            + ("the output to rank + 1" if op == "F" else "the input's gradient to rank - 1")
            if sends_out
            else f"{sends} send(s); this step sends nothing on this rank"
        )
    if recvs != int(receives):
        return (
            f"{recvs} receive(s); this step receives {int(receives)}"
            + (": the activation from rank - 1" if op == "F" and receives else "")
            + (": the output's gradient from rank + 1" if op == "B" and receives else "")
        )
    returned = got[2] if op == "F" and isinstance(got, (tuple, list)) and len(got) == 3 else got
    if any(w.waited for w in tracker.sends):
        return (
            "the step waited for its own send: return the work instead (the caller waits at the end of the "
            "pipeline step), or with NCCL two neighbours sending to each other would both wait forever"
        )
    if sends_out and not returned:
        return "return the send's work (in a list) so that the caller can wait for it at the end of the step"
    return None


@exercise("07.stage_step", points=2)
def test_stage_step(
    forward_step, backward_step, world_size: int = 4, quick: bool = True, seed: int = 0, timeout: float = 60
):
    assert callable(forward_step) and callable(backward_step), "pass forward_step and backward_step"
    sizes = sorted({2, 3, world_size} if quick else {2, 3, 4, world_size})
    for p in sizes:
        for order, m in (("1F1B", p + 1), ("AFAB", 3)):
            check_stages(forward_step, backward_step, p, order, m, seed, timeout)


def check_stages(
    forward_step, backward_step, p: int, order: str, m: int, seed: int, timeout: float, hint: str = ""
) -> None:
    """One pipeline of ``p`` stages run with the learner's steps on ranks, against gradient
    accumulation in one process; raise what is wrong (``hint``: said after any message)."""
    from ultrascale.parity import assert_same, merge_ranks
    from ultrascale.runtime import CallTimeout, grading_cluster

    where = f"{order}, p={p}, m={m}"
    try:
        results = grading_cluster(p).run(_stage_on_rank, forward_step, backward_step, order, m, seed, timeout=timeout)
    except CallTimeout as err:
        raise AssertionError(
            f"{where}: the ranks waited for each other for {timeout:g} s and were stopped. A "
            "receive nobody sends to (a missing send, or one to the wrong rank, or to a rank that "
            f"does not exist)? {str(err).splitlines()[0]}.{hint}"
        ) from None
    problems = [result["problem"] for result in results if "problem" in result]
    if problems:
        grading_cluster(p).restart()  # sends the others posted may have no receiver: a fresh group
        first = next((text for text in problems if text), "a rank failed")
        if first.startswith(NOT_IMPLEMENTED):
            raise NotImplementedError(first[len(NOT_IMPLEMENTED) :])
        raise AssertionError(first + ("." if hint and not first.endswith(".") else "") + hint)
    grads = merge_ranks([result["grads"] for result in results])
    missing = sorted(name for name, g in grads.items() if g is None)
    if missing:
        raise AssertionError(
            f"{where}: no gradient for {missing[:3]}: did backward_step run the stage's backward "
            f"with the received gradient?{hint}"
        )
    assert_same(
        grads,
        _reference(p, m, seed),
        f"{where}: gradients against gradient accumulation in one process",
        optimizer=None,
        dtype=DT,
    )


# ---- 07.split_backward ------------------------------------------------------------------


def _split_stage(seed: int):
    from ultrascale.parallel.pipeline_parallel import build_stage

    return build_stage(_model(4, seed), range(1, 3), first=False, last=False)


class _GradientWatch:
    """Counts, per phase, the gradients autograd computes for the stage's weights and for its input.

    Tensor hooks fire whenever autograd computes a gradient for their tensor, by ``backward`` or by
    ``torch.autograd.grad``: so B computing weight gradients (to stash them for W) or W computing the
    input's gradient again shows here, whatever the code does with the result.
    """

    def __init__(self, params):
        self.seen = {"weights": 0, "input": 0}
        for q in params:
            q.register_hook(self._weight)

    def _weight(self, grad):
        self.seen["weights"] += 1

    def _input(self, grad):
        self.seen["input"] += 1

    def watch_input(self, x):
        x.register_hook(self._input)

    def count(self, what: str) -> int:
        count, self.seen[what] = self.seen[what], 0
        return count


def _micro_batches(seed: int, mbs: int):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(1, CFG_KW["seq_len"], CFG_KW["hidden"], generator=g, dtype=DT) for _ in range(mbs)]
    return xs, [torch.randn(x.shape, generator=g, dtype=DT) for x in xs]


def _problem_split(backward_input, backward_weight, seed: int, mbs: int = 3) -> str | None:
    from ultrascale_grading.guards import call_learner, forbid_library
    from ultrascale.parallel import pipeline_parallel as pp_module
    from ultrascale.parity import max_difference, tolerance
    from ultrascale.train import gradients

    tol = tolerance(None, DT)
    xs, dys = _micro_batches(seed, mbs)
    whole, split = _split_stage(seed), _split_stage(seed)
    want_dx, want_grads = [], []  # the input gradient of each micro-batch, the weights' after each
    for x, dy in zip(xs, dys):
        x = x.clone().requires_grad_()
        whole(x).backward(dy)
        want_dx.append(x.grad)
        want_grads.append(gradients(whole))
    params = [q for q in split.parameters() if q.requires_grad]
    watch = _GradientWatch(params)
    forbid = (
        [pp_module.backward_input, pp_module.backward_weight],
        "07.split_backward",
        "use torch.autograd.grad yourself",
    )
    kept = []
    for i, (x, dy) in enumerate(zip(xs, dys)):  # B0 B1 B2: the input gradients first
        x = x.clone().requires_grad_()
        y = split(x)
        watch.watch_input(x)
        before, given = gradients(split), dy.clone()
        with forbid_library(*forbid):
            dx = call_learner(backward_input, y, x, given, call=f"backward_input(...) of micro-batch {i}")
        if not torch.is_tensor(dx) or dx.shape != x.shape:
            return f"B of micro-batch {i}: return the gradient of stage_input, shaped like it {tuple(x.shape)}"
        if not torch.allclose(dx, want_dx[i], **tol):
            return f"B of micro-batch {i}: the input gradient differs by {max_difference(dx, want_dx[i]):.3g}"
        after = gradients(split)
        if any(
            (before[n] is None) != (after[n] is None) or before[n] is not None and not torch.equal(before[n], after[n])
            for n in before
        ):
            return (
                f"B of micro-batch {i} changed the weights' .grad: B computes only the input's gradient (ask "
                "torch.autograd.grad for that one alone, and keep the graph for W); the weights' gradients are "
                "W's job, later"
            )
        if watch.count("weights"):
            return (
                f"B of micro-batch {i} computed the weights' gradients too (kept for W?). The point of the "
                "split is that B computes only the input's gradient, which the previous stage waits for, "
                "and leaves the weights' to W, which fills the bubbles later: ask torch.autograd.grad for the "
                "stage input's gradient only"
            )
        problem = _grad_output_problem(given, dy, f"B of micro-batch {i}")
        if problem:
            return problem
        kept.append((y, dy))
    watch.count("input")
    for i, (y, dy) in enumerate(kept):  # W0 W1 W2: deferred, as Zero Bubble runs them
        given = dy.clone()
        with forbid_library(*forbid):
            try:
                call_learner(backward_weight, y, params, given, call=f"backward_weight(...) of micro-batch {i}")
            except AssertionError as err:
                if "backward through the graph a second time" in str(err):
                    return (
                        f"W of micro-batch {i}: the graph was freed. B must keep it for W: "
                        "torch.autograd.grad(..., retain_graph=True)"
                    )
                raise
        problem = _weights_problem(gradients(split), want_grads, i, tol)
        if problem:
            return problem
        if watch.count("input"):
            return (
                f"W of micro-batch {i} computed the input's gradient again (a whole backward?). B already did: "
                "W computes only the weights' gradients, torch.autograd.grad(output, params, grad_output)"
            )
    return None


def _grad_output_problem(given, dy, who: str) -> str | None:
    if torch.equal(given, dy):
        return None
    return (
        f"{who} changed grad_output in place. It is the next stage's message, still needed: W uses it "
        "again after B. Compute with it, do not write into it"
    )


def _weights_problem(got, want_grads, i, tol) -> str | None:
    """After W of micro-batch ``i``, .grad must hold the sum of micro-batches 0..i's weight gradients."""
    from ultrascale.parity import max_difference

    want = want_grads[i]
    missing = [n for n, t in got.items() if t is None]
    if missing:
        return (
            f"after W of micro-batch {i}, {len(missing)} weights have no gradient (e.g. {missing[0]}): "
            "W must set their .grad"
        )
    if all(torch.allclose(got[n], want[n], **tol) for n in want):
        return None
    if i > 0:
        alone = {n: want[n] - want_grads[i - 1][n] for n in want}
        if all(torch.allclose(got[n], alone[n], **tol) for n in want):
            return (
                f"after W of micro-batch {i} the weights' gradients are those of the last micro-batch alone: W must "
                "*add* to .grad (p.grad += g when it exists), as backward() does, so micro-batches accumulate"
            )
    return (
        f"after W of micro-batch {i} the weights' gradients differ by {max_difference(got, want):.3g} from those "
        f"backward() leaves after micro-batches 0..{i}: W of micro-batch {i} must add the gradients of its own "
        "output with its own grad_output, once"
    )


@exercise("07.split_backward", points=1)
def test_split_backward(
    backward_input, backward_weight, world_size: int = 4, quick: bool = True, seed: int = 0, timeout: float = 60
):
    assert callable(backward_input) and callable(backward_weight), "pass backward_input and backward_weight"
    problem = _problem_split(backward_input, backward_weight, seed)
    if problem:
        raise AssertionError(problem)
