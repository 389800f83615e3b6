"""Issue 37, chapters 04, 05 and 07: plausible wrong answers the graders used to accept now fail.

The kinds: a case only the full run had (the grader runs QUICK); a backward that changes its
incoming gradient in place, which corrupts another branch's gradient; an output no check
looked at; and a collective without ``group=group``, which only a tp group other than the
whole cluster shows (3 ranks cut into [0, 1] and [2], or into [0] and [1, 2]). Each wrong
answer is written inside its test, so that cloudpickle ships it by value to the ranks, and
must fail with a message that names its mistake; the solution's answer still passes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_grader_holes import _fails

from ultrascale_grading import PASS, check

torch.set_num_threads(1)
IN_PLACE = "changed the gradient it was given in place"
NO_GROUP = "not over the 2 ranks of the tp group: pass group=group"


# ---- 04.conjugate_pair --------------------------------------------------------------------


def test_conjugate_pair_refuses_in_place_gradients_and_a_missing_group(ch04):
    Copy, Reduce = ch04["Copy"], ch04["Reduce"]

    class CopyReducingGradInPlace(torch.autograd.Function):  # the right sum, written into grad itself
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x

        @staticmethod
        def backward(ctx, grad):
            dist.all_reduce(grad, group=ctx.group)
            return grad, None

    class CopyThroughAnAlias(torch.autograd.Function):  # "total" is grad under another name
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x

        @staticmethod
        def backward(ctx, grad):
            total = grad
            work = dist.all_reduce(total, group=ctx.group, async_op=True)
            work.wait()
            return total, None

    class ReduceOverAllRanks(torch.autograd.Function):  # forgets group= in forward
        @staticmethod
        def forward(ctx, x, group):
            total = x.clone()
            dist.all_reduce(total)
            return total

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    class CopyWithGroupNone(torch.autograd.Function):  # keeps a group, but not the one it was given
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = None
            return x

        @staticmethod
        def backward(ctx, grad):
            total = grad.clone()
            dist.all_reduce(total, group=ctx.group)
            return total, None

    exercise = "04.conjugate_pair"
    _fails(check(exercise, CopyReducingGradInPlace, Reduce), "Copy, 2 ranks", IN_PLACE, "grad.clone()")
    _fails(check(exercise, CopyThroughAnAlias, Reduce), "Copy, 2 ranks", IN_PLACE, "residual")
    _fails(check(exercise, Copy, ReduceOverAllRanks), "Reduce, 3 ranks split into tp groups [0, 1] and [2]", NO_GROUP)
    _fails(check(exercise, CopyWithGroupNone, Reduce), "Copy, 3 ranks split", NO_GROUP)
    assert check(exercise, Copy, Reduce).status == PASS


# ---- 04.column_parallel_linear and 04.row_parallel_linear ----------------------------------


def test_tp_linears_refuse_a_missing_group(ch04):
    from ultrascale.comm.functional import f, f_star

    def column_f_over_everyone(x, weight_shard, bias_shard, group):
        return F.linear(f(x, None), weight_shard, bias_shard)  # None: the default group, all ranks

    def column_own_copy_without_group(x, weight_shard, bias_shard, group):
        class Copy(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x

            @staticmethod
            def backward(ctx, grad):
                total = grad.clone()
                dist.all_reduce(total)  # group= left out
                return total

        return F.linear(Copy.apply(x), weight_shard, bias_shard)

    def row_f_star_over_everyone(x_shard, weight_shard, bias, group):
        return f_star(F.linear(x_shard, weight_shard), None) + bias

    def row_own_reduce_without_group(x_shard, weight_shard, bias, group):
        class Reduce(torch.autograd.Function):
            @staticmethod
            def forward(ctx, partial):
                total = partial.clone()
                dist.all_reduce(total)  # group= left out
                return total

            @staticmethod
            def backward(ctx, grad):
                return grad

        return Reduce.apply(F.linear(x_shard, weight_shard)) + bias

    for wrong in (column_f_over_everyone, column_own_copy_without_group):
        _fails(check("04.column_parallel_linear", wrong), "3 ranks split into tp groups [0, 1] and [2]", NO_GROUP)
    for wrong in (row_f_star_over_everyone, row_own_reduce_without_group):
        _fails(check("04.row_parallel_linear", wrong), "3 ranks split into tp groups [0, 1] and [2]", NO_GROUP)
    assert check("04.column_parallel_linear", ch04["column_parallel_forward"]).status == PASS
    assert check("04.row_parallel_linear", ch04["row_parallel_forward"]).status == PASS


def test_row_parallel_linear_refuses_an_f_star_that_writes_into_its_gradient(ch04):
    def row_with(backward):
        def row_parallel_forward(x_shard, weight_shard, bias, group):
            class Reduce(torch.autograd.Function):
                @staticmethod
                def forward(ctx, partial):
                    total = partial.clone()
                    dist.all_reduce(total, group=group)
                    return total

                @staticmethod
                def backward(ctx, grad):
                    return backward(grad)

            return Reduce.apply(F.linear(x_shard, weight_shard)) + bias

        return row_parallel_forward

    # The two answers give the right gradients here; what they change is the tensor they were given,
    # which the bias' branch (y = f*(partial) + b) and any residual share.
    def doubling_in_place(grad):  # "the bias' branch gets its own copy": it does not, it is the same tensor
        grad.mul_(2)
        return grad / 2

    def halving_in_place(grad):
        grad.div_(2)
        return grad * 2

    for wrong in (doubling_in_place, halving_in_place):
        _fails(check("04.row_parallel_linear", row_with(wrong)), "2 ranks", IN_PLACE)
    assert check("04.row_parallel_linear", ch04["row_parallel_forward"]).status == PASS


# ---- 04.vocab_parallel_cross_entropy -----------------------------------------------------------


def _cross_entropy(
    local_logits, targets, vocab_start, group, max_group="group", shift_in_place=False, sum_group="group"
):
    """The solution's loss, with one of the mistakes below switched on."""
    from ultrascale.comm.functional import f_star

    pick = {"group": group, "none": None}
    local_vocab = local_logits.shape[-1]
    with torch.no_grad():
        top = local_logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=pick[max_group])
        if shift_in_place:
            local_logits -= top.unsqueeze(-1)  # the caller's logits shifted where they stand
    shifted = local_logits if shift_in_place else local_logits - top.unsqueeze(-1)
    mine = (targets >= vocab_start) & (targets < vocab_start + local_vocab)
    index = (targets - vocab_start).clamp(0, local_vocab - 1).unsqueeze(-1)
    target_logit = torch.where(mine, shifted.gather(-1, index).squeeze(-1), 0.0)
    sums = f_star(torch.stack([shifted.exp().sum(-1), target_logit]), pick[sum_group])
    return (sums[0].log() - sums[1]).mean()


