"""Vocabulary parallelism: the embedding, the LM head and the cross-entropy split over the vocabulary.

Each tp rank holds the rows of the embedding table for its slice of token ids (other ids
look up zeros, and ``f*`` sums the ranks' lookups); the LM head is column-parallel over the
vocabulary and returns only this rank's slice of the logits, as :class:`VocabParallelLogits`.
``F.cross_entropy`` on them (so ``lm_loss``, ``Batch.loss`` and ``train.train`` unchanged)
is the parallel cross-entropy: the ranks all-reduce the maximum, the sum of exponentials and
the target's logit, never the full ``(tokens x vocab)`` logits (torchtitan's
``loss_parallel`` does the same for DTensor logits). The vocabulary is not padded: a ``tp``
that does not divide it is refused. GPT ties ``head.weight`` to ``embed.weight``: both are
sharded by vocabulary rows, so they share one local Parameter.
``tensor_parallel.apply_tp`` puts these layers in the model (plan styles "vocab_embedding"
and "vocab_head"): this module registers them in ``tensor_parallel.VOCABULARY`` when the
package imports it, and sequence parallelism subclasses them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..comm.functional import f_star, gather_along_dim, rank_and_size
from .tensor_parallel import VOCABULARY, ColumnParallelLinear, shard_parameter

__all__ = ["VocabParallelEmbedding", "VocabParallelHead", "VocabParallelLogits", "vocab_parallel_cross_entropy"]


class VocabParallelEmbedding(nn.Module):
    """Rows ``vocab_start .. vocab_start + V/tp`` of the embedding table on this rank.

    A token outside the slice looks up zeros here and its row on its owner rank, so the sum
    over ranks (``f*``) is the ordinary lookup. (Under sequence parallelism:
    ``sequence_parallel.SequenceParallelEmbedding``, whose ``g*`` also leaves this rank its
    slice of the sequence.)"""

    def __init__(self, weight, vocab_start, group=None):
        super().__init__()
        self.weight, self.vocab_start, self.group = weight, vocab_start, group

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group=None, shared=None):
        weight = shard_parameter(embedding.weight, 0, group, shared)
        start = rank_and_size(group, "tensor-parallel layers")[0] * weight.shape[0]
        return cls(weight, start, group)

    def forward(self, idx):
        return f_star(self.local_lookup(idx), self.group)

    def local_lookup(self, idx):
        """This rank's part of the lookup: its rows, zeros for the ids of other ranks."""
        outside = (idx < self.vocab_start) | (idx >= self.vocab_start + self.weight.shape[0])
        local = F.embedding((idx - self.vocab_start).masked_fill(outside, 0), self.weight)
        return local.masked_fill(outside.unsqueeze(-1), 0.0)  # row 0 was only a placeholder

    def extra_repr(self):
        return (
            f"local rows {self.vocab_start}..{self.vocab_start + self.weight.shape[0] - 1}, dim={self.weight.shape[1]}"
        )


class VocabParallelHead(ColumnParallelLinear):
    """The LM head, column-parallel over the vocabulary: returns :class:`VocabParallelLogits`.
    (Under sequence parallelism: ``sequence_parallel.SequenceParallelVocabHead``.)"""

    def __init__(self, weight, bias=None, group=None, enter_region=True, **options):
        super().__init__(weight, bias, group, enter_region, **options)
        # the first vocabulary id of this rank's slice: the group is checked here, once, not per forward
        self.vocab_start = rank_and_size(group, "tensor-parallel layers")[0] * weight.shape[0]

    @classmethod
    def from_linear(cls, linear, group=None, enter_region=True, shared=None, **options):
        if linear.bias is not None:
            raise ValueError("vocab_head expects a head without bias (as the course models have)")
        return super().from_linear(linear, group, enter_region, shared, **options)

    def forward(self, x):
        local = super().forward(x)  # (batch, seq, V/tp); under SP, g has gathered the sequence
        return VocabParallelLogits.wrap(local, self.vocab_start, self.group)


