"""FlashAttention in Triton: forward with online softmax, and a simple backward.

Shapes: q is (batch, heads, seq_q, head_dim); k and v are (batch, heads, seq_k, head_dim).

Forward. One program instance owns BLOCK_M query rows of one head. It keeps
those rows of Q, the running max ``m``, the running sum ``l`` and the output
accumulator on chip, and streams K and V through in blocks of BLOCK_N keys,
updating the statistics with the online-softmax rescaling (the same loop as
``tiled_attention_reference``). The s x s scores never reach global memory. It
writes O and, per query row, ``lse = m + log(l)`` (the log of the softmax
denominator), which is all the backward needs to rebuild P.

Backward (kept simple rather than fast). With P = exp(S - lse) recomputed tile
by tile, and delta = rowsum(dO * O):
    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta),
    dQ = scale * dS K,   dK = scale * dS^T Q.
Two kernels avoid any atomics: one instance per *key* block accumulates dK
and dV over all query blocks; one instance per *query* block accumulates dQ
over all key blocks. Each recomputes S, which costs extra FLOPs but no memory.

Tensors are made contiguous, so the (b, h) slice of any of them starts at
``bh * seq * head_dim`` and the kernels need no stride arguments.
"""

import math

import torch
import triton
import triton.language as tl

from ultrascale.kernels._device import check_dot_dtype, check_tensors, on_gpu
from ultrascale.kernels.tiled_attention import naive_attention

#: The reference for these kernels: plain attention that builds the whole score matrix.
attention_reference = naive_attention


