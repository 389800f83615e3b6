"""Every way to lay a training step out on a cluster: the planner's search space.

A configuration (:class:`ParallelConfig`) fixes the five parallel degrees and the batch:

* ``dp * pp * ep * cp * tp = GPUs``, the course's mesh (``parallel.mesh``: ep is an axis of
  its own; the dense layers are replicated along it, so dp and ep ranks all see different
  data);
* ``mbs * gas * dp * ep * seq = global batch tokens``: each data-parallel replica runs
  ``gas`` micro-batches of ``mbs`` sequences per step;
* plus the ZeRO stage, the activation recomputation and the pipeline schedule;
* and, for ZeRO-3, hybrid sharding (HSDP, ``dp_shard``): the states sharded over
  ``dp_shard`` of the dp ranks (with the ep and cp ranks, which hold the same weights) and
  replicated over the other ``dp / dp_shard``, so the frequent gathers can stay inside a node
  and only one all-reduce per step crosses the nodes.

Not every product is a configuration one can run. :func:`violations` names the rules a
configuration breaks, in words; :func:`enumerate_configs` yields only those that break none:

* tp divides the node's GPU count (a TP group stays inside a node, on NVLink: appendix A3's
  TP ratio is about 9 times worse across nodes) and divides the attention and K/V heads;
* pp is at most the number of layers (stages may differ by one layer, as Llama 3 405B's 126
  layers on 16 stages do);
* cp splits the sequence into ``2 cp`` equal chunks (the zig-zag layout of chapter 06);
* ep divides the number of experts, and is 1 for a dense model;
* the global batch is a whole number of sequences, shared evenly by the ``dp * ep`` replicas;
* ``dp_shard`` (0: ZeRO over all of them) is a divisor of dp below dp, with ZeRO-3 only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields

from ..model import RECOMPUTE_MODES

ZERO_STAGES = (0, 1, 2, 3)
SCHEDULES = ("1f1b", "interleaved")


class PlanError(ValueError):
    """A request no configuration can satisfy; the message says why and what to change."""


@dataclass(frozen=True, order=True)
class ParallelConfig:
    """One candidate layout of a training step."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    mbs: int = 1
    gas: int = 1
    recompute: str = "none"
    schedule: str = "1f1b"
    chunks: int = 1  # model chunks per pipeline rank (v); > 1 only for "interleaved"
    dp_shard: int = 0  # HSDP: ZeRO-3 over dp_shard of the dp ranks, dp / dp_shard replicas; 0: over all

    @property
    def dp_replicate(self) -> int:
        """Replicas of the sharded states along dp: dp / dp_shard under HSDP, else 1."""
        return self.dp // self.dp_shard if self.dp_shard else 1

    @property
    def shard_ranks(self) -> int:
        """Ranks over which ZeRO shards a dense weight: those holding it (dp * ep * cp), or
        under HSDP one replica's block of them (dp_shard * ep * cp)."""
        return (self.dp_shard or self.dp) * self.ep * self.cp

    @property
    def gpus(self) -> int:
        return self.dp * self.pp * self.ep * self.cp * self.tp

    @property
    def replicas(self) -> int:
        """Ranks that hold the same dense weights and see different data: dp * ep."""
        return self.dp * self.ep

    def batch_tokens(self, seq: int) -> int:
        """Tokens in one optimizer step: ``mbs * gas * dp * ep * seq``."""
        return self.mbs * self.gas * self.replicas * seq

    def short(self) -> str:
        """``dp64 tp8 pp16 z1 mbs1 gas16 sel`` with the axes of size 1 left out."""
        parts = [f"{axis}{getattr(self, axis)}" for axis in ("dp", "tp", "pp", "cp", "ep") if getattr(self, axis) > 1]
        parts += [f"z{self.zero}"] + ([f"hsdp{self.dp_replicate}x{self.dp_shard}"] if self.dp_shard else [])
        parts += [f"mbs{self.mbs}", f"gas{self.gas}", self.recompute[:4]]
        if self.pp > 1 and self.schedule != "1f1b":
            parts.append(f"{self.schedule}x{self.chunks}")
        return " ".join(parts or ["1 GPU"])

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, in increasing order."""
    if n < 1:
        raise ValueError(f"divisors of {n}: need a positive integer")
    return [d for d in range(1, n + 1) if n % d == 0]


def sequences_per_step(global_batch_tokens: int, seq: int) -> int:
    """``global_batch_tokens / seq``, which must be a whole number of sequences."""
    if seq < 1 or global_batch_tokens < 1:
        raise PlanError(f"seq ({seq}) and the global batch ({global_batch_tokens} tokens) must be positive")
    if global_batch_tokens % seq:
        raise PlanError(
            f"a global batch of {global_batch_tokens:,} tokens is not a whole number of "
            f"{seq}-token sequences ({global_batch_tokens / seq:.2f}); pick a multiple of {seq}, "
            f"e.g. {round(global_batch_tokens / seq) * seq:,}"
        )
    return global_batch_tokens // seq


def _experts(model) -> int:
    return getattr(model, "experts", 0) or 0


def violations(
    model, c: ParallelConfig, *, gpus: int, global_batch_tokens: int, seq: int, gpus_per_node: int = 8
) -> list[str]:
    """The rules ``c`` breaks for ``model`` on ``gpus`` GPUs, as sentences (empty: valid)."""
    broken = []
    degrees = {name: getattr(c, name) for name in ("dp", "tp", "pp", "cp", "ep", "mbs", "gas", "chunks")}
    for name, value in degrees.items():
        if not isinstance(value, int) or value < 1:
            broken.append(f"{name}={value!r} must be a positive integer")
    if broken:
        return broken
    if c.gpus != gpus:
        broken.append(f"dp*pp*ep*cp*tp = {c.gpus}, not the {gpus} GPUs")
    if gpus_per_node % c.tp:
        broken.append(f"tp={c.tp} does not divide the {gpus_per_node} GPUs of a node: a TP group must stay in one node")
    if model.heads % c.tp or getattr(model, "kv_heads", model.heads) % c.tp:
        broken.append(
            f"tp={c.tp} does not divide the {model.heads} attention heads "
            f"({getattr(model, 'kv_heads', model.heads)} K/V heads)"
        )
    if c.pp > model.layers:
        broken.append(f"pp={c.pp} stages for {model.layers} layers: a stage needs at least one layer")
    if c.cp > 1 and seq % (2 * c.cp):
        broken.append(f"cp={c.cp}: seq={seq} does not split into 2*cp equal chunks (zig-zag layout)")
    experts = _experts(model)
    if c.ep > 1 and (experts == 0 or experts % c.ep):
        broken.append(f"ep={c.ep} must divide the number of experts ({experts or 'none: a dense model'})")
    if c.batch_tokens(seq) != global_batch_tokens:
        broken.append(
            f"mbs*gas*dp*ep*seq = {c.batch_tokens(seq):,} tokens, not the global batch of {global_batch_tokens:,}"
        )
    if c.zero not in ZERO_STAGES:
        broken.append(f"zero={c.zero!r}: choose one of {ZERO_STAGES}")
    if c.dp_shard:
        if not isinstance(c.dp_shard, int) or c.dp_shard < 0 or c.dp_shard >= c.dp or c.dp % c.dp_shard:
            broken.append(f"dp_shard={c.dp_shard!r} must divide dp={c.dp} and be smaller (0: ZeRO over every dp rank)")
        elif c.zero != 3:
            broken.append(f"dp_shard={c.dp_shard} (hybrid sharding) shards weights and states as ZeRO-3 does: zero=3")
        elif c.shard_ranks == 1:
            broken.append("dp_shard=1 without ep or cp shards over one rank: that is plain data parallelism")
    if c.recompute not in RECOMPUTE_MODES:
        broken.append(f"recompute={c.recompute!r}: choose one of {RECOMPUTE_MODES}")
    if c.schedule not in SCHEDULES:
        broken.append(f"schedule={c.schedule!r}: choose one of {SCHEDULES}")
    elif (c.schedule == "interleaved") != (c.chunks > 1):
        broken.append("an interleaved schedule has chunks > 1, 1F1B has chunks = 1")
    elif c.chunks > 1 and (c.pp == 1 or c.pp * c.chunks > model.layers):
        broken.append(f"{c.chunks} chunks on {c.pp} stages need pp > 1 and at least pp*chunks layers")
    return broken


def enumerate_configs(
    model,
    *,
    gpus: int,
    global_batch_tokens: int,
    seq: int,
    gpus_per_node: int = 8,
    zero_stages=ZERO_STAGES,
    recompute=RECOMPUTE_MODES,
    max_cp: int = 64,
    schedules=(("1f1b", 1),),
    hsdp: bool = False,
):
    """Yield every valid :class:`ParallelConfig` (see the module docstring for the rules).

    ``schedules``: the (schedule, chunks) pairs to try when pp > 1, e.g.
    ``(("1f1b", 1), ("interleaved", 2))``. ZeRO stages above 0 are tried only where there is
    something to shard over (more than one rank holds the same weights). ``hsdp``: also
    every hybrid sharding of ZeRO-3 (each ``dp_shard`` dividing dp, below it).
    Raises :class:`PlanError` when the batch is not a whole number of sequences.
    """
    if gpus < 1:
        raise PlanError(f"need at least one GPU, got {gpus}")
    sequences = sequences_per_step(global_batch_tokens, seq)
    experts = _experts(model)
    for tp, pp, cp, ep in itertools.product(
        divisors(gpus_per_node), divisors(gpus), divisors(gpus), divisors(experts) if experts else [1]
    ):
        rest, remainder = divmod(gpus, tp * pp * cp * ep)
        if remainder or cp > max_cp:
            continue
        dp = rest
        if sequences % (dp * ep):
            continue
        for mbs in divisors(sequences // (dp * ep)):
            gas = sequences // (dp * ep * mbs)
            shared = dp * ep * cp > 1
            for zero, mode in itertools.product(zero_stages if shared else (0,), recompute):
                shards = [0] + (divisors(dp)[:-1] if hsdp and zero == 3 else [])
                for (schedule, chunks), dp_shard in itertools.product(schedules if pp > 1 else (("1f1b", 1),), shards):
                    c = ParallelConfig(dp, tp, pp, cp, ep, zero, mbs, gas, mode, schedule, chunks, dp_shard)
                    if not violations(
                        model,
                        c,
                        gpus=gpus,
                        global_batch_tokens=global_batch_tokens,
                        seq=seq,
                        gpus_per_node=gpus_per_node,
                    ):
                        yield c
