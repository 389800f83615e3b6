"""Properties of the exercises whose inputs are lists of tensors, traces, clocks, layouts and models
(in one process) and of those that run on ranks (on ``grading_cluster(2)`` and ``(3)``, the inputs
made on the host from a drawn seed, then moved to ``ctx.device``); see ``exercise_tests.properties``
for how they run. Each names what its draws reach that the exercise's fixed cases do not:

* ``00.mean_across_ranks``: float64 and bf16 tensors, 0-d, size-1 and transposed (non-contiguous)
  ones, on 2 and 3 ranks (a result made in float32, or through ``view``, is wrong there);
* ``01.grad_accumulation``: float64 models (a loss logged in a float32 accumulator loses their
  digits), token batches that are transposed views, sequences of length 1, one micro-batch;
* ``02.assign_buckets``: parameters of mixed dtypes in one list (bf16 beside float64), 0-d ones,
  and views into a larger storage (its bytes are not the parameter's);
* ``02.bucket_manager``: a float64 model (a bucket buffer made in float32 rounds its gradients),
  caps that make one bucket per parameter, a few, or one, on 2 and 3 ranks;
* ``04.conjugate_pair`` (its ``Reduce``, f*): the tensors of ``00.mean_across_ranks``, forward and
  backward;
* ``04.column_parallel_linear``, ``04.row_parallel_linear``: x with no batch axis (1-D), one, or
  two, float64 and bf16, one feature per rank, forward and backward on 2 and 3 ranks (an einsum
  spelled for the fixed cases' three axes, or a float32 buffer, is wrong there);
* ``05.sequence_gather_scatter`` (its ``Gather``, whose backward is the reduce-scatter): any
  dim, negative ones included, float64 and bf16, size-1 axes, transposed inputs (a buffer made
  without the input's dtype is wrong there);
* ``06.ulysses_attention``: q and k of size up to 40 (scores of thousands: exp overflows even
  float64 unless each row's maximum is subtracted), one token or one head per rank, float32;
* ``08.split_sizes``: 1 and 3 experts per rank (every fixed case has 2), a rank with no tokens,
  top-3 routing;
* ``08.dispatch_combine``: a rank with no tokens, one expert per rank, float64, on 2 and 3 ranks;
* ``08.expert_gradients``: dense and expert gradients (with replicas or none) in float64 and bf16,
  0-d and transposed, on 2 and 3 ranks;
* ``10.memory_filter``: a GPU whose usable memory is exactly what one layout needs (it fits:
  ``<=``), other models, cluster sizes and headrooms;
* ``10.step1``: whole-number parameter counts at the 10B edge, nodes of 1 to 72 GPUs, and the
  arguments passed by position in the order of the text's signature (every fixed case names them);
* ``a0.ring_reduce_scatter``, ``a0.ring_all_gather``, ``a0.ring_all_reduce``,
  ``a0.recursive_doubling``, ``a0.halving_doubling``: float64 and bf16 tensors (whole numbers, so
  every dtype adds them exactly), strided and transposed views, 0-d tensors, lengths the ranks do
  not divide, on 2 and 3 ranks (a buffer made with ``torch.empty(n)`` is float32; ``view`` needs
  contiguous memory);
* ``a1.timed_median``: an even number of repeats whose middle two differ by an odd amount (the
  median is then not a whole number), no warm-up, launches that cost nothing;
* ``a1.launched_by``: launches named otherwise than ``cudaLaunchKernel`` (the driver's
  ``cuLaunchKernel``, ``cudaLaunchKernelExC``), launches on an operator's very edge, kernels that
  start together, two processes sharing thread ids, timestamps since the epoch.

Values come from torch or ``random`` generators seeded by a drawn integer, as in
``exercise_tests.properties``. The model and cluster draws are the slowest (a forward and
backward, or a call on 2 or 3 ranks): each costs about a tenth of a second or less once the
clusters run (the exercise's fixed cases have started them).
"""

from __future__ import annotations

import copy
import functools
import math
import random
import statistics

import torch

from ultrascale_grading.properties import Property, floats
from ultrascale_grading.properties import seeded_values as _values
from ultrascale_grading.properties import strategies as _st

FLOATS = floats()


# ---- 00.mean_across_ranks ------------------------------------------------------------------


def _mean_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            world_size=st.sampled_from((2, 3)),
            shape=st.lists(st.integers(1, 5), min_size=0, max_size=3),
            dtype=st.sampled_from(FLOATS),
            transposed=st.booleans(),
            seed=st.integers(0, 99),
        )
    )


def _mean_input(case, rank: int) -> torch.Tensor:
    shape = case["shape"]
    if case["transposed"] and len(shape) == 2:  # a non-contiguous view, as W.t() gives
        return _values(1000 * case["seed"] + rank, shape[::-1], case["dtype"]).t()
    return _values(1000 * case["seed"] + rank, shape, case["dtype"])


def _mean_on_rank(ctx, fn, case):
    x = _mean_input(case, ctx.rank).to(ctx.device)
    out = fn(ctx, x)
    return out.detach().cpu() if torch.is_tensor(out) else out


def _judge_mean(fn, case):
    from ultrascale.runtime import grading_cluster

    n, dtype = case["world_size"], case["dtype"]
    inputs = [_mean_input(case, r) for r in range(n)]
    want = torch.stack([x.double() for x in inputs]).mean(0)
    for rank, got in enumerate(grading_cluster(n).run(_mean_on_rank, fn, case)):
        if not torch.is_tensor(got):
            return f"rank {rank} returned {type(got).__name__}, not a tensor"
        if got.dtype != dtype or tuple(got.shape) != tuple(want.shape):
            return (
                f"rank {rank} returned a {tuple(got.shape)} tensor of {got.dtype}; the mean of {dtype} tensors "
                f"of shape {tuple(want.shape)} is one too (all-reduce a clone of the input itself: no "
                "float(), view(-1) or torch.zeros of another dtype or shape)"
            )
        # float64 sums are exact to its last bits; bf16 keeps 8 bits, so a sum of n of them is off
        # by up to about n * 2**-8 of the largest input
        scale = max(float(x.double().abs().max()) for x in inputs) if want.numel() else 0.0
        tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, n * 2.0**-7) * max(scale, 1.0)
        if not torch.allclose(got.double(), want, rtol=0, atol=tol):
            return f"rank {rank}'s values differ from the mean of every rank's input (computed in float64)"
    return None


def _describe_mean(case):
    shape = tuple(case["shape"])
    layout = " (a transposed, non-contiguous view)" if case["transposed"] and len(shape) == 2 else ""
    return (
        f"world_size={case['world_size']}, a {case['dtype']} tensor of shape {shape}"
        f"{' (0-d)' if not shape else ''}{layout} on each rank"
    )


# ---- 01.grad_accumulation --------------------------------------------------------------------


