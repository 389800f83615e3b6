"""Mixture of experts (MoE): a router and E feed-forward experts in place of one MLP.

A dense block sends every token through the same MLP. An MoE block holds E MLPs, the
*experts*, and a *router* that picks k of them per token (Switch Transformer: k = 1;
Mixtral: k = 2; DeepSeek-V3: 8 of 256). A token's output is the weighted sum of its k
experts' outputs, so the model has E times the MLP parameters but each token pays for
only k MLPs: more parameters at nearly the same FLOPs.

* ``Router``: a linear layer to E logits, softmax, top-k. With k > 1 the k weights are
  renormalised to sum to 1 (Mixtral); with k = 1 the weight is the probability itself
  (Switch), since a renormalised single weight is always 1 and the router would get no
  gradient from the loss. *Group-limited* routing (DeepSeek's node-limited routing) lets a
  token choose experts from at most ``group_limit`` of ``expert_groups`` groups of experts:
  the groups whose ``top_k / group_limit`` best probabilities add up to the most.
* ``apply_experts``: the tokens gathered per expert (sorted by expert id), each expert run
  once on its batch of tokens, the outputs weighted and added back to their tokens.
* ``MoE``: the module. ``experts_forward`` is the step expert parallelism replaces from
  outside (``parallel.expert_parallel``): the router and the weighting stay the same.
* ``balance_loss``: the load-balancing loss, per sequence as DeepSeek-V3's complementary
  loss, so that the mean over ranks holding different sequences is the loss of the whole
  batch. It is recorded on the module (``aux_loss``) and added by ``auxiliary_loss(model)``.
* ``update_selection_bias``: DeepSeek-V3's balancing without a loss: between steps, each
  router's ``selection_bias`` moves by a fixed speed against its expert's load.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Router(nn.Module):
    """Token -> (weights (T, k), chosen experts (T, k), probabilities (T, E))."""

    def __init__(self, hidden: int, experts: int, top_k: int, expert_groups: int = 1, group_limit: int = 0):
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.top_k, self.expert_groups, self.group_limit = top_k, expert_groups, group_limit
        # Added to the probabilities when choosing, not to the weights (DeepSeek-V3's bias for
        # balancing without a loss, moved by update_selection_bias). Zero by default; chapter 08
        # also sets it by hand to skew the routing onto one expert.
        self.register_buffer("selection_bias", torch.zeros(experts))
        self.load = None  # choices per expert since the last update_selection_bias (a plain tensor)

    def forward(self, x):
        probs = torch.softmax(self.gate(x), dim=-1)
        scores = probs + self.selection_bias
        if self.group_limit:
            scores = limit_groups(scores, self.expert_groups, self.group_limit, self.top_k)
        chosen = self.choose(scores)
        weights = probs.gather(-1, chosen)
        if self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.training:  # an evaluation forward is no part of a training step's load
            self._count(chosen)
        return weights, chosen, probs

    def choose(self, scores):
        """Each token's ``top_k`` experts: the highest scores. (The dry run replaces this one
        step with a routing stated in advance, since fake tensors have no scores to rank.)"""
        return scores.topk(self.top_k, dim=-1).indices

    def _count(self, chosen):
        # The bias update needs each expert's load over a whole step, which may be several
        # forwards (micro-batches): add them up until update_selection_bias reads and clears it.
        # A plain attribute, not a buffer: it is neither saved nor broadcast with the model.
        # scatter_add, not bincount: bincount's output size waits for the GPU (a sync per layer).
        ids = chosen.detach().flatten()
        counts = ids.new_zeros(self.selection_bias.numel()).scatter_add_(0, ids, torch.ones_like(ids))
        self.load = counts if self.load is None else self.load + counts


def limit_groups(scores, groups: int, limit: int, top_k: int):
    """``scores`` (T, E) with the experts outside each token's ``limit`` best groups set to
    -inf, so top-k never picks them.

    A group's score is the sum of its ``top_k / limit`` highest scores (DeepSeek-V3's
    node-limited routing: 8 experts from at most 4 nodes, each node scored by its 2 best
    experts). With one expert per group and per pick that is the best expert's score, the
    rule of DeepSeek-V2; the sum prefers a group that can supply its share of the k picks
    over a group with a single strong expert.
    """
    t, e = scores.shape
    per_group = max(1, min(e // groups, top_k // limit))
    ranked = scores.detach().view(t, groups, e // groups).topk(per_group, dim=-1).values
    group_scores = ranked.sum(-1)  # (T, groups)
    best = group_scores.topk(limit, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best, True)
    return scores.masked_fill(~keep.repeat_interleave(e // groups, dim=1), float("-inf"))


def apply_experts(experts, x, chosen, weights):
    """``y[t] = sum_j weights[t, j] * experts[chosen[t, j]](x[t])``, skipping ``chosen = -1``.

    ``experts`` is a sequence; ``chosen`` indexes it. Every (token, slot) pair is sorted by
    expert, so each expert runs once on one contiguous batch of its tokens (and on an empty
    batch if none came: its gradient is then zero, not missing, on every rank alike).
    """
    rows, slots, counts = expert_batches(chosen, len(experts))
    out = torch.cat([expert(part) for expert, part in zip(experts, x[rows].split(counts))])
    out = out * weights[rows, slots].unsqueeze(-1)
    return x.new_zeros(x.shape).index_add(0, rows, out)


def expert_batches(chosen, experts: int):
    """``apply_experts``' plan: (token, slot) of every choice, sorted by expert (``rows``, ``slots``),
    and how many each of the ``experts`` gets (``counts``, a list: the sizes to split the batch by)."""
    rows, slots = (chosen >= 0).nonzero(as_tuple=True)
    ids = chosen[rows, slots]
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=experts).tolist()
    return rows[order], slots[order], counts


def grouped_mlp(experts, x_sorted, counts):
    """The experts of ``apply_experts`` as one batched matmul per layer (GPT-style MLP experts).

    A per-expert loop launches E small matmuls; a grouped GEMM launches one. Here the tokens
    are padded to the busiest expert's count and run as ``torch.bmm`` over stacked weights,
    the simplest grouped form (real kernels skip the padding). Same result as the loop.
    """
    e, most = len(counts), max(counts)
    padded = x_sorted.new_zeros(e, most, x_sorted.shape[-1])
    mask = torch.arange(most, device=x_sorted.device) < torch.tensor(counts, device=x_sorted.device)[:, None]
    padded[mask] = x_sorted
    fc_w = torch.stack([m.fc.weight for m in experts]).transpose(1, 2)
    proj_w = torch.stack([m.proj.weight for m in experts]).transpose(1, 2)
    hidden = F.gelu(torch.bmm(padded, fc_w) + torch.stack([m.fc.bias for m in experts])[:, None], approximate="tanh")
    out = torch.bmm(hidden, proj_w) + torch.stack([m.proj.bias for m in experts])[:, None]
    return out[mask]


def balance_loss(probs, chosen, experts: int, sequences: int):
    """Sequence-wise load-balancing loss: mean over sequences of ``sum_i f_i * P_i``.

    ``f_i``: the fraction of the sequence's (token, slot) choices that went to expert i,
    times E; ``P_i``: the mean router probability of expert i over the sequence. It is 1 for
    a perfectly even split and grows as the router favours a few experts.
    """
    t, k = chosen.shape
    per_seq = t // sequences
    chosen_counts = F.one_hot(chosen, experts).sum(1).view(sequences, per_seq, experts).sum(1)
    f = chosen_counts.to(probs.dtype) * experts / (k * per_seq)
    p = probs.view(sequences, per_seq, experts).mean(1)
    return (f * p).sum(-1).mean()


def bias_update(load, speed: float):
    """The change of every expert's selection bias for one step: ``speed * sign(mean - load)``.

    An overloaded expert (more choices than the mean) loses ``speed``, an underloaded one gains
    it, one exactly at the mean keeps its bias. The step is fixed, not proportional to the
    imbalance, so a single huge batch cannot throw the bias far off.
    """
    load = load.float()
    return speed * torch.sign(load.mean() - load)


@torch.no_grad()
def update_selection_bias(model, speed: float, sum_over_ranks=None) -> list:
    """Load balancing without an auxiliary loss: call it after each optimizer step.

    DeepSeek-V3 (arXiv 2412.19437, section 2.1.2), after Wang et al. 2024, "Auxiliary-Loss-Free
    Load Balancing Strategy for Mixture-of-Experts" (arXiv 2408.15664): a per-expert bias is
    added to the router's scores only to choose the top-k experts; the gating weights still come
    from the unbiased scores (``Router.forward``). After each step every bias moves by
    ``bias_update`` of the load its router counted since the last call. No gradient is involved:
    the bias is a buffer, so the language-model loss is not traded for balance as with
    ``balance_loss``. (DeepSeek-V3 adds it to sigmoid affinities; here to the softmax
    probabilities, the same idea.)

    ``sum_over_ranks`` (e.g. ``torch.distributed.all_reduce``): sums a load tensor in place over
    the ranks holding different tokens, so that every replica applies the same update and the
    biases stay equal. Returns each router's load for the step (after the sum).
    """
    loads = []
    for router in (m for m in model.modules() if isinstance(m, Router)):
        if router.load is None:  # no forward since the last update: nothing to go by
            continue
        load, router.load = router.load, None
        if sum_over_ranks is not None:
            sum_over_ranks(load)
        router.selection_bias += bias_update(load, speed).to(router.selection_bias.dtype)
        loads.append(load)
    return loads


class MoE(nn.Module):
    """A mixture-of-experts feed-forward: ``router``, ``experts`` (made by ``make_expert``)."""

    def __init__(self, hidden: int, config, make_expert):
        super().__init__()
        self.router = Router(hidden, config.experts, config.top_k, config.expert_groups, config.group_limit)
        self.experts = nn.ModuleList(make_expert() for _ in range(config.experts))
        self.num_experts, self.aux_loss_coef = config.experts, config.aux_loss_coef
        self.aux_loss = None  # coef * balance loss of the last forward (when coef > 0)

    def forward(self, x):
        b, s, h = x.shape
        tokens = x.reshape(-1, h)
        weights, chosen, probs = self.router(tokens)
        if self.aux_loss_coef:
            self.aux_loss = self.aux_loss_coef * balance_loss(probs, chosen, self.num_experts, b)
        return self.experts_forward(tokens, chosen, weights).view(b, s, h)

    def experts_forward(self, tokens, chosen, weights):
        """Run every token through its chosen experts (replaced by expert parallelism)."""
        return apply_experts(self.experts, tokens, chosen, weights)


def auxiliary_loss(model):
    """The sum of the MoE layers' load-balancing losses of the last forward (0 if none):
    what the training loss adds to the language-model loss."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoE) and m.aux_loss is not None]
    return sum(losses) if losses else 0.0


def moe_params_per_layer(hidden: int, experts: int, expert_params: int) -> int:
    """Parameters of one MoE feed-forward: the router (h x E, no bias) and E experts."""
    return hidden * experts + experts * expert_params
