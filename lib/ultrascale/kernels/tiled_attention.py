"""Attention without the s x s matrix, in plain PyTorch, and what that saves.

Naive attention computes S = Q K^T (s x s per head), P = softmax(S) (s x s
again) and O = P V. For s = 32k one head's S in fp32 is 4 GiB, and on a GPU
it is written to and read back from global memory (HBM) several times.

The tiled version walks over blocks of keys and keeps, for each query row,
only three things: the running maximum ``m`` of the scores seen so far, the
running sum ``l`` of exp(score - m), and the running (unnormalised) output.
When a new block of keys raises the maximum, the old sum and output are
rescaled by exp(m_old - m_new) ("online softmax"), so the result equals the
softmax over all keys at the end. (``tiled_attention_reference`` keeps the same
information as the normalised output and lse = m + log l.) Only a block_m x block_n piece of S exists
at any time. The FlashAttention kernel (flash_attention.py) is this same loop,
run with the blocks in on-chip SRAM.

``merge_partial_attention`` is that rescaling written once, for two partial
results that each carry their log-sum-exp (lse = m + log l): the reference loop
below uses it for every key block, and ring attention (context parallelism,
``ultrascale.parallel.context_parallel``) uses it for the key blocks that arrive
from other ranks. One merge rule for both.

``peak_intermediate_bytes`` measures (it does not model) how many bytes of
tensors a function keeps alive at once, so the two can be compared as s grows.
"""

import math
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _scale(q: torch.Tensor, sm_scale):
    return 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale


def naive_attention(q, k, v, causal: bool = False, sm_scale=None):
    """softmax(q k^T * scale) v over the last two dims, building the full score matrix.

    Returns ``(out, lse)``: ``lse`` is the natural-log logsumexp of each query's
    scaled scores, the one statistic the FlashAttention backward needs. Causal
    masking is top-left aligned: query i sees keys 0..i (as in PyTorch's SDPA).
    Computed in fp32, returned in q's dtype (lse stays fp32).
    """
    scores = (q.float() @ k.float().transpose(-2, -1)) * _scale(q, sm_scale)
    if causal:
        seq_q, seq_k = scores.shape[-2:]
        allowed = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ v.float()
    return out.to(q.dtype), lse


def merge_partial_attention(out_a, lse_a, out_b, lse_b):
    """Attention over the keys of two parts, from each part's normalised result.

    ``out_x`` (..., rows, d) is softmax attention over part x's keys alone, ``lse_x``
    (..., rows) the log-sum-exp of those scores. Over both parts the softmax
    denominator is exp(lse_a) + exp(lse_b), so
        lse = logaddexp(lse_a, lse_b),   out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse):
    each part is weighted by its share of the total. Working with lse instead of
    exp(lse) keeps every exponent <= 0, so nothing overflows. A row that sees no key
    in a part (a causal mask) has lse = -inf there, and weight 0; a row that sees no
    key at all keeps lse = -inf and output 0 (not the NaN of -inf - -inf).
    Returns ``(out, lse)``.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    out = out_a * torch.exp(lse_a - finite)[..., None] + out_b * torch.exp(lse_b - finite)[..., None]
    return out, lse


def tiled_attention_reference(q, k, v, causal: bool = False, sm_scale=None, block_m: int = 64, block_n: int = 64):
    """The same result as ``naive_attention`` with online softmax over key blocks: no s x s tensor."""
    scale = _scale(q, sm_scale)
    seq_q = q.shape[-2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for start_m in range(0, seq_q, block_m):
        rows = slice(start_m, min(start_m + block_m, seq_q))
        out[..., rows, :], lse[..., rows] = _attend_one_query_block(
            q[..., rows, :].float(), k, v, start_m, causal, scale, block_n
        )
    return out, lse


def _attend_one_query_block(q_blk, k, v, start_m, causal, scale, block_n):
    n_rows = q_blk.shape[-2]
    # Nothing seen yet: output 0 and lse = log(0) = -inf, which the first merge replaces.
    out = torch.zeros(q_blk.shape[:-1] + (v.shape[-1],), device=q_blk.device)
    lse = torch.full(q_blk.shape[:-1], float("-inf"), device=q_blk.device)
    # With causal masking, key blocks entirely to the right of the last query row are skipped.
    end_n = min(k.shape[-2], start_m + n_rows) if causal else k.shape[-2]
    for start_n in range(0, end_n, block_n):
        cols = slice(start_n, min(start_n + block_n, end_n))
        s = (q_blk @ k[..., cols, :].float().transpose(-2, -1)) * scale  # only block_m x block_n
        if causal:
            q_idx = torch.arange(start_m, start_m + n_rows, device=q_blk.device)[:, None]
            k_idx = torch.arange(cols.start, cols.stop, device=q_blk.device)[None, :]
            s = s.masked_fill(k_idx > q_idx, float("-inf"))
        # This block's own softmax result, then merged into what the earlier blocks gave.
        lse_blk = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse_blk[..., None])
        # A row whose keys here are all in its future has lse_blk = -inf and p = NaN
        # (exp(-inf - -inf)); its output is zeroed and the merge gives it weight 0.
        out_blk = p.nan_to_num(0.0) @ v[..., cols, :].float()
        out, lse = merge_partial_attention(out, lse, out_blk, lse_blk)
    # Key 0 is visible to every query, so every row has a finite lse at the end.
    return out, lse


# ---- Measuring the memory of intermediates --------------------------------------------------


class _LiveTensorBytes(TorchDispatchMode):
    """Tracks the bytes of every new tensor storage created by an op, until it is freed."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0

    def _free(self, nbytes):
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        input_storages = {
            t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            # Views and in-place results share an input's storage: no new memory.
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in input_storages:
                nbytes = t.untyped_storage().nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, nbytes)  # runs when the tensor is garbage
        return out