def _accumulation_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            llama=st.booleans(),
            dtype=st.sampled_from((torch.float32, torch.float64)),
            grad_acc=st.integers(1, 4),
            mbs=st.integers(1, 3),
            seq=st.integers(1, 6),
            transposed=st.booleans(),
            seed=st.integers(0, 99),
        )
    )


def _accumulation_model(case):
    from ultrascale.model import GPTConfig, LlamaConfig, build_model

    config = (
        LlamaConfig(vocab_size=11, hidden=8, layers=1, heads=2, kv_heads=1, ffn=12)
        if case["llama"]
        else GPTConfig(vocab_size=11, hidden=8, layers=1, heads=2)
    )
    torch.manual_seed(case["seed"])
    return build_model(config).to(case["dtype"]), config


def _tokens(case, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    batch, seq = case["mbs"] * case["grad_acc"], case["seq"]
    if case["transposed"]:  # (batch, seq) as a view of a (seq, batch) tensor: not contiguous
        return torch.randint(0, vocab, (seq, batch), generator=g).t()
    return torch.randint(0, vocab, (batch, seq), generator=g)


def _judge_accumulation(fn, case):
    model, config = _accumulation_model(case)
    reference = copy.deepcopy(model)
    inputs = _tokens(case, config.vocab_size, 2 * case["seed"])
    targets = _tokens(case, config.vocab_size, 2 * case["seed"] + 1)
    loss = reference.loss(inputs, targets)
    loss.backward()
    got_loss = fn(model, inputs, targets, case["grad_acc"])
    # float32 sums in another order differ in their last bits; float64 ones far less
    tol = 1e-5 if case["dtype"] == torch.float32 else 1e-10
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if p.grad is None or p.grad.dtype != q.dtype:
            return f"{name}.grad is {None if p.grad is None else p.grad.dtype}, expected {q.dtype}"
        if not torch.allclose(p.grad, q.grad, rtol=tol, atol=tol):
            return f"the gradient of {name} differs from the whole batch's"
    if got_loss is None or not math.isclose(float(got_loss), loss.item(), rel_tol=tol, abs_tol=tol):
        return f"returned loss {got_loss!r}, the whole batch's mean loss is {loss.item():.10g}"
    return None


def _describe_accumulation(case):
    batch = case["mbs"] * case["grad_acc"]
    return (
        f"a {'Llama' if case['llama'] else 'GPT'} model in {case['dtype']}, batch of {batch} = {case['mbs']} x "
        f"grad_acc {case['grad_acc']}, seq {case['seq']}"
        + (", inputs and targets transposed views (not contiguous)" if case["transposed"] else "")
    )


# ---- 02.assign_buckets -----------------------------------------------------------------------


def _bucket_cases():
    st = _st()
    param = st.fixed_dictionaries(
        dict(
            shape=st.lists(st.integers(1, 6), min_size=0, max_size=3),  # [] is a 0-d parameter
            dtype=st.sampled_from(FLOATS + (torch.float16,)),
            view=st.booleans(),
        )
    )
    return st.fixed_dictionaries(dict(params=st.lists(param, min_size=1, max_size=8), cap=st.integers(1, 300)))


def _bucket_params(case) -> list:
    params = []
    for spec in case["params"]:
        numel = math.prod(spec["shape"])
        if spec["view"]:  # a window into a larger flat storage, as a flattened model's parameters are
            storage = torch.zeros(numel + 7, dtype=spec["dtype"])
            params.append(storage[3 : 3 + numel].view(spec["shape"]))
        else:
            params.append(torch.zeros(spec["shape"], dtype=spec["dtype"]))
    return params


def _buckets_by(params, cap, nbytes) -> list:
    """The buckets (by parameter index) DDP's rule makes when a parameter weighs ``nbytes(p)``."""
    buckets, current, total = [], [], 0
    for i in reversed(range(len(params))):
        current.append(i)
        total += nbytes(params[i])
        if total >= cap:
            buckets.append(current)
            current, total = [], 0
    return buckets + ([current] if current else [])


def _judge_buckets(fn, case):
    params, cap = _bucket_params(case), case["cap"]
    want = _buckets_by(params, cap, lambda p: p.numel() * p.element_size())
    index = {id(p): i for i, p in enumerate(params)}
    got = fn(list(params), cap)
    try:
        got = [[index[id(p)] for p in bucket] for bucket in got]
    except (KeyError, TypeError):
        return "return a list of buckets, each a list of the parameters given (the same objects)"
    if got == want:
        return None
    hint = ""
    if got == _buckets_by(params, cap, lambda p: p.numel() * params[0].element_size()):
        hint = " Every parameter was weighed with the first one's element size: weigh each by its own dtype."
    elif got == _buckets_by(params, cap, lambda p: p.untyped_storage().nbytes()):
        hint = (
            " A parameter was weighed by its storage, which a view shares with other tensors: weigh its own "
            "elements, p.numel() * p.element_size()."
        )
    return f"expected buckets (by parameter index) {want}, got {got}.{hint}"


def _describe_buckets(case):
    kinds = [
        f"{tuple(s['shape'])} {str(s['dtype']).replace('torch.', '')}{' view' if s['view'] else ''}"
        for s in case["params"]
    ]
    return f"assign_buckets(<parameters {', '.join(kinds)}>, bucket_cap_bytes={case['cap']})"


# ---- 08.dispatch_combine -------------------------------------------------------------------------


def _moe_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            world_size=st.sampled_from((2, 3)),
            per_rank=st.integers(1, 2),
            tokens=st.lists(st.integers(0, 4), min_size=3, max_size=3),
            hidden=st.integers(1, 4),
            k=st.integers(1, 2),
            dtype=st.sampled_from((torch.float32, torch.float64)),
            seed=st.integers(0, 99),
        )
    )


def _moe_problem(case):
    """Every expert (whole), and each rank's tokens, choices and weights: the same in every process."""
    n, h, dtype = case["world_size"], case["hidden"], case["dtype"]
    experts_total, k = case["per_rank"] * n, min(case["k"], case["per_rank"] * n)
    g = torch.Generator().manual_seed(case["seed"])
    experts = []
    for _ in range(experts_total):
        layer = torch.nn.Linear(h, h, dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(h, h, generator=g, dtype=torch.float64))
            layer.bias.copy_(torch.randn(h, generator=g, dtype=torch.float64))
        experts.append(layer)
    ranks = []
    for r in range(n):
        t = case["tokens"][r]  # a rank may have no tokens at all
        x = torch.randn(t, h, generator=g, dtype=torch.float64).to(dtype)
        chosen = (
            torch.stack([torch.randperm(experts_total, generator=g)[:k] for _ in range(t)])
            if t
            else torch.zeros(0, k, dtype=torch.long)
        )
        w = torch.rand(t, k, generator=g, dtype=torch.float64).to(dtype)
        ranks.append((x, chosen, w))
    return experts, ranks