def test_vocab_parallel_cross_entropy_refuses_a_missing_group_and_shifted_logits(ch04):
    def maximum_over_everyone(local_logits, targets, vocab_start, group):  # any common shift gives the same loss
        return _cross_entropy(local_logits, targets, vocab_start, group, max_group="none")

    def sums_over_everyone(local_logits, targets, vocab_start, group):
        return _cross_entropy(local_logits, targets, vocab_start, group, sum_group="none")

    def shifted_in_place(local_logits, targets, vocab_start, group):
        return _cross_entropy(local_logits, targets, vocab_start, group, shift_in_place=True)

    def stabilised_in_place(local_logits, targets, vocab_start, group):  # subtracts the max, then the loss
        with torch.no_grad():
            top = local_logits.max(dim=-1, keepdim=True).values
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            local_logits.sub_(top)
        return _cross_entropy(local_logits, targets, vocab_start, group)

    class MeanOverTokens(torch.autograd.Function):  # scales the incoming gradient where it stands
        @staticmethod
        def forward(ctx, per_token):
            ctx.tokens = per_token.numel()
            return per_token.mean()

        @staticmethod
        def backward(ctx, grad):
            grad /= ctx.tokens
            return grad.expand(ctx.tokens)

    class MeanScalingTheLossGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, per_token):
            ctx.tokens = per_token.numel()
            return per_token.sum() / ctx.tokens

        @staticmethod
        def backward(ctx, grad):
            return grad.mul_(1 / ctx.tokens).expand(ctx.tokens)

    def per_token_loss(local_logits, targets, vocab_start, group, mean):
        from ultrascale.comm.functional import f_star

        local_vocab = local_logits.shape[-1]
        with torch.no_grad():
            top = local_logits.max(dim=-1).values
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = local_logits - top.unsqueeze(-1)
        mine = (targets >= vocab_start) & (targets < vocab_start + local_vocab)
        index = (targets - vocab_start).clamp(0, local_vocab - 1).unsqueeze(-1)
        target_logit = torch.where(mine, shifted.gather(-1, index).squeeze(-1), 0.0)
        sums = f_star(torch.stack([shifted.exp().sum(-1), target_logit]), group)
        return mean.apply(sums[0].log() - sums[1])

    exercise = "04.vocab_parallel_cross_entropy"
    for wrong in (maximum_over_everyone, sums_over_everyone):
        _fails(check(exercise, wrong), "3 ranks split into tp groups [0, 1] and [2]", NO_GROUP)
    for wrong in (shifted_in_place, stabilised_in_place):
        _fails(check(exercise, wrong), "changed its argument `local_logits`", "work on a copy")  # the contract
    for mean in (MeanOverTokens, MeanScalingTheLossGradient):
        _fails(check(exercise, lambda *a, mean=mean: per_token_loss(*a, mean)), IN_PLACE)
    assert check(exercise, ch04["vocab_parallel_cross_entropy"]).status == PASS


