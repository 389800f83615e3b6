"""A pipeline schedule as data: for every rank, the actions it runs, in order.

An action is one of

* ``F``: the forward of one micro-batch through one stage (a model chunk);
* ``B``: its backward. Without a ``W`` for the same micro-batch and stage, ``B`` is the whole
  backward (gradients of the inputs *and* of the weights); with one, ``B`` computes only the
  input gradients, which the previous stage is waiting for, and ``W`` the weight gradients,
  which nobody waits for until the optimizer step (Zero Bubble's B/W split);
* ``send_F`` / ``recv_F``: the activations leaving stage s for stage s+1 on another rank;
* ``send_B`` / ``recv_B``: the gradient of those activations, going back.

Stages are numbered globally, ``0 .. p*v - 1`` for p ranks with v chunks each. A placement
says which rank holds a stage: ``"loop"`` puts stage s on rank ``s % p`` (Megatron's
interleaving: rank r holds chunks r, r+p, r+2p, ...), ``"v"`` goes down the ranks and back
up (rank r holds stages r and 2p-1-r: ZB-V and DualPipeV).

A :class:`Schedule` is built from the compute actions alone (what the book's figures show);
the send/recv actions are derived from the placement, so the simulator and the ranks run
exactly the same lists (``schedule.actions(rank)``). Building a schedule checks it: every
micro-batch has one F and one B on every stage (and at most one W), on the rank that holds
the stage, and the simulator runs it once to prove that it cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .ops import COMM_OPS, COMPUTE_OPS, Action, ScheduleError
from .simulate import simulate

PLACEMENTS = ("loop", "v")


def parse(text: str, stage: int = 0) -> list[Action]:
    """Actions from their short form: ``parse("F0 F1 B0 F2 B1 B2")``, or with stages
    ``"F0s1 B0s1"``; ``stage`` is the default for tokens that do not name one."""
    out = []
    for token in text.split():
        op = token.rstrip("0123456789s")
        rest = token[len(op) :]
        mb, _, s = rest.partition("s")
        if op not in COMPUTE_OPS + COMM_OPS or not mb.isdigit() or (s and not s.isdigit()):
            raise ValueError(f"cannot read {token!r}: write e.g. F0, B3 or W2s1 (op, micro-batch, s + stage)")
        out.append(Action(op, int(mb), int(s) if s else stage))
    return out


def rank_of_stage(stage: int, ranks: int, placement: str = "loop") -> int:
    """The rank holding ``stage`` under a placement (see the module docstring)."""
    if placement == "loop":
        return stage % ranks
    lap, position = divmod(stage, ranks)  # "v": down on even laps, back up on odd ones
    return position if lap % 2 == 0 else ranks - 1 - position


@dataclass(frozen=True)
class Schedule:
    """Per-rank compute actions (F, B, W) for ``microbatches`` micro-batches.

    ``compute[r]`` is rank r's list, in the order it runs them; ``chunks`` (v) is the number
    of stages per rank. Use ``actions(r)`` for the full list with send/recv, which is what
    both the simulator and the real ranks execute.
    """

    name: str
    compute: tuple
    microbatches: int
    chunks: int = 1
    placement: str = "loop"

    def __post_init__(self):
        object.__setattr__(self, "compute", tuple(tuple(Action(*a) for a in acts) for acts in self.compute))
        _check_sizes(self)
        _check_complete(self)
        simulate(self)  # the simulator proves that the lists cannot deadlock

    # ------------------------------------------------------------------ layout
    @property
    def ranks(self) -> int:
        """p, the pipeline-parallel degree."""
        return len(self.compute)

    @property
    def stages(self) -> int:
        return self.ranks * self.chunks

    def rank_of(self, stage: int) -> int:
        return rank_of_stage(stage, self.ranks, self.placement)

    def stages_of(self, rank: int) -> list[int]:
        """The stages (model chunks) rank ``rank`` holds, in model order."""
        return [s for s in range(self.stages) if self.rank_of(s) == rank]

    def chunk_of(self, stage: int) -> int:
        """Which of its rank's chunks ``stage`` is: 0 for the first, v-1 for the last."""
        return self.stages_of(self.rank_of(stage)).index(stage)

    @cached_property
    def split_backward(self) -> frozenset:
        """(micro-batch, stage) pairs whose backward is split into B and W."""
        return frozenset((a.microbatch, a.stage) for acts in self.compute for a in acts if a.op == "W")

    # ------------------------------------------------------------------ with communication
    def actions(self, rank: int) -> list[Action]:
        """Rank ``rank``'s compute actions with the send/recv they need.

        A receive goes right before the action that needs the data, and a send right after
        the action that produced it: sends never block (``isend``), receives do.
        """
        out = []
        for a in self.compute[rank]:
            before, after = self._neighbour(a, -1), self._neighbour(a, +1)
            if a.op == "F" and before is not None and before != rank:
                out.append(Action("recv_F", a.microbatch, a.stage))
            if a.op == "B" and after is not None and after != rank:
                out.append(Action("recv_B", a.microbatch, a.stage))
            out.append(a)
            if a.op == "F" and after is not None and after != rank:
                out.append(Action("send_F", a.microbatch, a.stage))
            if a.op == "B" and before is not None and before != rank:
                out.append(Action("send_B", a.microbatch, a.stage))
        return out

    def _neighbour(self, action: Action, step: int):
        """The rank of the stage before (step=-1) or after (+1) the action's, or None at an end."""
        stage = action.stage + step
        return self.rank_of(stage) if 0 <= stage < self.stages else None

    def __str__(self) -> str:
        lines = [f"{self.name}: p={self.ranks}, m={self.microbatches}, v={self.chunks}"]
        lines += [f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.compute)]
        return "\n".join(lines)