def _moe_on_rank(ctx, fn, case):
    experts, ranks = _moe_problem(case)
    mine = [e.to(ctx.device) for e in experts[ctx.rank * case["per_rank"] : (ctx.rank + 1) * case["per_rank"]]]
    x, chosen, w = (t.to(ctx.device) for t in ranks[ctx.rank])
    with torch.no_grad():
        y = fn(x, chosen, w, mine, None)
    return y.detach().cpu() if torch.is_tensor(y) else y


def _judge_moe(fn, case):
    from ultrascale.moe import apply_experts
    from ultrascale.runtime import grading_cluster

    experts, ranks = _moe_problem(case)
    tol = 1e-5 if case["dtype"] == torch.float32 else 1e-10
    for rank, got in enumerate(grading_cluster(case["world_size"]).run(_moe_on_rank, fn, case)):
        with torch.no_grad():
            want = apply_experts(experts, *ranks[rank])
        if not torch.is_tensor(got) or got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            return (
                f"rank {rank} returned "
                + (f"a {tuple(got.shape)} tensor of {got.dtype}" if torch.is_tensor(got) else type(got).__name__)
                + f", expected its tokens' outputs, {tuple(want.shape)} of {want.dtype}"
            )
        if not torch.allclose(got, want, rtol=tol, atol=tol):
            return f"rank {rank}'s outputs differ from the one-process MoE layer's"
    return None


def _describe_moe(case):
    n = case["world_size"]
    return (
        f"ep_forward on {n} ranks with {case['tokens'][:n]} tokens, {case['per_rank']} expert(s) per rank, "
        f"hidden {case['hidden']}, top-{min(case['k'], case['per_rank'] * n)}, {case['dtype']}"
    )


# ---- 08.expert_gradients -----------------------------------------------------------------------


def _expert_grad_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            world_size=st.sampled_from((2, 3)),
            expert=st.booleans(),
            replicas=st.booleans(),
            shape=st.lists(st.integers(1, 4), min_size=0, max_size=2),
            dtype=st.sampled_from(FLOATS),
            transposed=st.booleans(),
            seed=st.integers(0, 99),
        )
    )


def _expert_grad_on_rank(ctx, fn, case):
    import torch.distributed as dist

    grad = _mean_input(case, ctx.rank).to(ctx.device)
    # data_group: the world; an expert's replicas: the world too, or none (None)
    out = fn(grad, case["expert"], dist.group.WORLD, dist.group.WORLD if case["replicas"] else None)
    return out.detach().cpu() if torch.is_tensor(out) else out


def _judge_expert_grad(fn, case):
    from ultrascale.runtime import grading_cluster

    n, dtype = case["world_size"], case["dtype"]
    inputs = [_mean_input(case, r).double() for r in range(n)]
    summed = torch.stack(inputs).sum(0) if not case["expert"] or case["replicas"] else None
    for rank, got in enumerate(grading_cluster(n).run(_expert_grad_on_rank, fn, case)):
        want = (inputs[rank] if summed is None else summed) / n
        if not torch.is_tensor(got) or got.dtype != dtype or tuple(got.shape) != tuple(want.shape):
            return (
                f"rank {rank} returned "
                + (f"a {tuple(got.shape)} tensor of {got.dtype}" if torch.is_tensor(got) else type(got).__name__)
                + f": the gradient a parameter keeps is a {tuple(want.shape)} tensor of "
                f"{dtype}, as it was given"
            )
        scale = max([float(x.abs().max()) for x in inputs if x.numel()] + [1.0])
        tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, n * 2.0**-7) * scale
        if not torch.allclose(got.double(), want, rtol=0, atol=tol):
            return f"rank {rank}'s gradient differs from the expected one (computed in float64)"
    return None


def _describe_expert_grad(case):
    shape = tuple(case["shape"])
    layout = " (a transposed, non-contiguous view)" if case["transposed"] and len(shape) == 2 else ""
    kind = (
        (
            "an expert's, summed over its replicas (the world)"
            if case["replicas"]
            else "an expert's without replicas (expert_group=None)"
        )
        if case["expert"]
        else "a dense parameter's"
    )
    return (
        f"reduce_gradient on {case['world_size']} ranks, data_group the world: {kind} gradient, a "
        f"{case['dtype']} tensor of shape {shape}{' (0-d)' if not shape else ''}{layout}"
    )


# ---- 10.memory_filter ------------------------------------------------------------------------

MEMORY_MODELS = ("LLAMA3_8B", "LLAMA3_70B", "MOE_8B")


@functools.lru_cache(maxsize=None)
def _layouts(model_name: str, gpus: int, seq: int) -> tuple:
    from ultrascale import plan

    return tuple(
        plan.enumerate_configs(_memory_model(model_name), gpus=gpus, global_batch_tokens=2**20, seq=seq, max_cp=4)
    )


def _memory_model(name: str):
    import dataclasses

    from ultrascale import model

    if name == "MOE_8B":
        return dataclasses.replace(model.LLAMA3_8B, experts=8, top_k=2)
    return getattr(model, name)


def _memory_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            model=st.sampled_from(MEMORY_MODELS),
            gpus=st.sampled_from((8, 16, 32)),
            seq=st.sampled_from((2048, 4096)),
            count=st.integers(1, 12),
            boundary=st.booleans(),
            gigabytes=st.sampled_from((24, 40, 80, 141)),
            # headrooms whose 1 - h is a power of two: memory_bytes * (1 - h) is then exact
            headroom=st.sampled_from((0.0, 0.5, 0.75)),
            seed=st.integers(0, 999),
        )
    )


def _memory_problem(case):
    from ultrascale.plan import fit

    model = _memory_model(case["model"])
    layouts = _layouts(case["model"], case["gpus"], case["seq"])
    configs = random.Random(case["seed"]).sample(layouts, min(case["count"], len(layouts)))
    memory_bytes = case["gigabytes"] * 1e9
    if case["boundary"]:  # usable memory exactly the first layout's need (every part is a whole number of bytes)
        memory_bytes = fit.memory_per_gpu(model, configs[0], case["seq"])["total"] / (1 - case["headroom"])
    return model, configs, memory_bytes


def _judge_memory(fn, case):
    from ultrascale.plan import Hardware, fit

    model, configs, memory_bytes = _memory_problem(case)
    want, _ = fit.memory_filter(
        model, configs, case["seq"], Hardware(memory_bytes=memory_bytes, memory_headroom=case["headroom"])
    )
    got = fn(model, list(configs), case["seq"], memory_bytes, case["headroom"])
    got = list(got) if got is not None else None
    if got is None or [c for c, _ in got] != [c for c, _ in want]:
        kept = None if got is None else [c.short() for c, _ in got]
        hint = ""
        if (
            case["boundary"]
            and got is not None
            and [c for c, _ in got] == [c for c, _ in want[1:]]
            and want
            and want[0][0] == configs[0]
        ):
            hint = (
                f" {configs[0].short()} needs exactly the usable memory, "
                f"{memory_bytes * (1 - case['headroom']):.0f} bytes: it fits (need <= usable, not <)"
            )
        return f"kept {kept}, expected {[c.short() for c, _ in want]} (in the order given).{hint}"
    for (c, nbytes), (_, need) in zip(got, want):
        if not math.isclose(nbytes, need, rel_tol=1e-9):
            return f"{c.short()} needs {need:.0f} bytes, you say {nbytes!r}"
    return None


