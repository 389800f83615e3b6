"""Moving K/V between the context-parallel ranks: round a ring, or all-gathered; dK/dV back.

Ring attention (``ring_attention.py``) needs every rank's keys and values at each rank:

* **ring**: at each of the cp steps a rank starts sending the block it holds to the next
  rank and receiving the previous rank's, without waiting, hands its block to the caller to
  attend to, then waits (:func:`ring_kv_blocks`, a walk of ``comm.ring.ring_blocks``). Two
  receive buffers take turns. In backward each block's dK/dV accumulator follows the block
  round the ring (``comm.ring.ring_step``), every rank adding its share, and one last step
  brings it home (:class:`TravellingGradients`);
* **all-gather**: one all-gather of every rank's K and V, the same blocks in the same order
  (:func:`gathered_kv_blocks`); in backward a reduce-scatter sums the ranks' dK/dV and leaves
  each rank its own block's (:class:`GatheredGradients`).

:class:`KVBufferMeter` measures the bytes of these buffers alive at once on a rank
(``memory.cp_kv_buffer_bytes`` is the model).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from ..comm.functional import all_gather_into, reduce_scatter_into
from ..comm.ring import ring_blocks, ring_step, wait_all

__all__ = ["KV_EXCHANGES", "KVBufferMeter"]

_K, _V, _DKV = 0, 1, 2  # message tags: K, V and dK/dV transfers may be in flight together


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


def ring_kv_blocks(k, v, group, timeline):
    """Yield ``(owner rank, (k, v))`` for every rank's block, own block first (``ring_blocks``:
    the next block travels while the caller attends to this one). A step's K and V go as one
    batch, into one of two receive buffers that take turns: the buffer received two steps ago
    has been sent on by now."""
    buffers = []

    def receive_buffer(step, owner):
        if len(buffers) < 2:
            buffers.append(_buffer(k.new_empty((2, *k.shape))))
        return tuple(buffers[step % 2])

    yield from ring_blocks((k, v), group, receive_buffer, tag=_K, batched=True, timeline=timeline, name="receive K/V")


def gathered_kv_blocks(k, v, group, timeline):
    """The same blocks in the same order, from one all-gather of every rank's K and V."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    gathered = []
    for t in (k, v):
        full = _buffer(t.new_empty((n, *t.shape)))
        with timeline.span("all-gather K/V", "communication"):
            all_gather_into(full.flatten(0, 1), t, group)
        gathered.append(full)
    for step in range(n):
        src = (r - step) % n
        yield src, (gathered[0][src], gathered[1][src])


class TravellingGradients:
    """Ring backward: the dK/dV accumulator of a block follows the block round the ring,
    each rank adding its share, and one last step brings it home to the block's owner."""

    def __init__(self, k, dtype, group, timeline):
        self.group, self.timeline, self.n = group, timeline, dist.get_world_size(group)
        self.acc = _buffer(k.new_zeros((2, *k.shape), dtype=dtype))
        self.incoming = _buffer(torch.empty_like(self.acc)) if self.n > 1 else None
        self.works, self.step = [], 0

    def add(self, src, part):
        if self.step > 0:  # the accumulator of the block just attended, from the previous rank
            wait_all(self.works)
            self.acc, self.incoming = self.incoming, self.acc
        if part is not None:
            last_key, dk, dv = part
            self.acc[0, ..., :last_key, :] += dk
            self.acc[1, ..., :last_key, :] += dv
        if self.n > 1:
            self.works = ring_step(
                [self.acc],
                [self.incoming],
                self.group,
                tag=_DKV,
                batched=True,
                timeline=self.timeline,
                name="receive dK/dV",
            )
        self.step += 1

    def finish(self):
        wait_all(self.works)
        return self.incoming if self.n > 1 else self.acc


class GatheredGradients:
    """All-gather backward: dK/dV for every rank's block, then a reduce-scatter sums the
    ranks' contributions and leaves each rank those of its own block."""

    def __init__(self, k, dtype, group, timeline):
        self.group, self.timeline = group, timeline
        self.full = _buffer(k.new_zeros((dist.get_world_size(group), 2, *k.shape), dtype=dtype))

    def add(self, src, part):
        if part is not None:
            last_key, dk, dv = part
            self.full[src, 0, ..., :last_key, :] += dk
            self.full[src, 1, ..., :last_key, :] += dv

    def finish(self):
        mine = self.full.new_empty(self.full.shape[1:])
        with self.timeline.span("reduce-scatter dK/dV", "communication"):
            reduce_scatter_into(mine, self.full.flatten(0, 1), self.group)
        return mine


# For each kind of context-parallel attention: how the K/V blocks come, and how dK/dV goes back.
KV_EXCHANGES = {"ring": (ring_kv_blocks, TravellingGradients), "all_gather": (gathered_kv_blocks, GatheredGradients)}
