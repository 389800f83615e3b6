"""The memory filter: does one GPU's share of a configuration fit in its memory?

The bytes come from the course's one memory model, ``ultrascale.memory.breakdown``
(parameters, gradients, optimizer states, activations on the busiest GPU), so the planner
and chapters 01-09 never disagree about memory. What each degree does there:
TP and PP divide the weights, ZeRO shards them over the ranks that hold the same weights
(``dp * cp`` here; the ep ranks too once the memory model knows experts; under HSDP only
``dp_shard * cp`` of them), TP with sequence
parallelism, CP and recomputation shrink the activations, and the first pipeline stage holds
the activations of the micro-batches in flight. Training runs in bf16 mixed precision.

Newer keyword arguments of ``breakdown`` (``ep``, and the pipeline's ``schedule`` and
``micro_batches``) are passed when the memory model has them, so the filter follows the
memory model as it grows rather than keeping a copy of it.
"""

from __future__ import annotations

import functools
import inspect
import math

from .. import memory
from .enumerate import ParallelConfig
from .hardware import Hardware

CONSUMERS = ("parameters", "gradients", "optimizer states", "activations")


@functools.lru_cache(maxsize=None)
def _breakdown_accepts() -> frozenset:
    return frozenset(inspect.signature(memory.breakdown).parameters)


def memory_per_gpu(model, c: ParallelConfig, seq: int) -> dict:
    """Bytes held by the busiest GPU of configuration ``c``, by consumer (and ``"total"``)."""
    kwargs = dict(
        seq=seq,
        micro_batch=c.mbs,
        mixed_precision=True,
        recompute=c.recompute,
        zero_stage=c.zero,
        tp=c.tp,
        dp=c.dp * c.cp,
        pp=c.pp,
        cp=c.cp,
        sequence_parallel=True,
    )
    if c.dp_shard:  # HSDP: the states shard over one replica's block of the dp (x cp) ranks
        kwargs["dp_shard"] = c.dp_shard * c.cp
    if "ep" in _breakdown_accepts():
        kwargs["ep"] = c.ep
    elif c.ep > 1:
        raise ValueError("this memory model has no expert parallelism (memory.breakdown(ep=...)) yet")
    parts = dict(_breakdown(model, tuple(sorted(kwargs.items()))))
    # breakdown's default is 1F1B with at least pp micro-batches: any other schedule, or fewer
    # micro-batches than stages (the first stage then holds gas, not pp), takes the simulation's count
    if c.pp > 1 and (c.schedule != "1f1b" or c.gas < c.pp) and hasattr(memory, "pp_in_flight"):
        parts["activations"] *= _schedule_factor(model.layers, c.pp, c.schedule, c.gas, c.chunks)
    parts = {k: parts[k] for k in CONSUMERS if k in parts}
    parts["total"] = sum(parts.values())
    return parts


@functools.lru_cache(maxsize=65536)
def _breakdown(model, kwargs: tuple) -> dict:
    return memory.breakdown(model, **dict(kwargs))


@functools.lru_cache(maxsize=4096)
def _schedule_factor(layers: int, pp: int, schedule: str, micro_batches: int, chunks: int) -> float:
    """Activations of a simulated schedule over those of the memory model's default (1F1B).

    Without a schedule ``breakdown`` keeps ``pp`` micro-batches of a ``ceil(L/pp)``-layer
    stage, which is exactly 1F1B's busiest rank when gas >= pp; with gas < pp that rank holds
    gas of them (a dry run of Llama 3 8B on pp 16 with one micro-batch of 64 sequences measured
    11 GB where the default charged 72: chapter 10), so 1F1B takes this factor too. Other schedules keep
    ``in_flight`` (micro-batch, chunk) pairs of ``ceil(L/(pp v))`` layers each, from
    ``memory.pp_in_flight``'s simulation; simulating once per (schedule, pp, m, v) rather
    than once per candidate keeps the search fast. ``tests/test_plan.py`` checks the
    result against ``breakdown(schedule=...)``.
    """
    in_flight = max(memory.pp_in_flight(schedule, pp, micro_batches, chunks))
    return math.ceil(layers / (pp * chunks)) * in_flight / (math.ceil(layers / pp) * pp)


def fits(model, c: ParallelConfig, seq: int, hardware: Hardware) -> bool:
    """True when the busiest GPU needs no more than the hardware's usable memory."""
    return memory_per_gpu(model, c, seq)["total"] <= hardware.usable_memory


def memory_filter(model, configs, seq: int, hardware: Hardware) -> tuple[list, list]:
    """Split ``configs`` into those that fit and those that do not, each as (config, bytes) pairs."""
    fitting, too_big = [], []
    for c in configs:
        need = memory_per_gpu(model, c, seq)["total"]
        (fitting if need <= hardware.usable_memory else too_big).append((c, need))
    return fitting, too_big
