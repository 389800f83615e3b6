"""All-gathered K/V: context-parallel attention's other way of moving keys and values.

A refinement of ring attention (``ring_attention.py``), which registers itself there: importing
this module (the package ``ultrascale.parallel`` always does) adds ``kind="all_gather"`` to
``ring_attention.KV_EXCHANGES``, so ``context_parallel_attention`` and ``apply_cp`` take it.

Instead of passing the K/V blocks round the ring, each transfer hidden behind the attention to
the block before, every rank all-gathers all ranks' K and V at once, then attends to the same
blocks in the same order as the ring (Llama 3's choice): one collective to schedule, but a
buffer of the whole sequence's K/V on every rank where the ring holds two blocks
(``memory.cp_kv_buffer_bytes`` is the model; ``KVBufferMeter`` counts these buffers too). In
backward a reduce-scatter sums the ranks' dK/dV and leaves each rank its own block's. The
attention, the merge and the rest of the backward are ring attention's own.
"""

from __future__ import annotations

import torch.distributed as dist

from ..comm.functional import all_gather_into, reduce_scatter_into
from .ring_attention import KV_EXCHANGES, context_parallel_attention, count_buffer

__all__ = ["all_gather_attention", "gathered_kv_blocks", "gathered_kv_gradients"]


def gathered_kv_blocks(k, v, group, timeline):
    """The same blocks in the same order, from one all-gather of every rank's K and V."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    gathered = []
    for t in (k, v):
        full = count_buffer(t.new_empty((n, *t.shape)))
        with timeline.span("all-gather K/V", "communication"):
            all_gather_into(full.flatten(0, 1), t, group)
        gathered.append(full)
    for step in range(n):
        src = (r - step) % n
        yield src, (gathered[0][src], gathered[1][src])


def gathered_kv_gradients(k, v, dtype, group, timeline, add_part):
    """All-gather backward: dK/dV for every rank's block, then a reduce-scatter sums the ranks'
    shares and leaves each rank those of its own block."""
    full = count_buffer(k.new_zeros((dist.get_world_size(group), 2, *k.shape), dtype=dtype))
    for src, (k_blk, v_blk) in gathered_kv_blocks(k, v, group, timeline):
        add_part(src, k_blk, v_blk, full[src])
    mine = full.new_empty(full.shape[1:])
    with timeline.span("reduce-scatter dK/dV", "communication"):
        reduce_scatter_into(mine, full.flatten(0, 1), group)
    return mine


def all_gather_attention(q, k, v, group=None, **options):
    """``context_parallel_attention`` with the K/V all-gathered first (and dK/dV reduce-scattered)."""
    return context_parallel_attention(q, k, v, group, kind="all_gather", **options)


# Registered with the basic form: the same blocks in the same order, by one collective.
KV_EXCHANGES["all_gather"] = (gathered_kv_blocks, gathered_kv_gradients)
