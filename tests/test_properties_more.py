"""Issue 53, item 2, for the exercises of ``exercise_tests.properties_more`` (lists of tensors,
traces, clocks, layouts, models, and the mean across ranks): the solutions pass their checks with
the property cases added (graded as every solution is, by test_grading's papermill run of
solutions/), and wrong answers that pass every fixed case (each written as a learner
might, on an assumption the fixed cases happen to satisfy) fail on a drawn input with a message
that names the mistake.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from test_grader_holes import _fails, _load

from ultrascale_grading.exercise_tests import properties_more
from ultrascale_grading.exercise_tests.properties import PROPERTIES
from ultrascale_grading import check

COVERED = {
    "00.mean_across_ranks",
    "01.grad_accumulation",
    "02.assign_buckets",
    "10.memory_filter",
    "a1.timed_median",
    "a1.launched_by",
    "a0.ring_reduce_scatter",
    "a0.ring_all_gather",
    "a0.ring_all_reduce",
    "a0.recursive_doubling",
    "a0.halving_doubling",
    "08.split_sizes",
    "05.sequence_gather_scatter",
    "04.column_parallel_linear",
    "04.row_parallel_linear",
    "10.step1",
    "08.expert_gradients",
    "08.dispatch_combine",
    "04.conjugate_pair",
    "06.ulysses_attention",
    "02.bucket_manager",
}
DRAWN = "the fixed cases pass, but an input they do not cover fails"


def test_every_exercise_here_has_a_property_in_the_merged_table():
    assert set(properties_more.PROPERTIES) == COVERED
    for exercise_id, prop in properties_more.PROPERTIES.items():
        assert PROPERTIES[exercise_id] is prop


# ---- wrong answers that pass every fixed case ---------------------------------------------------


def test_a_mean_made_in_float32_fails_on_float64_and_bf16():
    def mean_across_ranks(ctx, tensor):
        total = tensor.float().clone()  # a copy, so the caller's tensor is safe... and float32
        dist.all_reduce(total, group=ctx.group)
        return total / ctx.world_size

    _fails(check("00.mean_across_ranks", mean_across_ranks), DRAWN, "torch.float64", "no float()")


def test_a_mean_through_view_fails_on_a_transposed_tensor():
    def mean_across_ranks(ctx, tensor):
        flat = tensor.view(-1).clone()  # one flat buffer for the collective
        dist.all_reduce(flat, group=ctx.group)
        return (flat / ctx.world_size).view(tensor.shape)

    _fails(check("00.mean_across_ranks", mean_across_ranks), DRAWN, "transposed, non-contiguous", "RuntimeError")


def test_a_logged_loss_summed_in_float32_fails_on_a_float64_model():
    def accumulate_gradients(model, inputs, targets, grad_acc):
        model.zero_grad()
        total = torch.zeros(())  # float32, as every fixed case's model is
        for x, y in zip(inputs.chunk(grad_acc), targets.chunk(grad_acc)):
            loss = model.loss(x, y) / grad_acc
            loss.backward()
            total += loss.detach()
        return total.item()

    _fails(check("01.grad_accumulation", accumulate_gradients), DRAWN, "torch.float64", "returned loss")


def _buckets_weighing(nbytes):
    def assign_buckets(params, bucket_cap_bytes):
        params = list(params)
        buckets, current, total = [], [], 0
        for p in reversed(params):
            current.append(p)
            total += nbytes(p, params)
            if total >= bucket_cap_bytes:
                buckets.append(current)
                current, total = [], 0
        return buckets + ([current] if current else [])

    return assign_buckets


def test_buckets_weighed_with_the_first_parameters_dtype_fail_on_mixed_dtypes():
    wrong = _buckets_weighing(lambda p, params: p.numel() * params[0].element_size())  # one dtype per model
    _fails(check("02.assign_buckets", wrong), DRAWN, "bfloat16", "its own dtype")


def test_buckets_weighed_by_storage_fail_on_views():
    wrong = _buckets_weighing(lambda p, params: p.untyped_storage().nbytes())
    _fails(check("02.assign_buckets", wrong), DRAWN, "view", "weighed by its storage")


def test_a_memory_filter_with_a_strict_comparison_fails_at_exactly_full():
    from ultrascale.memory import breakdown

    def fitting(model, configs, seq, memory_bytes, headroom):
        usable = memory_bytes * (1 - headroom)
        kept = []
        for c in configs:
            pipeline = dict(schedule=c.schedule, micro_batches=c.gas) if c.pp > 1 else {}
            parts = breakdown(
                model,
                seq=seq,
                micro_batch=c.mbs,
                mixed_precision=True,
                recompute=c.recompute,
                zero_stage=c.zero,
                tp=c.tp,
                dp=c.dp * c.cp,
                pp=c.pp,
                cp=c.cp,
                sequence_parallel=True,
                ep=c.ep,
                **pipeline,
            )
            need = sum(parts[k] for k in ("parameters", "gradients", "optimizer states", "activations"))
            if need < usable:  # room to spare: wrong only at exactly full
                kept.append((c, need))
        return kept

    _fails(check("10.memory_filter", fitting), DRAWN, "needs exactly the usable memory", "need <= usable")


def test_a_median_by_floor_division_fails_between_two_odd_middles():
    def time_median(fn, warmup, repeats, synchronize, clock):
        for _ in range(warmup):
            fn()
        synchronize()
        times = []
        for _ in range(repeats):
            start = clock()
            fn()
            synchronize()
            times.append(clock() - start)
        times.sort()
        middle = len(times) // 2
        return times[middle] if len(times) % 2 else (times[middle - 1] + times[middle]) // 2  # the clock is ints

    _fails(check("a1.timed_median", time_median), DRAWN, "even number of repeats", "not //")


def test_launches_found_by_the_name_cudalaunchkernel_miss_the_driver_api():
    def launched_by(events):
        events = list(events)
        ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
        launches = {e["args"]["correlation"]: e for e in events if e.get("name") == "cudaLaunchKernel"}
        pairs = []
        for k in sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"), key=lambda e: e["ts"]):
            launch = launches.get(k["args"].get("correlation"))
            around = (
                []
                if launch is None
                else [
                    o
                    for o in ops
                    if (o["pid"], o["tid"]) == (launch["pid"], launch["tid"])
                    and o["ts"] <= launch["ts"] <= o["ts"] + o["dur"]
                ]
            )
            pairs.append((k["name"], min(around, key=lambda o: o["dur"])["name"] if around else None))
        return pairs

    _fails(check("a1.launched_by", launched_by), DRAWN, "cuLaunchKernel", "whatever it is called")


def test_a_ring_all_gather_into_a_float32_buffer_fails_on_float64_and_bf16():
    send_recv = _load("a0_collectives_exercises.ipynb")["send_recv"]

    def ring_all_gather(ctx, chunk, numel):
        me, size = ctx.rank, ctx.world_size
        gathered = torch.empty(numel, device=chunk.device)  # float32, as every fixed case's chunks are
        places = torch.tensor_split(gathered, size)
        places[me].copy_(chunk)
        for step in range(size - 1):
            send_recv(places[(me - step) % size], places[(me - step - 1) % size], (me + 1) % size, (me - 1) % size)
        return gathered

    _fails(check("a0.ring_all_gather", ring_all_gather), DRAWN, "torch.float32, expected", "new_empty")


def test_a_ring_all_reduce_through_view_fails_on_a_transposed_tensor():
    a0 = _load("a0_collectives_exercises.ipynb")
    reduce_scatter, all_gather = a0["ring_reduce_scatter"], a0["ring_all_gather"]

    def ring_all_reduce(ctx, tensor):
        flat = tensor.view(-1)  # every fixed case's tensor is contiguous
        return all_gather(ctx, reduce_scatter(ctx, flat), flat.numel()).view(tensor.shape)

    _fails(check("a0.ring_all_reduce", ring_all_reduce), DRAWN, "transposed, non-contiguous", "RuntimeError")


def _split_sizes(needs):
    def split_sizes(chosen, per_rank, group=None):
        n = dist.get_world_size(group)
        send = needs(chosen, per_rank, n).sum(0)
        receive = torch.empty_like(send)
        dist.all_to_all_single(receive, send, group=group)
        return send.tolist(), receive.tolist()

    return split_sizes


def test_split_sizes_with_two_experts_per_rank_built_in_fail_on_one_or_three():
    def needs(chosen, per_rank, n):  # expert e lives on rank e // 2
        return torch.zeros(chosen.shape[0], n, dtype=torch.bool, device=chosen.device).scatter_(1, chosen // 2, True)

    _fails(check("08.split_sizes", _split_sizes(needs)), DRAWN, "experts_per_rank=", "on rank e // ")


def test_split_sizes_stacked_per_token_fail_on_a_rank_without_tokens():
    def needs(chosen, per_rank, n):
        return torch.stack([torch.bincount(row // per_rank, minlength=n) > 0 for row in chosen])

    _fails(check("08.split_sizes", _split_sizes(needs)), DRAWN, "0 token(s) per rank (none: an empty batch)")


def test_a_gather_into_float32_buffers_fails_on_float64_and_bf16():
    from ultrascale.comm.functional import all_gather_into, reduce_scatter_into

    def along(x, dim, group, collective, rows):
        first = x.movedim(dim, 0).contiguous()
        out = torch.empty((rows(first.shape[0]), *first.shape[1:]), device=x.device)  # float32, as the fixed x
        collective(out, first, group)
        return out.movedim(0, dim).contiguous()

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dim, group):
            ctx.dim, ctx.group, ctx.n = dim, group, dist.get_world_size(group)
            return along(x, dim, group, all_gather_into, lambda r: r * ctx.n)

        @staticmethod
        def backward(ctx, grad):
            return along(grad, ctx.dim, ctx.group, reduce_scatter_into, lambda r: r // ctx.n), None, None

    class ReduceScatter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dim, group):
            ctx.dim, ctx.group, ctx.n = dim, group, dist.get_world_size(group)
            return along(x, dim, group, reduce_scatter_into, lambda r: r // ctx.n)

        @staticmethod
        def backward(ctx, grad):
            return along(grad, ctx.dim, ctx.group, all_gather_into, lambda r: r * ctx.n), None, None

    _fails(check("05.sequence_gather_scatter", Gather, ReduceScatter), DRAWN, "torch.float64")


def test_linear_layers_spelled_for_three_axes_fail_on_other_inputs():
    from ultrascale.comm.functional import f, f_star

    def column_parallel_forward(x, weight_shard, bias_shard, group):
        return torch.einsum("bsi,oi->bso", f(x, group), weight_shard) + bias_shard  # (batch, seq, features)

    def row_parallel_forward(x_shard, weight_shard, bias, group):
        return f_star(torch.einsum("bsi,oi->bso", x_shard, weight_shard), group) + bias

    _fails(
        check("04.column_parallel_linear", column_parallel_forward),
        DRAWN,
        "x of shape ()",
        "(1-D: no batch axes)",
        "RuntimeError",
    )
    _fails(check("04.row_parallel_linear", row_parallel_forward), DRAWN, "x of shape ()", "RuntimeError")


def test_step1_with_its_options_in_another_order_fails_when_they_are_passed_by_position():
    def step1_techniques(n_params, gpus, long_sequence=False, moe=False, gpus_per_node=8):  # the flags first
        small = n_params < 10e9
        if gpus >= 1024:
            options = [{"TP", "ZeRO-2"}] if small else [{"TP", "PP", "ZeRO-2"}]
        elif gpus >= 512:
            options = [{"TP", "ZeRO-3"}, {"TP", "DP"}] + ([] if small else [{"PP", "DP"}, {"PP", "ZeRO-1"}])
        elif small:
            options = [{"TP"}, {"ZeRO-3"}, {"DP"}] if gpus <= gpus_per_node else [{"ZeRO-3"}, {"DP"}, {"TP", "DP"}]
        else:
            options = [{"TP", "PP"}, {"TP", "ZeRO-3"}, {"ZeRO-3"}]
        extra = ({"CP"} if long_sequence else set()) | ({"EP"} if moe else set())
        return [o | extra for o in options]

    _fails(check("10.step1", step1_techniques), DRAWN, "passed by position", "gpus_per_node=8, long_sequence=False")


def test_gradients_reduced_in_float32_fail_on_float64_and_bf16():
    def reduce_gradient(grad, expert, data_group, expert_group):
        grad = grad.float().clone()  # sum in float32, whatever the parameters hold
        group = expert_group if expert else data_group
        if group is not None:
            dist.all_reduce(grad, group=group)
        return grad / dist.get_world_size(data_group)

    _fails(check("08.expert_gradients", reduce_gradient), DRAWN, "of torch.float32", "as it was given")


def test_an_moe_layer_combined_token_by_token_fails_on_a_rank_without_tokens():
    from ultrascale.comm.functional import all_to_all
    from ultrascale.moe import apply_experts
    from ultrascale.parallel.expert_parallel import dispatch_plan, exchange_counts

    def ep_forward(tokens, chosen, weights, experts, group=None):
        n = dist.get_world_size(group)
        plan = dispatch_plan(chosen, weights, n, len(experts))
        send = plan.send_counts
        receive = exchange_counts(send, group, tokens.device)
        ids = all_to_all(plan.local_ids, receive, send, group)
        x = all_to_all(tokens[plan.rows], receive, send, group)
        w = all_to_all(plan.weights, receive, send, group)
        back = all_to_all(apply_experts(experts, x, ids, w), send, receive, group)
        # each token's output: the sum of the rows that came back for it
        return torch.stack([back[plan.rows == t].sum(0) for t in range(tokens.shape[0])])

    _fails(check("08.dispatch_combine", ep_forward), DRAWN, "[3, 0, 2] tokens", "stack expects a non-empty")


def test_an_f_star_summing_into_a_float32_buffer_fails_on_float64_and_bf16():
    class Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x

        @staticmethod
        def backward(ctx, grad):
            total = grad.clone()
            dist.all_reduce(total, group=ctx.group)
            return total, None

    class Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            summed = torch.empty(x.shape, device=x.device)  # a fresh buffer... in float32
            summed.copy_(x)
            dist.all_reduce(summed, group=group)
            return summed

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    _fails(check("04.conjugate_pair", Copy, Reduce), DRAWN, "Reduce.apply", "of torch.float32, expected")


def test_ulysses_with_a_softmax_that_keeps_the_maximum_in_fails_on_large_scores():
    import math

    from ultrascale.comm.functional import all_to_all

    def ulysses_attention(q, k, v, group):
        n = dist.get_world_size(group)

        def to_head_group(t):
            b, h, s, d = t.shape
            received = all_to_all(t.reshape(b, n, h // n, s, d).transpose(0, 1), group=group)
            return received.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)

        def to_my_tokens(t):
            b, g, s, d = t.shape
            received = all_to_all(t.reshape(b, g, n, s // n, d).permute(2, 0, 1, 3, 4), group=group)
            return received.transpose(0, 1).reshape(b, n * g, s // n, d)

        q, k, v = to_head_group(q), to_head_group(k), to_head_group(v)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        later = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        weights = scores.masked_fill(later, float("-inf")).exp()  # softmax, written out
        return to_my_tokens(weights / weights.sum(-1, keepdim=True) @ v)

    _fails(check("06.ulysses_attention", ulysses_attention), DRAWN, "size ~40", "Subtract each row's maximum")


def test_a_bucket_manager_with_float32_buffers_fails_on_a_float64_model():
    assign_buckets = _load("02_data_parallelism_exercises.ipynb")["assign_buckets"]

    class BucketManager:
        def __init__(self, params, bucket_cap_bytes, group=None):
            self.group, self.world_size = group, dist.get_world_size(group)
            self.buckets = assign_buckets(params, bucket_cap_bytes)
            self.slots, self.bucket_of, self.buffers = {}, {}, []
            for i, bucket in enumerate(self.buckets):
                offset = 0
                for p in bucket:
                    self.slots[p], self.bucket_of[p] = (offset, offset + p.numel()), i
                    offset += p.numel()
                self.buffers.append(torch.zeros(offset, device=bucket[0].device))  # no dtype: float32
            self.ready, self.handles = [set() for _ in self.buckets], [None] * len(self.buckets)

        def grad_ready(self, param):
            i, (start, end) = self.bucket_of[param], self.slots[param]
            self.buffers[i][start:end].copy_(param.grad.reshape(-1))
            self.ready[i].add(param)
            if len(self.ready[i]) == len(self.buckets[i]):
                self.handles[i] = dist.all_reduce(self.buffers[i], group=self.group, async_op=True)

        def finish(self):
            for i, bucket in enumerate(self.buckets):
                self.handles[i].wait()
                self.buffers[i].div_(self.world_size)
                for p in bucket:
                    start, end = self.slots[p]
                    p.grad.copy_(self.buffers[i][start:end].view_as(p))
                self.ready[i].clear()
                self.handles[i] = None

    _fails(check("02.bucket_manager", BucketManager), DRAWN, "float64", "in their own dtype")