# ---- 05.sequence_gather_scatter ----------------------------------------------------------


def test_sequence_gather_scatter_refuses_in_place_gradients_and_a_missing_group(ch05):
    Gather, ReduceScatter = ch05["Gather"], ch05["ReduceScatter"]
    gather_along, reduce_scatter_along = ch05["gather_along"], ch05["reduce_scatter_along"]

    class GatherReducingGradInPlace(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dim, group):
            ctx.dim, ctx.group = dim, group
            return gather_along(x, dim, group)

        @staticmethod
        def backward(ctx, grad):  # scales the incoming gradient in place before the reduce-scatter
            grad.mul_(1.0 / dist.get_world_size(ctx.group))
            return reduce_scatter_along(grad, ctx.dim, ctx.group) * dist.get_world_size(ctx.group), None, None

    class GatherNormalisingInPlace(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dim, group):
            ctx.dim, ctx.group = dim, group
            return gather_along(x, dim, group)

        @staticmethod
        def backward(ctx, grad):  # "contiguous first": but .contiguous() of a contiguous grad is grad itself
            front = grad.contiguous()
            front.mul_(2.0)
            return reduce_scatter_along(front, ctx.dim, ctx.group) / 2.0, None, None

    class GatherOverAllRanks(torch.autograd.Function):  # forgets group= in the collectives
        @staticmethod
        def forward(ctx, x, dim, group):
            ctx.dim = dim
            return gather_along(x, dim, None)

        @staticmethod
        def backward(ctx, grad):
            return reduce_scatter_along(grad, ctx.dim, None), None, None

    class GatherOnTheWorld(torch.autograd.Function):  # the world group named, not the one given
        @staticmethod
        def forward(ctx, x, dim, group):
            ctx.dim, ctx.group = dim, group
            return gather_along(x, dim, dist.group.WORLD)

        @staticmethod
        def backward(ctx, grad):
            return reduce_scatter_along(grad, ctx.dim, ctx.group), None, None

    exercise = "05.sequence_gather_scatter"
    for wrong in (GatherReducingGradInPlace, GatherNormalisingInPlace):
        _fails(check(exercise, wrong, ReduceScatter), "Gather, dim 1, 2 ranks", IN_PLACE)
    # (A reduce-scatter over the world crashes gloo instead: the groups' buffers differ in size there.)
    for wrong in (GatherOverAllRanks, GatherOnTheWorld):
        _fails(
            check(exercise, wrong, ReduceScatter),
            "Gather, dim 1, 3 ranks split into tp groups [0, 1] and [2]",
            NO_GROUP,
        )
    assert check(exercise, Gather, ReduceScatter).status == PASS


# ---- 05.sequence_parallel_norm_grads --------------------------------------------------------


