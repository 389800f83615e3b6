"""Exercises whose function takes a process group are graded on groups that are not the world.

Issue 37, kind 1: graded only on the whole world (or on a group that starts at rank 0), a
function that leaves out ``group=``, reduces over the default group, takes its size from the
world or uses the global rank where the rank in the group is meant got full marks. Each test
submits several such answers (written inside the test, so that cloudpickle ships them by value
to the ranks) and expects a failure that says what is wrong; the solution notebook's own answer
must still pass. Also here: ``08.router``'s gradient (kind 4) and gradients left unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from test_grader_holes import _fails

from ultrascale_grading import PASS, check

torch.set_num_threads(1)
GROUPS = "Did you pass group="  # what every failure from an error or a hang on a split says


# ---- 02: data parallelism over a group ------------------------------------------------------


def test_overlapped_dp_hooks_average_over_the_group_given(ch02):
    class NoGroupPassed:  # keeps the group for its size, forgets it in the all-reduce
        def __init__(self, module, group=None):
            self.world_size, self.pending = dist.get_world_size(group), []
            for p in module.parameters():
                p.register_post_accumulate_grad_hook(self.grad_ready)

        def grad_ready(self, param):
            self.pending.append((param, dist.all_reduce(param.grad, async_op=True)))

        def finish(self):
            for param, work in self.pending:
                work.wait()
                param.grad.div_(self.world_size)
            self.pending.clear()

    class WorldSize(NoGroupPassed):  # the right group, the world's size
        def __init__(self, module, group=None):
            super().__init__(module, group)
            self.group, self.world_size = group, dist.get_world_size()

        def grad_ready(self, param):
            self.pending.append((param, dist.all_reduce(param.grad, group=self.group, async_op=True)))

    class IgnoresTheGroup(NoGroupPassed):  # the default group for everything: right on the world
        def __init__(self, module, group=None):
            super().__init__(module, None)

    exercise = "02.overlapped_dp_hooks"
    _fails(check(exercise, NoGroupPassed), "[1, 2]", "gradients of ranks outside the group got in", "group=")
    _fails(check(exercise, WorldSize), "[1, 2]", "divided by the world's size (3), not the group's (2)")
    _fails(check(exercise, IgnoresTheGroup), "[1, 2]", "outside the group got in")
    assert check(exercise, ch02["OverlappedGradSync"]).status == PASS


def test_bucket_manager_averages_over_the_group_given(ch02):
    def bucket_manager(all_reduce_group, size_of):
        """The solution's BucketManager, but reducing over ``all_reduce_group(group)`` and dividing
        by ``size_of(group)``: each wrong answer below changes one of them."""

        class Buckets(ch02["BucketManager"]):
            def __init__(self, params, bucket_cap_bytes, group=None):
                super().__init__(params, bucket_cap_bytes, group)
                self.group, self.world_size = all_reduce_group(group), size_of(group)

        return Buckets

    no_group = bucket_manager(lambda g: None, dist.get_world_size)
    world_size = bucket_manager(lambda g: g, lambda g: dist.get_world_size())
    exercise = "02.bucket_manager"
    _fails(check(exercise, no_group), "[1, 2]", "bucket_cap_bytes", "outside the group got in")
    _fails(check(exercise, world_size), "[1, 2]", "divided by the world's size (3)")
    assert check(exercise, ch02["BucketManager"]).status == PASS


# ---- 03: a gradient's rows over a group (per-parameter sharding, issue 57) -----------------


def test_shard_gradient_names_the_group_the_uneven_rows_the_dtype_and_the_mean(ch03):
    """Issue 57's kinds: a group other than the world, an uneven shard, a gradient left in the
    compute dtype (returned in it, or reduced in it), and a sum or the world's size for the mean."""
    reduce_scatter_into = ch03["reduce_scatter_into"]

    def rows_of(
        full_grad, group, dtype, reduce_group="given", keep_padding=False, reduce_dtype=None, divide_by="group"
    ):
        n, member = dist.get_world_size(group), dist.get_rank(group)
        rows = full_grad.shape[0]
        per = -(-rows // n)
        padded = full_grad.new_zeros((per * n, *full_grad.shape[1:]), dtype=reduce_dtype or dtype)
        padded[:rows] = full_grad
        mine = padded.new_empty((per, *full_grad.shape[1:]))
        if reduce_group == "given":
            reduce_scatter_into(mine, padded, group=group)
        else:
            reduce_scatter_into(mine, padded)  # the default group: the world
        mine = mine / {"group": n, "world": dist.get_world_size(), "none": 1}[divide_by]
        if keep_padding:
            return mine
        start = min(member * per, rows)
        return mine[: max(0, min(per, rows - start))]

    def no_group(full_grad, group, dtype):
        return rows_of(full_grad, group, dtype, reduce_group="world")

    def padded_rows(full_grad, group, dtype):  # every member returns ceil(rows / n) rows
        return rows_of(full_grad, group, dtype, keep_padding=True)

    def left_in_bf16(full_grad, group, dtype):
        return rows_of(full_grad, group, dtype, reduce_dtype=full_grad.dtype)

    def reduced_in_bf16(full_grad, group, dtype):
        return rows_of(full_grad, group, dtype, reduce_dtype=full_grad.dtype).to(dtype)

    def summed(full_grad, group, dtype):
        return rows_of(full_grad, group, dtype, divide_by="none")

    def world_size(full_grad, group, dtype):
        return rows_of(full_grad, group, dtype, divide_by="world")

    exercise = "03.shard_gradient"
    _fails(check(exercise, no_group), "[1, 2]", "over the default group (no group=)", GROUPS)
    _fails(check(exercise, padded_rows), "torch.chunk", "the last members short or empty", "drop the padding")
    _fails(check(exercise, left_in_bf16), "return the gradient in torch.float32", "left in the compute dtype")
    _fails(check(exercise, reduced_in_bf16), "reduced in torch.bfloat16", "cast to torch.float32 first")
    _fails(check(exercise, summed), "these are the sums over the group's", "divide by the group's size")
    _fails(check(exercise, world_size), "divided by the world's size (3), not the group's")
    assert check(exercise, ch03["shard_gradient"]).status == PASS


def test_muon_rows_names_a_step_on_the_shard_the_group_and_the_dtype(ch03):
    """Issue 57's kind: a Muon step on this rank's rows instead of the whole matrix; also no group=,
    and Newton-Schulz left in its bf16 default."""
    all_gather_into, newton_schulz = ch03["all_gather_into"], ch03["newton_schulz"]

    def gathered_rows(update_rows, rows, group, reduce_group="given", dtype=None):
        n, member = dist.get_world_size(group), dist.get_rank(group)
        per = -(-rows // n)
        piece = update_rows.new_zeros((per, *update_rows.shape[1:]))
        piece[: update_rows.shape[0]] = update_rows
        whole = piece.new_empty((per * n, *update_rows.shape[1:]))
        all_gather_into(whole, piece, **({"group": group} if reduce_group == "given" else {}))
        ortho = newton_schulz(whole[:rows], **({"dtype": dtype} if dtype else {}))
        start = min(member * per, rows)
        return ortho[start : start + update_rows.shape[0]].to(update_rows.dtype)

    def on_the_shard(update_rows, rows, group):
        return newton_schulz(update_rows, dtype=update_rows.dtype)

    def no_group(update_rows, rows, group):
        return gathered_rows(update_rows, rows, group, reduce_group="world", dtype=update_rows.dtype)

    def in_bf16(update_rows, rows, group):
        return gathered_rows(update_rows, rows, group)

    exercise = "03.muon_rows"
    _fails(check(exercise, on_the_shard), "[1, 2]", "you orthogonalised this rank's rows alone", "whole matrix")
    _fails(check(exercise, no_group), "over the default group (no group=)", GROUPS)
    _fails(check(exercise, in_bf16), "orthogonalised in bfloat16")
    assert check(exercise, ch03["muon_rows"]).status == PASS


# ---- 06: a ring over a group ----------------------------------------------------------------


def _ring_step(post):
    """The solution's ring step with the transfers posted by ``post(kv, incoming, group)``."""

    def ring_step(q, kv, out, lse, attend, group, last):
        from ultrascale.kernels.tiled_attention import merge_partial_attention

        works, incoming = [], None
        if not last:
            incoming = torch.empty_like(kv)
            works = post(kv, incoming, group)
        out, lse = merge_partial_attention(out, lse, *attend(q, kv[0], kv[1]))
        for work in works:
            work.wait()
        return out, lse, incoming

    return ring_step


def test_ring_step_sends_within_the_group_given(ch06):
    def global_rank(kv, incoming, group):  # dist.get_rank() where the rank in the group is meant
        r, n = dist.get_rank(), dist.get_world_size(group)
        return dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, kv, group=group, group_peer=(r + 1) % n),
                dist.P2POp(dist.irecv, incoming, group=group, group_peer=(r - 1) % n),
            ]
        )

    def no_group(kv, incoming, group):  # the right ranks, sent over the default group
        r, n = dist.get_rank(group), dist.get_world_size(group)
        return [dist.isend(kv, dst=(r + 1) % n), dist.irecv(incoming, src=(r - 1) % n)]

    def group_rank_as_dst(kv, incoming, group):  # dst= takes a global rank, even with group=
        r, n = dist.get_rank(group), dist.get_world_size(group)
        return [dist.isend(kv, dst=(r + 1) % n, group=group), dist.irecv(incoming, src=(r - 1) % n, group=group)]

    def world_size(kv, incoming, group):  # the ring as long as the world
        r, n = dist.get_rank(group), dist.get_world_size()
        return dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, kv, group=group, group_peer=(r + 1) % n),
                dist.P2POp(dist.irecv, incoming, group=group, group_peer=(r - 1) % n),
            ]
        )

    exercise = "06.ring_step"
    for post, phrases in (
        (global_rank, ["[1, 2]", "this rank itself", "this rank's place in the group"]),
        (no_group, ["[1, 2]", "not in the ring's group", "group="]),
        (group_rank_as_dst, ["[1, 2]", "dst= / src= take a global rank"]),
        (world_size, ["[1, 2]", GROUPS, "take the size and the rank from the group"]),
    ):
        _fails(check(exercise, _ring_step(post), timeout=30), *phrases)
    assert check(exercise, ch06["ring_step"]).status == PASS


