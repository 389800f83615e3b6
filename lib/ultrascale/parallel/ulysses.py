"""Ulysses sequence parallelism: trade the sequence split for a head split, attend, trade back.

A refinement of context parallelism that registers itself with the basic form: importing this
module (the package ``ultrascale.parallel`` always does) adds ``kind="ulysses"`` to
``context_parallel.CORES``, so ``apply_cp(..., kind="ulysses")`` puts ``ulysses_attention`` in
every attention layer in place of ring attention.

DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for
Enabling Training of Extreme Long Sequence Transformer Models", arXiv 2309.14509) takes the
other road to attention over a sequence cut across P ranks. Ring attention
(``ring_attention.py``) keeps every rank on its own queries and brings it everybody's keys.
Ulysses notices that attention heads are independent: if a rank held *all* the tokens of a
few heads, it could run ordinary attention on them, with no merging and no mask arithmetic
across ranks. One all-to-all gets it there:

    q, k, v on rank r:   (batch, heads,     seq/P, head_dim)   tokens of slice r, all heads
        all-to-all  ->   (batch, heads/P,   seq,   head_dim)   all tokens, head group r
        attention per head (causal over the whole sequence, as in one process)
        all-to-all  ->   (batch, heads,     seq/P, head_dim)   back to this rank's tokens

Backward needs nothing new: the derivative of an all-to-all is the reverse all-to-all
(``comm.functional.all_to_all``), and attention's own backward runs on the head group.

**What moves.** Each of the four all-to-alls (q, k, v forward, the output back) sends away
(P-1)/P of a (seq/P x heads*head_dim) slice: O(n*d/P) bytes per rank, falling as P grows.
The ring sends (P-1) K/V blocks of (seq/P x kv_dim): O(n*d_kv) per rank, whatever P is.
``ulysses_bytes`` and ``ring_bytes`` are the two formulas; the tests hold the logger to them.

**Its limit.** A head cannot be cut, so P must divide the number of heads, and under
grouped-query attention also the number of K/V heads (each rank must receive whole K/V
heads for its query heads). Both are refused; the message says what to do instead. There is
no load imbalance to fix: every rank attends over the whole sequence for its heads, so the
zig-zag layout buys nothing, and only the contiguous layout is accepted (the slices arrive
in rank order, which must be sequence order).
"""

from __future__ import annotations

import functools
import math

import torch

from ..comm.functional import all_to_all, rank_and_size
from .context_parallel import CORES
from .ring_attention import check_attention_inputs

__all__ = ["ulysses_attention", "ulysses_problem", "ulysses_core", "ulysses_bytes", "ring_bytes", "LAYOUT_REFUSAL"]

LAYOUT_REFUSAL = (
    "Ulysses needs no load balancing (every rank attends over the whole sequence for its heads), "
    "and its all-to-all puts the slices back in rank order: use layout='contiguous'"
)


# --------------------------------------------------------------------------- the limit
def ulysses_problem(heads: int, kv_heads: int, cp: int) -> str | None:
    """Why Ulysses cannot split these heads over ``cp`` ranks, with what to do; None if it can."""
    if heads % cp:
        return (
            f"Ulysses gives each rank whole heads, but {heads} heads do not split over {cp} ranks: use a "
            f"number of ranks that divides {heads}, or ring attention (kind='ring'), which has no such limit"
        )
    if kv_heads % cp:
        return (
            f"Ulysses gives each rank whole K/V heads, but grouped-query attention's K/V heads ({kv_heads}) "
            f"do not split over {cp} ranks: repeat each K/V head {cp // math.gcd(kv_heads, cp)} times before the call "
            "(k.repeat_interleave(..., dim=1), as many times the K/V bytes), or use ring attention "
            "(kind='ring'), whose K/V blocks travel whole"
        )
    return None