def test_sequence_parallel_norm_refuses_hooks_that_overwrite_their_argument_and_a_missing_group(ch05):
    def all_reduce_in_place(module, group):  # the hook's return value is None: PyTorch keeps grad, changed
        return [p.register_hook(lambda grad: dist.all_reduce(grad, group=group)) for p in module.parameters()]

    def all_reduce_and_return_it(module, group):
        def summed(grad):
            dist.all_reduce(grad, group=group)
            return grad

        return [p.register_hook(summed) for p in module.parameters()]

    def over_everyone(module, group):
        def summed(grad):
            total = grad.clone()
            dist.all_reduce(total)  # group= left out
            return total

        return [p.register_hook(summed) for p in module.parameters()]

    def over_group_none(module, group):  # the group saved from a default argument
        def summed(grad, group=None):
            total = grad.clone()
            dist.all_reduce(total, group=group)
            return total

        return [p.register_hook(summed) for p in module.parameters()]

    exercise = "05.sequence_parallel_norm_grads"
    for wrong in (all_reduce_in_place, all_reduce_and_return_it):
        _fails(
            check(exercise, wrong), "2 ranks", "your hook changed the gradient it was given in place", "grad.clone()"
        )
    for wrong in (over_everyone, over_group_none):
        _fails(check(exercise, wrong), "tp groups [0, 1] and [2]", NO_GROUP)
    assert check(exercise, ch05["sync_norm_gradients"]).status == PASS


def test_tp_groups_include_one_whose_ranks_are_not_the_global_ones(ch04):
    """3 ranks cut into [0] and [1, 2]: global rank 1 is rank 0 of its group. Code that takes the
    tp rank to be the global rank modulo the tp size (true where tp groups are [0, 1], [2, 3], ...)
    passes on the groups [0, 1] and [2], and fails there."""

    def start_from_the_global_rank(local_logits, targets, vocab_start, group):
        tp_rank = dist.get_rank() % dist.get_world_size(group)
        return _cross_entropy(local_logits, targets, tp_rank * local_logits.shape[-1], group)

    def start_from_the_rank(local_logits, targets, vocab_start, group):  # dist.get_rank() without the group
        return _cross_entropy(local_logits, targets, dist.get_rank() * local_logits.shape[-1], group)

    exercise = "04.vocab_parallel_cross_entropy"
    _fails(
        check(exercise, start_from_the_global_rank),
        "3 ranks split into tp groups [0] and [1, 2]",
        "rank 1, moderate logits",
        "vocab_start <= target",
    )
    _fails(
        check(exercise, start_from_the_rank),
        "3 ranks split into tp groups [0, 1] and [2]",
        "rank 2, moderate logits",
        "vocab_start <= target",
    )
    assert check(exercise, ch04["vocab_parallel_cross_entropy"]).status == PASS


# ---- 07.one_f_one_b: QUICK keeps the case with fewer micro-batches than stages -------------------


def test_one_f_one_b_quick_has_fewer_micro_batches_than_the_warm_up(ch07):
    def warmup_not_capped(p, m, rank):  # p - 1 - rank forwards even when there are fewer micro-batches
        warmup = p - 1 - rank
        out = [f"F{i}" for i in range(warmup)]
        for i in range(m):
            if warmup + i < m:
                out.append(f"F{warmup + i}")
            out.append(f"B{i}")
        return out

    def drain_from_m_minus_warmup(p, m, rank):  # warm-up, steady state, drain: the drain starts below 0
        warmup = p - 1 - rank
        out = [f"F{i}" for i in range(min(warmup, m))]
        for i in range(m - warmup):
            out += [f"F{warmup + i}", f"B{i}"]
        return out + [f"B{i}" for i in range(m - warmup, m)]

    exercise = "07.one_f_one_b"
    _fails(
        check(exercise, warmup_not_capped, quick=True),
        "p=6, m=2",
        "rank 0: F2, but there are only m=2",
        "more forwards than there are micro-batches",
    )
    _fails(check(exercise, drain_from_m_minus_warmup, quick=True), "p=6, m=2", "'B-3'")
    assert check(exercise, ch07["one_f_one_b_list"], quick=True).status == PASS


# ---- 07.bubble_fraction: timelines where rank 0 is not first and last -----------------------


def test_bubble_refuses_windows_read_off_the_lists(ch07):
    def rank_0_window(spans):  # the step from rank 0's first span to its last
        start, end = spans[0][0][0], spans[0][-1][1]
        busy = sum(b - a for r in spans for a, b in r)
        return (len(spans) * (end - start) - busy) / busy

    def first_and_last_items(spans):  # each rank's spans assumed in time order
        start = min(r[0][0] for r in spans)
        end = max(r[-1][1] for r in spans)
        busy = sum(b - a for r in spans for a, b in r)
        return (len(spans) * (end - start) - busy) / busy

    exercise = "07.bubble_fraction"
    _fails(check(exercise, rank_0_window), "the ranks listed last to first", "over *all* spans")
    _fails(check(exercise, first_and_last_items), "listed newest first", "over *all* spans")
    assert check(exercise, ch07["bubble"]).status == PASS


