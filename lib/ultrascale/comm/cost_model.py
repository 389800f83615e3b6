"""The alpha-beta (latency-bandwidth) model of communication cost.

Sending one message of ``n`` bytes takes ``t(n) = alpha + n / beta``: a fixed start-up
latency ``alpha`` (seconds) plus the bytes over the bandwidth ``beta`` (bytes/s).

A ring collective on ``N`` ranks of a ``K``-byte buffer is ``N - 1`` steps (per phase)
of one message of ``K / N`` bytes each, so

* reduce-scatter or all-gather: ``(N - 1) (alpha + K / (N beta))``
* all-reduce (both phases):     ``2 (N - 1) (alpha + K / (N beta))``

Small messages are latency bound and large ones bandwidth bound; the two terms are
equal at ``n* = alpha * beta`` bytes, the crossover size.
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


def fit_alpha_beta(sizes, times, relative: bool = True) -> AlphaBeta:
    """Fit ``t = alpha + n / beta`` to measured point-to-point (size, time) pairs."""
    alpha, inverse_beta = _fit_line(sizes, times, relative)
    if inverse_beta <= 0:
        raise ValueError("the fitted time does not grow with size; measure larger "
                         "messages (up to MiBs) or more iterations per size")
    return AlphaBeta(max(alpha, 0.0), 1.0 / inverse_beta)


def fit_ring_all_reduce(sizes, times, world_size: int, relative: bool = True) -> AlphaBeta:
    """Recover alpha and beta from ring all-reduce timings of ``K``-byte buffers.

    The model ``2 (N-1) alpha + 2 (N-1) / N * K / beta`` is a line in ``K``: its
    intercept gives alpha and its slope beta.
    """
    n = world_size
    if n < 2:
        raise ValueError("an all-reduce on one rank sends nothing; fit with world_size >= 2")
    intercept, slope = _fit_line(sizes, times, relative)
    if slope <= 0:
        raise ValueError("the fitted time does not grow with size; measure larger buffers")
    steps = 2 * (n - 1)
    return AlphaBeta(max(intercept, 0.0) / steps, steps / (n * slope))