def _describe_memory(case):
    model, configs, memory_bytes = _memory_problem(case)
    return (
        f"fitting({case['model']}, {len(configs)} layouts of {case['gpus']} GPUs, seq={case['seq']}, "
        f"memory_bytes={memory_bytes:.6g}, headroom={case['headroom']})"
        + (f", where {configs[0].short()} needs exactly the usable memory" if case["boundary"] else "")
    )


# ---- 02.bucket_manager ---------------------------------------------------------------------------


def _manager_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            world_size=st.sampled_from((2, 3)),
            dtype=st.sampled_from((torch.float32, torch.float64)),
            cap=st.sampled_from((1, 40, 100, 10**9)),
            seed=st.integers(0, 99),
        )
    )


def _manager_model(case):
    """A small model, the same on every rank (seeded), in the drawn dtype: 3 -> 4 -> 2."""
    torch.manual_seed(case["seed"])
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).to(case["dtype"])


def _manager_batch(case, rank: int) -> torch.Tensor:
    return _values(1000 * case["seed"] + rank, (5, 3), case["dtype"])


def _manager_on_rank(ctx, BucketManager, case):
    model = _manager_model(case).to(ctx.device)
    manager = BucketManager(list(model.parameters()), case["cap"])
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(manager.grad_ready)
    model(_manager_batch(case, ctx.rank).to(ctx.device)).pow(2).sum().backward()
    manager.finish()
    return [p.grad.detach().cpu() for p in model.parameters()]


def _judge_manager(BucketManager, case):
    from ultrascale.runtime import grading_cluster

    n = case["world_size"]
    per_rank = []
    for r in range(n):  # each rank's own gradients, in float64
        model = _manager_model(case).double()
        model(_manager_batch(case, r).double()).pow(2).sum().backward()
        per_rank.append([p.grad for p in model.parameters()])
    want = [torch.stack(grads).mean(0) for grads in zip(*per_rank)]
    tol = 1e-5 if case["dtype"] == torch.float32 else 1e-12
    names = [name for name, _ in _manager_model(case).named_parameters()]
    for rank, grads in enumerate(grading_cluster(n).run(_manager_on_rank, BucketManager, case)):
        for name, got, mean in zip(names, grads, want):
            if got.dtype != case["dtype"]:
                return f"rank {rank}: {name}.grad came back as {got.dtype}, the parameters are {case['dtype']}"
            if not torch.allclose(got.double(), mean, rtol=tol, atol=tol):
                return (
                    f"rank {rank}: {name}.grad is not the mean over the ranks of their gradients (to {tol:g}): "
                    "a bucket's buffer must hold its gradients in their own dtype (torch.zeros(..., dtype=...))"
                )
    return None


def _describe_manager(case):
    return (
        f"BucketManager(params, bucket_cap_bytes={case['cap']}) on {case['world_size']} ranks, a 3 -> 4 -> 2 model "
        f"in {case['dtype']}, one step"
    )


# ---- 04.conjugate_pair (its Reduce, f*: all-reduce forward, identity backward) -----------------------


def _reduce_on_rank(ctx, Reduce, case):
    x = _mean_input(case, ctx.rank).to(ctx.device).requires_grad_(True)
    upstream = _mean_input(dict(case, seed=case["seed"] + 50), ctx.rank).to(ctx.device)
    y = Reduce.apply(x, None)
    y.backward(upstream.reshape(y.shape) if torch.is_tensor(y) else upstream)
    return y.detach().cpu(), None if x.grad is None else x.grad.cpu(), upstream.cpu()


def _judge_reduce(Reduce, case):
    from ultrascale.runtime import grading_cluster

    n, dtype = case["world_size"], case["dtype"]
    inputs = [_mean_input(case, r).double() for r in range(n)]
    want = torch.stack(inputs).sum(0)
    scale = max([float(x.abs().max()) for x in inputs if x.numel()] + [1.0])
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, n * 2.0**-7) * scale * n
    for rank, (y, grad, upstream) in enumerate(grading_cluster(n).run(_reduce_on_rank, Reduce, case)):
        if y.dtype != dtype or tuple(y.shape) != tuple(want.shape):
            return (
                f"rank {rank}: Reduce's output is a {tuple(y.shape)} tensor of {y.dtype}, expected "
                f"{tuple(want.shape)} of {dtype} (all-reduce a clone of x itself)"
            )
        if not torch.allclose(y.double(), want, rtol=0, atol=tol):
            return f"rank {rank}: Reduce's output is not the sum over ranks of x"
        if grad is None or grad.dtype != dtype or not torch.equal(grad, upstream):
            return f"rank {rank}: x.grad is not the upstream gradient as it came (f*'s backward is the identity)"
    return None


def _describe_reduce(case):
    return "Reduce.apply(x, group), then backward: " + _describe_mean(case)


# ---- 04.column_parallel_linear and 04.row_parallel_linear -----------------------------------------


def _linear_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            world_size=st.sampled_from((2, 3)),
            batch=st.lists(st.integers(1, 3), min_size=0, max_size=2),  # x may be 1-D
            inputs=st.integers(1, 4),
            outputs=st.integers(1, 3),
            dtype=st.sampled_from(FLOATS),
            seed=st.integers(0, 99),
        )
    )


def _full_layer(case, kind: str):
    """The whole layer in float64: x, W, b and the upstream gradient of its output. Column-parallel
    splits the ``outputs`` per rank, row-parallel the ``inputs`` per rank."""
    n, seed = case["world_size"], case["seed"]
    ins = case["inputs"] * (n if kind == "row" else 1)
    outs = case["outputs"] * (n if kind == "column" else 1)
    return (
        _values(seed, case["batch"] + [ins], torch.float64),
        _values(seed + 1, (outs, ins), torch.float64),
        _values(seed + 2, (outs,), torch.float64),
        _values(seed + 3, case["batch"] + [outs], torch.float64),
    )


def _rank_share(case, kind: str, rank: int):
    """(x, weight, bias, upstream) as rank ``rank`` gets them, in the drawn dtype."""
    x, w, b, dy = _full_layer(case, kind)
    if kind == "column":
        rows = slice(rank * case["outputs"], (rank + 1) * case["outputs"])
        share = x, w[rows], b[rows], dy[..., rows]
    else:
        cols = slice(rank * case["inputs"], (rank + 1) * case["inputs"])
        share = x[..., cols], w[:, cols], b, dy
    return [t.to(case["dtype"]) for t in share]