def peak_intermediate_bytes(fn, *args, **kwargs):
    """Run ``fn`` and return ``(result, peak)``: the most bytes of tensors it held alive at once.

    Counts every tensor created inside ``fn`` (its outputs included, its inputs
    not), on any device, by watching PyTorch's operator dispatch. Run it under
    ``torch.no_grad()`` semantics (it does so itself) so autograd's saved
    tensors do not blur the picture.
    """
    tracker = _LiveTensorBytes()
    with torch.no_grad(), tracker:
        result = fn(*args, **kwargs)
    return result, tracker.peak


def attention_memory_report(
    seq_lens=(256, 512, 1024, 2048),
    head_dim: int = 64,
    block: int = 64,
    batch_heads: int = 1,
    dtype=torch.float32,
    causal: bool = False,
):
    """Measured peak bytes of intermediates for naive vs tiled attention, one dict per sequence length."""
    rows = []
    for seq in seq_lens:
        q, k, v = (torch.randn(batch_heads, seq, head_dim, dtype=dtype) for _ in range(3))
        _, naive = peak_intermediate_bytes(naive_attention, q, k, v, causal)
        _, tiled = peak_intermediate_bytes(tiled_attention_reference, q, k, v, causal, None, block, block)
        score_matrix = batch_heads * seq * seq * 4  # one fp32 s x s matrix, for scale
        rows.append(dict(seq=seq, naive_bytes=naive, tiled_bytes=tiled, score_matrix_bytes=score_matrix))
    return rows


def attention_hbm_bytes(seq: int, head_dim: int, block_m: int = 128, elem_bytes: int = 2) -> dict:
    """Modelled global-memory (HBM) traffic of one head's forward, in bytes (a model, not a measurement).

    naive: read Q, K; write S; read S, write P (softmax); read P, V; write O
           -> 4*s*d + 4*s*s elements.
    flash: read Q once and write O once; every query block of ``block_m`` rows
           streams all of K and V through SRAM -> 2*s*d + 2*s*d*ceil(s/block_m).
    The s*s term is gone: traffic grows with s*s*d/block_m, and block_m is set by SRAM size.
    The naive count is a floor: masking, scaling or dropout done as separate kernels each add
    another read and write of an s x s matrix, and S is often kept in fp32.
    """
    naive = 4 * seq * head_dim + 4 * seq * seq
    flash = 2 * seq * head_dim + 2 * seq * head_dim * math.ceil(seq / block_m)
    return dict(naive=naive * elem_bytes, flash=flash * elem_bytes)
