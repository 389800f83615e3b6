"""Published training setups, and where the planner ranks them.

A planner is worth trusting only if, handed the models and clusters that teams really
trained on, it puts what they chose among its best. Each :class:`Published` holds a
setup's model, cluster and batch, and the layout its authors report; fields they do not
report (the micro-batch, the recomputation, the interleaving) are left free, and the
planner takes the best value of each for the published layout before ranking it.

* **Llama 3 405B** (Llama Team, "The Llama 3 Herd of Models", 2024, section 3.3 and
  table 4): 16,384 H100 GPUs, TP 8, CP 1, PP 16, DP 128, 8,192-token sequences, 16M-token
  batches (16 sequences per DP rank), an interleaved pipeline schedule, weights kept
  after the forward but gradients and optimizer states sharded (ZeRO-2), about 41% BF16 MFU.
  (Its long-context stage used CP 16 at 131,072 tokens: :data:`LLAMA3_405B_LONG`.)
* **DeepSeek-V3** (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, section 3.2):
  2,048 H800 GPUs, PP 16, EP 64 spanning 8 nodes, ZeRO-1 data parallelism, no TP,
  4,096-token sequences, batches growing to 15,360 sequences. H800s compute like H100s but
  their NVLink is cut down: the report measures about 160 GB/s, and 50 GB/s of InfiniBand.
  The model is approximated with the course's Llama-style MoE config (61 layers, h = 7168,
  256 experts of width 2048, top 8: about 700B parameters, 36B active; the real one has
  671B and 37B, multi-head latent attention, a shared expert and 3 dense layers). It
  trained in FP8; we plan in BF16.

The book's own benchmark (1 to 64 nodes of 8 H100s, sequence 4096, 1M-token batches)
reported findings rather than one layout: :func:`heatmap` recomputes that sweep and
``chapters/10_best_configuration`` checks them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..comm.cost_model import AlphaBeta
from ..model import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B, LlamaConfig
from .enumerate import ParallelConfig, PlanError
from .hardware import H100, Hardware
from .search import plan

# Llama 3.2's published 1B and 3B shapes (tied embeddings), for the small end of the sweep.
LLAMA32_1B = LlamaConfig(
    vocab_size=128256, hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, seq_len=4096, tie_embeddings=True
)
LLAMA32_3B = LlamaConfig(
    vocab_size=128256, hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, seq_len=4096, tie_embeddings=True
)
SWEEP_MODELS = {"1B": LLAMA32_1B, "3B": LLAMA32_3B, "8B": LLAMA3_8B, "70B": LLAMA3_70B, "405B": LLAMA3_405B}
SWEEP_NODES = (1, 2, 4, 8, 16, 32, 64)
SWEEP_SEQ, SWEEP_BATCH_TOKENS = 4096, 2**20  # the book's sweep: 4096 tokens, 1M-token batches

DEEPSEEK_V3 = LlamaConfig(
    vocab_size=129280, hidden=7168, layers=61, heads=128, kv_heads=128, ffn=2048, seq_len=4096, experts=256, top_k=8
)
H800 = dataclasses.replace(H100, name="8x H800 per node", intra_node=AlphaBeta(3e-6, 160e9))


@dataclass(frozen=True)
class Published:
    """A reported setup: the model, the cluster, the batch, and the layout chosen."""

    name: str
    model: object
    gpus: int
    global_batch_tokens: int
    seq: int
    layout: dict  # the reported fields of a ParallelConfig
    hardware: Hardware = H100
    free: dict = field(default_factory=dict)  # unreported fields: the values to try
    source: str = ""


LLAMA3_405B_PRETRAIN = Published(
    "Llama 3 405B",
    LLAMA3_405B,
    gpus=16384,
    global_batch_tokens=16 * 128 * 8192,
    seq=8192,
    layout=dict(tp=8, cp=1, pp=16, dp=128, mbs=1, gas=16, zero=2),
    free=dict(recompute=("none", "selective", "full"), schedule=(("interleaved", 2), ("interleaved", 4), ("1f1b", 1))),
    source="Llama 3 Herd of Models, table 4 (16,384 GPUs, 8K sequences)",
)
LLAMA3_405B_LONG = Published(
    "Llama 3 405B, long context",
    LLAMA3_405B,
    gpus=16384,
    global_batch_tokens=16 * 8 * 131072,
    seq=131072,
    layout=dict(tp=8, cp=16, pp=16, dp=8, mbs=1, gas=16, zero=2),
    free=dict(recompute=("none", "selective", "full"), schedule=(("interleaved", 2), ("interleaved", 4), ("1f1b", 1))),
    source="Llama 3 Herd of Models, table 4 (131K sequences)",
)
DEEPSEEK_V3_PRETRAIN = Published(
    "DeepSeek-V3",
    DEEPSEEK_V3,
    gpus=2048,
    global_batch_tokens=15360 * 4096,
    seq=4096,
    layout=dict(tp=1, cp=1, pp=16, ep=64, dp=2, zero=1),
    hardware=H800,
    free=dict(recompute=("none", "selective", "full"), schedule=(("1f1b", 1),)),
    source="DeepSeek-V3 Technical Report, section 3.2",
)
PUBLISHED = (LLAMA3_405B_PRETRAIN, LLAMA3_405B_LONG, DEEPSEEK_V3_PRETRAIN)


def matches(config: ParallelConfig, layout: dict) -> bool:
    """Whether ``config`` has every reported field of ``layout``."""
    return all(getattr(config, k) == v for k, v in layout.items())


def compare(setup: Published, **options) -> dict:
    """Plan ``setup``'s model on its cluster and rank its published layout.

    Returns ``plan`` (the :class:`Plan`), ``published`` (the best-scoring configuration with
    the published fields, the free ones chosen by the planner) and its ``rank`` (1 = the
    planner's best; None if it does not fit), ``slowdown`` (its step time over the best's),
    and ``best``. ``options`` go to the enumerator; the reported schedules are always tried.
    """
    schedules = tuple(dict.fromkeys(((s, v) for s, v in setup.free.get("schedule", (("1f1b", 1),)))))
    options.setdefault("schedules", schedules)
    options.setdefault("recompute", setup.free.get("recompute", ("none", "selective", "full")))
    result = plan(
        setup.model,
        gpus=setup.gpus,
        global_batch_tokens=setup.global_batch_tokens,
        seq=setup.seq,
        hardware=setup.hardware,
        **options,
    )
    for rank, scored in enumerate(result.ranked, start=1):
        if matches(scored.config, setup.layout):
            return {
                "plan": result,
                "published": scored,
                "rank": rank,
                "best": result.best,
                "slowdown": scored.step / result.best.step,
                "of": len(result.ranked),
            }
    return {
        "plan": result,
        "published": None,
        "rank": None,
        "best": result.best,
        "slowdown": None,
        "of": len(result.ranked),
    }


def heatmap(
    models=None,
    nodes=SWEEP_NODES,
    *,
    seq=SWEEP_SEQ,
    global_batch_tokens=SWEEP_BATCH_TOKENS,
    hardware: Hardware = H100,
    progress=None,
    **options,
) -> dict:
    """The book's sweep: the planner's best layout for each (model, node count).

    Returns ``{(name, nodes): Scored or None}`` (None: fits on no layout). ``options`` go to
    the enumerator; the book's sweep had no CP, so ``max_cp`` defaults to 1.
    ``progress(done, total)`` is called after each cell.
    """
    models = SWEEP_MODELS if models is None else models
    options.setdefault("max_cp", 1)
    cells, total = {}, len(models) * len(nodes)
    for name, model in models.items():
        for n in nodes:
            try:
                cells[name, n] = plan(
                    model,
                    gpus=n * hardware.gpus_per_node,
                    global_batch_tokens=global_batch_tokens,
                    seq=seq,
                    hardware=hardware,
                    **options,
                ).best
            except PlanError:
                cells[name, n] = None
            if progress is not None:
                progress(len(cells), total)
    return cells
