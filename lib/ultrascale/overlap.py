"""When can communication hide behind computation? The book's appendix A3, as arithmetic.

For each technique we write down two times, both for the piece of work that the
communication is supposed to overlap with:

* ``t_comm``: bytes moved / bandwidth, with the bandwidth counted as nccl-tests' *bus*
  bandwidth (``comm.bandwidth``), so a ring all-reduce of ``K`` bytes on ``N`` ranks takes
  ``2 (N-1)/N * K / peak_bw`` and an all-gather or reduce-scatter ``(N-1)/N * K / peak_bw``;
* ``t_compute``: FLOPs / ``peak_flops``, with A2's counts (``scales``): ``2 T N`` for a
  forward, ``4 T N`` for a backward.

Their quotient is the **overlap ratio**. At or below 1, the communication fits inside the
computation and can be hidden completely (if the implementation overlaps at all); above 1
some of it shows, however clever the schedule. The ratios say what helps:

========  ========================================================  ==========================
DP        ``(DP-1)/DP * 1/(2 T) * peak_flops/peak_bw``               more tokens per rank
ZeRO-3    ``(DP-1)/DP * 1/(2 seq mbs) * peak_flops/peak_bw``         longer micro-batches
TP        ``(TP-1)/(2 h) * peak_flops/peak_bw``                      wider models (not seq, mbs)
PP        ``peak_flops / (32 h layers_per_stage peak_bw)``           more layers per stage
========  ========================================================  ==========================

(DP as derived here from the book's own ``t_comm`` and ``t_compute``; the book prints an
extra factor ``num_params``, see ``dp_ratio_as_printed``.)

Units: like the book, the functions count one byte per element unless you pass
``bytes_per_element`` (2 for bf16, 4 for fp32). They are plain arithmetic, so they take
numbers, numpy arrays or sympy symbols; the planner of chapter 10 calls them with numbers,
the A3 chapter with symbols to derive the ratios.

Only ``measure_matmul_flops`` measures anything: the ``peak_flops`` of this machine for
plugging in (``comm.bus_bandwidth_sweep`` measures ``peak_bw``).
"""

from __future__ import annotations

import statistics
import time

from .scales import block_params

DDP_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default bucket_cap_mb = 25 (MiB); the book's "25MB"


# --------------------------------------------------------------------------- data parallelism
def dp_comm_time(nbytes, dp, peak_bw):
    """All-reduce of ``nbytes`` over ``dp`` ranks (a bucket, or the whole gradient):
    ``nbytes * 2 (DP-1) / (DP * peak_bw)``."""
    return nbytes * 2 * (dp - 1) / (dp * peak_bw)


def dp_compute_time(num_tokens, num_params, peak_flops):
    """Backward of ``num_tokens`` tokens through ``num_params`` parameters: ``4 T N / peak_flops``."""
    return 4 * num_tokens * num_params / peak_flops


def dp_ratio(num_tokens, num_params, dp, peak_flops, peak_bw, bytes_per_element=1):
    """All-reduce of the whole gradient over the whole backward: ``t_comm / t_compute``.

    ``num_tokens``: the tokens of one rank's backward (``seq * mbs``). Simplified, the
    parameter count cancels: ``bytes_per_element * (DP-1)/DP / (2 T) * peak_flops/peak_bw``.
    """
    return dp_comm_time(bytes_per_element * num_params, dp, peak_bw) / dp_compute_time(
        num_tokens, num_params, peak_flops
    )


def dp_ratio_as_printed(num_tokens, num_params, dp, peak_flops, peak_bw):
    """The book's DP condition exactly as printed, ``N/(2T) * (DP-1)/DP * peak_flops/peak_bw``.

    It does not follow from the book's own two lines (``dp_ratio`` does): it is ``num_params``
    times larger. Here only so that the A3 chapter can show the difference; do not plan with it.
    """
    return num_params / (2 * num_tokens) * (dp - 1) / dp * peak_flops / peak_bw


# --------------------------------------------------------------------------- ZeRO-3
def zero3_comm_time(params_per_block, dp, peak_bw, bytes_per_element=1):
    """All-gather of one block's parameters, each rank holding ``1/DP`` of them:
    ``P_block (DP-1) / (DP * peak_bw)`` (``16h^2 (DP-1) / (DP peak_bw)`` for A2's block)."""
    return bytes_per_element * params_per_block * (dp - 1) / (dp * peak_bw)


def zero3_compute_time(params_per_block, seq, mbs, peak_flops):
    """Forward of one block on one micro-batch: ``2 seq mbs P_block / peak_flops``
    (``32 seq mbs h^2 / peak_flops`` for A2's ``16h^2`` block)."""
    return 2 * seq * mbs * params_per_block / peak_flops


def zero3_ratio(seq, mbs, dp, peak_flops, peak_bw, params_per_block=1, bytes_per_element=1):
    """Prefetching the next block's parameters during this block's forward.

    ``(DP-1)/DP / (2 seq mbs) * peak_flops/peak_bw`` (times ``bytes_per_element``): the size
    of the block cancels, so ``params_per_block`` changes nothing but is accepted."""
    return zero3_comm_time(params_per_block, dp, peak_bw, bytes_per_element) / zero3_compute_time(
        params_per_block, seq, mbs, peak_flops
    )


