"""Facts that several chapters state, written once.

A fact a chapter repeats from another drifts: chapter 09 once gave Llama 3 405B's data
parallelism as ZeRO-3 while chapter 10's planner ranked it as ZeRO-2, and one chapter had
torchtitan apply TP before the pipeline split while it splits first. So the facts that more
than one chapter states live here; the chapters print them (``print(facts.LLAMA3_405B)``)
instead of retyping them, and ``tests/test_facts.py`` checks that no chapter's prose says
otherwise and that the planner's published layout (``plan.published``) agrees.

* :data:`LLAMA3_405B`: the layout Llama 3 405B trained with (Llama Team, "The Llama 3 Herd of
  Models", 2024, section 3.3.2 and table 4).
* :data:`TORCHTITAN_ORDER`: the order torchtitan applies the techniques in (its ``train.py``:
  with a pipeline, ``pipeline_llm`` splits the model into stages, then calls the model's
  ``parallelize`` function on each stage).
* :data:`OVERLAP_ON_GPUS`: what overlapping communication with computation costs on a GPU.
* :data:`PP_WITH_ZERO`: which ZeRO stages the book says combine with pipeline parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Fact",
    "LLAMA3_405B",
    "LLAMA3_405B_LAYOUT",
    "LLAMA3_405B_LONG_LAYOUT",
    "OVERLAP_ON_GPUS",
    "PP_WITH_ZERO",
    "TORCHTITAN_ORDER",
]


@dataclass(frozen=True)
class Fact:
    """One fact: a short name, the statement in the course's words, and where it comes from."""

    name: str
    statement: str
    source: str

    def __str__(self) -> str:
        return f"{self.name}: {self.statement} ({self.source})"


# Llama 3 405B. The Llama paper's table 4 gives the degrees; section 3.3.2 says its FSDP shards
# the optimizer states and the gradients but does not reshard the weights after the forward
# (that would cost a second all-gather in the backward): the weights are gathered once per step
# and kept until the backward is done, which is ZeRO-2's memory, not ZeRO-3's (PyTorch's FSDP
# calls this mode SHARD_GRAD_OP, "ZeRO-2"). The planner's ``plan.published`` uses the same
# degrees and zero=2; tests/test_facts.py holds the two together.
LLAMA3_405B_LAYOUT = dict(gpus=16384, seq=8192, tp=8, sp=True, cp=1, pp=16, dp=128, zero=2)
LLAMA3_405B_LONG_LAYOUT = dict(gpus=16384, seq=131072, tp=8, sp=True, cp=16, pp=16, dp=8, zero=2)
LLAMA3_405B = Fact(
    "Llama 3 405B's layout",
    "on 16,384 H100s, TP 8 with SP inside each node, PP 16 across nodes and DP 128 at 8K tokens "
    "(CP 16 and DP 8 for its 128K-token stage); its data parallelism is FSDP that shards the "
    "optimizer states and gradients but keeps the gathered weights from the forward to the "
    "backward, so ZeRO-2 in the book's terms, not ZeRO-3",
    "The Llama 3 Herd of Models, section 3.3.2 and table 4",
)

# torchtitan (train.py, distributed/pipeline_parallel.py, models/llama3/infra/parallelize.py):
# with pp > 1 the model is split into stages first and parallelize() runs on each stage's
# module, applying TP (with SP), activation checkpointing, torch.compile and then FSDP (over
# dp, and cp, whose ranks see other tokens); CP itself is a context around the training step.
TORCHTITAN_ORDER = Fact(
    "torchtitan's order",
    "the pipeline split first (each rank builds only its stages), then on each stage TP with SP, "
    "activation checkpointing, torch.compile, and FSDP last over the data ranks (dp and cp); "
    "CP swaps attention for ring attention around the training step",
    "torchtitan, train.py and pipeline_llm",
)

# The book (its section on overlapping TP's communication, and the A3 appendix's premise) and
# NCCL's design: a collective is a CUDA kernel that occupies SMs and memory bandwidth.
OVERLAP_ON_GPUS = Fact(
    "overlap on GPUs",
    "NCCL's collectives are kernels that run on the same SMs as the computation and share its "
    "memory bandwidth, so communication hidden behind compute still slows that compute down: "
    "overlap saves time, but it is not free",
    "the book; NCCL",
)

# The book, on combining ZeRO with PP: ZeRO-1 and ZeRO-2 combine easily with a pipeline (its
# rule for 1024+ GPUs uses TP + PP + ZeRO-2, DeepSeek-V3 trained with PP and ZeRO-1); ZeRO-3
# with PP needs a large global batch, since every micro-batch gathers the weights again.
PP_WITH_ZERO = Fact(
    "PP with ZeRO",
    "ZeRO-1 and ZeRO-2 combine easily with pipeline parallelism; ZeRO-3 with it is rare, because "
    "every micro-batch gathers the weights again and only a large global batch hides that",
    "the book, 5D parallelism and finding the best configuration",
)