# ---- 07.stage_step: every transfer on the pipeline group ----------------------------------


def test_stage_step_refuses_transfers_without_the_group(ch07):
    forward, backward = ch07["forward_step"], ch07["backward_step"]

    def forward_without_group(stage, x, group, rank, p, shape, dtype):
        if rank > 0:
            x = torch.empty(shape, dtype=dtype)
            dist.recv(x, src=rank - 1)
            x.requires_grad_()
        output = stage(x)
        return x, output, [dist.isend(output.detach(), dst=rank + 1)] if rank < p - 1 else []

    def backward_without_group(stage_input, output, group, rank, p):
        if rank == p - 1:
            output.backward()
        else:
            grad = torch.empty_like(output)
            dist.recv(grad, src=rank + 1)
            torch.autograd.backward(output, grad)
        return [dist.isend(stage_input.grad, dst=rank - 1)] if rank > 0 else []

    exercise = "07.stage_step"
    _fails(check(exercise, forward_without_group, backward), "forward_step of micro-batch 0", "without group=group")
    _fails(check(exercise, forward, backward_without_group), "backward_step of micro-batch 0", "without group=group")
    assert check(exercise, forward, backward).status == PASS


# ---- 07.split_backward: what B and W compute ---------------------------------------------------


def test_split_backward_refuses_weight_work_in_b_input_work_in_w_and_the_wrong_micro_batch(ch07):
    b_in, w = ch07["backward_input"], ch07["backward_weight"]
    stash, seen = [], []

    def everything_in_b_kept_for_w(output, stage_input, grad_output):  # B does W's work ahead of time
        graph_inputs = [stage_input] + _leaves(output, stage_input)
        grads = torch.autograd.grad(output, graph_inputs, grad_output, retain_graph=True, allow_unused=True)
        stash.append(dict(zip(graph_inputs[1:], grads[1:])))
        return grads[0]

    def w_adding_what_b_kept(output, params, grad_output):
        kept = stash.pop(0)
        for q in params:
            g = kept.get(q)
            if g is not None:
                q.grad = g if q.grad is None else q.grad + g

    def w_as_a_whole_backward(output, params, grad_output):  # recomputes the input's gradient too
        torch.autograd.backward(output, grad_output, retain_graph=True)

    def w_from_the_last_output(output, params, grad_output):  # uses what the last B saw, not its own
        latest = seen[-1]
        grads = torch.autograd.grad(latest[0], params, latest[1], retain_graph=True, allow_unused=True)
        for q, g in zip(params, grads):
            if g is not None:
                q.grad = g if q.grad is None else q.grad + g

    def b_remembering(output, stage_input, grad_output):
        seen.append((output, grad_output))
        return b_in(output, stage_input, grad_output)

    def w_with_ones(output, params, grad_output):  # W from a gradient of ones, not the one received
        return w(output, params, torch.ones_like(grad_output))

    def b_clearing_the_message(output, stage_input, grad_output):  # zeroes the buffer "to reuse it"
        grad = b_in(output, stage_input, grad_output)
        grad_output.zero_()
        return grad

    exercise = "07.split_backward"
    _fails(
        check(exercise, everything_in_b_kept_for_w, w_adding_what_b_kept),
        "B of micro-batch 0",
        "computed the weights' gradients too",
    )
    _fails(check(exercise, b_in, w_as_a_whole_backward), "W of micro-batch 0", "computed the input's gradient again")
    _fails(
        check(exercise, b_remembering, w_from_the_last_output),
        "after W of micro-batch 0",
        "its own output with its own grad_output",
    )
    _fails(check(exercise, b_in, w_with_ones), "after W of micro-batch 0", "its own output with its own grad_output")
    _fails(check(exercise, b_clearing_the_message, w), "changed its argument `grad_output`")  # the contract
    assert check(exercise, b_in, w).status == PASS


def _leaves(output, stage_input) -> list:
    """The leaf tensors that require grad in ``output``'s graph: the stage's weights, to a learner
    who does not have them in B."""
    found, seen, todo = [], set(), [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None and variable is not stage_input:
            found.append(variable)
        todo += [n for n, _ in node.next_functions]
    return found
