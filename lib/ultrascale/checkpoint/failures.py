"""How often to checkpoint: Young's and Daly's intervals, and a run with random failures to hold them to.

A checkpoint costs ``C`` seconds; a failure throws away the work done since the last one
(on average half an interval) and costs a restart. Checkpointing often wastes time saving,
rarely wastes time redoing: Young (1974) balanced the two to first order, for failures that
come on average every ``M`` seconds (the mean time between failures, MTBF, of the whole job:
a node's MTBF divided by the number of nodes):

    tau_Young = sqrt(2 C M)        (compute time between two checkpoints)

Daly (2006) kept the higher-order terms (a failure can strike during a checkpoint or a
restart, and failures are random in time, not evenly spread):

    tau_Daly = sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C     for C < 2M, else M

For C much smaller than M the two agree; when a checkpoint is slow next to M, Daly's is
shorter by about C. :func:`simulate_run` measures the time lost at a given interval in a
seeded run with failures drawn at random (exponential gaps, mean M), to check both against.
"""

from __future__ import annotations

import math
import random

__all__ = ["young_interval", "daly_interval", "simulate_run", "checkpoint_seconds"]


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimal compute time between checkpoints, sqrt(2 C M)."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimal interval (his eq. 37); M itself once C reaches 2M."""
    c, m = checkpoint_s, mtbf_s
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c


def simulate_run(
    work_s: float,
    interval_s: float,
    checkpoint_s: float,
    mtbf_s: float,
    *,
    restart_s: float = 0.0,
    runs: int = 200,
    seed: int = 0,
) -> float:
    """The mean time lost (wall time minus ``work_s``) over ``runs`` seeded runs that compute
    ``interval_s`` seconds, save for ``checkpoint_s``, and so on; a failure (exponential gaps of
    mean ``mtbf_s``, at any moment, a save included) costs ``restart_s`` and the work since the
    last complete checkpoint. Every interval sees the same seeds, so two intervals differ
    by the interval, not by luck."""
    rng, lost = random.Random(seed), 0.0
    for _ in range(runs):
        wall, done = 0.0, 0.0
        while done < work_s:
            segment = min(interval_s, work_s - done)
            need = segment + (checkpoint_s if done + segment < work_s else 0.0)  # no save after the end
            failure = rng.expovariate(1 / mtbf_s)  # memoryless: a fresh draw per attempt is exact
            if failure >= need:
                wall, done = wall + need, done + segment
            else:
                wall += failure + restart_s
        lost += wall - work_s
    return lost / runs


def checkpoint_seconds(parameters: float, bytes_per_parameter: float, write_gb_s: float, ranks: int = 1) -> float:
    """Seconds to write a model's training state when ``ranks`` ranks each write their share at
    ``write_gb_s`` GB/s (their storage bandwidth adds up until the file system's is reached:
    pass the file system's as ``write_gb_s`` and ranks=1 then). ``bytes_per_parameter``: 2 for
    bf16 weights alone, 16 with fp32 master weights and Adam's two moments (2 + 4 + 4 + 4 + 2
    for bf16 gradients not saved: 14)."""
    return parameters * bytes_per_parameter / (write_gb_s * 1e9 * ranks)
