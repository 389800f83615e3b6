"""Pipeline parallelism's messages: activations and their gradients sent between stages.

A stage's output goes to the next stage's rank (``send_F``) and the gradient of a stage's
input back to the previous one (``send_B``):

* ``send_*``: ``isend``, never blocking, waited for at the end of the step (the tensor is
  kept alive until then); with a timeline, a helper thread draws each send's bar;
* **one process group per direction**: a message to a higher rank of the pipeline goes on the pp
  group, one to a lower rank on a second group over the same ranks (``twin_group``). Under
  NCCL a send does not complete until its receive is posted, and the messages between two ranks
  in one group run in the order they were posted; so in 1F1B's steady state, where each of two
  neighbours sends to the other before receiving from it, one group would hold each rank's
  receive behind its send, forever. Each group has its own NCCL streams: with one direction per
  group, a receive never waits behind a send (torch's pipelining batches such pairs instead,
  schedule by schedule; this works for every schedule, DualPipeV's two directions included);
* ``recv_*``: ``irecv`` and wait, right before the action that needs it. Between two ranks,
  messages are received in the order they were sent (an earlier one is kept in the inbox
  until its action comes), as NCCL requires; gloo could also tell them apart by the tag
  each carries. Every rank knows from the schedule the order its senders send in;
* under sequence parallelism (``apply_tp(..., sequence_parallel=True)``) the activation between
  two blocks is split along the sequence over the tp ranks, so a message is this rank's slice,
  ``(rows, seq/tp, hidden)``, sent to the rank of equal tp coordinate in the next stage (the pp
  group pairs them): tp times fewer bytes per message than sending the whole sequence, which
  every tp rank would otherwise send (the same bytes, tp times over) or gather first;
* GPT's tied embedding/head weight lives on the first and the last stage: after the backward
  the two ranks swap their parts of its gradient and add them.

:class:`StageMessages` is a part of :class:`~ultrascale.parallel.pipeline_parallel.Pipeline`;
it reads the pipeline's schedule, group, timeline and stages.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..comm.ring import send_recv
from .timeline import COMMUNICATION

__all__ = ["StageMessages", "twin_group"]


class StageMessages:
    """The ``send_*`` and ``recv_*`` actions of :class:`~ultrascale.parallel.pipeline_parallel.Pipeline`."""

    def _send_F(self, a, st):
        self._send(st, st.outputs[(a.microbatch, a.stage)].detach(), a.stage + 1, "F", a.microbatch, "activation")

    def _send_B(self, a, st):
        self._send(st, st.input_grads.pop((a.microbatch, a.stage)), a.stage - 1, "B", a.microbatch, "gradient")

    def _recv_F(self, a, st):
        buf = self._receive(st, ("F", a.microbatch, a.stage), self.schedule.rank_of(a.stage - 1))
        st.inputs[(a.microbatch, a.stage)] = buf.requires_grad_()

    def _recv_B(self, a, st):
        st.grads[(a.microbatch, a.stage)] = self._receive(
            st, ("B", a.microbatch, a.stage), self.schedule.rank_of(a.stage + 1)
        )

    def _tag(self, kind: str, mb: int, stage: int) -> int:
        """One tag per message: (micro-batch, receiving stage, forward or backward)."""
        return 2 * (mb * self.schedule.stages + stage) + (kind == "B")

    def _group_of(self, sender: int, receiver: int):
        """The group a message from ``sender`` to ``receiver`` goes on: the pp group up the
        pipeline's ranks, its twin down (see the module's docstring)."""
        return self.group if sender < receiver else self.group_down

    def _send(self, st, tensor, to_stage, kind, mb, what):
        dst = self.schedule.rank_of(to_stage)
        work = dist.isend(
            tensor, group=self._group_of(self.rank, dst), group_dst=dst, tag=self._tag(kind, mb, to_stage)
        )
        if self.timeline.enabled:  # a helper thread per send: only when someone draws it
            work = _WatchedSend(
                work, self.timeline, f"send {what} {mb} to stage {to_stage}", tensor.numel() * tensor.element_size()
            )
        st.sends.append(work)
        st.sent.append(tensor)  # the tensor must live until its send is done

    def _receive(self, st, message, src):
        """Take the messages of rank ``src`` in the order it sent them until ``message`` (kind,
        micro-batch, receiving stage) is in: NCCL matches a send with a receive by their order
        alone (gloo also by tag). Those taken early wait in the inbox; they were sent already."""
        while message not in st.inbox:
            kind, mb, stage = nxt = self.arrivals[src][st.received.get(src, 0)]
            st.received[src] = st.received.get(src, 0) + 1
            batch = st.batches[mb].inputs  # activations and their gradients: (rows, seq, hidden),
            rows, seq = batch.shape  # or (rows, seq/tp, hidden) under sequence parallelism
            buf = torch.empty((rows, seq // self.sequence_shards, self.hidden), dtype=self.dtype, device=batch.device)
            what = "activation" if kind == "F" else "gradient"
            with self._span(None, f"recv {what} {mb} for stage {stage}", COMMUNICATION):
                dist.irecv(
                    buf, group=self._group_of(src, self.rank), group_src=src, tag=self._tag(kind, mb, stage)
                ).wait()
            st.inbox[nxt] = buf
        return st.inbox.pop(message)

    def _arrivals(self) -> dict:
        """For each rank that sends to this one, its messages in the order it sends them."""
        order = {}
        for src in range(self.schedule.ranks):
            for a in self.schedule.actions(src):
                to_stage = a.stage + 1 if a.op == "send_F" else a.stage - 1
                if a.op.startswith("send") and self.schedule.rank_of(to_stage) == self.rank:
                    order.setdefault(src, []).append((a.op[-1], a.microbatch, to_stage))
        return order

    def tied_weight(self):
        """This rank's end of the tied embedding/head weight (the embedding's on the first stage)."""
        return (self.chunks["0"].embed if "0" in self.chunks else self.chunks[str(self.last)].head).weight

    def add_tied(self, mine: torch.Tensor) -> torch.Tensor:
        """``mine`` plus the matching tensor of the rank at the other end of the tied weight."""
        theirs = torch.empty_like(mine)
        send_recv(mine, theirs, self.tied_peer, self.tied_peer, self.group)
        return mine + theirs  # a + b and b + a: the same bits on both ranks

    def _add_tied_gradients(self):
        """Embedding and head share one weight: add the gradient parts of its two ranks."""
        weight = self.tied_weight()
        weight.grad = self.add_tied(weight.grad if weight.grad is not None else torch.zeros_like(weight))


_TWINS: dict = {}  # the ranks of a group -> the twin over them, one per process


def twin_group(group):
    """A second process group over ``group``'s ranks, in the same order (so a rank's number in
    it is the same), for the messages that go the other way. Made once per set of ranks and
    process, by those ranks alone (``use_local_synchronization``: the other pipelines of a mesh
    need not take part); groups with the same ranks (the world, a mesh's pp group) share one."""
    group = group if group is not None else dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _TWINS:
        _same_group_count(group)
        _TWINS[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _TWINS[ranks]


def forget_twin_groups() -> None:
    """Drop this process's twin groups: for a process whose process group was destroyed and that
    starts another (the dry run's, which runs several fake worlds in turn)."""
    _TWINS.clear()


def _same_group_count(group) -> None:
    """Bring this rank's count of process groups up to the highest among ``group``'s ranks.

    torch names a group made with ``use_local_synchronization`` after its ranks *and the number
    of groups the calling process already has*, and its ranks meet in the store under that name.
    Ranks that made different groups before (rank 0 kept out of a pipeline over ranks 1 and 2,
    which made a twin of its own) would pick different names and wait for each other forever.
    So the ranks first tell each other their counts (on the group's backend, which no CommLogger
    counts as the technique's traffic), and those behind make one-rank groups, which need no
    one else, until every rank has the same count."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    mine = torch.tensor([len(c10d._world.pg_names)], device=device)
    counts = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    group.allgather([counts], [mine]).wait()
    for _ in range(int(max(c.item() for c in counts) - mine.item())):
        dist.new_group([dist.get_rank()], use_local_synchronization=True)


class _WatchedSend:
    """A send drawn from its launch to its end. gloo's P2P works have no future to hang a
    callback on, and two threads waiting on one gloo send hang, so a helper thread is the only
    one to wait: ``wait()`` joins it."""

    def __init__(self, work, timeline, name, nbytes):
        start = timeline.now()

        def watch():
            work.wait()
            timeline.add(COMMUNICATION, name, start, timeline.now(), nbytes)

        self.thread = threading.Thread(target=watch, daemon=True)
        self.thread.start()

    def wait(self):
        self.thread.join()