def zero3_bytes_per_block(params_per_block, dp):
    """What one rank contributes per block and step: an all-gather in forward, an all-gather
    and a reduce-scatter in backward, ``P_block / DP`` each: ``3 P_block / DP``."""
    return 3 * params_per_block / dp


def zero3_bytes_per_step(params_per_block, layers, dp):
    """``3 * layers * P_block / DP`` per rank and step."""
    return layers * zero3_bytes_per_block(params_per_block, dp)


# --------------------------------------------------------------------------- tensor parallelism
def tp_comm_time(seq, mbs, h, tp, peak_bw, bytes_per_element=1):
    """The all-gather (or reduce-scatter) of one ``seq x mbs x h`` activation over ``tp``
    ranks: ``seq mbs h (TP-1) / (TP * peak_bw)``."""
    return bytes_per_element * seq * mbs * h * (tp - 1) / (tp * peak_bw)


def tp_compute_time(seq, mbs, h, tp, peak_flops):
    """One ``h x h`` matmul of the micro-batch, split ``tp`` ways: ``2 seq mbs h^2 / (TP * peak_flops)``."""
    return 2 * seq * mbs * h * h / (tp * peak_flops)


def tp_ratio(h, tp, peak_flops, peak_bw, seq=1, mbs=1, bytes_per_element=1):
    """``(TP-1)/(2h) * peak_flops/peak_bw``: the micro-batch cancels (``seq``, ``mbs`` accepted
    but change nothing), so only a wider model buys room for a larger TP degree."""
    return tp_comm_time(seq, mbs, h, tp, peak_bw, bytes_per_element) / tp_compute_time(seq, mbs, h, tp, peak_flops)


def tp_bytes_per_block(seq, mbs, h, tp):
    """Two column and two row linears, each an all-gather one way and a reduce-scatter the
    other of ``seq mbs h / TP``: ``8 seq mbs h / TP`` per block."""
    return 8 * seq * mbs * h / tp


# --------------------------------------------------------------------------- pipeline parallelism
def pp_comm_time(seq, mbs, h, peak_bw, bytes_per_element=1):
    """Sending one micro-batch's activation to the next stage: ``seq mbs h / peak_bw``."""
    return bytes_per_element * seq * mbs * h / peak_bw


def pp_compute_time(seq, mbs, h, layers_per_stage, peak_flops, params_per_block=None):
    """Forward of the next stage's layers on that micro-batch: ``32 seq mbs h^2 L_stage / peak_flops``
    with A2's ``16h^2`` block (or ``2 seq mbs P_block L_stage`` for another block size)."""
    block = block_params(h) if params_per_block is None else params_per_block
    return 2 * seq * mbs * block * layers_per_stage / peak_flops


def pp_ratio(h, layers_per_stage, peak_flops, peak_bw, seq=1, mbs=1, bytes_per_element=1):
    """``peak_flops / (32 h L_stage peak_bw)``: deeper stages hide the transfer better."""
    return pp_comm_time(seq, mbs, h, peak_bw, bytes_per_element) / pp_compute_time(
        seq, mbs, h, layers_per_stage, peak_flops
    )


def pp_bytes_per_step(seq, mbs, h, grad_acc=1):
    """Per micro-batch, an activation forward and its gradient backward, each sent and
    received: ``4 seq mbs h``; ``grad_acc`` micro-batches per step."""
    return 4 * grad_acc * seq * mbs * h


# --------------------------------------------------------------------------- all four
def overlap_ratios(*, h, seq, mbs, tp=1, dp=1, layers_per_stage=1, peak_flops, peak_bw, bytes_per_element=1) -> dict:
    """The four ratios for one setting, by technique name ("DP", "ZeRO-3", "TP", "PP").

    DP is the derived form (whole gradient against a backward of ``seq * mbs`` tokens)."""
    return {
        "DP": dp_ratio(seq * mbs, 1, dp, peak_flops, peak_bw, bytes_per_element),
        "ZeRO-3": zero3_ratio(seq, mbs, dp, peak_flops, peak_bw, bytes_per_element=bytes_per_element),
        "TP": tp_ratio(h, tp, peak_flops, peak_bw, bytes_per_element=bytes_per_element),
        "PP": pp_ratio(h, layers_per_stage, peak_flops, peak_bw, bytes_per_element=bytes_per_element),
    }


# --------------------------------------------------------------------------- calibration
def measure_matmul_flops(n: int = 512, dtype=None, device=None, warmup: int = 3, repeats: int = 7) -> float:
    """FLOP/s of an ``n x n`` matmul on this machine: the median of ``repeats`` timed runs
    after ``warmup`` untimed ones (a GPU is synchronized before each clock reading)."""
    import torch

    a = torch.randn(n, n, dtype=dtype or torch.float32, device=device)
    b = torch.randn(n, n, dtype=dtype or torch.float32, device=device)
    sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    for _ in range(warmup):
        a @ b
    seconds = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        a @ b
        sync()
        seconds.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(seconds)