# --------------------------------------------------------------------------- the two all-to-alls
def _sequence_to_heads(t, group, cp):
    """(b, heads, seq/P, d) of this rank's tokens -> (b, heads/P, seq, d) of its head group."""
    b, h, s, d = t.shape
    # Head group j goes to rank j: put the group index first, the dim all_to_all cuts along.
    pieces = t.reshape(b, cp, h // cp, s, d).transpose(0, 1)
    received = all_to_all(pieces, group=group)  # piece i: rank i's tokens of my heads
    # Rank i holds slice i of the sequence (contiguous layout): concatenating in rank order
    # is sequence order.
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_sequence(t, group, cp):
    """(b, heads/P, seq, d) of this rank's head group -> (b, heads, seq/P, d) of its tokens."""
    b, g, s, d = t.shape
    pieces = t.reshape(b, g, cp, s // cp, d).permute(2, 0, 1, 3, 4)  # slice j of the sequence -> rank j
    received = all_to_all(pieces, group=group)  # piece i: my tokens of rank i's heads
    return received.transpose(0, 1).reshape(b, cp * g, s // cp, d)


# --------------------------------------------------------------------------- the function to call
def ulysses_attention(
    q, k, v, group=None, *, causal: bool = True, layout: str = "contiguous", sm_scale: float | None = None
):
    """softmax(Q K^T * scale) V of this rank's tokens against the whole sequence, by head groups.

    q: (batch, heads, seq_local, head_dim); k, v: (batch, kv_heads, seq_local, head_dim), this
    rank's slice of the sequence in the contiguous layout over the ranks of ``group``. The
    group's size must divide heads and kv_heads (``ulysses_problem``). Returns this rank's rows,
    shaped like q. Differentiable. Every rank of ``group`` must call it, with inputs of the same
    shapes.
    """
    _, cp = rank_and_size(group, "Ulysses attention")  # a clear error outside a process group
    if layout != "contiguous":
        raise ValueError(f"layout={layout!r}: {LAYOUT_REFUSAL}")
    check_attention_inputs(q, k, v, group)  # the same shapes on every rank, or all refuse together
    problem = ulysses_problem(q.shape[1], k.shape[1], cp)
    if problem is not None:  # the shapes agree on every rank by now, so every rank refuses
        raise ValueError(problem)
    q_h, k_h, v_h = (_sequence_to_heads(t, group, cp) for t in (q, k, v))
    # Head group r of q is served by K/V head group r: query head i uses K/V head
    # i // (heads/kv_heads), so the grouping of one process survives the cut.
    # aten's op, not F.scaled_dot_product_attention: torch 2.11's context_parallel() replaces the
    # latter for as long as a rank lives (chapter 06 runs PyTorch's CP first on the same ranks),
    # and its replacement refuses plain CPU tensors. The op and its autograd are the same.
    y = torch.ops.aten.scaled_dot_product_attention(
        q_h, k_h.to(q.dtype), v_h.to(q.dtype), is_causal=causal, scale=sm_scale, enable_gqa=k.shape[1] != q.shape[1]
    )
    return _heads_to_sequence(y, group, cp)


# --------------------------------------------------------------------------- registered with apply_cp
def ulysses_core(module, group, cp: int, layout: str):
    """``apply_cp``'s attention core for ``module`` under kind="ulysses". The layout and the
    head counts are refused here, when the model is changed, rather than in its first forward."""
    if layout != "contiguous":
        raise ValueError(f"kind='ulysses' with layout={layout!r}: {LAYOUT_REFUSAL}")
    problem = ulysses_problem(module.q.out_features // module.head_dim, module.k.out_features // module.head_dim, cp)
    if problem is not None:
        raise ValueError(problem)
    return functools.partial(ulysses_attention, group=group, causal=True)


CORES["ulysses"] = ulysses_core


# --------------------------------------------------------------------------- the bytes
def ulysses_bytes(batch, heads, kv_heads, seq, head_dim, cp, bytes_per_element, backward=False) -> int:
    """Bytes one rank sends in one attention's forward (or backward) under Ulysses.

    Four all-to-alls (q, k, v there, the output back; backward: the output's gradient there,
    dq, dk, dv back), each keeping 1/cp of a (seq/cp) slice and sending the rest."""
    per_token = 2 * heads + 2 * kv_heads  # q and out, k and v (in head_dim units)
    # heads and kv_heads are multiples of cp, so the division is exact, as in the logger.
    return batch * (seq // cp) * head_dim * per_token * bytes_per_element * (cp - 1) // cp


def ring_bytes(batch, kv_heads, seq, head_dim, cp, bytes_per_element, backward=False) -> int:
    """Bytes one rank sends in one attention's forward (or backward) under ring attention:
    K and V blocks of (seq/cp x kv_dim), cp - 1 hops; backward again, plus dK/dV's sums, cp - 1
    hops (``ring_attention.ring_kv_gradients``)."""
    block = batch * kv_heads * (seq // cp) * head_dim * bytes_per_element
    return 2 * block * (cp - 1) * (2 if backward else 1)