@triton.jit
def _load_tile(base_ptr, start, seq, head_dim, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows start..start+BLOCK of a (seq, head_dim) matrix; rows and columns past the end read 0."""
    rows = start + tl.arange(0, BLOCK)
    dims = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < seq) & (dims[None, :] < head_dim)
    return tl.load(base_ptr + rows[:, None] * head_dim + dims[None, :], mask=mask, other=0.0)


@triton.jit
def _store_tile(base_ptr, tile, start, seq, head_dim, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = start + tl.arange(0, BLOCK)
    dims = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < seq) & (dims[None, :] < head_dim)
    tl.store(base_ptr + rows[:, None] * head_dim + dims[None, :], tile.to(base_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _visible(start_m, start_n, seq_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Which (query, key) pairs of this tile take part: keys in range and, if causal, key <= query.

    Query rows past seq_q need no mask: they were loaded as zeros (so are their dO rows), give
    finite scores, add nothing to dK or dV, and are never stored. Masking them would make a row
    of -inf whose max is -inf, and then exp(-inf - (-inf)) = NaN.
    """
    q_idx = start_m + tl.arange(0, BLOCK_M)
    k_idx = start_n + tl.arange(0, BLOCK_N)
    ok = k_idx[None, :] < seq_k  # shape (1, BLOCK_N): the same for every row
    if CAUSAL:
        ok = ok & (k_idx[None, :] <= q_idx[:, None])
    return ok


@triton.jit
def _key_end(start_m, seq_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """One past the last key a query block can see: causal blocks stop at their last row."""
    if CAUSAL:
        return tl.minimum(seq_k, start_m + BLOCK_M)
    return seq_k


@triton.jit
def flash_attention_forward_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    seq_q,
    seq_k,
    head_dim,
    sm_scale,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M  # which query rows
    bh = tl.program_id(1)  # which (batch, head)
    q_base = q_ptr + bh * seq_q * head_dim
    k_base = k_ptr + bh * seq_k * head_dim
    v_base = v_ptr + bh * seq_k * head_dim

    q = _load_tile(q_base, start_m, seq_q, head_dim, BLOCK_M, BLOCK_D)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    for start_n in range(0, _key_end(start_m, seq_k, CAUSAL, BLOCK_M), BLOCK_N):
        k = _load_tile(k_base, start_n, seq_k, head_dim, BLOCK_N, BLOCK_D)
        v = _load_tile(v_base, start_n, seq_k, head_dim, BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(k)) * sm_scale  # BLOCK_M x BLOCK_N scores, on chip only
        s = tl.where(_visible(start_m, start_n, seq_k, CAUSAL, BLOCK_M, BLOCK_N), s, float("-inf"))
        # The first key block always holds key 0, visible to every row, so m_new is finite from
        # the first step: exp(m - m_new) is then exp(-inf) = 0, never exp(-inf + inf) = NaN.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        rescale = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    _store_tile(o_ptr + bh * seq_q * head_dim, acc / l[:, None], start_m, seq_q, head_dim, BLOCK_M, BLOCK_D)
    rows = start_m + tl.arange(0, BLOCK_M)
    tl.store(lse_ptr + bh * seq_q + rows, m + tl.log(l), mask=rows < seq_q)


@triton.jit
def _probabilities(
    q,
    k,
    lse,
    start_m,
    start_n,
    seq_q,
    seq_k,
    sm_scale,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Rebuild one tile of P = exp(S - lse) from Q, K and the saved logsumexp; hidden pairs get 0."""
    s = tl.dot(q, tl.trans(k)) * sm_scale
    p = tl.exp(s - lse[:, None])
    return tl.where(_visible(start_m, start_n, seq_k, CAUSAL, BLOCK_M, BLOCK_N), p, 0.0)


@triton.jit
def flash_attention_backward_dkdv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    seq_q,
    seq_k,
    head_dim,
    sm_scale,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N  # this instance owns BLOCK_N keys
    bh = tl.program_id(1)
    q_base = q_ptr + bh * seq_q * head_dim
    do_base = do_ptr + bh * seq_q * head_dim
    k = _load_tile(k_ptr + bh * seq_k * head_dim, start_n, seq_k, head_dim, BLOCK_N, BLOCK_D)
    v = _load_tile(v_ptr + bh * seq_k * head_dim, start_n, seq_k, head_dim, BLOCK_N, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Causal: queries before start_n cannot see any key of this block, so skip them.
    first_m = start_n if CAUSAL else 0
    for start_m in range(first_m, seq_q, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q = _load_tile(q_base, start_m, seq_q, head_dim, BLOCK_M, BLOCK_D)
        do = _load_tile(do_base, start_m, seq_q, head_dim, BLOCK_M, BLOCK_D)
        lse = tl.load(lse_ptr + bh * seq_q + rows, mask=rows < seq_q, other=0.0)
        delta = tl.load(delta_ptr + bh * seq_q + rows, mask=rows < seq_q, other=0.0)
        p = _probabilities(q, k, lse, start_m, start_n, seq_q, seq_k, sm_scale, CAUSAL, BLOCK_M, BLOCK_N)
        dv += tl.dot(tl.trans(p).to(do.dtype), do)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds).to(q.dtype), q)

    _store_tile(dk_ptr + bh * seq_k * head_dim, dk * sm_scale, start_n, seq_k, head_dim, BLOCK_N, BLOCK_D)
    _store_tile(dv_ptr + bh * seq_k * head_dim, dv, start_n, seq_k, head_dim, BLOCK_N, BLOCK_D)


@triton.jit
def flash_attention_backward_dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    seq_q,
    seq_k,
    head_dim,
    sm_scale,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M  # this instance owns BLOCK_M queries
    bh = tl.program_id(1)
    k_base = k_ptr + bh * seq_k * head_dim
    v_base = v_ptr + bh * seq_k * head_dim
    rows = start_m + tl.arange(0, BLOCK_M)
    q = _load_tile(q_ptr + bh * seq_q * head_dim, start_m, seq_q, head_dim, BLOCK_M, BLOCK_D)
    do = _load_tile(do_ptr + bh * seq_q * head_dim, start_m, seq_q, head_dim, BLOCK_M, BLOCK_D)
    lse = tl.load(lse_ptr + bh * seq_q + rows, mask=rows < seq_q, other=0.0)
    delta = tl.load(delta_ptr + bh * seq_q + rows, mask=rows < seq_q, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    for start_n in range(0, _key_end(start_m, seq_k, CAUSAL, BLOCK_M), BLOCK_N):
        k = _load_tile(k_base, start_n, seq_k, head_dim, BLOCK_N, BLOCK_D)
        v = _load_tile(v_base, start_n, seq_k, head_dim, BLOCK_N, BLOCK_D)
        p = _probabilities(q, k, lse, start_m, start_n, seq_q, seq_k, sm_scale, CAUSAL, BLOCK_M, BLOCK_N)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)

    _store_tile(dq_ptr + bh * seq_q * head_dim, dq * sm_scale, start_m, seq_q, head_dim, BLOCK_M, BLOCK_D)


# ---- Python wrappers ---------------------------------------------------------------------------


def _check_shapes(q, k, v):
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            "flash attention needs q (batch, heads, seq_q, d) and k, v (batch, heads, seq_k, d); got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not 16 <= q.shape[-1] <= 128:  # the range the tests and the GPU tile sizes cover
        raise ValueError(f"head_dim must be between 16 and 128, got {q.shape[-1]}")
    check_tensors(q, k, v)
    check_dot_dtype(q, k, v)


def launch_config(
    head_dim: int, backward: bool, block_m=None, block_n=None, gpu: bool | None = None, dtype_bytes: int = 2
) -> dict:
    """Tile sizes and launch options for the forward or the backward kernels."""
    gpu = on_gpu() if gpu is None else gpu
    # tl.dot needs tile sides >= 16; head_dim is padded up to a power of two and masked.
    cfg = dict(BLOCK_D=max(16, triton.next_power_of_2(head_dim)))
    if not gpu:
        cfg.update(BLOCK_M=32, BLOCK_N=32)  # interpreter: modest tiles, so short sequences still span several
    elif backward:
        # The backward holds more tiles at once (q, k, v, do, dk, dv), so it uses smaller ones.
        cfg.update(BLOCK_M=64, BLOCK_N=64, num_warps=4 if head_dim <= 64 else 8, num_stages=2)
    else:
        cfg.update(BLOCK_M=128, BLOCK_N=64, num_warps=4 if head_dim <= 64 else 8, num_stages=3)
    if gpu and dtype_bytes > 2:
        cfg["BLOCK_N"] //= 2  # fp32 tiles take twice the shared memory of bf16 ones
    if block_m is not None:
        cfg["BLOCK_M"] = block_m
    if block_n is not None:
        cfg["BLOCK_N"] = block_n
    return cfg


def _scale(head_dim, sm_scale):
    return 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale


def flash_attention_forward(q, k, v, causal: bool = False, sm_scale=None, block_m=None, block_n=None):
    """Returns ``(out, lse)``: the attention output (q's dtype) and the fp32 logsumexp per query row."""
    _check_shapes(q, k, v)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seq_q, dtype=torch.float32, device=q.device)
    cfg = launch_config(head_dim, backward=False, block_m=block_m, block_n=block_n, dtype_bytes=q.element_size())
    grid = (triton.cdiv(seq_q, cfg["BLOCK_M"]), batch * heads)
    flash_attention_forward_kernel[grid](
        q, k, v, out, lse, seq_q, seq_k, head_dim, _scale(head_dim, sm_scale), CAUSAL=causal, **cfg
    )
    return out, lse


def flash_attention_backward(do, q, k, v, out, lse, causal: bool = False, sm_scale=None, block_m=None, block_n=None):
    """Returns ``(dq, dk, dv)`` from the output gradient and what the forward saved (out, lse)."""
    _check_shapes(q, k, v)
    q, k, v, do = q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous()
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    scale = _scale(head_dim, sm_scale)
    # delta_i = sum_j P_ij dP_ij = rowsum(dO * O): a cheap O(s d) pre-pass, done in PyTorch.
    delta = (do.float() * out.float()).sum(dim=-1).contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    cfg = launch_config(head_dim, backward=True, block_m=block_m, block_n=block_n, dtype_bytes=q.element_size())
    flash_attention_backward_dkdv_kernel[(triton.cdiv(seq_k, cfg["BLOCK_N"]), batch * heads)](
        q, k, v, do, lse, delta, dk, dv, seq_q, seq_k, head_dim, scale, CAUSAL=causal, **cfg
    )
    flash_attention_backward_dq_kernel[(triton.cdiv(seq_q, cfg["BLOCK_M"]), batch * heads)](
        q, k, v, do, lse, delta, dq, seq_q, seq_k, head_dim, scale, CAUSAL=causal, **cfg
    )
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    """Saves only q, k, v, out and lse (O(s d) memory); P is rebuilt in the backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale):
        out, lse = flash_attention_forward(q, k, v, causal, sm_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.sm_scale = causal, sm_scale
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(do, q, k, v, out, lse, ctx.causal, ctx.sm_scale)
        return dq, dk, dv, None, None


def flash_attention(q, k, v, causal: bool = False, sm_scale=None) -> torch.Tensor:
    """Attention output with the Triton kernels for forward and backward (differentiable)."""
    return FlashAttentionFunction.apply(q, k, v, causal, sm_scale)