class VocabParallelLogits(torch.Tensor):
    """This rank's vocabulary slice of the logits, ``(..., V/tp)``; otherwise a plain tensor.

    ``F.cross_entropy`` on it (hence ``lm_loss``) computes the vocabulary-parallel
    cross-entropy; reshapes that keep the last dimension (``flatten(0, 1)``) and dtype
    casts keep it sharded; any other operation works on the plain local slice (so
    ``argmax(-1)`` or ``softmax(-1)`` see this rank's vocabulary only: gather first).
    ``full_tensor()`` all-gathers the full logits, for checks only.
    """

    _KEEPS_VOCAB_DIM = {"flatten", "view", "reshape", "float", "double", "to", "contiguous"}

    @staticmethod
    def wrap(local, vocab_start, group):
        with torch._C.DisableTorchFunctionSubclass():
            out = local.as_subclass(VocabParallelLogits)  # stays on the autograd graph
        out.vocab_start, out.group = vocab_start, group
        return out

    def local(self) -> torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor)

    def full_tensor(self) -> torch.Tensor:
        return gather_along_dim(self.local(), -1, self.group)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            return _cross_entropy(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            me = args[0] if args and isinstance(args[0], cls) else None
            keep = (
                me is not None
                and getattr(func, "__name__", "") in cls._KEEPS_VOCAB_DIM
                and isinstance(out, torch.Tensor)
                and out.dim()
                and out.shape[-1] == me.shape[-1]
            )
        return cls.wrap(out, me.vocab_start, me.group) if keep else out


def _cross_entropy(
    logits,
    target,
    weight=None,
    size_average=None,
    ignore_index=-100,
    reduce=None,
    reduction="mean",
    label_smoothing=0.0,
):
    if weight is not None or size_average is not None or reduce is not None or label_smoothing or reduction != "mean":
        raise ValueError(
            "the vocabulary-parallel cross-entropy supports the mean loss only "
            "(no weight, reduction or label smoothing)"
        )
    return vocab_parallel_cross_entropy(logits.local(), target, logits.vocab_start, logits.group, ignore_index)


def vocab_parallel_cross_entropy(
    local_logits, targets, vocab_start: int, group=None, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy from this rank's logits for vocabulary ids ``vocab_start ..
    vocab_start + local_logits.shape[-1] - 1``, equal on every rank to ``lm_loss`` of the full
    logits (``F.cross_entropy``: targets equal to ``ignore_index`` do not count).
    loss = log(sum_v exp(z_v - m)) - (z_target - m), with m the maximum logit."""
    logits = local_logits.flatten(0, -2)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # as lm_loss: a softmax over the vocabulary needs fp32
    targets = targets.flatten()
    # 1. The global maximum only keeps exp() in range; softmax does not depend on it, so it
    #    needs no gradient and a plain all-reduce (MAX) will do.
    with torch.no_grad():
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top.unsqueeze(-1)
    # 2. The target's logit lives on exactly one rank; the others contribute zero.
    mine = (targets >= vocab_start) & (targets < vocab_start + logits.shape[-1])
    index = (targets - vocab_start).masked_fill(~mine, 0).unsqueeze(-1)
    target_logit = shifted.gather(-1, index).squeeze(-1).masked_fill(~mine, 0.0)
    # 3. Both sums over the vocabulary in one f*: its backward is the identity, right here
    #    because every rank then computes the same loss from the same sums.
    sums = f_star(torch.stack([shifted.exp().sum(-1), target_logit]), group)
    counted = targets != ignore_index
    return torch.where(counted, sums[0].log() - sums[1], 0.0).sum() / counted.sum()


# What apply_tp builds for the styles "vocab_embedding" and "vocab_head" (plain TP; SP and
# async TP register subclasses of these in their own forms).
VOCABULARY["embedding"] = VocabParallelEmbedding.from_embedding
VOCABULARY["head"] = VocabParallelHead.from_linear