def _linear_on_rank(ctx, fn, case, kind):
    x, w, b, dy = (t.to(ctx.device) for t in _rank_share(case, kind, ctx.rank))
    x.requires_grad_(True)
    w, b = torch.nn.Parameter(w), torch.nn.Parameter(b)
    y = fn(x, w, b, None)
    y.backward(dy)
    return [None if t is None else t.detach().cpu() for t in (y, x.grad, w.grad, b.grad)]


def _linear_want(case, kind: str, rank: int) -> list:
    """(y, x.grad, weight.grad, bias.grad) of this rank, from the whole layer in float64."""
    x, w, b, dy = _full_layer(case, kind)
    y, x_grad = x @ w.T + b, dy @ w
    flat_x, flat_dy = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    w_grad, b_grad = flat_dy.T @ flat_x, flat_dy.sum(0)
    if kind == "column":
        rows = slice(rank * case["outputs"], (rank + 1) * case["outputs"])
        return [y[..., rows], x_grad, w_grad[rows], b_grad[rows]]
    cols = slice(rank * case["inputs"], (rank + 1) * case["inputs"])
    return [y, x_grad[..., cols], w_grad[:, cols], b_grad]


def _linear_judge(kind: str):
    def judge(fn, case):
        from ultrascale.runtime import grading_cluster

        n, dtype = case["world_size"], case["dtype"]
        base = {torch.float64: 1e-10, torch.float32: 1e-5}.get(dtype, 4e-2)  # bf16 keeps 8 bits
        for rank, got in enumerate(grading_cluster(n).run(_linear_on_rank, fn, case, kind)):
            for what, g, want in zip(
                ("the output", "x.grad", "weight.grad", "bias.grad"), got, _linear_want(case, kind, rank)
            ):
                if g is None or g.dtype != dtype or tuple(g.shape) != tuple(want.shape):
                    return (
                        f"rank {rank}: {what} is "
                        + ("None" if g is None else f"a {tuple(g.shape)} tensor of {g.dtype}")
                        + f", expected {tuple(want.shape)} of {dtype}"
                    )
                tol = base * max(1.0, float(want.abs().max()) if want.numel() else 0.0)
                if not torch.allclose(g.double(), want, rtol=0, atol=tol):
                    return f"rank {rank}: {what} differs from the whole layer's (computed in float64)"
        return None

    return judge


def _describe_linear(kind: str):
    def describe(case):
        split = "output" if kind == "column" else "input"
        other = "inputs" if kind == "column" else "outputs"
        return (
            f"x of shape {tuple(case['batch'])} + (features,){' (1-D: no batch axes)' if not case['batch'] else ''}, "
            f"{case[split + 's']} {split} feature(s) per rank, {case[other]} {other[:-1]} feature(s), "
            f"{case['dtype']}, {case['world_size']} ranks, forward then backward"
        )

    return describe


def _linear(kind: str) -> Property:
    edge = dict(world_size=2, batch=[], inputs=3, outputs=2, dtype=torch.float64, seed=0)
    return Property(_linear_cases, _linear_judge(kind), _describe_linear(kind), examples=(edge,))


# ---- 05.sequence_gather_scatter (Gather: its backward is the reduce-scatter) --------------------


def _gather_cases():
    st = _st()
    return st.lists(st.integers(1, 3), min_size=1, max_size=3).flatmap(
        lambda shape: st.fixed_dictionaries(
            dict(
                world_size=st.sampled_from((2, 3)),
                shape=st.just(shape),
                dim=st.integers(-len(shape), len(shape) - 1),  # negative dims count from the end
                dtype=st.sampled_from(FLOATS),
                transposed=st.booleans(),
                seed=st.integers(0, 99),
            )
        )
    )


def _gather_tensors(case, rank: int):
    """This rank's x (a transposed view when drawn, for 2-D and 3-D) and its upstream gradient."""
    shape, n, dim = list(case["shape"]), case["world_size"], case["dim"]
    if case["transposed"] and len(shape) > 1:
        x = _values(1000 * case["seed"] + rank, shape[::-1], case["dtype"]).permute(*reversed(range(len(shape))))
    else:
        x = _values(1000 * case["seed"] + rank, shape, case["dtype"])
    long = [size * n if d == dim % len(shape) else size for d, size in enumerate(shape)]
    return x, _values(1000 * case["seed"] + 500 + rank, long, case["dtype"])


def _gather_on_rank(ctx, Gather, case):
    x, upstream = (t.to(ctx.device) for t in _gather_tensors(case, ctx.rank))
    x.requires_grad_(True)
    y = Gather.apply(x, case["dim"], None)
    y.backward(upstream)
    return y.detach().cpu(), None if x.grad is None else x.grad.cpu()


def _judge_gather(Gather, case):
    from ultrascale.runtime import grading_cluster

    n, dim, dtype = case["world_size"], case["dim"], case["dtype"]
    pairs = [_gather_tensors(case, r) for r in range(n)]
    want_y = torch.cat([x.double() for x, _ in pairs], dim)
    summed = torch.stack([u.double() for _, u in pairs]).sum(0)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, n * 2.0**-7) * max(float(summed.abs().max()), 1.0)
    for rank, (y, grad) in enumerate(grading_cluster(n).run(_gather_on_rank, Gather, case)):
        if y.dtype != dtype or tuple(y.shape) != tuple(want_y.shape):
            return (
                f"rank {rank}'s output is a {tuple(y.shape)} tensor of {y.dtype}, expected {tuple(want_y.shape)} "
                f"of {dtype}: every rank's x concatenated along dim {dim}"
            )
        if not torch.equal(y.double(), want_y):
            return f"rank {rank}'s output is not every rank's x concatenated along dim {dim} in rank order"
        want_grad = torch.tensor_split(summed, n, dim)[rank]
        if grad is None or grad.dtype != dtype or not torch.allclose(grad.double(), want_grad, rtol=0, atol=tol):
            return (
                f"rank {rank}'s x.grad is not its slice, along dim {dim}, of the sum over ranks of the upstream "
                "gradients" + ("" if grad is None or grad.dtype == dtype else f" (it is {grad.dtype})")
            )
    return None


def _describe_gather(case):
    shape = tuple(case["shape"])
    layout = " (a transposed, non-contiguous view)" if case["transposed"] and len(shape) > 1 else ""
    return (
        f"Gather.apply(x, dim={case['dim']}, group) on {case['world_size']} ranks, x a {case['dtype']} tensor of "
        f"shape {shape}{layout}, then backward"
    )


# ---- 06.ulysses_attention ------------------------------------------------------------------------


def _ulysses_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            world_size=st.sampled_from((2, 3)),
            heads_per_rank=st.integers(1, 2),
            tokens=st.integers(1, 3),
            dim=st.integers(1, 4),
            dtype=st.sampled_from((torch.float32, torch.float64)),
            magnitude=st.sampled_from((1.0, 10.0, 40.0)),
            seed=st.integers(0, 99),
        )
    )  # 40: scores of thousands