# ---- 08: expert parallelism over a group, and the router's gradient ------------------------


def test_router_weights_carry_the_routers_gradient(ch08):
    def detached_softmax(logits, k):  # "the probabilities are just numbers"
        weights, chosen = torch.softmax(logits.detach(), -1).topk(k, dim=-1)
        return (weights / weights.sum(-1, keepdim=True) if k > 1 else weights), chosen

    def detached_sum(logits, k):  # the right weights, half of their gradient
        weights, chosen = torch.softmax(logits, -1).topk(k, dim=-1)
        return (weights / weights.sum(-1, keepdim=True).detach() if k > 1 else weights), chosen

    def rebuilt_weights(logits, k):  # the right values, copied out of the graph
        weights, chosen = ch08["route"](logits, k)
        return torch.tensor(weights.tolist()), chosen

    exercise = "08.router"
    _fails(check(exercise, detached_softmax), "E=4, k=1", "do not require grad", "never trains the router")
    _fails(check(exercise, detached_sum), "k=2", "renormalising sum is detached")
    _fails(check(exercise, rebuilt_weights), "E=4, k=1", "do not require grad")
    assert check(exercise, ch08["route"]).status == PASS


def _split_sizes(size_of, exchange_group):
    """The solution's split_sizes with the size from ``size_of(group)`` and the counts exchanged
    over ``exchange_group(group)``: each wrong answer below changes one of them."""

    def split_sizes(chosen, per_rank, group=None):
        n = size_of(group)
        needs = torch.zeros(chosen.shape[0], n, dtype=torch.bool).scatter_(1, chosen // per_rank, True)
        send = needs.sum(0)
        receive = torch.empty_like(send)
        dist.all_to_all_single(receive, send, group=exchange_group(group))
        return send.tolist(), receive.tolist()

    return split_sizes


def test_split_sizes_count_and_exchange_within_the_group(ch08):
    no_group = _split_sizes(dist.get_world_size, lambda g: None)
    world_size = _split_sizes(lambda g: dist.get_world_size(), lambda g: g)
    ignores_the_group = _split_sizes(lambda g: dist.get_world_size(), lambda g: None)
    exercise = "08.split_sizes"
    _fails(check(exercise, no_group, timeout=30), "[1, 2, 3]", GROUPS)
    _fails(check(exercise, world_size, timeout=30), "[1, 2, 3]", GROUPS, "take the size")
    _fails(check(exercise, ignores_the_group, timeout=30), "[1, 2, 3]", GROUPS)
    assert check(exercise, ch08["split_sizes"]).status == PASS


def _ep_forward(size_of, counts_group, rows_group):
    """The solution's ep_forward with the size from ``size_of(group)``, the counts exchanged over
    ``counts_group(group)`` and the rows over ``rows_group(group)``."""

    def ep_forward(tokens, chosen, weights, experts, group=None):
        from ultrascale.comm.functional import all_to_all
        from ultrascale.moe import apply_experts
        from ultrascale.parallel.expert_parallel import dispatch_plan, exchange_counts

        plan = dispatch_plan(chosen, weights, size_of(group), len(experts))
        send = plan.send_counts
        receive = exchange_counts(send, counts_group(group))
        g = rows_group(group)
        ids, x, w = (all_to_all(t, receive, send, g) for t in (plan.local_ids, tokens[plan.rows], plan.weights))
        back = all_to_all(apply_experts(experts, x, ids, w), send, receive, g)
        return tokens.new_zeros(tokens.shape).index_add(0, plan.rows, back)

    return ep_forward


def test_dispatch_combine_sends_within_the_group(ch08):
    same = lambda g: g  # noqa: E731
    world_size = _ep_forward(lambda g: dist.get_world_size(), same, same)
    counts_over_the_world = _ep_forward(dist.get_world_size, lambda g: None, same)
    rows_over_the_world = _ep_forward(dist.get_world_size, same, lambda g: None)
    exercise = "08.dispatch_combine"
    for wrong in (world_size, counts_over_the_world, rows_over_the_world):
        _fails(check(exercise, wrong, timeout=30), "[1, 2, 3]", GROUPS)
    assert check(exercise, ch08["ep_forward"]).status == PASS


def test_dispatch_combine_leaves_the_incoming_gradient_alone(ch08):
    def frees_the_incoming_gradient(tokens, chosen, weights, experts, group=None):
        class Combine(torch.autograd.Function):  # the rows home, by hand, with a "memory saving" backward
            @staticmethod
            def forward(ctx, back, rows):
                ctx.rows = rows
                return back.new_zeros(tokens.shape).index_add(0, rows, back)

            @staticmethod
            def backward(ctx, grad_output):
                grad = grad_output[ctx.rows]
                grad_output.zero_()  # wrong: it is the caller's tensor, not a buffer to free
                return grad, None

        from ultrascale.comm.functional import all_to_all
        from ultrascale.moe import apply_experts
        from ultrascale.parallel.expert_parallel import dispatch_plan, exchange_counts

        plan = dispatch_plan(chosen, weights, dist.get_world_size(group), len(experts))
        send = plan.send_counts
        receive = exchange_counts(send, group)
        ids, x, w = (all_to_all(t, receive, send, group) for t in (plan.local_ids, tokens[plan.rows], plan.weights))
        return Combine.apply(all_to_all(apply_experts(experts, x, ids, w), send, receive, group), plan.rows)

    _fails(
        check("08.dispatch_combine", frees_the_incoming_gradient),
        "top-1, rank 0",
        "the gradient that backward was given for the output changed",
    )


def test_expert_gradients_reduce_over_the_groups_given(ch08):
    def dense_over_the_world(grad, expert, data_group, expert_group):  # no group= for the dense ones
        grad = grad.clone()
        if expert:
            if expert_group is not None:
                dist.all_reduce(grad, group=expert_group)
        else:
            dist.all_reduce(grad)
        return grad / dist.get_world_size(data_group)

    def world_size(grad, expert, data_group, expert_group):  # the right sums, the world's divisor
        grad = grad.clone()
        group = expert_group if expert else data_group
        if group is not None:
            dist.all_reduce(grad, group=group)
        return grad / dist.get_world_size()

    def in_place(grad, expert, data_group, expert_group):  # the right values, written over the argument
        group = expert_group if expert else data_group
        if group is not None:
            dist.all_reduce(grad, group=group)
        return grad.div_(dist.get_world_size(data_group))

    exercise = "08.expert_gradients"
    _fails(
        check(exercise, dense_over_the_world),
        "the group [1, 3]",
        "data_group is the group [1, 3], not the world",
        GROUPS,
    )
    _fails(check(exercise, world_size), "the group [1, 3]", "divide by the size of data_group")
    _fails(check(exercise, in_place), "changed its argument `grad`", "work on a copy")  # the contract
    assert check(exercise, ch08["reduce_gradient"]).status == PASS
