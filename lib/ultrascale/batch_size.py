"""The global batch size identity and the recipe for choosing dp, mbs and grad_acc.

    gbs = mbs × grad_acc × dp        (in samples; × seq_len for tokens)

The recipe, in the order the decisions are made:
1. pick the global batch size in tokens (GBST) from the literature or experiments;
2. pick the sequence length (2-8k tokens works reliably; DeepSeek and Llama
   pre-train at 4k), which turns GBST into a number of samples;
3. pick the largest micro-batch size (mbs) that fits in one GPU's memory;
4. the number of GPUs gives dp; what is left over is gradient accumulation:
   grad_acc = gbs / (mbs × dp).

If grad_acc would be below 1 the cluster is "GPU-rich": one step with every GPU
processing one micro-batch already exceeds the target batch. See ``gpu_rich_options``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def global_batch_size(mbs: int, grad_acc: int, dp: int) -> int:
    """Samples per optimizer step: each of dp replicas runs grad_acc micro-batches of mbs."""
    for name, value in (("mbs", mbs), ("grad_acc", grad_acc), ("dp", dp)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return mbs * grad_acc * dp


def nearest_power_of_two(x: float) -> int:
    """The power of two closest to x (on a log scale): 976.6 -> 1024."""
    if x <= 0:
        raise ValueError(f"need a positive number, got {x}")
    return 2 ** round(math.log2(x))


def samples_per_step(gbs_tokens: float, seq_len: int, power_of_two: bool = True) -> int:
    """Turn a batch size in tokens into samples of seq_len tokens.

    Batch sizes are usually rounded to a power of two, which is how 4M tokens at a
    4k sequence length becomes 1024 samples (4e6 / 4096 = 976.6).
    """
    samples = gbs_tokens / seq_len
    return nearest_power_of_two(samples) if power_of_two else max(1, round(samples))


@dataclass
class BatchPlan:
    """The outcome of the recipe for one cluster size."""

    gbs: int  # target global batch size, in samples
    seq_len: int
    mbs: int
    dp: int
    grad_acc: int  # 0 when the cluster is GPU-rich (see options)
    options: list = field(default_factory=list)

    @property
    def gpu_rich(self) -> bool:
        return self.grad_acc == 0

    @property
    def achieved_gbs(self) -> int:
        """The batch the plan really trains with (may differ when gbs is not divisible)."""
        return self.mbs * self.grad_acc * self.dp

    @property
    def tokens_per_step(self) -> int:
        return self.achieved_gbs * self.seq_len

    def __str__(self) -> str:
        if self.gpu_rich:
            lines = [
                f"GPU-rich: mbs={self.mbs} on dp={self.dp} already covers "
                f"{self.mbs * self.dp} samples > gbs={self.gbs}. Options:"
            ]
            return "\n".join(lines + [f"  - {o}" for o in self.options])
        return (
            f"gbs={self.achieved_gbs} samples ({self.tokens_per_step:,} tokens) = "
            f"mbs {self.mbs} x grad_acc {self.grad_acc} x dp {self.dp}"
        )


def plan_batch(gbs_tokens: float, seq_len: int, mbs: int, dp: int, power_of_two: bool = True) -> BatchPlan:
    """Steps 2-4 of the recipe: samples from tokens, then grad_acc = gbs / (mbs × dp).

    >>> plan_batch(4e6, 4096, mbs=2, dp=128).grad_acc
    4
    """
    gbs = samples_per_step(gbs_tokens, seq_len, power_of_two)
    per_step = mbs * dp
    if per_step > gbs:
        return BatchPlan(gbs, seq_len, mbs, dp, 0, gpu_rich_options(gbs, mbs, dp))
    if gbs % per_step:
        # Round to the nearest whole number of micro-batches; achieved_gbs says what it costs.
        return BatchPlan(gbs, seq_len, mbs, dp, max(1, round(gbs / per_step)))
    return BatchPlan(gbs, seq_len, mbs, dp, gbs // per_step)


def gpu_rich_options(gbs: int, mbs: int, dp: int) -> list[str]:
    """What to do when mbs × dp exceeds the global batch (grad_acc would be below 1)."""
    options = []
    used = gbs // mbs
    if used >= 1:
        options.append(
            f"leave GPUs idle: use dp={used} and leave {dp - used} of {dp} GPUs unused "
            "(or give them to another form of parallelism)"
        )
    options.append(
        f"raise the global batch size to mbs x dp = {mbs * dp} samples "
        f"({mbs * dp / gbs:.3g}x the target; check that training still converges)"
    )
    if dp <= gbs:
        m = gbs // dp
        exact = "" if m * dp == gbs else f", not exactly gbs={gbs}"
        options.append(
            f"lower the micro-batch size to {m}: {m} x {dp} GPUs = {m * dp} samples per step"
            f"{exact} (smaller matrix multiplies use each GPU less efficiently)"
        )
    else:
        options.append(
            f"lower the micro-batch size: even mbs=1 on {dp} GPUs gives {dp} samples, "
            f"more than gbs={gbs}, so combine it with one of the options above"
        )
    return options
