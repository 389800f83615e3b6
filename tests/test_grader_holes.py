"""The grader cannot be fooled: plausible wrong answers fail, the solutions still pass.

Each test submits a wrong answer a learner could write (defined inside the test, so that
cloudpickle ships it by value to the ranks) and expects a failure whose message says
what to fix; the solution notebook's own answer must still pass.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import nbformat
import torch
import torch.distributed as dist

from ultrascale_grading import FAIL, PASS, check

torch.set_num_threads(1)
SOLUTIONS = Path(__file__).resolve().parents[1] / "solutions"
KINDS = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)


def _load(notebook: str) -> dict:
    """The imports, functions and classes of a solution notebook (demos and checks left out)."""
    namespace = {"__name__": "__main__"}  # cloudpickle sends __main__ functions by value
    for cell in nbformat.read(SOLUTIONS / notebook, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        body = [node for node in ast.parse(cell.source).body if isinstance(node, KINDS)]
        exec(compile(ast.Module(body=body, type_ignores=[]), notebook, "exec"), namespace)
    return namespace


def _fails(result, *phrases):
    assert result.status == FAIL, result
    for phrase in phrases:
        assert phrase in result.message, f"{phrase!r} not in:\n{result.message}"


# ---- 02: a synchronous all-reduce in the hook does not overlap -------------------------


def test_overlapped_hooks_refuse_a_synchronous_all_reduce(ch02):
    class SyncInHook:
        def __init__(self, module, group=None):
            self.group, self.params = group, []
            for p in module.parameters():
                p.register_post_accumulate_grad_hook(self.grad_ready)

        def grad_ready(self, param):
            dist.all_reduce(param.grad, group=self.group)  # blocks backward until done
            self.params.append(param)

        def finish(self):
            for p in self.params:
                p.grad.div_(dist.get_world_size(self.group))
            self.params.clear()

    class WaitInHook(SyncInHook):
        def grad_ready(self, param):
            dist.all_reduce(param.grad, group=self.group, async_op=True).wait()
            self.params.append(param)

    _fails(check("02.overlapped_dp_hooks", SyncInHook), "synchronous", "async_op=True")
    _fails(check("02.overlapped_dp_hooks", WaitInHook), "waited for during backward")
    assert check("02.overlapped_dp_hooks", ch02["OverlappedGradSync"]).status == PASS


def test_bucket_manager_refuses_a_synchronous_all_reduce(ch02):
    Solution = ch02["BucketManager"]

    class SyncBuckets(Solution):
        def grad_ready(self, param):
            i = self.bucket_of[param]
            start, end = self.slots[param]
            self.buffers[i][start:end].view_as(param).copy_(param.grad)
            self.ready[i].add(param)
            if len(self.ready[i]) == len(self.buckets[i]):
                dist.all_reduce(self.buffers[i], group=self.group)
                self.handles[i] = self  # finish() waits on it: nothing to wait for

        def wait(self):
            pass

    _fails(check("02.bucket_manager", SyncBuckets), "synchronous", "bucket")
    assert check("02.bucket_manager", Solution).status == PASS


def test_assign_buckets_refuses_buckets_closed_before_the_cap_and_a_strict_comparison(ch02):
    def close_before_passing(params, bucket_cap_bytes):  # never over the cap: more, smaller buckets
        buckets, current, size = [], [], 0
        for p in reversed(list(params)):
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > bucket_cap_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        return buckets + [current] if current else buckets

    def strictly_over(params, bucket_cap_bytes):  # > where DDP has >=: a bucket at the cap stays open
        buckets, current, size = [], [], 0
        for p in reversed(list(params)):
            current.append(p)
            size += p.numel() * p.element_size()
            if size > bucket_cap_bytes:
                buckets.append(current)
                current, size = [], 0
        return buckets + [current] if current else buckets

    _fails(check("02.assign_buckets", close_before_passing), "expected buckets", "reach the cap")
    _fails(check("02.assign_buckets", strictly_over), "expected buckets", "reach the cap")
    assert check("02.assign_buckets", ch02["assign_buckets"]).status == PASS


def test_dp_exercises_refuse_the_librarys_data_parallel(ch02):
    from torch import nn

    from ultrascale.parallel import BucketedDataParallel, OverlappedDataParallel
    from ultrascale.parallel.data_parallel import Bucket

    class LibraryBuckets:  # the library's wrapper registers its own hooks and buckets
        def __init__(self, params, bucket_cap_bytes, group=None):
            holder = nn.Module()
            holder.params = nn.ParameterList(params)
            self.ddp = BucketedDataParallel(
                holder, bucket_cap_mb=bucket_cap_bytes / 2**20, group=group, broadcast=False
            )
            self.buckets = [b.params for b in self.ddp.buckets]

        def grad_ready(self, param):
            pass

        def finish(self):
            self.ddp.finish_gradient_synchronization()

    class LibraryBufferBuckets(ch02["BucketManager"]):  # the library's Bucket as the flat buffer
        def __init__(self, params, bucket_cap_bytes, group=None):
            super().__init__(params, bucket_cap_bytes, group)
            flat = [Bucket(i, b, b[0].dtype, b[0].device) for i, b in enumerate(self.buckets)]
            self.buffers = [b.buffer for b in flat]
            self.slots = {p: b.offsets[p] for b in flat for p in b.params}

    class LibraryHooks:
        def __init__(self, module, group=None):
            self.ddp = OverlappedDataParallel(module, group=group, broadcast=False)

        def finish(self):
            self.ddp.finish_gradient_synchronization()

    refused = "your code called the course library's ultrascale.parallel.data_parallel."
    _fails(check("02.bucket_manager", LibraryBuckets), refused + "Bucket.__init__")  # its buckets
    _fails(check("02.bucket_manager", LibraryBufferBuckets), refused + "Bucket.__init__")
    _fails(check("02.overlapped_dp_hooks", LibraryHooks), refused + "DataParallel._all_reduce")
    # The library is itself again on the ranks afterwards. (That the solutions still pass under
    # the refusal: the tests above and the grader's run of solutions/ in test_grading.py.)
    from ultrascale.runtime import shared_cluster

    flat = shared_cluster(2).run(lambda ctx: Bucket(0, [torch.zeros(3)], torch.float32, "cpu").buffer.numel())
    assert flat == [3, 3]


# ---- a0: the ring, not the same bytes sent straight to their owner ----------------------


def _ring_reduce_scatter(exchange):
    """A ring reduce-scatter whose every step moves its chunks with ``exchange(me, out, incoming,
    right, left)``. (The function it returns is local, so cloudpickle ships it by value.)"""

    def ring_reduce_scatter(ctx, tensor):
        me, n = ctx.rank, ctx.world_size
        right, left = (me + 1) % n, (me - 1) % n
        parts = [part.clone() for part in torch.tensor_split(tensor, n)]
        for step in range(n - 1):
            out, target = parts[(me - step - 1) % n], parts[(me - step - 2) % n]
            incoming = torch.empty_like(target)
            exchange(me, out, incoming, right, left)
            target += incoming
        return parts[me]

    return ring_reduce_scatter


def test_ring_collectives_refuse_direct_sends(a0):
    send_recv = a0["send_recv"]

    def exchange(ctx, outgoing, incoming):
        """Post every send and receive (peer -> tensor), then wait: no deadlock."""
        ops = [dist.P2POp(dist.isend, t, peer) for peer, t in outgoing.items() if t.numel()]
        ops += [dist.P2POp(dist.irecv, t, peer) for peer, t in incoming.items() if t.numel()]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def ring_reduce_scatter(ctx, tensor):  # every chunk straight to the rank that owns it
        me, n = ctx.rank, ctx.world_size
        parts = torch.tensor_split(tensor, n)
        mine = parts[me].clone()
        incoming = {q: torch.empty_like(mine) for q in range(n) if q != me}
        exchange(ctx, {q: parts[q].contiguous() for q in range(n) if q != me}, incoming)
        for t in incoming.values():
            mine += t
        return mine

    def ring_all_gather(ctx, chunk, numel):  # own chunk straight to every other rank
        me, n = ctx.rank, ctx.world_size
        out = chunk.new_empty(numel)
        places = torch.tensor_split(out, n)
        places[me].copy_(chunk)
        exchange(ctx, {q: chunk for q in range(n) if q != me}, {q: places[q] for q in range(n) if q != me})
        return out

    def ring_all_reduce(ctx, tensor):
        flat = tensor.reshape(-1)
        return ring_all_gather(ctx, ring_reduce_scatter(ctx, flat), flat.numel()).reshape(tensor.shape)

    def in_halves(me, out, incoming, right, left):  # a ring, but each chunk in two messages
        for a, b in zip(torch.tensor_split(out, 2), torch.tensor_split(incoming, 2)):
            send_recv(a, b, right, left)

    halves_reduce_scatter = _ring_reduce_scatter(in_halves)

    for exercise, wrong, right in [
        ("a0.ring_reduce_scatter", ring_reduce_scatter, "ring_reduce_scatter"),
        ("a0.ring_all_gather", ring_all_gather, "ring_all_gather"),
        ("a0.ring_all_reduce", ring_all_reduce, "ring_all_reduce"),
    ]:
        _fails(check(exercise, wrong), "sent messages to ranks", "right neighbour")
        assert check(exercise, a0[right]).status == PASS, exercise
    _fails(check("a0.ring_reduce_scatter", halves_reduce_scatter), "N-1 = 1 step", "do not split a chunk")


# ---- 03: the gathered parameters must really be freed -----------------------------------


def test_zero3_refuses_gathered_memory_kept_in_a_closure(ch03):
    all_gather_into = ch03["all_gather_into"]

    def install_zero3_hooks(ctx, module):
        cache = []  # outlives the forward: the full parameters stay in memory

        def gather(module, args):
            shard = module.zero3_shard
            full = torch.empty(shard.numel() * ctx.world_size, dtype=shard.dtype)
            all_gather_into(full, shard)
            cache.append(full)
            for p, offset, shape in module.zero3_layout:
                p.data = full[offset : offset + math.prod(shape)].view(shape)

        def free(module, args, output):
            for p, _, _ in module.zero3_layout:
                p.data = torch.empty(0, dtype=p.dtype)

        return [module.register_forward_pre_hook(gather), module.register_forward_hook(free)]

    _fails(check("03.zero3_gather_free", install_zero3_hooks), "still alive", "closure")
    assert check("03.zero3_gather_free", ch03["install_zero3_hooks"]).status == PASS


# ---- 00: the input tensor stays unchanged ----------------------------------------------


def test_mean_across_ranks_refuses_an_in_place_all_reduce(ch00):
    def mean_across_ranks(ctx, tensor):
        dist.all_reduce(tensor, group=ctx.group)
        return tensor / ctx.world_size

    _fails(check("00.mean_across_ranks", mean_across_ranks), "changed its argument `tensor`", "clone()")  # the contract
    assert check("00.mean_across_ranks", ch00["mean_across_ranks"]).status == PASS


# ---- an expected ValueError: which input, and what was expected --------------------------


def test_an_unexpected_exception_names_the_input_and_the_expected_value_error(ch00, ch01, ch02):
    def pipeline_stage_layers(num_layers, pp_degree):  # no check: divides by zero for pp_degree=0
        share, remainder = divmod(num_layers, pp_degree)
        return [share + (stage < remainder) for stage in range(pp_degree)]

    _fails(
        check("00.pipeline_stage_layers", pipeline_stage_layers),
        "pipeline_stage_layers(4, 0) raised ZeroDivisionError",
        "expected a ValueError",
    )

    def activation_memory(layers, hidden, heads, seq, micro_batch, recompute="none"):
        factor = {"none": 34 + 5 * heads * seq / hidden, "selective": 34, "full": 2}[recompute]  # KeyError
        return layers * seq * micro_batch * hidden * factor

    _fails(
        check("01.activation_memory", activation_memory),
        "activation_memory(2, 64, 4, 128, 1, 'partial') raised KeyError",
        "expected a ValueError",
    )

    def grad_acc_steps(gbs_tokens, seq_len, mbs, dp):
        gbs = 2 ** round(math.log2(gbs_tokens / seq_len))
        grad_acc = gbs // (mbs * dp)  # 0 when GPU-rich
        if gbs % grad_acc:  # meant gbs % (mbs * dp): a modulo by zero when GPU-rich
            raise ValueError("mbs x dp does not divide the global batch")
        return grad_acc

    _fails(check("02.grad_acc_steps", grad_acc_steps), "raised ZeroDivisionError", "expected a ValueError (")
    for exercise, name in [
        ("00.pipeline_stage_layers", "pipeline_stage_layers"),
        ("01.activation_memory", "activation_memory"),
        ("02.grad_acc_steps", "grad_acc_steps"),
    ]:
        solutions = {**ch00, **ch01, **ch02}
        assert check(exercise, solutions[name]).status == PASS, exercise


# ---- the library's own implementation is not an answer -----------------------------------


def test_calling_the_library_implementation_is_refused(ch01, ch02):
    from ultrascale.batch_size import plan_batch, samples_per_step
    from ultrascale.memory import activation_bytes
    from ultrascale.model import GPTConfig, count_params
    from ultrascale.parallel import build_buckets

    def gpt_param_count(hidden, vocab, layers, tied=True):
        config = GPTConfig(vocab_size=vocab, hidden=hidden, layers=layers, heads=1)
        return count_params(config) + (0 if tied else hidden * vocab)

    def activation_memory(layers, hidden, heads, seq, micro_batch, recompute="none"):
        from types import SimpleNamespace

        return activation_bytes(SimpleNamespace(layers=layers, hidden=hidden, heads=heads), seq, micro_batch, recompute)

    def grad_acc_steps(gbs_tokens, seq_len, mbs, dp):
        gbs = samples_per_step(gbs_tokens, seq_len)
        if mbs * dp > gbs or gbs % (mbs * dp):
            raise ValueError("no whole number of micro-batches")
        return gbs // (mbs * dp)

    def grad_acc_from_plan(gbs_tokens, seq_len, mbs, dp):  # through another library function
        plan = plan_batch(gbs_tokens, seq_len, mbs, dp)
        if plan.gpu_rich or plan.achieved_gbs != plan.gbs:
            raise ValueError("no whole number of micro-batches")
        return plan.grad_acc

    def assign_buckets(params, bucket_cap_bytes):
        return build_buckets(list(reversed(list(params))), bucket_cap_bytes)

    for exercise, wrong, name in [
        ("01.param_count", gpt_param_count, "ultrascale.model.count_params"),
        ("01.activation_memory", activation_memory, "ultrascale.memory.activation_bytes"),
        ("02.grad_acc_steps", grad_acc_steps, "ultrascale.batch_size.samples_per_step"),
        ("02.grad_acc_steps", grad_acc_from_plan, "ultrascale.batch_size.samples_per_step"),
        ("02.assign_buckets", assign_buckets, "ultrascale.parallel.data_parallel.build_buckets"),
    ]:
        _fails(
            check(exercise, wrong), f"{exercise}: your code called the course library's {name}", "compute it yourself"
        )
    # the library is itself again afterwards, and the solutions pass
    assert count_params(GPTConfig(vocab_size=10, hidden=4, layers=1, heads=1)) == 4 * 10 + 12 * 16 + 13 * 4 + 8
    assert samples_per_step(4e6, 4096) == 1024
    for exercise, name in [
        ("01.param_count", "gpt_param_count"),
        ("01.activation_memory", "activation_memory"),
        ("02.grad_acc_steps", "grad_acc_steps"),
        ("02.assign_buckets", "assign_buckets"),
    ]:
        assert check(exercise, {**ch01, **ch02}[name]).status == PASS, exercise


# ---- 04 and 05: tensor and sequence parallelism -------------------------------------------


def test_tp_conjugate_pair_refuses_collectives_in_the_wrong_direction(ch04):
    Copy, Reduce = ch04["Copy"], ch04["Reduce"]

    class CopyReducingBothWays(torch.autograd.Function):  # f that all-reduces in forward too
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            total = x.clone()
            dist.all_reduce(total, group=group)
            return total

        @staticmethod
        def backward(ctx, grad):
            total = grad.clone()
            dist.all_reduce(total, group=ctx.group)
            return total, None

    class CopyWithoutReduce(torch.autograd.Function):  # identity both ways
        @staticmethod
        def forward(ctx, x, group):
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    class CopyOverAllRanks(torch.autograd.Function):  # forgets group=
        @staticmethod
        def forward(ctx, x, group):
            return x

        @staticmethod
        def backward(ctx, grad):
            total = grad.clone()
            dist.all_reduce(total)
            return total, None

    class CopyGatheringGradients(torch.autograd.Function):  # right sum, wrong collective
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x

        @staticmethod
        def backward(ctx, grad):
            parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
            dist.all_gather(parts, grad.contiguous(), group=ctx.group)
            return sum(parts), None

    class ReduceBothWays(torch.autograd.Function):  # f* that also all-reduces in backward
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            total = x.clone()
            dist.all_reduce(total, group=group)
            return total

        @staticmethod
        def backward(ctx, grad):
            total = grad.clone()
            dist.all_reduce(total, group=ctx.group)
            return total, None

    class ReduceInPlace(torch.autograd.Function):  # overwrites the caller's tensor
        @staticmethod
        def forward(ctx, x, group):
            dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    _fails(
        check("04.conjugate_pair", CopyReducingBothWays, Reduce),
        "Copy, 2 ranks",
        "returned the sum of x over the ranks",
        "identity in forward",
    )
    _fails(
        check("04.conjugate_pair", CopyWithoutReduce, Reduce),
        "own upstream gradient",
        "all-reduce (sum) the gradient in backward",
    )
    _fails(check("04.conjugate_pair", CopyOverAllRanks, Reduce), "tp groups [0, 1] and [2]", "group=group")
    _fails(
        check("04.conjugate_pair", CopyGatheringGradients, Reduce),
        "the backward called all_gather",
        "exactly one all-reduce",
    )
    _fails(
        check("04.conjugate_pair", Copy, ReduceBothWays),
        "Reduce, 2 ranks",
        "backward all-reduced the gradient",
        "f*'s backward is the identity",
    )
    _fails(check("04.conjugate_pair", Copy, ReduceInPlace), "changed its input x in place", "x.clone()")
    assert check("04.conjugate_pair", Copy, Reduce).status == PASS


def test_tp_column_parallel_linear_needs_f(ch04):
    import torch.nn.functional as F

    from ultrascale.comm.functional import f, f_star, gather_along_dim

    def without_f(x, weight_shard, bias_shard, group):
        return F.linear(x, weight_shard, bias_shard)

    def with_f_star(x, weight_shard, bias_shard, group):
        return F.linear(f_star(x, group), weight_shard, bias_shard)

    def gathering_the_output(x, weight_shard, bias_shard, group):
        return gather_along_dim(F.linear(f(x, group), weight_shard, bias_shard), -1, group)

    _fails(check("04.column_parallel_linear", without_f), "x.grad holds only this rank's share", "route x through f")
    _fails(check("04.column_parallel_linear", with_f_star), "2 times too large", "f is the identity in forward")
    _fails(check("04.column_parallel_linear", gathering_the_output), "all 8 output features", "only this rank's slice")
    assert check("04.column_parallel_linear", ch04["column_parallel_forward"]).status == PASS


def test_tp_row_parallel_linear_adds_the_bias_once_after_the_sum(ch04):
    import torch.nn.functional as F

    from ultrascale.comm.functional import f_star

    def bias_before_the_sum(x_shard, weight_shard, bias, group):
        return f_star(F.linear(x_shard, weight_shard, bias), group)

    def no_sum(x_shard, weight_shard, bias, group):
        return F.linear(x_shard, weight_shard) + bias

    def bias_on_rank_0_only(x_shard, weight_shard, bias, group):
        partial = F.linear(x_shard, weight_shard)
        if dist.get_rank(group) == 0:
            partial = partial + bias
        return f_star(partial, group)

    def plain_all_reduce(x_shard, weight_shard, bias, group):  # no backward formula: autograd warns
        partial = F.linear(x_shard, weight_shard)
        dist.all_reduce(partial, group=group)
        return partial + bias

    _fails(check("04.row_parallel_linear", bias_before_the_sum), "the bias is counted 2 times", "after the all-reduce")
    _fails(check("04.row_parallel_linear", no_sum), "partial product only", "f_star")
    _fails(check("04.row_parallel_linear", bias_on_rank_0_only), "rank 1", "bias.grad is None on this rank")
    _fails(
        check("04.row_parallel_linear", plain_all_reduce),
        "dist.all_reduce directly on a tensor that autograd tracks",
        "f_star(y, group)",
    )
    assert check("04.row_parallel_linear", ch04["row_parallel_forward"]).status == PASS


def test_vocab_parallel_cross_entropy_refuses_gathered_logits_and_local_maxima(ch04):
    import torch.nn.functional as F

    from ultrascale.comm.functional import f_star, gather_along_dim

    def gathering_the_logits(local_logits, targets, vocab_start, group):
        return F.cross_entropy(gather_along_dim(local_logits, -1, group), targets)

    def summing_padded_logits(local_logits, targets, vocab_start, group):  # the full logits on every rank
        full = local_logits.new_zeros(local_logits.shape[0], local_logits.shape[1] * dist.get_world_size(group))
        full[:, vocab_start : vocab_start + local_logits.shape[1]] = local_logits
        return F.cross_entropy(f_star(full, group), targets)

    def cross_entropy(local_logits, targets, vocab_start, group, shift="global", last=False):
        local_vocab = local_logits.shape[-1]
        with torch.no_grad():
            top = local_logits.max(dim=-1).values
            if shift == "global":
                dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            elif shift == "none":
                top.zero_()
        shifted = local_logits - top.unsqueeze(-1)
        end = vocab_start + local_vocab + (1 if last else 0)  # last: the next slice's first id counted too
        mine = (targets >= vocab_start) & (targets < end)
        index = (targets - vocab_start).clamp(0, local_vocab - 1).unsqueeze(-1)
        target_logit = torch.where(mine, shifted.gather(-1, index).squeeze(-1), 0.0)
        sums = f_star(torch.stack([shifted.exp().sum(-1), target_logit]), group)
        return (sums[0].log() - sums[1]).mean()

    def own_maximum(local_logits, targets, vocab_start, group):
        return cross_entropy(local_logits, targets, vocab_start, group, shift="local")

    def no_maximum(local_logits, targets, vocab_start, group):
        return cross_entropy(local_logits, targets, vocab_start, group, shift="none")

    def off_by_one(local_logits, targets, vocab_start, group):
        return cross_entropy(local_logits, targets, vocab_start, group, last=True)

    exercise = "04.vocab_parallel_cross_entropy"
    _fails(check(exercise, gathering_the_logits), "all_gather", "that gathers the logits")
    _fails(check(exercise, summing_padded_logits), "all_reduce", "as much as its whole slice of the logits")
    _fails(check(exercise, own_maximum), "every rank subtracted its own maximum", "op=dist.ReduceOp.MAX")
    _fails(check(exercise, no_maximum), "logits of size ~1e3", "the loss is inf", "subtract the maximum")
    _fails(check(exercise, off_by_one), "count the target's logit on the one rank whose slice holds it")
    assert check(exercise, ch04["vocab_parallel_cross_entropy"]).status == PASS


def test_sequence_gather_scatter_refuses_all_reduce_and_slice(ch05):
    Gather, ReduceScatter = ch05["Gather"], ch05["ReduceScatter"]
    gather_along, reduce_scatter_along = ch05["gather_along"], ch05["reduce_scatter_along"]

    def all_reduce_and_slice(x, dim, group):  # the right numbers, twice the traffic
        total = x.clone()
        dist.all_reduce(total, group=group)
        piece = x.shape[dim] // dist.get_world_size(group)
        return total.narrow(dim, dist.get_rank(group) * piece, piece).contiguous()

    class GatherAllReducingBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dim, group):
            ctx.dim, ctx.group = dim, group
            return gather_along(x, dim, group)

        @staticmethod
        def backward(ctx, grad):
            return all_reduce_and_slice(grad, ctx.dim, ctx.group), None, None

    class ReduceScatterAllReducing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dim, group):
            ctx.dim, ctx.group = dim, group
            return all_reduce_and_slice(x, dim, group)

        @staticmethod
        def backward(ctx, grad):
            return gather_along(grad, ctx.dim, ctx.group), None, None

    class GatherAlongDim0(torch.autograd.Function):  # ignores dim
        @staticmethod
        def forward(ctx, x, dim, group):
            ctx.dim, ctx.group = dim, group
            return gather_along(x, 0, group)

        @staticmethod
        def backward(ctx, grad):
            return reduce_scatter_along(grad, 0, ctx.group), None, None

    class GatherKeepingOwnGradient(torch.autograd.Function):  # no sum over ranks in backward
        @staticmethod
        def forward(ctx, x, dim, group):
            ctx.dim, ctx.group = dim, group
            return gather_along(x, dim, group)

        @staticmethod
        def backward(ctx, grad):
            piece = grad.shape[ctx.dim] // dist.get_world_size(ctx.group)
            return grad.narrow(ctx.dim, dist.get_rank(ctx.group) * piece, piece).contiguous(), None, None

    exercise = "05.sequence_gather_scatter"
    _fails(
        check(exercise, GatherAllReducingBackward, ReduceScatter),
        "Gather, dim 1",
        "the backward all-reduced the whole tensor and kept one slice",
        "double the traffic",
    )
    _fails(
        check(exercise, Gather, ReduceScatterAllReducing),
        "ReduceScatter, dim 1",
        "the forward all-reduced the whole tensor and kept one slice",
        "double the traffic",
    )
    _fails(check(exercise, GatherAlongDim0, ReduceScatter), "concatenated along dim 0", "movedim(1, 0)")
    _fails(
        check(exercise, GatherKeepingOwnGradient, ReduceScatter),
        "slice of its own upstream gradient",
        "a reduce-scatter",
    )
    assert check(exercise, Gather, ReduceScatter).status == PASS


def test_sequence_parallel_norm_hooks_sum_before_accumulation(ch05):
    def after_accumulation(module, group):  # right after one micro-batch, wrong after two
        return [
            p.register_post_accumulate_grad_hook(lambda p: dist.all_reduce(p.grad, group=group))
            for p in module.parameters()
        ]

    def no_hooks(module, group):
        return []

    def averaging(module, group):
        def mean_over_ranks(grad):
            total = grad.clone()
            dist.all_reduce(total, group=group)
            return total / dist.get_world_size(group)

        return [p.register_hook(mean_over_ranks) for p in module.parameters()]

    exercise = "05.sequence_parallel_norm_grads"
    _fails(
        check(exercise, after_accumulation),
        "after 2 backward passes",
        "counts the first micro-batch 2 times",
        "before it is accumulated",
    )
    _fails(check(exercise, no_hooks), "only the contribution of this rank's tokens", "register_hook")
    _fails(check(exercise, averaging), "the average over the 2 tp ranks", "no division")
    assert check(exercise, ch05["sync_norm_gradients"]).status == PASS


def test_tp_exercises_refuse_the_library_answer(ch04, ch05):
    import torch.nn.functional as F

    from ultrascale.parallel.tensor_parallel import ColumnParallelLinear
    from ultrascale.parallel.vocab_parallel import VocabParallelLogits
    from ultrascale.parallel.vocab_parallel import vocab_parallel_cross_entropy as library_loss

    def column_parallel_forward(x, weight_shard, bias_shard, group):
        return ColumnParallelLinear(weight_shard, bias_shard, group)(x)

    def through_the_library(local_logits, targets, vocab_start, group):
        return library_loss(local_logits, targets, vocab_start, group)

    def through_sharded_logits(local_logits, targets, vocab_start, group):
        return F.cross_entropy(VocabParallelLogits.wrap(local_logits, vocab_start, group), targets)

    def sync_norm_gradients(module, group):
        from ultrascale.parallel.sequence_parallel import sum_gradient_over_tp

        for p in module.parameters():
            sum_gradient_over_tp(p, group)

    _fails(
        check("04.column_parallel_linear", column_parallel_forward),
        "the course library's",
        "ColumnParallelLinear is the answer",
    )
    for wrong in (through_the_library, through_sharded_logits):
        _fails(
            check("04.vocab_parallel_cross_entropy", wrong),
            "the course library's ultrascale.parallel.vocab_parallel.",
            "compute it yourself",
        )

    def through_the_shared_helper(module, group):  # what sum_gradient_over_tp calls
        from ultrascale.parallel.grad_sync import sync_in_backward

        sync_in_backward(list(module.parameters()), group, divide_by=1, keep_as="_mine")

    _fails(
        check("05.sequence_parallel_norm_grads", sync_norm_gradients),
        "sum_gradient_over_tp",
        "register the hooks yourself",
    )
    _fails(
        check("05.sequence_parallel_norm_grads", through_the_shared_helper),
        "sync_in_backward",
        "register the hooks yourself",
    )

    def through_sp_form(module, group):  # what apply_tp(sequence_parallel=True) does to a norm
        from ultrascale.parallel.sequence_parallel import sum_norm_gradients

        sum_norm_gradients(module, group)

    _fails(
        check("05.sequence_parallel_norm_grads", through_sp_form), "sum_norm_gradients", "register the hooks yourself"
    )
    # the library works again afterwards, and the solutions pass
    assert check("04.vocab_parallel_cross_entropy", ch04["vocab_parallel_cross_entropy"]).status == PASS
    assert check("05.sequence_parallel_norm_grads", ch05["sync_norm_gradients"]).status == PASS


def test_activation_memory_refuses_the_wrong_splits(ch05):
    def split(config, seq, micro_batch, tp=1, sequence_parallel=False, recompute="none"):
        return ch05["activation_bytes_per_rank"](config, seq, micro_batch, tp, sequence_parallel, recompute)

    def tp_divides_everything(config, seq, micro_batch, tp=1, sequence_parallel=False, recompute="none"):
        return split(config, seq, micro_batch, tp, True, recompute)  # as if TP alone split the norms too

    def sp_changes_nothing(config, seq, micro_batch, tp=1, sequence_parallel=False, recompute="none"):
        return split(config, seq, micro_batch, tp, sequence_parallel and recompute == "full", recompute)

    def scores_not_split(config, seq, micro_batch, tp=1, sequence_parallel=False, recompute="none"):
        sbh = seq * micro_batch * config.hidden
        scores = 0 if recompute == "selective" else 5 * config.heads * seq * seq * micro_batch
        if recompute == "full":
            return config.layers * 2 * sbh / (tp if sequence_parallel else 1)
        linear = 34 * sbh / tp if sequence_parallel else 10 * sbh + 24 * sbh / tp
        return config.layers * (linear + scores)  # the heads are split, so are the scores

    def full_always_split(config, seq, micro_batch, tp=1, sequence_parallel=False, recompute="none"):
        return split(config, seq, micro_batch, tp, sequence_parallel or recompute == "full", recompute)

    def one_layer(config, seq, micro_batch, tp=1, sequence_parallel=False, recompute="none"):
        return split(config, seq, micro_batch, tp, sequence_parallel, recompute) / config.layers

    def right_at_powers_of_two_only(config, seq, micro_batch, tp=1, sequence_parallel=False, recompute="none"):
        return split(config, seq, micro_batch, tp, sequence_parallel, recompute) // 1 if tp != 3 else 0

    def library(config, seq, micro_batch, tp=1, sequence_parallel=False, recompute="none"):
        from ultrascale.memory import activation_bytes

        return activation_bytes(config, seq, micro_batch, recompute, tp, sequence_parallel)

    exercise = "05.activation_memory"
    _fails(check(exercise, tp_divides_everything), "sequence_parallel=False", "leaves 10·s·b·h bytes per layer whole")
    _fails(check(exercise, sp_changes_nothing), "sequence_parallel=True", "every term divides by tp")
    _fails(check(exercise, scores_not_split), "split by heads", "divide them by tp as well")
    _fails(check(exercise, full_always_split), "recompute='full'", "whole on every rank under TP alone")
    _fails(check(exercise, one_layer), "multiply by the number of layers")
    _fails(check(exercise, right_at_powers_of_two_only), "tp=3")
    _fails(check(exercise, library), "your code called the course library's ultrascale.memory.activation_bytes")
    assert check(exercise, ch05["activation_bytes_per_rank"]).status == PASS


# ---- 12: mixed precision ---------------------------------------------------------------------


def _fields(x, exponent_bits, mantissa_bits, mask=True):
    bits = 1 + exponent_bits + mantissa_bits
    raw = int(x.reshape(1).view({32: torch.int32, 16: torch.int16, 8: torch.uint8}[bits]).item())
    raw = raw & ((1 << bits) - 1) if mask else raw
    return raw >> (bits - 1), (raw >> mantissa_bits) & ((1 << exponent_bits) - 1), raw & ((1 << mantissa_bits) - 1)


def test_ch12_decode_float_refuses_signed_bits_float32_fields_and_wrong_widths(ch12):
    widths = {
        torch.float32: (8, 23),
        torch.float16: (5, 10),
        torch.bfloat16: (8, 7),
        torch.float8_e4m3fn: (4, 3),
        torch.float8_e5m2: (5, 2),
    }

    def signed(x):  # the signed view, never masked: a negative number's sign comes out as -1
        return _fields(x, *widths[x.dtype], mask=False)

    def via_float32(x):  # converted first: these are float32's fields
        return _fields(x.float(), 8, 23)

    def by_width(x):  # 16 bits taken to mean float16's layout, bfloat16 included
        return _fields(x, *{32: (8, 23), 16: (5, 10), 8: widths[x.dtype]}[torch.finfo(x.dtype).bits])

    def library(x):
        from ultrascale.precision import decode

        f = decode(x)
        return f.sign, f.exponent, f.mantissa

    _fails(check("12.decode_float", signed), "sign came out as -1", "Mask it")
    _fails(check("12.decode_float", via_float32), "converted to float32", "x.view(")
    _fails(check("12.decode_float", by_width), "5 exponent and 10 mantissa bits", "torch.bfloat16 has 8 and 7")
    _fails(check("12.decode_float", library), "the course library's ultrascale.precision.formats.decode")
    assert check("12.decode_float", ch12["decode_float"]).status == PASS


def test_ch12_quantize_per_tensor_refuses_an_inverted_scale_the_wrong_maximum_and_nan_for_zeros(ch12):
    def inverted(x, dtype=torch.float8_e4m3fn):  # the quantising factor returned as the scale
        scale = torch.finfo(dtype).max / x.abs().max().clamp(min=1e-12)
        return (x * scale).to(dtype), scale

    def e4m3_maximum(x, dtype=torch.float8_e4m3fn):  # 448 for both formats
        scale = x.abs().max().clamp(min=1e-12) / 448
        return (x / scale).clamp(-448, 448).to(dtype), scale

    def unclamped_amax(x, dtype=torch.float8_e4m3fn):  # 0 / 0 for a tensor of zeros
        scale = x.abs().max() / torch.finfo(dtype).max
        return (x / scale).to(dtype), scale

    def dequantised(x, dtype=torch.float8_e4m3fn):  # returns q * scale, not the FP8 tensor
        scale = x.abs().max().clamp(min=1e-12) / torch.finfo(dtype).max
        return (x / scale).to(dtype).float() * scale, scale

    exercise = "12.quantize_per_tensor"
    _fails(check(exercise, inverted), "fp8_max / amax", "x ~ q * scale")
    _fails(check(exercise, e4m3_maximum), "e5m2's is 57,344")
    _fails(check(exercise, unclamped_amax), "torch.zeros(4, 4)", "Clamp amax")
    _fails(check(exercise, dequantised), "q must be a tensor of dtype torch.float8_e4m3fn")
    assert check(exercise, ch12["quantize_per_tensor"]).status == PASS


def test_ch12_quantize_tiles_refuses_one_scale_first_rows_transposed_scales_and_no_refusal(ch12):
    def one_scale(x, tile_rows, tile_cols, dtype=torch.float8_e4m3fn):
        rows, cols = x.shape
        if rows % tile_rows or cols % tile_cols:
            raise ValueError("uneven tiles")
        scale = x.abs().max() / torch.finfo(dtype).max
        return (x / scale).to(dtype), scale.expand(rows // tile_rows, cols // tile_cols)

    def first_rows(x, tile_rows, tile_cols, dtype=torch.float8_e4m3fn):  # a tile taken as one row
        rows, cols = x.shape
        if rows % tile_rows or cols % tile_cols:
            raise ValueError("uneven tiles")
        top = torch.finfo(dtype).max
        scales = x[::tile_rows].reshape(rows // tile_rows, cols // tile_cols, tile_cols).abs().amax(-1) / top
        full = scales.repeat_interleave(tile_rows, 0).repeat_interleave(tile_cols, 1)
        return (x / full).clamp(-top, top).to(dtype), scales

    def transposed(x, tile_rows, tile_cols, dtype=torch.float8_e4m3fn):
        q, scales = ch12["quantize_tiles"](x, tile_rows, tile_cols, dtype)
        return q, scales.t()

    def no_refusal(x, tile_rows, tile_cols, dtype=torch.float8_e4m3fn):  # the reshape fails instead
        rows, cols = x.shape
        top = torch.finfo(dtype).max
        tiles = x.reshape(rows // tile_rows, tile_rows, cols // tile_cols, tile_cols)
        scales = tiles.abs().amax(dim=(1, 3)) / top
        return (tiles / scales[:, None, :, None]).to(dtype).reshape(rows, cols), scales

    exercise = "12.quantize_tiles"
    _fails(check(exercise, one_scale), "whole tensor's scale")
    _fails(check(exercise, first_rows), "Only the first row of each tile")
    _fails(check(exercise, transposed), "(transposed?)")
    _fails(check(exercise, no_refusal), "raised RuntimeError", "expected a ValueError, because 4 x 200")
    assert check(exercise, ch12["quantize_tiles"]).status == PASS


def test_ch12_fp8_backward_refuses_e4m3_gradients_float32_products_a_transposed_wgrad_and_the_library(ch12):
    quantize = ch12["quantize_per_tensor"]

    def deq(t, dtype):
        q, scale = quantize(t, dtype)
        return q.float() * scale

    def e4m3_gradients(x, weight, dy):
        g = deq(dy, torch.float8_e4m3fn)
        return g @ deq(weight, torch.float8_e4m3fn), g.t() @ deq(x, torch.float8_e4m3fn)

    def float32(x, weight, dy):
        return dy @ weight, dy.t() @ x

    def transposed_wgrad(x, weight, dy):
        g = deq(dy, torch.float8_e5m2)
        return g @ deq(weight, torch.float8_e4m3fn), deq(x, torch.float8_e4m3fn).t() @ g

    def library(x, weight, dy):
        from ultrascale.precision import FP8Linear

        layer = FP8Linear(torch.nn.Parameter(weight.clone()), None, "tensorwise")
        x = x.clone().requires_grad_()
        layer(x).backward(dy)
        return x.grad, layer.weight.grad

    exercise = "12.fp8_backward"
    _fails(check(exercise, e4m3_gradients), "dy quantised to e4m3", "e5m2")
    _fails(check(exercise, float32), "these are the float32 gradients")
    _fails(check(exercise, transposed_wgrad), "dW (Wgrad) must have the shape of the weight", "dW = dy^T @ x")
    _fails(check(exercise, library), "the course library's ultrascale.precision.fp8_linear.")
    assert check(exercise, ch12["fp8_backward"]).status == PASS


def test_ch12_update_scale_refuses_forgotten_resets_late_growth_and_an_infinite_scale(ch12):
    def no_reset_after_growth(
        scale, growth_tracker, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000
    ):
        if found_inf:
            return scale * backoff_factor, 0
        growth_tracker += 1
        if growth_tracker % growth_interval == 0 and scale * growth_factor <= 3.4e38:
            return scale * growth_factor, growth_tracker
        return scale, growth_tracker

    def no_reset_after_overflow(
        scale, growth_tracker, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000
    ):
        if found_inf:
            return scale * backoff_factor, growth_tracker
        return ch12["update_scale"](scale, growth_tracker, False, growth_factor, backoff_factor, growth_interval)

    def one_step_late(scale, growth_tracker, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        if found_inf:
            return scale * backoff_factor, 0
        if growth_tracker == growth_interval:
            return scale * growth_factor, 0
        return scale, growth_tracker + 1

    def to_infinity(scale, growth_tracker, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        if found_inf:
            return scale * backoff_factor, 0
        growth_tracker += 1
        if growth_tracker == growth_interval:
            return scale * growth_factor, 0
        return scale, growth_tracker

    def library(scale, growth_tracker, found_inf, **settings):
        from ultrascale.precision import update_scale

        return update_scale(scale, growth_tracker, found_inf, **settings)

    exercise = "12.update_scale"
    _fails(check(exercise, no_reset_after_growth), "After growing, the count of good steps starts again from 0")
    _fails(check(exercise, no_reset_after_overflow), "After an overflow the count of good steps starts again")
    _fails(check(exercise, one_step_late), "the scale grows by growth_factor now")
    _fails(check(exercise, to_infinity), "past float32's largest value")
    _fails(check(exercise, library), "the course library's ultrascale.precision.loss_scaling.update_scale")
    assert check(exercise, ch12["update_scale"]).status == PASS


def test_a_ring_of_blocking_sends_counts_one_message_per_send():
    """dist.send calls dist.isend itself; the check must see one message, not two (it once
    failed this right ring with "do not split a chunk into several messages")."""

    def blocking(me, out, incoming, right, left):  # even ranks send first: no deadlock
        for first in (me % 2 == 0, me % 2 == 1):
            if first and out.numel():
                dist.send(out, right)
            elif not first and incoming.numel():
                dist.recv(incoming, left)

    assert check("a0.ring_reduce_scatter", _ring_reduce_scatter(blocking)).status == PASS


# ---- a0: recursive doubling, not any all-reduce with the right sum -------------------------


def test_recursive_doubling_refuses_rings_shifts_halves_and_a_missing_fold(a0):
    send_recv = a0["send_recv"]

    def doubling(partners, hand_back=True):
        """Recursive doubling with the fold, sending to and receiving from ``partners(me, distance, P)``."""

        def all_reduce(ctx, tensor):
            me, n = ctx.rank, ctx.world_size
            power = 1 << (n.bit_length() - 1)
            total = tensor.reshape(-1).clone()
            incoming = torch.empty_like(total)
            if me >= power:
                dist.send(total, me - power)
                if hand_back:
                    dist.recv(total, me - power)
                return total.reshape(tensor.shape)
            if me + power < n:
                dist.recv(incoming, me + power)
                total += incoming
            distance = 1
            while distance < power:
                send_recv(total, incoming, *partners(me, distance, power))
                total += incoming
                distance *= 2
            if hand_back and me + power < n:
                dist.send(total, me + power)
            return total.reshape(tensor.shape)

        return all_reduce

    # right sums for a power of two, but passed round a circle instead of swapped
    shifted = doubling(lambda me, distance, power: ((me + distance) % power, (me - distance) % power))
    # folds the extra ranks in, never hands them the sum
    no_answer_for_the_extra_ranks = doubling(lambda me, distance, power: (me ^ distance,) * 2, hand_back=False)

    def the_library(ctx, tensor):  # the course's own recursive doubling, right messages and all
        from ultrascale.comm.recursive import recursive_doubling_all_reduce

        return recursive_doubling_all_reduce(tensor.clone())

    exercise = "a0.recursive_doubling"
    _fails(check(exercise, the_library), "the course library's collectives")
    _fails(check(exercise, a0["ring_all_reduce"]), "recursive doubling sends 1, to ranks [1]")
    _fails(check(exercise, shifted), "r XOR 2**k")
    _fails(check(exercise, a0["halving_doubling_all_reduce"]), "whole tensor")  # the next exercise's answer
    _fails(check(exercise, no_answer_for_the_extra_ranks), "world_size=3", "rank 2: wrong values", "own input")
    assert check(exercise, a0["recursive_doubling_all_reduce"]).status == PASS
    assert check(exercise, a0["recursive_doubling_all_reduce"], world_size=7, quick=False).status == PASS


# ---- a0: halving-doubling, the ring's bytes in few messages --------------------------------


def test_halving_doubling_refuses_doubling_rings_a_forward_all_gather_and_the_library(a0):
    send_recv, right = a0["send_recv"], a0["halving_doubling_all_reduce"]

    def all_gather_in_halving_order(ctx, tensor):  # the right reduce-scatter, gathered d = 1 first
        me, n = ctx.rank, ctx.world_size
        if n & (n - 1):  # the fold is not what this answer gets wrong
            return right(ctx, tensor)
        flat = tensor.reshape(-1).clone()
        lo, hi, levels, distance = 0, flat.numel(), [], 1
        while distance < n:
            partner, mid = me ^ distance, lo + (hi - lo) // 2
            keep, give = (slice(mid, hi), slice(lo, mid)) if me & distance else (slice(lo, mid), slice(mid, hi))
            incoming = torch.empty_like(flat[keep])
            send_recv(flat[give], incoming, partner, partner)
            flat[keep] += incoming
            levels.append((partner, keep, give))
            lo, hi = keep.start, keep.stop
            distance *= 2
        for partner, keep, give in levels:
            send_recv(flat[keep], flat[give], partner, partner)
        return flat.reshape(tensor.shape)

    def the_library(ctx, tensor):
        from ultrascale.comm.halving_doubling import halving_doubling_all_reduce

        return halving_doubling_all_reduce(tensor.clone())

    exercise = "a0.halving_doubling"
    _fails(check(exercise, the_library), "the course library's collectives")

    def the_library_direct_exchange(ctx, tensor):  # right sums, and the course's code, not the learner's
        from ultrascale.comm.direct import direct_all_reduce

        return direct_all_reduce(tensor.clone())

    _fails(check(exercise, the_library_direct_exchange), "the course library's collectives")
    _fails(check(exercise, a0["recursive_doubling_all_reduce"]), "world_size=4", "carried the whole tensor")
    _fails(check(exercise, a0["ring_all_reduce"]), "halving-doubling sends")
    _fails(check(exercise, all_gather_in_halving_order, world_size=4), "world_size=4", "wrong values")
    assert check(exercise, a0["halving_doubling_all_reduce"]).status == PASS
    assert check(exercise, a0["halving_doubling_all_reduce"], world_size=7, quick=False).status == PASS
