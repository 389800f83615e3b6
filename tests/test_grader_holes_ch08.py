"""The chapter 8 exercises cannot be fooled: plausible wrong answers fail with a message that
says what to fix, and the solution notebook's own answers pass."""

from __future__ import annotations

import torch
import torch.distributed as dist
from test_grader_holes import _fails

from ultrascale_grading import PASS, check


# ---- 08.router -----------------------------------------------------------------------------


def test_router_refuses_missing_or_wrong_renormalisation(ch08):
    def not_renormalised(logits, k):
        return torch.softmax(logits, -1).topk(k, dim=-1)

    def always_renormalised(logits, k):
        w, c = torch.softmax(logits, -1).topk(k, dim=-1)
        return w / w.sum(-1, keepdim=True), c

    def weights_from_logits(logits, k):
        return logits.topk(k, dim=-1)

    def least_probable(logits, k):
        w, c = torch.softmax(-logits, -1).topk(k, dim=-1)
        return w, c

    exercise = "08.router"
    _fails(check(exercise, not_renormalised), "k=2", "renormalise")
    _fails(check(exercise, always_renormalised), "k=1: every weight is 1", "Switch")
    _fails(check(exercise, weights_from_logits), "weights differ from softmax(logits)")
    _fails(check(exercise, least_probable), "other experts than their k most probable")
    assert check(exercise, ch08["route"]).status == PASS


# ---- 08.split_sizes ------------------------------------------------------------------------


def test_split_sizes_refuses_choices_counts_and_the_senders_view(ch08):
    def counting_choices(chosen, per_rank, group=None):
        n = dist.get_world_size(group)
        send = torch.bincount((chosen // per_rank).flatten(), minlength=n)
        receive = torch.empty_like(send)
        dist.all_to_all_single(receive, send, group=group)
        return send.tolist(), receive.tolist()

    def senders_view(chosen, per_rank, group=None):
        n = dist.get_world_size(group)
        needs = torch.zeros(chosen.shape[0], n, dtype=torch.bool).scatter_(1, chosen // per_rank, True)
        send = needs.sum(0).tolist()
        return send, send

    def library(chosen, per_rank, group=None):
        from ultrascale.parallel.expert_parallel import dispatch_plan, exchange_counts

        plan = dispatch_plan(chosen, torch.ones(chosen.shape), dist.get_world_size(group), per_rank)
        return plan.send_counts, exchange_counts(plan.send_counts, group)

    exercise = "08.split_sizes"
    _fails(check(exercise, counting_choices), "top-2", "sent there once")
    _fails(check(exercise, senders_view), "collectives on this rank: none", "made of all_to_all")  # the contract
    _fails(check(exercise, library), "the course library's")
    assert check(exercise, ch08["split_sizes"]).status == PASS


# ---- 08.dispatch_combine -------------------------------------------------------------------


def test_dispatch_combine_refuses_lost_order_no_gradient_and_all_gather(ch08):
    def forgets_the_permutation(tokens, chosen, weights, experts, group=None):
        from ultrascale.comm.functional import all_to_all
        from ultrascale.moe import apply_experts
        from ultrascale.parallel.expert_parallel import dispatch_plan, exchange_counts

        plan = dispatch_plan(chosen, weights, dist.get_world_size(group), len(experts))
        send = plan.send_counts
        receive = exchange_counts(send, group)
        ids = all_to_all(plan.local_ids, receive, send, group)
        y = apply_experts(
            experts,
            all_to_all(tokens[plan.rows], receive, send, group),
            ids,
            all_to_all(plan.weights, receive, send, group),
        )
        return all_to_all(y, send, receive, group)  # rows in plan order, not token order

    def without_autograd(tokens, chosen, weights, experts, group=None):
        with torch.no_grad():
            return ch08["ep_forward"](tokens, chosen, weights, experts, group)

    def by_all_gather(tokens, chosen, weights, experts, group=None):
        from ultrascale.comm.functional import gather_along_dim, reduce_from_parallel_region
        from ultrascale.moe import apply_experts

        r, n = dist.get_rank(group), dist.get_world_size(group)
        every = gather_along_dim(tokens, 0, group)  # every rank gets every token
        w = gather_along_dim(weights, 0, group)
        ids = [torch.empty_like(chosen) for _ in range(n)]
        dist.all_gather(ids, chosen, group=group)
        ids = torch.cat(ids) - r * len(experts)
        ids = torch.where((ids >= 0) & (ids < len(experts)), ids, -1)
        y = reduce_from_parallel_region(apply_experts(experts, every, ids, w), group)
        return y[r * tokens.shape[0] : (r + 1) * tokens.shape[0]]

    def library(tokens, chosen, weights, experts, group=None):
        from ultrascale.parallel.expert_parallel import ExpertParallelDispatch

        modules = torch.nn.ModuleDict({str(i): e for i, e in enumerate(experts)})
        return ExpertParallelDispatch(modules, len(experts) * dist.get_world_size(group), group)(
            tokens, chosen, weights
        )

    exercise = "08.dispatch_combine"
    _fails(check(exercise, forgets_the_permutation), "wrong order", "index_add")
    _fails(check(exercise, without_autograd), "does not require grad", "all_to_all")
    _fails(check(exercise, by_all_gather), "made of all_to_all", "all_gather", "another algorithm")  # contract
    _fails(check(exercise, library), "the course library's")
    assert check(exercise, ch08["ep_forward"]).status == PASS


# ---- 08.expert_gradients -------------------------------------------------------------------


def test_expert_gradients_refuse_wrong_groups_and_divisors(ch08):
    def replicas_average(grad, expert, data_group, expert_group):
        grad = grad.clone()
        group = expert_group if expert else data_group
        if group is not None:
            dist.all_reduce(grad, group=group)
        return grad / (dist.get_world_size(group) if group is not None else 1)

    def experts_over_data_group(grad, expert, data_group, expert_group):
        grad = grad.clone()
        dist.all_reduce(grad, group=data_group)
        return grad / dist.get_world_size(data_group)

    def dense_not_divided(grad, expert, data_group, expert_group):
        grad = grad.clone()
        if not expert:
            dist.all_reduce(grad, group=data_group)
            return grad
        return ch08["reduce_gradient"](grad, expert, data_group, expert_group)

    def library(grad, expert, data_group, expert_group):
        from ultrascale.parallel.expert_parallel import _reduce

        return _reduce(grad, expert_group if expert else data_group, dist.get_world_size(data_group))

    def shared_helper(grad, expert, data_group, expert_group):  # the helper every technique calls
        from ultrascale.parallel.grad_sync import reduce_gradient

        group = expert_group if expert else data_group
        if group is None:  # an expert no other rank holds
            return grad / dist.get_world_size(data_group)
        return reduce_gradient(grad, group, dist.get_world_size(data_group))

    exercise = "08.expert_gradients"
    _fails(check(exercise, shared_helper), "the course library's", "reduce_gradient")
    _fails(check(exercise, replicas_average), "ep=2", "divide by the size of data_group")
    _fails(check(exercise, experts_over_data_group), "differs from one process")
    _fails(check(exercise, dense_not_divided), "ep=2", "differs from one process")
    _fails(check(exercise, library), "the course library's")
    assert check(exercise, ch08["reduce_gradient"]).status == PASS
