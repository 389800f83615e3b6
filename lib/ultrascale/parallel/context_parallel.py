"""Context parallelism (CP): the sequence split across ranks, applied from outside.

Files for the basic form (ring attention), in reading order: this module (``apply_cp``),
``ring_attention.py`` (attention over the split sequence, forward and backward, and the K/V
blocks and their gradients round the ring; it merges partial results with
``kernels/tiled_attention.py``'s online softmax), ``comm/ring.py`` (one ring step) and
``mesh.py`` (the cp group). The refinements register themselves with the basic form when the
package imports them: ``all_gather_kv.py`` (K/V all-gathered instead of passed round the ring,
``kind="all_gather"``) and ``ulysses.py`` (an all-to-all to head groups, ``kind="ulysses"``).

Under CP every rank holds a slice of the sequence through the whole model: embeddings,
norms, MLPs and the loss treat tokens one at a time and need nothing from the other ranks.
Only attention mixes tokens; ``parallel.ring_attention`` gives every rank's queries the
other ranks' keys and values, by a ring of point-to-point transfers overlapped with the
compute (or by one all-gather, for comparison), forward and backward. ``kind="ulysses"``
(``parallel.ulysses``, registered in ``CORES``) instead trades the sequence split for a head
split with an all-to-all, attends per head group over the whole sequence, and trades back
(contiguous layout only).

**Layouts** (``data.sequence_positions`` is the one definition of both). "contiguous"
gives rank r the r-th slice: under a causal mask rank 0's queries see one block of keys
and the last rank's all cp, so every layer waits for the last rank. "zigzag" cuts the
sequence into 2*cp chunks and gives rank r chunks r and 2*cp-1-r: an early chunk with
little to attend to and a late one with much, the same work on every rank.
``causal_tile_counts`` counts that work per rank.

**The model.** ``apply_cp`` replaces the attention core of every block (``Attention.core``:
``model.py`` stays free of parallel code) and fills in, or checks, the global positions
the model is given (RoPE rotates a token by where it is in the whole sequence). The loss
on a rank is the mean over its tokens; the slices are equal, so the mean of the ranks'
losses is the loss of the whole sequence, and the gradient of one process is the
*average* of the ranks' gradients: a hook on every parameter all-reduces its gradient over
the cp group and divides by cp as it is computed, inside backward (as sequence
parallelism's hooks do; nothing to call after backward, and gradient accumulation stays
right). Turn it off (``sync_gradients=False``) when data parallelism averages over the
joint (dp, cp) group instead.

Refused rather than padded: a sequence that does not cut into equal chunks (2*cp for
zigzag, cp for contiguous), a cp larger than the number of chunks, ranks holding slices of
different lengths, q and k with different head dims (padding would need masking in
attention and in the loss; the messages say what to change).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from ..comm.functional import rank_and_size
from ..data import sequence_positions
from ..matching import match_plan
from .grad_sync import sync_in_backward
from .mesh import axis_group
from .ring_attention import KV_EXCHANGES, LAYOUTS, KVBufferMeter, context_parallel_attention, ring_attention

# The attention kinds that are not ring attention's (ring attention's kinds are its ways of moving
# K/V, ``KV_EXCHANGES``): kind -> ``core(module, group, cp, layout)``, what replaces the attention
# module's core, or a ValueError saying why the kind cannot serve it. The refinements fill it when
# the package imports them (``ulysses.py``: "ulysses"), so the basic form imports none of them.
CORES: dict = {}

__all__ = [
    "LAYOUTS",
    "CORES",
    "sequence_positions",
    "split_sequence",
    "causal_tile_counts",
    "context_parallel_attention",
    "ring_attention",
    "apply_cp",
    "KVBufferMeter",
]


# --------------------------------------------------------------------------- layouts and work
def split_sequence(x: torch.Tensor, rank: int, cp: int, layout: str = "zigzag", dim: int = 1):
    """This rank's tokens of ``x`` along ``dim`` (the sequence) and their global positions."""
    positions = sequence_positions(x.shape[dim], rank, cp, layout).to(x.device)
    return x.index_select(dim, positions), positions