def _ulysses_inputs(case):
    """The whole sequence's q, k, v: (1, heads, n * tokens, dim), the same in every process."""
    n = case["world_size"]
    shape = (1, case["heads_per_rank"] * n, case["tokens"] * n, case["dim"])
    return [_values(case["seed"] + i, shape, case["dtype"], case["magnitude"] if i < 2 else 1.0) for i in range(3)]


def _ulysses_on_rank(ctx, fn, case):
    rows = slice(ctx.rank * case["tokens"], (ctx.rank + 1) * case["tokens"])
    q, k, v = (t[:, :, rows].contiguous().to(ctx.device) for t in _ulysses_inputs(case))
    out = fn(q, k, v, None)
    return out.detach().cpu() if torch.is_tensor(out) else out


def _judge_ulysses(fn, case):
    import torch.nn.functional as F

    from ultrascale.runtime import grading_cluster

    q, k, v = (t.double() for t in _ulysses_inputs(case))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    tol = 1e-4 if case["dtype"] == torch.float32 else 1e-8
    for rank, got in enumerate(grading_cluster(case["world_size"]).run(_ulysses_on_rank, fn, case)):
        mine = want[:, :, rank * case["tokens"] : (rank + 1) * case["tokens"]]
        if not torch.is_tensor(got) or tuple(got.shape) != tuple(mine.shape) or got.dtype != case["dtype"]:
            return f"rank {rank} returned {got!r:.80}, expected a {tuple(mine.shape)} tensor of {case['dtype']}"
        if not torch.isfinite(got).all():
            return (
                f"rank {rank}'s output has inf or NaN: with scores of this size exp overflows. Subtract each "
                "row's maximum score before exponentiating (F.scaled_dot_product_attention and torch.softmax do)"
            )
        if not torch.allclose(got.double(), mine, rtol=tol, atol=tol):
            return f"rank {rank}'s output differs from causal attention over the whole sequence (in float64)"
    return None


def _describe_ulysses(case):
    n = case["world_size"]
    return (
        f"ulysses_attention on {n} ranks, q, k and v of shape (1, {case['heads_per_rank'] * n}, {case['tokens']}, "
        f"{case['dim']}) per rank, {case['dtype']}, q and k of size ~{case['magnitude']:g}"
    )


# ---- 08.split_sizes ---------------------------------------------------------------------------


def _split_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            world_size=st.sampled_from((2, 3)),
            per_rank=st.integers(1, 3),
            tokens=st.integers(0, 7),
            k=st.integers(1, 3),
            seed=st.integers(0, 99),
        )
    )


def _split_chosen(case, rank: int) -> torch.Tensor:
    """Each token's k distinct experts (k at most the number of experts)."""
    experts = case["per_rank"] * case["world_size"]
    g = torch.Generator().manual_seed(1009 * case["seed"] + rank)
    rows = [torch.randperm(experts, generator=g)[: min(case["k"], experts)] for _ in range(case["tokens"])]
    return torch.stack(rows) if rows else torch.zeros(0, min(case["k"], experts), dtype=torch.long)


def _split_on_rank(ctx, fn, case):
    send, receive = fn(_split_chosen(case, ctx.rank).to(ctx.device), case["per_rank"], None)
    return [int(v) for v in send], [int(v) for v in receive]


def _judge_split(fn, case):
    from ultrascale.runtime import grading_cluster

    n = case["world_size"]
    # sends[r][q]: the tokens of rank r with at least one expert on rank q
    sends = [
        [int(((_split_chosen(case, r) // case["per_rank"]) == q).any(-1).sum()) for q in range(n)] for r in range(n)
    ]
    for rank, (send, receive) in enumerate(grading_cluster(n).run(_split_on_rank, fn, case)):
        want_receive = [sends[q][rank] for q in range(n)]
        if (send, receive) != (sends[rank], want_receive):
            return (
                f"rank {rank}: send {send}, receive {receive}; expected {sends[rank]} and {want_receive} "
                f"(experts_per_rank={case['per_rank']} puts expert e on rank e // {case['per_rank']})"
            )
    return None


def _describe_split(case):
    k = min(case["k"], case["per_rank"] * case["world_size"])
    return (
        f"split_sizes(chosen, experts_per_rank={case['per_rank']}) on {case['world_size']} ranks, "
        f"{case['tokens']} token(s) per rank{' (none: an empty batch)' if not case['tokens'] else ''}, top-{k}"
    )


# ---- 10.step1 ---------------------------------------------------------------------------------


def _step1_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            n_params=st.one_of(
                st.sampled_from((10**10 - 1, 10**10, 10**10 + 1, 9.99e9)),  # ints at the 10B edge
                st.floats(1e8, 1e12),
            ),
            gpus=st.one_of(st.sampled_from((1, 511, 512, 1023, 1024)), st.integers(1, 20000)),
            gpus_per_node=st.sampled_from((1, 2, 4, 6, 8, 16, 72)),
            long_sequence=st.booleans(),
            moe=st.booleans(),
            positional=st.booleans(),
        )
    )


def _judge_step1(fn, case):
    from ultrascale.plan import rules

    args = (case["n_params"], case["gpus"], case["gpus_per_node"], case["long_sequence"], case["moe"])
    want = {
        frozenset(o)
        for o in rules.step1_techniques(args[0], args[1], gpus_per_node=args[2], long_sequence=args[3], moe=args[4])
    }
    if case["positional"]:  # as the signature in the text allows: step1_techniques(n, gpus, per_node, long, moe)
        got = fn(*args)
    else:
        got = fn(args[0], args[1], gpus_per_node=args[2], long_sequence=args[3], moe=args[4])
    got = None if got is None else {frozenset(o) for o in got}
    if got == want:
        return None
    return (
        f"expected {sorted(sorted(o) for o in want)}, got {None if got is None else sorted(sorted(o) for o in got)}"
        + (
            " (the arguments passed by position, in the order of the text's signature: step1_techniques(n_params, "
            "gpus, gpus_per_node=8, long_sequence=False, moe=False))"
            if case["positional"]
            else ""
        )
    )


def _describe_step1(case):
    if case["positional"]:
        return (
            f"step1_techniques({case['n_params']!r}, {case['gpus']}, {case['gpus_per_node']}, "
            f"{case['long_sequence']}, {case['moe']})"
        )
    return (
        f"step1_techniques({case['n_params']!r}, {case['gpus']}, gpus_per_node={case['gpus_per_node']}, "
        f"long_sequence={case['long_sequence']}, moe={case['moe']})"
    )


# ---- a1.timed_median -------------------------------------------------------------------------


def _timing_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            warmup=st.integers(0, 4),
            repeats=st.integers(1, 8),
            launch_cost=st.integers(0, 3),
            durations=st.lists(st.integers(0, 500), min_size=12, max_size=12),
        )
    )


