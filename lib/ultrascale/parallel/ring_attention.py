"""Ring attention: attention over a sequence split across ranks, forward and backward.

Each rank of the group holds a slice of the sequence: its queries, keys and values,
(batch, heads, seq_local, head_dim). Its queries need every rank's keys and values:

* **ring**: the K/V blocks travel round the ring of ranks. At each of the cp steps a rank
  (1) starts sending the block it holds to the next rank and receiving the previous rank's,
  without waiting, (2) attends its queries to the block it holds, (3) waits for the
  transfer. The partial results are merged with their log-sum-exp,
  ``kernels.tiled_attention.merge_partial_attention``: the online softmax of
  FlashAttention (chapter 11), across ranks instead of across tiles. Besides its own
  block a rank holds two in flight (the one it attends to and the one arriving), whatever cp is;
* **all-gather**: gather every rank's K/V at once, then attend to the same blocks in the
  same order (Llama 3's choice): one collective, and a buffer of the whole sequence's K/V
  (a refinement, ``all_gather_kv.py``).

Backward is real, not autograd over a gathered copy (ring-flash-attention's design): the
forward saves Q, K, V, the output and each row's log-sum-exp (lse); backward sends the K/V
round the ring again, rebuilds each block's probabilities from the saved lse (as
FlashAttention's backward does), and sums each block's dK/dV round the ring: a running sum
passes from rank to rank, every rank adding its share, and ends, complete, at the rank that
owns the block.

**How the K/V move is a kind.** ``KV_EXCHANGES[kind]`` is a pair: ``blocks(k, v, group,
timeline)`` yields ``(owner rank, (k, v))`` for every rank's block, own block first;
``gradients(k, v, dtype, group, timeline, add_part)`` returns this rank's dK/dV
((2, *k.shape)), having called ``add_part(owner, k, v, into)`` for this rank's share of each
block. The ring's pair is here (walks of ``comm/ring.py``); the all-gather's registers itself
from ``all_gather_kv.py`` when the package imports it. ``KVBufferMeter`` measures the bytes of
their buffers alive at once on a rank (``memory.cp_kv_buffer_bytes`` is the model).

The causal mask is computed from the tokens' *global* positions (``data.sequence_positions``
for the layout), so the contiguous and zig-zag layouts both work; a block, or the rows and
keys of a block, that the mask hides entirely is skipped. ``parallel.context_parallel``
applies this to the course model.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.distributed as dist

from ..comm.functional import rank_and_size
from ..comm.logger import labelled
from ..comm.ring import reduce_round_ring, ring_blocks
from ..data import SEQUENCE_LAYOUTS as LAYOUTS
from ..data import sequence_positions
from ..kernels.tiled_attention import merge_partial_attention
from .timeline import or_disabled

__all__ = [
    "KV_EXCHANGES",
    "KVBufferMeter",
    "count_buffer",
    "ring_kv_blocks",
    "ring_kv_gradients",
    "LAYOUTS",
    "context_parallel_attention",
    "ring_attention",
    "ContextParallelAttention",
    "check_attention_inputs",
]


# --------------------------------------------------------------------------- the K/V buffers, measured
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


def count_buffer(t):
    """Count a new communication buffer in the open meters until it is garbage."""
    for meter in KVBufferMeter._open:
        meter._add(t.nbytes)
        weakref.finalize(t, meter._add, -t.nbytes)
    return t


# --------------------------------------------------------------------------- the K/V round the ring
_K, _V, _DKV = 0, 1, 2  # message tags: K, V and dK/dV transfers may be in flight together


def ring_kv_blocks(k, v, group, timeline):
    """Yield ``(owner rank, (k, v))`` for every rank's block, own block first (``ring_blocks``:
    the next block travels while the caller attends to this one). A step's K and V go as one
    batch, into one of two receive buffers that take turns: the buffer received two steps ago
    has been sent on by now."""
    buffers = []

    def receive_buffer(step, owner):
        if len(buffers) < 2:
            buffers.append(count_buffer(k.new_empty((2, *k.shape))))
        return tuple(buffers[step % 2])

    yield from ring_blocks((k, v), group, receive_buffer, tag=_K, batched=True, timeline=timeline, name="receive K/V")


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
            buffers.append(count_buffer(k.new_empty((2, *k.shape), dtype=dtype)))
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


# For each kind of context-parallel attention: how the K/V blocks come, and how dK/dV goes back.
# The ring is the basic form; refinements add their kinds when the package imports them
# (``all_gather_kv.py``: "all_gather").
KV_EXCHANGES = {"ring": (ring_kv_blocks, ring_kv_gradients)}


# --------------------------------------------------------------------------- which keys a query block sees
def _visible(pos_q, pos_k, causal):
    """What a causal mask leaves of a (queries x keys) block: ``(first_row, last_key, mask)``,
    or None. Positions are ascending on every rank, so the queries that see at least one
    of these keys are a suffix and the keys seen by at least one query a prefix."""
    if not causal:
        return 0, len(pos_k), None
    first_row = int(torch.searchsorted(pos_q, pos_k[0]))  # first query at or after key 0
    last_key = int(torch.searchsorted(pos_k, pos_q[-1], right=True))  # keys up to the last query
    if first_row == len(pos_q) or last_key == 0:
        return None  # all in the future: skip
    mask = pos_k[None, :last_key] <= pos_q[first_row:, None]
    return first_row, last_key, (None if bool(mask.all()) else mask)


# --------------------------------------------------------------------------- one block of keys
def _repeat_kv(t, q):
    """K or V as q's dtype and heads: with grouped-query attention each K/V head serves
    q.heads / kv.heads query heads (the K/V heads travel, not their copies)."""
    group = q.shape[1] // t.shape[1]
    t = t.to(q.dtype)
    return t.repeat_interleave(group, dim=1) if group > 1 else t


def _sum_groups(grad, like):
    """The gradient of a K/V head is the sum over the query heads it served."""
    b, kv_heads, s, d = like.shape
    return grad.view(b, kv_heads, -1, s, d).sum(2)


def _scores(q, k, mask, scale):
    s = (q @ k.transpose(-2, -1)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _attend(q, k, v, mask, scale):
    """Softmax attention of ``q`` to one block of keys alone: normalised output and lse.
    Every row of the visible part sees at least one key, so no row is all -inf."""
    s = _scores(q, _repeat_kv(k, q), mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]) @ _repeat_kv(v, q), lse


def _attend_backward(q, k, v, grad_out, lse, delta, mask, scale):
    """This block's share of dQ, dK, dV (FlashAttention's backward): the probabilities are
    rebuilt from the *final* lse, so they are the block's columns of the full softmax."""
    kr, vr = _repeat_kv(k, q), _repeat_kv(v, q)
    p = torch.exp(_scores(q, kr, mask, scale) - lse[..., None])
    dv = p.transpose(-2, -1) @ grad_out
    ds = p * (grad_out @ vr.transpose(-2, -1) - delta[..., None])  # softmax backward, delta = rowsum(dO * O)
    return ds @ kr * scale, _sum_groups(ds.transpose(-2, -1) @ q * scale, k), _sum_groups(dv, v)


