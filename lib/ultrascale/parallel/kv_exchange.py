"""Moving K/V between the context-parallel ranks: round a ring, or all-gathered; dK/dV back.

Ring attention (``ring_attention.py``) needs every rank's keys and values at each rank:

* **ring**: at each of the cp steps a rank starts sending the block it holds to the next
  rank and receiving the previous rank's, without waiting, hands its block to the caller to
  attend to, then waits (:func:`ring_kv_blocks`, a walk of ``comm.ring.ring_blocks``). Two
  receive buffers take turns. In backward the ranks' dK/dV for each block are summed round the
  ring (:func:`ring_kv_gradients`, ``comm.ring.reduce_round_ring``): a block's running sum starts
  at the rank after its owner, every rank adds its share and passes it on, and the owner adds
  its own last: cp - 1 transfers;
* **all-gather**: one all-gather of every rank's K and V, the same blocks in the same order
  (:func:`gathered_kv_blocks`); in backward a reduce-scatter sums the ranks' dK/dV and leaves
  each rank its own block's (:func:`gathered_kv_gradients`).

Backward hands each kind the same function, ``add_part(owner, k, v, into)``: this rank's dK/dV
for the block of rank ``owner`` (its K and V given), added into ``into`` ((2, *k.shape)).

:class:`KVBufferMeter` measures the bytes of these buffers alive at once on a rank
(``memory.cp_kv_buffer_bytes`` is the model).
"""

from __future__ import annotations

import itertools
import weakref

import torch.distributed as dist

from ..comm.functional import all_gather_into, reduce_scatter_into
from ..comm.ring import reduce_round_ring, ring_blocks

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


def ring_kv_gradients(k, v, dtype, group, timeline, add_part):
    """This rank's dK/dV ((2, *k.shape) in ``dtype``): every rank's share of it, summed round the
    ring (``reduce_round_ring``). At step s this rank adds its share of block ``r - s - 1`` to the
    running sum that arrived, and passes it on; its own block comes last, when the sum of
    every other rank's share has come round. The K/V blocks walk the ring as in forward, one
    step ahead: the own block is set aside for the last step.

    Three buffers take turns: the sum being sent, the one arriving, and the next one filled
    meanwhile (the step's compute overlaps both transfers)."""
    blocks = ring_kv_blocks(k, v, group, timeline)
    own = next(blocks)  # (r, (k, v)); the transfer of the previous rank's block has started
    buffers, filled = [], itertools.count(0, 2)

    def buffer(i):
        while len(buffers) <= i:
            buffers.append(_buffer(k.new_empty((2, *k.shape), dtype=dtype)))
        return buffers[i]

    # Step s fills buffer 2s mod 3 and receives into 2s + 1 mod 3. While step s + 1 fills
    # 2s + 2 mod 3, those two are still in flight: the three never meet.
    def term(owner):  # this rank's share of block ``owner``
        src, (k_blk, v_blk) = own if owner == own[0] else next(blocks)
        running = buffer(next(filled) % 3).zero_()
        add_part(src, k_blk, v_blk, running)
        return running

    return reduce_round_ring(
        term,
        group,
        lambda running, incoming: running.add_(incoming),
        lambda s, owner: buffer((2 * s + 1) % 3),
        tag=_DKV,
        batched=True,
        timeline=timeline,
        name="receive dK/dV",
    )


def gathered_kv_gradients(k, v, dtype, group, timeline, add_part):
    """All-gather backward: dK/dV for every rank's block, then a reduce-scatter sums the ranks'
    shares and leaves each rank those of its own block."""
    full = _buffer(k.new_zeros((dist.get_world_size(group), 2, *k.shape), dtype=dtype))
    for src, (k_blk, v_blk) in gathered_kv_blocks(k, v, group, timeline):
        add_part(src, k_blk, v_blk, full[src])
    mine = full.new_empty(full.shape[1:])
    with timeline.span("reduce-scatter dK/dV", "communication"):
        reduce_scatter_into(mine, full.flatten(0, 1), group)
    return mine


# For each kind of context-parallel attention: how the K/V blocks come, and how dK/dV goes back.
KV_EXCHANGES = {"ring": (ring_kv_blocks, ring_kv_gradients), "all_gather": (gathered_kv_blocks, gathered_kv_gradients)}
