"""The book's three steps to a training configuration, as small functions.

Step 1, **fit one step in memory**: which techniques a model of a given size needs on a
given number of GPUs (:func:`step1_techniques`), and for a GPU-poor cluster what to trade
for memory (:func:`gpu_poor`). Step 2, **reach the target global batch**: how many
micro-batches to accumulate (:func:`step2_gradient_accumulation`) and which way to move
when the batch is off target (:func:`step2_adjust`). Step 3, **maximise throughput**: the
next axis to try (:func:`step3_next_move`).

The rules are the book's rules of thumb (its section "Finding the best training
configuration"); the planner (``search.plan``) does the exhaustive version, and chapter 10
compares the two.
"""

from __future__ import annotations

from .enumerate import ParallelConfig, PlanError, sequences_per_step

BILLION = 1e9


def techniques(c: ParallelConfig) -> frozenset:
    """The techniques a configuration uses, by the book's names: "TP", "PP", "CP", "EP", and
    "DP" or "ZeRO-1/2/3" for data parallelism (``zero`` with nothing to shard is plain DP)."""
    used = {name for name, degree in (("TP", c.tp), ("PP", c.pp), ("CP", c.cp), ("EP", c.ep)) if degree > 1}
    if c.dp * c.ep * c.cp > 1:
        used.add(f"ZeRO-{c.zero}" if c.zero else "DP")
    return frozenset(used)


def step1_techniques(
    n_params: float, gpus: int, *, gpus_per_node: int = 8, long_sequence: bool = False, moe: bool = False
) -> list[frozenset]:
    """Step 1 for a GPU-rich cluster: the combinations the book suggests, each a set of techniques.

    The number of GPUs decides first where the book says scale does (512 and 1024 GPUs), and
    the model's size (10B parameters) decides in every branch:

    * under 10B parameters, up to 511 GPUs: one technique is enough on a node, TP, or ZeRO-3 /
      DP with full recomputation; on more than a node, ZeRO-3, DP, or TP inside the node with
      DP across;
    * 10B parameters and more, up to 511 GPUs: TP 8 with PP, TP 8 with ZeRO-3, or ZeRO-3 alone;
    * 512 to 1023 GPUs: pure DP or ZeRO-3 loses efficiency (its collectives span every GPU),
      so data parallelism goes beside TP or PP: ``{TP, ZeRO-3}``, ``{TP, DP}``, ``{PP, DP}``,
      ``{PP, ZeRO-1}``. PP goes with plain DP or ZeRO-1, not ZeRO-3 (the book calls that
      combination rare): ZeRO-3 gathers the weights again for every micro-batch, and PP runs
      many. ZeRO-1 shards the optimizer states, the largest part, at no cost per micro-batch.
      A model under 10B needs no PP (it fits with one technique, as above), so it gets only
      the two TP options;
    * from 1024 GPUs: the book's setup, TP 8 with data parallelism (ZeRO-2) and PP, for a
      model of 10B and more; a model under 10B again needs no PP: TP 8 with ZeRO-2;
    * long sequences add CP across nodes, and a mixture of experts adds EP across nodes.
    """
    if n_params <= 0 or gpus < 1:
        raise ValueError(f"need a positive parameter count and at least one GPU, got {n_params} and {gpus}")
    small = n_params < 10 * BILLION
    if gpus >= 1024:
        options = [{"TP", "ZeRO-2"}] if small else [{"TP", "PP", "ZeRO-2"}]
    elif gpus >= 512:
        options = [{"TP", "ZeRO-3"}, {"TP", "DP"}] + ([] if small else [{"PP", "DP"}, {"PP", "ZeRO-1"}])
    elif small:
        options = [{"TP"}, {"ZeRO-3"}, {"DP"}] if gpus <= gpus_per_node else [{"ZeRO-3"}, {"DP"}, {"TP", "DP"}]
    else:
        options = [{"TP", "PP"}, {"TP", "ZeRO-3"}, {"ZeRO-3"}]
    extra = ({"CP"} if long_sequence else set()) | ({"EP"} if moe else set())
    return [frozenset(o | extra) for o in options]


def gpu_poor(recompute: str = "none", gas: int = 1, factor: int = 2) -> dict:
    """The GPU-poor move: trade compute for memory. Full recomputation keeps only each
    layer's input, and accumulating ``factor`` times more (smaller) micro-batches keeps the
    global batch while each micro-batch's activations shrink."""
    return {"recompute": "full", "gas": gas * factor}


def step2_gradient_accumulation(global_batch_tokens: int, seq: int, mbs: int, replicas: int) -> int:
    """``gas = global_batch_tokens / (mbs * replicas * seq)``, which must be a whole number.

    ``replicas`` is the number of data-parallel replicas (dp * ep). Raises :class:`PlanError`
    saying what to change when the batch cannot be split so."""
    sequences = sequences_per_step(global_batch_tokens, seq)
    if mbs < 1 or replicas < 1:
        raise PlanError(f"mbs ({mbs}) and the data-parallel replicas ({replicas}) must be at least 1")
    per_step = mbs * replicas
    if sequences % per_step:
        raise PlanError(
            f"{sequences} sequences per step cannot be shared as whole micro-batches of {mbs} "
            f"by {replicas} replicas ({sequences / per_step:.2f} each); choose mbs and dp so that "
            f"mbs*dp divides {sequences}"
        )
    return sequences // per_step


def step2_adjust(target_tokens: int, batch_tokens: int, *, long_sequence: bool = False) -> str:
    """Which way to move when one step's batch (``batch_tokens``) misses the target."""
    if batch_tokens < target_tokens:
        return "raise it: more DP or more gradient accumulation" + (", or CP" if long_sequence else "")
    if batch_tokens > target_tokens:
        return "lower it: fewer DP replicas in favour of TP or PP" + (", or less CP" if long_sequence else "")
    return "on target"


def step3_next_move(c: ParallelConfig, parts: dict, *, gpus_per_node: int = 8, bottleneck: float = 0.1) -> str:
    """Step 3: the next axis to try from layout ``c`` with step-time ``parts`` (``steptime``).

    In the book's order: once data-parallel communication is the bottleneck (above
    ``bottleneck`` of the step), move ranks to PP; else grow TP up to the node size; else grow
    DP with ZeRO-3 at a fixed global batch; else sweep the micro-batch size."""
    step = parts["step"] if "step" in parts else sum(parts.values())
    if parts.get("DP", 0.0) > bottleneck * step:
        return "pp"
    if c.tp < gpus_per_node and c.tp * 2 <= gpus_per_node:
        return "tp"
    if c.zero < 3:
        return "zero3"
    return "mbs"
