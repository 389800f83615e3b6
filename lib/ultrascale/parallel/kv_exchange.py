"""Moving K/V between the context-parallel ranks: round a ring, or all-gathered; dK/dV back.

Ring attention (``ring_attention.py``) needs every rank's keys and values at each rank:

* **ring**: at each of the cp steps a rank starts sending the block it holds to the next
  rank and receiving the previous rank's, without waiting, hands its block to the caller to
  attend to, then waits (:func:`_ring_blocks`). Two receive buffers take turns. In backward
  each block's dK/dV accumulator follows the block round the ring, every rank adding its
  share, and one last step brings it home (:class:`_TravellingGradients`);
* **all-gather**: one all-gather of every rank's K and V, the same blocks in the same order
  (:func:`_gathered_blocks`); in backward a reduce-scatter sums the ranks' dK/dV and leaves
  each rank its own block's (:class:`_GatheredGradients`).

:class:`KVBufferMeter` measures the bytes of these buffers alive at once on a rank
(``memory.cp_kv_buffer_bytes`` is the model).
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from ..comm.functional import all_gather_into, rank_and_size, reduce_scatter_into
from ..comm.ring import exchange

__all__ = ["KVBufferMeter"]

_K, _V, _DKV = 0, 1, 2   # message tags: K, V and dK/dV transfers may be in flight together


class KVBufferMeter:
    """Measures the bytes of the K/V (and dK/dV) buffers that context-parallel attention
    allocates for other ranks' blocks, alive at once on this rank: ``with KVBufferMeter()
    as meter: ...; meter.peak``. (``memory.cp_kv_buffer_bytes`` is the model.)"""

    _open: list = []

    def __init__(self):
        self.live = self.peak = 0

    def __enter__(self):
        KVBufferMeter._open.append(self)
        return self

    def __exit__(self, *exc):
        KVBufferMeter._open.remove(self)

    def _add(self, nbytes):
        self.live += nbytes
        self.peak = max(self.peak, self.live)


def _buffer(t):
    """Count a new communication buffer in the open meters until it is garbage."""
    for meter in KVBufferMeter._open:
        meter._add(t.nbytes)
        weakref.finalize(t, meter._add, -t.nbytes)
    return t


def _exchange(sends, recvs, group, tag, timeline=None, what="K/V"):
    """Start sending ``sends`` to the next rank and receiving ``recvs`` from the previous one;
    return what to wait for. Nothing is waited for here: the caller computes meanwhile."""
    r, n = rank_and_size(group)
    works = exchange(sends, recvs, (r + 1) % n, (r - 1) % n, group, tag, batched=True)
    if timeline is not None:   # a bar from now until the last block has arrived
        works[-1] = timeline.communication(f"receive {what}", works[-1], sum(t.nbytes for t in recvs))
    return works


def _wait(works):
    for work in works:
        work.wait()


def _ring_blocks(k, v, group, timeline=None):
    """Yield ``(owner rank, (k, v))`` for every rank's block, own block first: at step s a
    rank holds the block of rank r - s. The next block's transfer starts *before* this one
    is handed to the caller, so it travels while the caller computes; it is waited for
    when the caller asks for the next. Two receive buffers take turns."""
    r, n = rank_and_size(group)
    current, free = (k, v), []
    for step in range(n):
        works = []
        if step < n - 1:
            incoming = free.pop() if free else _buffer(k.new_empty((2, *k.shape)))
            works = _exchange(current, incoming, group, _K, timeline)
        yield (r - step) % n, current
        _wait(works)
        if step < n - 1:
            if step > 0:
                free.append(current)   # a received buffer: its block has been sent on
            current = incoming


def _gathered_blocks(k, v, group, timeline=None):
    """The same blocks in the same order, from one all-gather of every rank's K and V."""
    r, n = rank_and_size(group)
    gathered = []
    for t in (k, v):
        full = _buffer(t.new_empty((n, *t.shape)))
        with timeline.span("all-gather K/V", "communication") if timeline else contextlib.nullcontext():
            all_gather_into(full.flatten(0, 1), t, group)
        gathered.append(full)
    for step in range(n):
        src = (r - step) % n
        yield src, (gathered[0][src], gathered[1][src])


class _TravellingGradients:
    """Ring backward: the dK/dV accumulator of a block follows the block round the ring,
    each rank adding its share, and one last step brings it home to the block's owner."""

    def __init__(self, k, dtype, group, timeline):
        self.group, self.timeline, self.n = group, timeline, rank_and_size(group)[1]
        self.acc = _buffer(k.new_zeros((2, *k.shape), dtype=dtype))
        self.incoming = _buffer(torch.empty_like(self.acc)) if self.n > 1 else None
        self.works, self.step = [], 0

    def add(self, src, part):
        if self.step > 0:   # the accumulator of the block just attended, from the previous rank
            _wait(self.works)
            self.acc, self.incoming = self.incoming, self.acc
        if part is not None:
            last_key, dk, dv = part
            self.acc[0, ..., :last_key, :] += dk
            self.acc[1, ..., :last_key, :] += dv
        if self.n > 1:
            self.works = _exchange([self.acc], [self.incoming], self.group, _DKV, self.timeline, "dK/dV")
        self.step += 1

    def finish(self):
        _wait(self.works)
        return self.incoming if self.n > 1 else self.acc


class _GatheredGradients:
    """All-gather backward: dK/dV for every rank's block, then a reduce-scatter sums the
    ranks' contributions and leaves each rank those of its own block."""

    def __init__(self, k, dtype, group, timeline):
        self.group, self.timeline = group, timeline
        self.full = _buffer(k.new_zeros((rank_and_size(group)[1], 2, *k.shape), dtype=dtype))

    def add(self, src, part):
        if part is not None:
            last_key, dk, dv = part
            self.full[src, 0, ..., :last_key, :] += dk
            self.full[src, 1, ..., :last_key, :] += dv

    def finish(self):
        mine = self.full.new_empty(self.full.shape[1:])
        with self.timeline.span("reduce-scatter dK/dV", "communication") if self.timeline else contextlib.nullcontext():
            reduce_scatter_into(mine, self.full.flatten(0, 1), self.group)
        return mine


_BLOCKS = {"ring": (_ring_blocks, _TravellingGradients), "all_gather": (_gathered_blocks, _GatheredGradients)}