def causal_tile_counts(seq: int, cp: int, layout: str = "zigzag", tile: int | None = None) -> list[int]:
    """Per rank: the (query tile, key tile) pairs with anything left to compute under a
    causal mask, tiles being ``tile`` consecutive tokens (default: one zigzag chunk, seq / 2cp).

    Key tile j is needed by a query tile iff its first key, j * tile, is not after the
    tile's last query. Equal counts mean balanced ranks."""
    tile = tile or max(seq // (2 * cp), 1)
    chunk = seq // (cp * (2 if layout == "zigzag" else 1))
    if chunk % tile:
        raise ValueError(f"tile={tile} does not divide the {layout} chunks of {chunk} tokens: choose a divisor")
    return [
        sum(int(last) // tile + 1 for last in sequence_positions(seq, r, cp, layout).view(-1, tile)[:, -1])
        for r in range(cp)
    ]


# --------------------------------------------------------------------------- the model
def _positions_hook(r: int, n: int, layout):
    """Before the model runs: fill in, or check, the global positions of the tokens of rank ``r``
    of the ``n`` context-parallel ranks."""

    def hook(model, args, kwargs):
        x, given = args[0], (args[1] if len(args) > 1 else kwargs.pop("positions", None))
        expected = sequence_positions(x.shape[1] * n, r, n, layout).to(x.device)
        if given is not None and not torch.equal(given.to(expected.device), expected):
            raise ValueError(
                f"rank {r} got positions {given.tolist()[:8]}..., but the {layout} layout puts its "
                f"tokens at {expected.tolist()[:8]}...: take the batch from data.split(batch, rank, "
                f"{n}, by='sequence', layout={layout!r})"
            )
        return (x, expected, *args[2:]), kwargs

    return hook


def _core(module, kind, group, cp, layout, timeline):
    """The attention core that replaces ``module.core`` for ``kind``: ring attention with that
    way of moving K/V, or a registered refinement's (``CORES``)."""
    if kind in CORES:
        return CORES[kind](module, group, cp, layout)
    return functools.partial(
        context_parallel_attention, group=group, causal=True, layout=layout, kind=kind, timeline=timeline
    )


def apply_cp(
    model,
    mesh_or_group=None,
    *,
    layout: str = "zigzag",
    kind: str = "ring",
    plan: dict | None = None,
    timeline=None,
    sync_gradients: bool = True,
) -> nn.Module:
    """Context-parallel ``model`` over the ``cp`` axis of a mesh (or a group; None: all ranks).

    ``plan``: ``{module-name pattern: kind}`` of the attention modules whose core becomes
    context-parallel attention (default ``{"blocks.*.attn": kind}``); kinds: "ring",
    "all_gather" or "ulysses" (contiguous layout only; cp must divide the heads). Afterwards the model
    takes this rank's tokens, ``model(idx_local, positions)`` (``data.split(batch, rank, cp,
    by="sequence", layout=layout)`` gives both); positions left out are filled in, wrong ones
    refused. ``sync_gradients``: average every gradient over the cp group inside backward
    (turn it off when a data-parallel wrapper averages over the joint (dp, cp) group, as
    torchtitan's FSDP does). ``timeline``: the ring's per-step compute and transfer bars.
    Returns the model, changed in place.
    """
    group = axis_group(mesh_or_group, "cp")
    r, n = rank_and_size(group, "context parallelism")  # checked once: the positions hook reuses r, n
    plan = {"blocks.*.attn": kind} if plan is None else plan
    kinds = (*KV_EXCHANGES, *CORES)
    if layout not in LAYOUTS or not set(plan.values()) <= set(kinds):
        raise ValueError(
            f"layout={layout!r}, plan kinds {sorted(set(plan.values()))}: choose a layout in "
            f"{LAYOUTS} and kinds in {kinds}"
        )
    for pattern, attention_kind in plan.items():  # each pattern must name attention modules only
        named = match_plan(model, {pattern: attention_kind})
        if not all(hasattr(module, "core") for _, module, _ in named):
            raise ValueError(
                f"plan pattern {pattern!r} must match attention modules (with a core), matched {len(named)} module(s)"
            )
    # Every core is made before any is set: a kind that cannot serve some module is refused
    # now, with the model untouched, rather than in the first forward.
    cores = [
        (module, _core(module, attention_kind, group, n, layout, timeline))
        for _, module, attention_kind in match_plan(model, plan)
    ]
    for module, core in cores:
        module.core = core
    model.register_forward_pre_hook(_positions_hook(r, n, layout), with_kwargs=True)
    if sync_gradients and n > 1:
        # Each rank's gradient is that of the mean loss over its own tokens; the model's is the
        # mean over the ranks: the average over the cp group, inside backward.
        sync_in_backward(model, group, keep_as="_cp_grad_sync")
    return model