def _judge_timing(fn, case):
    from ultrascale_grading.exercise_tests.cha1 import FakeDevice

    warmup, repeats = case["warmup"], case["repeats"]
    durations = case["durations"][: warmup + repeats]
    device = FakeDevice(durations, launch_cost=case["launch_cost"])
    want = statistics.median(case["launch_cost"] + d for d in durations[warmup:])
    got = fn(device.launch, warmup=warmup, repeats=repeats, synchronize=device.synchronize, clock=device.clock)
    if device.calls != warmup + repeats:
        return f"fn was called {device.calls} times, not warmup + repeats = {warmup + repeats}"
    if got == want:
        return None
    hint = ""
    if repeats % 2 == 0 and want != int(want) and got == math.floor(want):
        hint = (
            " With an even number of repeats the median is the mean of the middle two, which need not be a "
            "whole number: statistics.median, or (a + b) / 2, not //"
        )
    return f"expected a median of {want} time units, got {got!r}.{hint}"


def _describe_timing(case):
    warmup, repeats = case["warmup"], case["repeats"]
    d = case["durations"]
    return (
        f"time_median(fn, warmup={warmup}, repeats={repeats}, ...) on a device whose calls take "
        f"{d[:warmup]} (warm-up) then {d[warmup : warmup + repeats]} time units, plus {case['launch_cost']} "
        "to launch"
    )


# ---- a1.launched_by --------------------------------------------------------------------------

# (name, category) of the host calls that launch a kernel in real traces
LAUNCHES = (
    ("cudaLaunchKernel", "cuda_runtime"),
    ("cudaLaunchKernelExC", "cuda_runtime"),
    ("cuLaunchKernel", "cuda_driver"),
)


def _launch_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            processes=st.integers(1, 2),
            threads=st.integers(1, 2),
            other_launches=st.booleans(),
            edges=st.booleans(),
            ties=st.booleans(),
            epoch=st.booleans(),
            seed=st.integers(0, 999),
        )
    )