# --------------------------------------------------------------------------- the autograd Function
class ContextParallelAttention(torch.autograd.Function):
    """Attention of this rank's queries to every rank's keys; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, kind, scale, timeline):
        ctx.dtypes = q.dtype, k.dtype, v.dtype
        # Compute and accumulate in at least fp32; K and V travel as they are (sent whole:
        # contiguous), and each block is converted when it is used.
        q = q.to(torch.promote_types(q.dtype, torch.float32))
        k, v = k.contiguous(), v.contiguous()
        r, n = dist.get_rank(group), dist.get_world_size(group)  # the group checked by the caller
        positions = [sequence_positions(q.shape[2] * n, src, n, layout).to(q.device) for src in range(n)]
        visible = {src: _visible(positions[r], positions[src], causal) for src in range(n)}
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)  # nothing seen yet
        blocks, _ = KV_EXCHANGES[kind]
        for src, (k_blk, v_blk) in blocks(k, v, group, timeline):
            with timeline.span(f"attend to K/V of rank {src}"):
                if visible[src] is None:
                    continue
                first, last, mask = visible[src]
                part = _attend(q[..., first:, :], k_blk[..., :last, :], v_blk[..., :last, :], mask, scale)
                out[..., first:, :], lse[..., first:] = merge_partial_attention(
                    out[..., first:, :], lse[..., first:], *part
                )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.setup = (group, kind, scale, timeline, visible)
        return out.to(ctx.dtypes[0])

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, kind, scale, timeline, visible = ctx.setup
        grad_out = grad_out.to(q.dtype)
        delta = (grad_out * out).sum(-1)
        dq = torch.zeros_like(q)

        def add_part(src, k_blk, v_blk, dkv):  # this rank's dK/dV of src's block into dkv; dQ here
            with timeline.span(f"backward for K/V of rank {src}"):
                if visible[src] is None:
                    return
                first, last, mask = visible[src]
                dq_part, dk, dv = _attend_backward(
                    q[..., first:, :],
                    k_blk[..., :last, :],
                    v_blk[..., :last, :],
                    grad_out[..., first:, :],
                    lse[..., first:],
                    delta[..., first:],
                    mask,
                    scale,
                )
                dq[..., first:, :] += dq_part
                dkv[0, ..., :last, :] += dk
                dkv[1, ..., :last, :] += dv

        _, gradients = KV_EXCHANGES[kind]
        dkv = gradients(k, v, q.dtype, group, timeline, add_part)  # dK/dV summed in q's (>= fp32) dtype
        dq, dk, dv = (g.to(dtype) for g, dtype in zip((dq, dkv[0], dkv[1]), ctx.dtypes))
        return dq, dk, dv, None, None, None, None, None, None


# --------------------------------------------------------------------------- checks
_SIZES = ("batch", "heads", "sequence length", "head_dim", "K/V heads")


def _local_problem(q, k, v, layout, kind):
    """What is wrong with this rank's own inputs, or None."""
    if layout not in LAYOUTS or kind not in KV_EXCHANGES:
        return f"layout={layout!r}, kind={kind!r}: choose a layout in {LAYOUTS} and a kind in {tuple(KV_EXCHANGES)}"
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        return (
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected q (batch, heads, "
            "seq_local, head_dim) and k, v both (batch, kv_heads, seq_local, head_dim)"
        )
    if q.shape[-1] != k.shape[-1]:
        return (
            f"head_dim mismatch: q has head_dim {q.shape[-1]}, k and v {k.shape[-1]}: the q, k and v "
            "projections must give heads of the same size"
        )
    if (q.shape[0], q.shape[2]) != (k.shape[0], k.shape[2]) or q.shape[1] % k.shape[1]:
        return (
            f"q {tuple(q.shape)} and k {tuple(k.shape)}: they need the same batch and sequence length, "
            "and a number of query heads that the K/V heads divide"
        )
    if layout == "zigzag" and q.shape[2] % 2:
        return (
            f"the zigzag layout gives every rank 2 equal chunks, but this rank holds {q.shape[2]} tokens: "
            "split the sequence with data.split(..., by='sequence', layout='zigzag')"
        )
    return None


def check_attention_inputs(q, k, v, group, layout="contiguous", kind="ring"):
    """Refuse bad inputs on *every* rank of the group, so that none is left waiting in the ring.

    One small all-reduce (max of each size and of minus each size) tells every rank the
    largest and smallest of every size and whether some rank found a problem of its own."""
    problem = _local_problem(q, k, v, layout, kind)
    sizes = [*q.shape, k.shape[1]] if problem is None else [0] * 5
    stats = torch.tensor(sizes + [problem is not None], dtype=torch.int64, device=q.device)
    stats = torch.cat([stats, -stats])
    with labelled("cp shape check"):
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    if problem is not None:
        raise ValueError(problem)
    if stats[5]:
        raise ValueError("another rank of the cp group refused its attention inputs (see its error)")
    high, low = stats[:5].tolist(), (-stats[6:11]).tolist()
    differ = [f"{name} from {lo} to {hi}" for name, lo, hi in zip(_SIZES, low, high) if lo != hi]
    if differ:
        raise ValueError(
            f"the ranks of the cp group hold attention inputs of different shapes ({', '.join(differ)}; "
            f"this rank: q {tuple(q.shape)}): every rank must hold an equal slice of the sequence; "
            "split the batch with data.split(..., by='sequence', layout=...)"
        )


# --------------------------------------------------------------------------- the functions to call
def context_parallel_attention(
    q,
    k,
    v,
    group=None,
    *,
    causal: bool = True,
    layout: str = "contiguous",
    kind: str = "ring",
    sm_scale: float | None = None,
    timeline=None,
):
    """softmax(Q K^T * scale) V of this rank's queries against the whole sequence's keys.

    q: (batch, heads, seq_local, head_dim); k, v: (batch, kv_heads, seq_local, head_dim),
    this rank's tokens in ``layout`` ("contiguous" or "zigzag", over the ranks of ``group``);
    kv_heads may divide heads (grouped-query attention: the K/V heads travel, not copies).
    ``kind``: "ring" (point-to-point, overlapped) or "all_gather". The causal mask follows
    the tokens' global positions. Differentiable (see ``ContextParallelAttention``).
    ``timeline``: a bar per block attended to and per transfer, for a Gantt chart.
    Every rank of ``group`` must call it, with inputs of the same shapes.
    """
    rank_and_size(group, "context-parallel attention")  # a clear error outside a process group
    check_attention_inputs(q, k, v, group, layout, kind)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    return ContextParallelAttention.apply(q, k, v, group, causal, layout, kind, scale, or_disabled(timeline))


def ring_attention(q, k, v, group=None, **options):
    """``context_parallel_attention`` with the K/V passed round the ring, point to point."""
    return context_parallel_attention(q, k, v, group, kind="ring", **options)