def _check_sizes(s: Schedule) -> None:
    if s.ranks < 1:
        raise ScheduleError("a schedule needs at least one rank")
    if isinstance(s.microbatches, bool) or not isinstance(s.microbatches, int) or s.microbatches < 1:
        raise ScheduleError(f"m={s.microbatches!r} micro-batches: a pipeline needs at least one (m >= 1)")
    if s.chunks < 1:
        raise ScheduleError(f"v={s.chunks} chunks per rank: use v >= 1")
    if s.placement not in PLACEMENTS:
        raise ScheduleError(f"placement={s.placement!r}: choose one of {PLACEMENTS}")


def _check_complete(s: Schedule) -> None:
    """One F and one B per (micro-batch, stage), at most one W, each on the stage's rank."""
    seen = {}
    for rank, acts in enumerate(s.compute):
        for a in acts:
            if a.op not in COMPUTE_OPS:
                raise ScheduleError(
                    f"rank {rank}: {a} is not a compute action; give F, B and W only "
                    "(send/recv are derived from the placement)"
                )
            if not (0 <= a.microbatch < s.microbatches and 0 <= a.stage < s.stages):
                raise ScheduleError(
                    f"rank {rank}: {a} is outside micro-batches 0..{s.microbatches - 1} or stages 0..{s.stages - 1}"
                )
            if s.rank_of(a.stage) != rank:
                raise ScheduleError(
                    f"rank {rank} runs {a}, but stage {a.stage} lives on rank "
                    f"{s.rank_of(a.stage)} ({s.placement} placement)"
                )
            if a in seen:
                raise ScheduleError(f"rank {rank} runs {a} twice")
            seen[a] = rank
    missing = [
        Action(op, mb, st)
        for st in range(s.stages)
        for mb in range(s.microbatches)
        for op in ("F", "B")
        if Action(op, mb, st) not in seen
    ]
    if missing:
        shown = " ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise ScheduleError(
            f"{len(missing)} actions are missing: {shown}; every micro-batch needs one F and one B on every stage"
        )
