"""The alpha-beta (latency-bandwidth) model of communication cost.

Sending one message of ``n`` bytes takes ``t(n) = alpha + n / beta``: a fixed start-up
latency ``alpha`` (seconds) plus the bytes over the bandwidth ``beta`` (bytes/s).

A ring collective on ``N`` ranks of a ``K``-byte buffer is ``N - 1`` steps (per phase)
of one message of ``K / N`` bytes each, so

* reduce-scatter or all-gather: ``(N - 1) (alpha + K / (N beta))``
* all-reduce (both phases):     ``2 (N - 1) (alpha + K / (N beta))``

Small messages are latency bound and large ones bandwidth bound; the two terms are
equal at ``n* = alpha * beta`` bytes, the crossover size.

``tensor_parallel_throughput`` puts the model to work on tensor parallelism: how much of
a step goes to TP's all-reduces, and why per-GPU throughput falls once the TP group
leaves the node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AlphaBeta:
    """Latency ``alpha`` in seconds and bandwidth ``beta`` in bytes per second."""

    alpha: float
    beta: float

    def message_time(self, nbytes):
        """Seconds to send one message of ``nbytes`` (works on numpy arrays too)."""
        return self.alpha + np.asarray(nbytes, dtype=float) / self.beta

    def ring_phase_time(self, nbytes, world_size: int):
        """Seconds for a ring reduce-scatter or all-gather of an ``nbytes`` buffer."""
        n = world_size
        return (n - 1) * (self.alpha + np.asarray(nbytes, dtype=float) / (n * self.beta))

    def ring_all_reduce_time(self, nbytes, world_size: int):
        """Seconds for a ring all-reduce: ``2 (N-1) (alpha + K / (N beta))``."""
        return 2 * self.ring_phase_time(nbytes, world_size)

    @property
    def crossover_bytes(self) -> float:
        """Message size where latency and bandwidth cost the same: ``alpha * beta``."""
        return crossover_size(self.alpha, self.beta)


def crossover_size(alpha: float, beta: float) -> float:
    """Bytes at which ``n / beta`` catches up with ``alpha``: below it latency dominates."""
    return alpha * beta


def noise_floor(sizes, times) -> np.ndarray:
    """``times`` with each capped by the fastest time measured for a larger (or equal) size.

    A burst of load on the machine only ever adds time, and sending more bytes never takes less: so
    a small message measured slower than a larger one was slowed by something else, and the larger
    one's time bounds it. Fitted as measured, a few such points at the small end (a rank descheduled
    for a millisecond on a busy laptop) can tilt a line fitted by relative error until it no longer
    grows with size. Capped, the times never fall as the size grows, and so neither does the fit."""
    sizes, times = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    order = np.argsort(sizes, kind="stable")
    capped = np.empty_like(times)
    capped[order] = np.minimum.accumulate(times[order][::-1])[::-1]
    return capped


def _fit_line(x, y, relative: bool) -> tuple[float, float]:
    """Least-squares ``y = a + b x``; returns (a, b).

    With ``relative=True`` each equation is divided by its ``y``, so every point counts
    by its relative error. Sizes in a sweep span several decades: an ordinary fit would
    be decided by the largest messages alone and get the small latency ``a`` wrong.
    """
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.shape != y.shape or x.size < 2 or len(np.unique(x)) < 2:
        raise ValueError("need at least two points with different sizes to fit a line")
    design = np.stack([np.ones_like(x), x], axis=1)
    if relative:
        design, y = design / y[:, None], np.ones_like(y)
    (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
    return float(a), float(b)


def _fit_floor(sizes, times, relative: bool) -> tuple[float, float]:
    """``_fit_line`` of the times capped by ``noise_floor``; the slope is 0 where the capped times are
    all equal (fitted, a flat line's slope is 0 only up to rounding)."""
    floor = noise_floor(sizes, times)
    intercept, slope = _fit_line(sizes, floor, relative)
    return intercept, (slope if np.ptp(floor) > 0 else 0.0)


def fit_alpha_beta(sizes, times, relative: bool = True) -> AlphaBeta:
    """Fit ``t = alpha + n / beta`` to measured point-to-point (size, time) pairs (``noise_floor`` first)."""
    alpha, inverse_beta = _fit_floor(sizes, times, relative)
    if inverse_beta <= 0:
        raise ValueError(
            "the fitted time does not grow with size; measure larger messages (up to MiBs) or more iterations per size"
        )
    return AlphaBeta(max(alpha, 0.0), 1.0 / inverse_beta)


def fit_ring_all_reduce(sizes, times, world_size: int, relative: bool = True) -> AlphaBeta:
    """Recover alpha and beta from ring all-reduce timings of ``K``-byte buffers.

    The model ``2 (N-1) alpha + 2 (N-1) / N * K / beta`` is a line in ``K``: its
    intercept gives alpha and its slope beta. The times are capped by ``noise_floor`` first.
    """
    n = world_size
    if n < 2:
        raise ValueError("an all-reduce on one rank sends nothing; fit with world_size >= 2")
    intercept, slope = _fit_floor(sizes, times, relative)
    if slope <= 0:
        raise ValueError("the fitted time does not grow with size; measure larger buffers")
    steps = 2 * (n - 1)
    return AlphaBeta(max(intercept, 0.0) / steps, steps / (n * slope))


# ---- tensor parallelism ---------------------------------------------------------------
def tensor_parallel_throughput(
    config,
    tp: int,
    *,
    seq: int,
    micro_batch: int,
    flops: float,
    peak_flops: float,
    intra_node: AlphaBeta,
    inter_node: AlphaBeta,
    gpus_per_node: int = 8,
    bytes_per_element: int = 2,
) -> dict:
    """Per-GPU tokens/s of one tensor-parallel group, and where its step time goes.

    A model, not a measurement. One training step of one micro-batch of ``b * s`` tokens
    (b = micro_batch, s = seq) on ``tp`` GPUs, for a model of ``config.layers`` layers of
    width ``config.hidden``:

    * compute: ``flops``, the model's training FLOPs for those tokens (the caller counts
      them, e.g. ``model.training_flops(config, b * s, seq_len=s)``: 6N per token plus
      attention), split evenly over the tp GPUs, at ``peak_flops`` each;
    * communication: per transformer layer, 4 all-reduces of the ``b * s * h`` activation
      (2 in forward: f* after attention's and the MLP's row-parallel layers; 2 in
      backward: f at the input of each region), each a ring all-reduce over the tp ranks. Within a node (tp <= gpus_per_node) the
      ring runs at ``intra_node`` (NVLink); once the group spans nodes it is only as fast
      as its slowest link, so the whole ring runs at ``inter_node``. With sequence
      parallelism each all-reduce becomes an all-gather plus a reduce-scatter: the same
      bytes, so the same time here.
    * no overlap: each all-reduce's output is the next operation's input, so TP's
      communication sits on the critical path. That is the point of the model.

    Returns a dict: ``tp``, ``compute_s``, ``comm_s`` and ``step_s`` (seconds of one step),
    ``tokens_per_s_per_gpu``, and ``bandwidth``, "intra-node" or "inter-node".
    Per-GPU throughput is ``b * s / (tp * (compute_s + comm_s))``. tp = 1 communicates
    nothing. Left out: overlapping communication with compute (as in async TP), the
    vocabulary-parallel embedding and loss, matmuls that run below peak as their shards
    shrink, and the memory TP frees, which in practice lets the batch or sequence grow.

    No hardware numbers are built in: pass your own. Illustrative H100-like inputs,
    not measurements::

        tensor_parallel_throughput(LLAMA3_8B, 16, seq=4096, micro_batch=1,
                                   flops=training_flops(LLAMA3_8B, 4096, seq_len=4096), peak_flops=989e12,
                                   intra_node=AlphaBeta(5e-6, 450e9),    # NVLink, per direction
                                   inter_node=AlphaBeta(1e-5, 50e9))     # 400 Gb/s per GPU
    """
    if tp < 1 or int(tp) != tp:
        raise ValueError(f"tp (the tensor-parallel degree) must be an integer >= 1, got {tp}")
    tokens = seq * micro_batch
    compute_s = flops / (tp * peak_flops)
    spans_nodes = tp > gpus_per_node
    link = inter_node if spans_nodes else intra_node
    activation = tokens * config.hidden * bytes_per_element
    all_reduces = 4 * config.layers
    comm_s = all_reduces * float(link.ring_all_reduce_time(activation, tp)) if tp > 1 else 0.0
    return {
        "tp": tp,
        "compute_s": compute_s,
        "comm_s": comm_s,
        "step_s": compute_s + comm_s,
        "tokens_per_s_per_gpu": tokens / (tp * (compute_s + comm_s)),
        "bandwidth": "inter-node" if spans_nodes else "intra-node",
    }


def tensor_parallel_scaling(config, tps, **kwargs) -> list[dict]:
    """``tensor_parallel_throughput`` for each degree in ``tps`` (same keyword inputs, ``flops``
    included: the whole micro-batch's, which the degrees split)."""
    return [tensor_parallel_throughput(config, tp, **kwargs) for tp in tps]
