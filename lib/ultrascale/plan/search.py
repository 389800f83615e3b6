"""The planner: enumerate, filter by memory, score by step time, rank.

    from ultrascale.plan import plan
    from ultrascale.model import LLAMA3_8B
    result = plan(LLAMA3_8B, gpus=64, global_batch_tokens=2**20, seq=4096)
    result.best.config.short()        # e.g. 'dp8 tp8 z1 mbs1 gas4 sele'
    result.table(5)                   # the top five with their memory and time

The three steps of the book become three filters: configurations that can be laid out
at all (``enumerate``), those whose busiest GPU fits in memory (``fit``), and among them
the fastest step (``steptime``). A request nothing satisfies raises :class:`PlanError`
with the reason and what to change, never an empty answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..model import RECOMPUTE_MODES, count_params
from .enumerate import ParallelConfig, PlanError, enumerate_configs, violations
from .fit import memory_per_gpu
from .hardware import H100, Hardware
from .steptime import step_time


@dataclass(frozen=True)
class Scored:
    """One configuration with its memory (bytes, by consumer) and its step time (seconds, by part)."""

    config: ParallelConfig
    memory: dict
    time: dict

    @property
    def step(self) -> float:
        return self.time["step"]

    @property
    def mfu(self) -> float:
        return self.time["mfu"]


@dataclass
class Plan:
    """The ranked configurations that fit, fastest first, and what was left out."""

    model: object
    gpus: int
    global_batch_tokens: int
    seq: int
    hardware: Hardware
    ranked: list = field(default_factory=list)
    candidates: int = 0  # valid layouts before the memory filter
    smallest_need: float = 0.0  # bytes per GPU of the leanest valid layout

    @property
    def best(self) -> Scored:
        return self.ranked[0]

    def rank_of(self, config: ParallelConfig) -> int | None:
        """1 for the fastest; None when ``config`` is not among those that fit."""
        for i, scored in enumerate(self.ranked, start=1):
            if scored.config == config:
                return i
        return None

    def score(self, config: ParallelConfig) -> Scored:
        """Memory and time of any valid ``config``, fitting or not (for comparisons)."""
        broken = violations(
            self.model,
            config,
            gpus=self.gpus,
            global_batch_tokens=self.global_batch_tokens,
            seq=self.seq,
            gpus_per_node=self.hardware.gpus_per_node,
        )
        if broken:
            raise PlanError(f"{config.short()} is not a valid layout here: " + "; ".join(broken))
        return Scored(
            config, memory_per_gpu(self.model, config, self.seq), step_time(self.model, config, self.seq, self.hardware)
        )

    def table(self, n: int = 5) -> list[dict]:
        """The top ``n`` as rows: the layout, GB per GPU, step seconds, MFU and time by part."""
        rows = []
        for i, s in enumerate(self.ranked[:n], start=1):
            rows.append(
                {
                    "rank": i,
                    "config": s.config.short(),
                    "GB/GPU": s.memory["total"] / 1e9,
                    "step s": s.step,
                    "MFU": s.mfu,
                    **{k: s.time[k] for k in ("compute", "recompute", "TP", "CP", "EP", "PP", "bubble", "DP")},
                }
            )
        return rows


def plan(model, *, gpus: int, global_batch_tokens: int, seq: int, hardware: Hardware = H100, **options) -> Plan:
    """Every valid layout of ``model`` on ``gpus`` GPUs that fits, ranked by step time.

    ``options`` go to :func:`~ultrascale.plan.enumerate.enumerate_configs` (``zero_stages``,
    ``recompute``, ``schedules``, ``max_cp``). Raises :class:`PlanError` when the request
    cannot be met: a batch that is not a whole number of sequences or cannot be shared by
    any data-parallel degree, or a model that fits on no layout (the message gives the
    leanest layout's need and the GPU memory).
    """
    result = Plan(model, gpus, global_batch_tokens, seq, hardware)
    leanest = None
    for c in enumerate_configs(
        model,
        gpus=gpus,
        global_batch_tokens=global_batch_tokens,
        seq=seq,
        gpus_per_node=hardware.gpus_per_node,
        **options,
    ):
        result.candidates += 1
        need = memory_per_gpu(model, c, seq)
        if leanest is None or need["total"] < leanest[1]["total"]:
            leanest = (c, need)
        if need["total"] <= hardware.usable_memory:
            result.ranked.append(Scored(c, need, step_time(model, c, seq, hardware)))
    if leanest is None:
        raise PlanError(
            f"no layout of {gpus} GPUs can run {global_batch_tokens:,}-token batches of {seq}-token "
            f"sequences: the {global_batch_tokens // seq} sequences cannot be shared evenly by any "
            f"data-parallel degree that the other axes leave (tp within a node of "
            f"{hardware.gpus_per_node}, pp <= {model.layers} layers, cp splitting the sequence). "
            "Change the GPU count or the batch so that they share a factor."
        )
    result.smallest_need = leanest[1]["total"]
    if not result.ranked:
        c, need = leanest
        raise PlanError(
            f"{_name(model)} fits on none of the {result.candidates} layouts of {gpus} GPUs: the leanest, "
            f"{c.short()}, needs {need['total'] / 1e9:.1f} GB per GPU "
            f"({', '.join(f'{k} {v / 1e9:.1f}' for k, v in need.items() if k != 'total')} GB) and "
            f"{hardware.usable_memory / 1e9:.1f} GB are usable ({hardware.memory_bytes / 1e9:.0f} GB "
            f"less {hardware.memory_headroom:.0%} headroom). Add GPUs (more pp or ZeRO-3 ranks), "
            "a shorter sequence, or GPUs with more memory."
        )
    result.ranked.sort(key=_rank_key)
    return result


TIE = 0.005  # step times within 0.5% count as equal: the model is not more precise than that


def _rank_key(s: Scored):
    """Fastest first; among (nearly) equal step times the simplest layout: fewer parallel
    axes, a lower ZeRO stage, less recomputation, then less memory. The book's advice is
    the same: add one axis at a time, and only when it buys something."""
    c = s.config
    axes = sum(getattr(c, a) > 1 for a in ("dp", "tp", "pp", "cp", "ep"))
    return (
        round(math.log(s.step) / math.log1p(TIE)),
        axes,
        c.zero,
        RECOMPUTE_MODES.index(c.recompute),
        s.memory["total"],
    )


def _name(model) -> str:
    return f"a {count_params(model) / 1e9:.1f}B-parameter model"