def _launch_trace(case) -> list:
    """Nested operators per (pid, tid), launches inside them (on their edges when drawn), kernels."""
    from ultrascale_grading.exercise_tests.cha1_launched_by import complete_event

    rng = random.Random(case["seed"])
    offset = 1_732_000_000_000_000 if case["epoch"] else 0  # microseconds since the epoch
    events, corr, kernel_ts = [], 0, []

    def ops(pid, tid, start, end, depth):
        nonlocal corr
        t = start
        while t < end - 4:
            dur = rng.randint(2, max(2, (end - t) // 2))
            events.append(
                complete_event(f"aten::op{depth}_{rng.randint(0, 99)}", "cpu_op", offset + t, dur, pid=pid, tid=tid)
            )
            if depth < 2 and dur > 8:
                ops(pid, tid, t + 1, t + dur - 1, depth + 1)
            if rng.random() < 0.7:
                corr += 1
                at = (
                    rng.choice((t, t + dur))
                    if case["edges"] and rng.random() < 0.5
                    else t + rng.randint(0, dur - 1) + 0.5
                )
                name, cat = rng.choice(LAUNCHES) if case["other_launches"] else LAUNCHES[0]
                events.append(complete_event(name, cat, offset + at, 1, pid=pid, tid=tid, correlation=corr))
                ts = (
                    rng.choice(kernel_ts)
                    if case["ties"] and kernel_ts and rng.random() < 0.5
                    else offset + at + rng.randint(1, 50)
                )
                kernel_ts.append(ts)
                events.append(
                    complete_event(f"kernel_{corr}", "kernel", ts, rng.randint(1, 9), pid=0, tid=7, correlation=corr)
                )
            t += dur + rng.randint(1, 5)

    for pid in range(1, case["processes"] + 1):
        for tid in range(1, case["threads"] + 1):
            ops(pid, tid, rng.randint(0, 5), 200, 0)
    rng.shuffle(events)
    return events


def _judge_launches(fn, case):
    from ultrascale_grading.exercise_tests.cha1_launched_by import reference_launched_by

    events = _launch_trace(case)
    want = reference_launched_by(events)
    got = fn(events)
    got = None if got is None else [tuple(pair) for pair in got]
    if got == want:
        return None
    hint = ""
    if got is not None and len(got) == len(want) and sorted(got, key=str) == sorted(want, key=str):
        hint = (
            " The pairs are right but not in order: sort by the kernel's ts, kernels with equal ts kept in trace order."
        )
    elif got is not None and len(got) == len(want):
        launch_names = {name for name, _ in LAUNCHES}
        hint = (
            " The launch is the non-kernel complete event with the kernel's correlation number, whatever it is "
            f"called ({', '.join(sorted(launch_names))}) and whichever API (cuda_runtime, cuda_driver) made it"
            if case["other_launches"]
            else ""
        )
    return f"expected {want}, got {got}.{hint}"


def _describe_launches(case):
    traits = [f"{case['processes']} process(es) x {case['threads']} thread(s) sharing thread ids"]
    traits += [
        t
        for t, on in (
            ("launches named cudaLaunchKernelExC or cuLaunchKernel (cat cuda_driver) too", case["other_launches"]),
            ("launches on an operator's start or end", case["edges"]),
            ("kernels that start at the same ts", case["ties"]),
            ("timestamps in microseconds since the epoch", case["epoch"]),
        )
        if on
    ]
    return f"launched_by(<a random trace, seed {case['seed']}: {'; '.join(traits)}>)"


# ---- a0: the ring, recursive doubling and halving-doubling collectives ---------------------------


def _collective_cases(flat: bool):
    """Tensors of any dtype the ranks add exactly (whole numbers: float32, float64, and bf16, whose 8 bits
    hold every sum of three of them), lengths the ranks do not divide or that leave chunks empty, and
    (all-reduces) 0-d and transposed 2-D tensors, on 2 and 3 ranks."""
    st = _st()
    shape = (
        st.lists(st.integers(1, 7), min_size=1, max_size=1)
        if flat
        else st.lists(st.integers(1, 5), min_size=0, max_size=2)
    )
    return st.fixed_dictionaries(
        dict(
            world_size=st.sampled_from((2, 3)),
            shape=shape,
            dtype=st.sampled_from(FLOATS),
            strided=st.booleans(),
            seed=st.integers(0, 99),
        )
    )


def _collective_input(case, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case["seed"] + rank)
    shape = list(case["shape"])
    if case["strided"] and len(shape) == 2:  # a transposed view
        return torch.randint(-50, 51, shape[::-1], generator=g).to(case["dtype"]).t()
    if case["strided"] and len(shape) == 1:  # every other element of a longer tensor
        return torch.randint(-50, 51, (2 * shape[0],), generator=g).to(case["dtype"])[::2]
    return torch.randint(-50, 51, shape, generator=g).to(case["dtype"])


def _collective_on_rank(ctx, kind: str, fn, case):
    from ultrascale_grading.exercise_tests.cha0 import forbid_collectives

    x = _collective_input(case, ctx.rank).to(ctx.device)
    with forbid_collectives(getattr(fn, "__name__", "your function")):
        if kind == "all_gather":
            chunk = torch.tensor_split(x.reshape(-1), ctx.world_size)[ctx.rank]
            out = fn(ctx, chunk, x.numel())
        else:
            out = fn(ctx, x)
    return out.detach().cpu() if torch.is_tensor(out) else out


def _collective_want(kind: str, case, rank: int) -> torch.Tensor:
    n = case["world_size"]
    inputs = [_collective_input(case, r) for r in range(n)]
    if kind == "all_gather":
        return torch.cat([torch.tensor_split(x.reshape(-1), n)[r] for r, x in enumerate(inputs)])
    total = torch.stack(inputs).sum(0)  # whole numbers: exact in every dtype drawn
    return torch.tensor_split(total, n)[rank] if kind == "reduce_scatter" else total


def _collective_judge(kind: str):
    def judge(fn, case):
        from ultrascale.runtime import grading_cluster

        for rank, got in enumerate(grading_cluster(case["world_size"]).run(_collective_on_rank, kind, fn, case)):
            want = _collective_want(kind, case, rank)
            if not torch.is_tensor(got):
                return f"rank {rank} returned {type(got).__name__}, not a tensor"
            if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
                return (
                    f"rank {rank} returned a {tuple(got.shape)} tensor of {got.dtype}, expected "
                    f"{tuple(want.shape)} of {want.dtype}: make buffers from the input (new_empty, empty_like, "
                    "clone), whose dtype they then keep, and reshape (view needs contiguous memory)"
                )
            if not torch.equal(got, want):
                return f"rank {rank}'s values differ from the {kind.replace('_', '-')} of the ranks' inputs"
        return None

    return judge


def _describe_collective(case):
    shape = tuple(case["shape"])
    layout = ""
    if case["strided"] and len(shape) == 2:
        layout = " (a transposed, non-contiguous view)"
    elif case["strided"] and len(shape) == 1:
        layout = " (every other element of a longer tensor: not contiguous)"
    return (
        f"world_size={case['world_size']}, a {case['dtype']} tensor of shape {shape}{' (0-d)' if not shape else ''}"
        f"{layout} of whole numbers on each rank"
    )


def _collective(kind: str, flat: bool) -> Property:
    edge = dict(world_size=3, shape=[2] if flat else [2, 3], dtype=torch.float64, strided=True, seed=0)
    return Property(lambda: _collective_cases(flat), _collective_judge(kind), _describe_collective, examples=(edge,))


PROPERTIES: dict = {
    "00.mean_across_ranks": Property(
        _mean_cases,
        _judge_mean,
        _describe_mean,
        examples=(
            dict(world_size=2, shape=[], dtype=torch.float64, transposed=False, seed=0),
            dict(world_size=3, shape=[2, 3], dtype=torch.bfloat16, transposed=True, seed=1),
        ),
    ),
    "01.grad_accumulation": Property(
        _accumulation_cases,
        _judge_accumulation,
        _describe_accumulation,
        examples=(dict(llama=False, dtype=torch.float64, grad_acc=3, mbs=2, seq=1, transposed=True, seed=0),),
    ),
    "02.assign_buckets": Property(
        _bucket_cases,
        _judge_buckets,
        _describe_buckets,
        examples=(
            # bf16 then float64 then a 0-d float32 view: each weighs its own bytes
            dict(
                params=[
                    dict(shape=[8], dtype=torch.bfloat16, view=False),
                    dict(shape=[2, 2], dtype=torch.float64, view=False),
                    dict(shape=[], dtype=torch.float32, view=True),
                ],
                cap=20,
            ),
        ),
    ),
    "08.dispatch_combine": Property(
        _moe_cases,
        _judge_moe,
        _describe_moe,
        examples=(dict(world_size=3, per_rank=1, tokens=[3, 0, 2], hidden=2, k=2, dtype=torch.float64, seed=0),),
    ),
    "08.expert_gradients": Property(
        _expert_grad_cases,
        _judge_expert_grad,
        _describe_expert_grad,
        examples=(
            dict(
                world_size=3, expert=True, replicas=False, shape=[2, 3], dtype=torch.bfloat16, transposed=True, seed=0
            ),
        ),
    ),
    "10.memory_filter": Property(
        _memory_cases,
        _judge_memory,
        _describe_memory,
        examples=(
            dict(model="LLAMA3_8B", gpus=8, seq=4096, count=6, boundary=True, gigabytes=80, headroom=0.5, seed=1),
        ),
    ),
    "10.step1": Property(
        _step1_cases,
        _judge_step1,
        _describe_step1,
        examples=(dict(n_params=10**10 - 1, gpus=6, gpus_per_node=6, long_sequence=True, moe=False, positional=True),),
    ),
    "a1.timed_median": Property(
        _timing_cases,
        _judge_timing,
        _describe_timing,
        examples=(dict(warmup=1, repeats=2, launch_cost=1, durations=[100, 10, 13] + [0] * 9),),
    ),
    "a1.launched_by": Property(
        _launch_cases,
        _judge_launches,
        _describe_launches,
        examples=(dict(processes=2, threads=2, other_launches=True, edges=True, ties=True, epoch=True, seed=0),),
    ),
    "02.bucket_manager": Property(
        _manager_cases,
        _judge_manager,
        _describe_manager,
        examples=(dict(world_size=2, dtype=torch.float64, cap=40, seed=0),),
    ),
    "04.conjugate_pair": Property(
        _mean_cases,
        _judge_reduce,
        _describe_reduce,
        argument=1,
        examples=(dict(world_size=3, shape=[2, 3], dtype=torch.float64, transposed=True, seed=0),),
    ),
    "04.column_parallel_linear": _linear("column"),
    "04.row_parallel_linear": _linear("row"),
    "05.sequence_gather_scatter": Property(
        _gather_cases,
        _judge_gather,
        _describe_gather,
        examples=(
            dict(world_size=2, shape=[2, 3], dim=0, dtype=torch.float64, transposed=True, seed=0),
            dict(world_size=3, shape=[1, 2, 1], dim=-2, dtype=torch.bfloat16, transposed=False, seed=1),
        ),
    ),
    "06.ulysses_attention": Property(
        _ulysses_cases,
        _judge_ulysses,
        _describe_ulysses,
        examples=(dict(world_size=2, heads_per_rank=1, tokens=2, dim=4, dtype=torch.float64, magnitude=40.0, seed=0),),
    ),
    "08.split_sizes": Property(
        _split_cases, _judge_split, _describe_split, examples=(dict(world_size=2, per_rank=3, tokens=0, k=2, seed=0),)
    ),
    "a0.ring_reduce_scatter": _collective("reduce_scatter", flat=True),
    "a0.ring_all_gather": _collective("all_gather", flat=True),
    "a0.ring_all_reduce": _collective("all_reduce", flat=False),
    "a0.recursive_doubling": _collective("all_reduce", flat=False),
    "a0.halving_doubling": _collective("all_reduce", flat=False),
}
