"""The parallelism methods side by side: the book's comparison tables as data, and rendered.

The Ultra-Scale Playbook closes its 5D section with three tables: ZeRO-3 against pipeline
parallelism, TP+SP against CP and EP, and a summary of what every method shards and what it
costs. Here the qualitative facts are data (``ZERO3_VS_PP``, ``TP_CP_EP``, ``METHODS``) and
the one quantitative column, *which memory a method saves*, is not typed in at all: it is
read off the memory calculator (``memory.breakdown``) by changing one degree and looking at
which of the four consumers shrink (:func:`memory_savings`).

    print(markdown(summary_rows()))          # the summary table, savings from the calculator
    print(markdown(comparison(ZERO3_VS_PP))) # ZeRO-3 vs PP
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .memory import breakdown
from .model import GPTConfig

__all__ = [
    "CONSUMERS",
    "METHODS",
    "Method",
    "TP_CP_EP",
    "ZERO3_VS_PP",
    "comparison",
    "markdown",
    "example_config",
    "memory_savings",
    "quiz",
    "summary_rows",
    "with_degree",
]

CONSUMERS = ("parameters", "gradients", "optimizer states", "activations")  # breakdown's keys


@dataclass(frozen=True)
class Method:
    """One row of the summary: how the method is switched on in ``breakdown``, and the facts."""

    name: str
    baseline: dict  # breakdown arguments without the method...
    applied: dict  # ...and with it (degree 2), everything else equal
    dimension: str  # what it splits
    disadvantage: str
    moe: bool = False  # the method exists only for a mixture-of-experts model


# At a fixed global batch: DP halves each rank's batch; ZeRO is compared with plain DP at the
# same dp; PP is run with a 1F1B schedule of m = 8 micro-batches.
METHODS = [
    Method(
        "DP",
        dict(dp=1, micro_batch=2),
        dict(dp=2, micro_batch=1),
        "batch",
        "the batch size caps it: each rank needs at least one sample",
    ),
    Method(
        "PP",
        dict(pp=1),
        dict(pp=2, schedule="1f1b", micro_batches=8),
        "layers",
        "idle bubble, and schedules that are hard to write",
    ),
    Method(
        "TP/SP",
        dict(tp=1),
        dict(tp=2, sequence_parallel=True),
        "hidden and sequence",
        "communicates in every layer: needs a fast (intra-node) link",
    ),
    Method("CP", dict(cp=1), dict(cp=2), "sequence", "adds communication inside attention"),
    Method("EP", dict(ep=1), dict(ep=2), "experts", "needs an MoE model and adds routing (all-to-all)", moe=True),
    Method(
        "ZeRO-1",
        dict(dp=2, zero_stage=0),
        dict(dp=2, zero_stage=1),
        "data-parallel replicas",
        "no extra bytes (reduce-scatter + all-gather = DP's all-reduce); the gather waits for the step",
    ),
    Method(
        "ZeRO-2",
        dict(dp=2, zero_stage=0),
        dict(dp=2, zero_stage=2),
        "data-parallel replicas",
        "no extra bytes (as ZeRO-1); each gradient must be reduce-scattered as soon as it is ready",
    ),
    Method(
        "ZeRO-3",
        dict(dp=2, zero_stage=0),
        dict(dp=2, zero_stage=3),
        "data-parallel replicas",
        "1.5x DP's bytes: the weights are all-gathered again in every forward and backward",
    ),
]


@dataclass(frozen=True)
class _MoEConfig(GPTConfig):
    """A GPT config with the fields ``breakdown`` reads of an MoE model (for EP's row)."""

    experts: int = 8
    top_k: int = 2


def example_config(moe: bool = False):
    """The model the summary table is computed on (an MoE variant for EP)."""
    config = GPTConfig(vocab_size=32000, hidden=1024, layers=8, heads=16, seq_len=2048)
    return (
        _MoEConfig(**{k: getattr(config, k) for k in ("vocab_size", "hidden", "layers", "heads", "seq_len")})
        if moe
        else config
    )


def memory_savings(method: Method, config=None) -> tuple[str, ...]:
    """The consumers (``CONSUMERS``) whose per-rank bytes ``breakdown`` shrinks when ``method``
    is switched on. Computed, not stated: the calculator is the source."""
    config = config or example_config(method.moe)
    before, after = breakdown(config, **method.baseline), breakdown(config, **method.applied)
    return tuple(c for c in CONSUMERS if after[c] < before[c])


def summary_rows(config=None) -> list[dict]:
    """The summary table: method, what memory it saves (from the calculator), the dimension it
    splits, and its disadvantage."""
    rows = []
    for m in METHODS:
        saved = ", ".join(memory_savings(m, config if not m.moe else None))
        rows.append(
            {
                "method": m.name,
                "saves memory of": saved + (" (of the experts)" if m.moe else ""),
                "splits": m.dimension,
                "disadvantage": m.disadvantage,
            }
        )
    return rows


# Two comparisons in the book's own categories (facts, in our words).
ZERO3_VS_PP = {
    "each rank stores": {"ZeRO-3": "a slice of every layer", "PP": "whole layers, some of them"},
    "communication moves": {"ZeRO-3": "weights (all-gathered)", "PP": "activations (stage to stage)"},
    "orchestration": {"ZeRO-3": "model-agnostic", "PP": "model-agnostic"},
    "hard part": {"ZeRO-3": "partitioning the model and its communication", "PP": "efficient schedules"},
    "prefers": {
        "ZeRO-3": "large mbs and seq_len, to hide the gathers",
        "PP": "large grad_acc (many micro-batches), to hide the bubble",
    },
}
TP_CP_EP = {
    "shards": {
        "TP+SP": "weights, and activations along hidden and sequence",
        "CP": "activations along the sequence",
        "EP": "expert weights and their activations",
    },
    "communicates for": {
        "TP+SP": "column- and row-parallel matmuls",
        "CP": "attention's keys and values",
        "EP": "routing tokens to experts",
    },
    "implementation": {
        "TP+SP": "model-specific",
        "CP": "model-agnostic except attention",
        "EP": "model-agnostic except the MoE layers",
    },
    "needs": {"TP+SP": "high intra-node bandwidth", "CP": "long sequences", "EP": "a mixture-of-experts model"},
}


def comparison(table: dict) -> list[dict]:
    """A ``{row: {column: fact}}`` table as rows of dicts, the row name first."""
    return [{"": row, **facts} for row, facts in table.items()]


def markdown(rows: list[dict]) -> str:
    """Rows of dicts (same keys) as a markdown table."""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def quiz(config=None) -> dict:
    """Questions over the tables, each with its answer computed from the data above
    (a set of method names, or one name)."""
    saves = {m.name: set(memory_savings(m, config if not m.moe else None)) for m in METHODS}
    return {
        "Which methods save optimizer-state memory?": {n for n, s in saves.items() if "optimizer states" in s},
        "Which methods save activation memory?": {n for n, s in saves.items() if "activations" in s},
        "Which methods save gradient memory but not parameter memory?": {
            n for n, s in saves.items() if "gradients" in s and "parameters" not in s
        },
        "Which method moves activations between ranks, ZeRO-3 or PP?": next(
            c for c, fact in ZERO3_VS_PP["communication moves"].items() if "activations" in fact
        ),
        "Which of TP+SP, CP and EP is model-specific?": next(
            c for c, fact in TP_CP_EP["implementation"].items() if fact == "model-specific"
        ),
        "Which methods split the data-parallel replicas' state?": {
            m.name for m in METHODS if m.dimension == "data-parallel replicas"
        },
    }


def with_degree(method: Method, degree: int) -> Method:
    """The same method at another degree (the calculator's answer does not depend on it)."""
    axis = {"DP": "dp", "PP": "pp", "TP/SP": "tp", "CP": "cp", "EP": "ep"}.get(method.name)
    return method if axis is None else replace(method, applied={**method.applied, axis: degree})
