"""Tests of the chapter 3 exercises (solutions/03_zero_exercises.ipynb): ZeRO from scratch.

* ``03.flatten_padded``: ``flatten_padded(tensors, world_size)`` concatenates the tensors'
  elements into one 1-D tensor and pads it with zeros to a multiple of ``world_size``.
* ``03.zero1_step``: ``zero1_step(ctx, params, master, optimizer)`` is one ZeRO-1 optimizer
  step: reduce-scatter the gradients, update this rank's slice of the fp32 master weights,
  all-gather the slices back into the parameters. Graded by parity with plain data
  parallelism (full optimizer on every rank) over several steps, with Adam and with SGD,
  and by the collectives it calls (no all-reduce; about 2Ψ of traffic per step).
* ``03.shard_gradient``: ``shard_gradient(full_grad, group, dtype)`` is per-parameter
  sharding's gradient step (FSDP2's, ``parallel/fsdp.py``): this rank's rows (``torch.chunk``'s
  cut) of the gradient averaged over ``group`` with a reduce-scatter, cast to the master
  weights' ``dtype`` before the reduction. Graded on groups that are not the world, on row
  counts the group does not divide (an empty shard among them), with bf16 gradients.
* ``03.muon_rows``: ``muon_rows(update_rows, rows, group)``: Muon on a weight sharded by rows.
  All-gather the matrix's rows from ``group``, orthogonalise the whole matrix
  (``parallel.sharded_muon.newton_schulz``), keep this rank's rows. Graded against the whole
  matrix's result on groups that are not the world, wide, tall and uneven matrices; the
  mistake the issue names, orthogonalising the shard alone, is recognised and named.
* ``03.zero3_gather_free``: ``install_zero3_hooks(ctx, module)`` registers a forward
  pre-hook that all-gathers a module's flat parameter shard into its full parameters and a
  forward hook that frees them again. Graded by the logits of a GPT whose blocks all hold
  only their shard, against the unsharded model, with one block gathered at a time, and
  by weak references to the gathered memory, which must be gone after each block's forward.

The clusters have 2 and 3 ranks, and the test model has Ψ = 27,520 parameters (its blocks
12,704 each): neither is divisible by 3, so the padding matters. Data, training loop and
loss come from the parity harness (``ultrascale.parity``), as in tests/test_zero.py.

Tolerances: ``ultrascale.parity.TOLERANCES`` (fp32, SGD and Adam), where the reasons are
written. A reduce-scatter and an all-reduce sum the ranks' gradients in different orders,
so the results differ in the last bits. SGD runs first: Adam is blind to a wrong gradient
scale, and SGD's failure message can say what a wrong scale means.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ultrascale.data import Batches
from ultrascale_grading.exercise_tests._groups import Split, only_group
from ultrascale_grading import exercise
from ultrascale.model import GPT, GPTConfig
from ultrascale.parity import max_difference, tolerance
from ultrascale.train import make_optimizer, train

# Ψ = 27,520, blocks of 12,704: not multiples of 3, so a 3-rank cluster needs padding.
CFG = GPTConfig(vocab_size=64, hidden=32, layers=2, heads=2, seq_len=16)
DATA = Batches(CFG, mbs=2, seed=0)  # the same tokens on every rank and in the reference
OPTIMIZERS = {"sgd": "SGD", "adam": "Adam"}  # SGD first (see the docstring)


def _sizes(world_size, quick):
    return sorted({2, 3, world_size} if quick else {2, 3, 4, world_size})


# ---- 03.flatten_padded ---------------------------------------------------------------


def reference_flatten_padded(tensors, world_size: int) -> torch.Tensor:
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    padding = -flat.numel() % world_size
    return torch.cat([flat, flat.new_zeros(padding)])


CASES = [
    [(3, 4)],
    [(5,), (2, 3), (7, 1, 2)],
    [(1,)],
    [(4, 4), (4,)],
    [(13,), (2, 5)],
]


@exercise("03.flatten_padded", points=1)
def test_flatten_padded(flatten_padded, quick: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # float64 even in QUICK: a round trip through float32 keeps fp32 and bf16 values but not fp64's.
    dtypes = (torch.float32, torch.bfloat16, torch.float64)
    for shapes in CASES:
        for dtype in dtypes:
            # drawn in float64, so that float64 tensors hold values a float32 round trip would change
            tensors = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]
            originals = [t.clone() for t in tensors]
            for world_size in range(1, 9):
                call = f"flatten_padded({[tuple(s) for s in shapes]} in {dtype}, world_size={world_size})"
                got = flatten_padded(tensors, world_size)
                expected = reference_flatten_padded(tensors, world_size)
                assert isinstance(got, torch.Tensor), f"{call}: return a tensor, got {type(got).__name__}"
                assert got.dim() == 1, f"{call}: return a 1-D tensor, got shape {tuple(got.shape)}"
                numel = sum(t.numel() for t in tensors)
                assert got.numel() == expected.numel(), (
                    f"{call}: {numel} elements padded to a multiple of {world_size} is {expected.numel()}, "
                    f"got {got.numel()}"
                    + (" (no padding is needed when it already divides)" if numel % world_size == 0 else "")
                )
                assert got.dtype == dtype, f"{call}: keep the tensors' dtype {dtype}, got {got.dtype}"
                assert torch.equal(got[:numel], expected[:numel]), (
                    f"{call}: the first {numel} elements must be the tensors' elements, in order "
                    "(each tensor flattened row by row, then the next one)"
                    + (
                        ". Yours went through float32 on the way, which rounds float64 values: keep the dtype"
                        if dtype == torch.float64 and torch.equal(got[:numel], expected[:numel].float().double())
                        else ""
                    )
                )
                assert torch.equal(got[numel:], expected[numel:]), f"{call}: the padding must be zeros"
            for t, original in zip(tensors, originals):
                assert torch.equal(t, original), "flatten_padded changed its input tensors"
    # A parameter that requires grad: the flat copy is data, not part of the autograd graph.
    p = torch.nn.Parameter(torch.randn(5, generator=g))
    got = flatten_padded([p], 3)
    assert not got.requires_grad, "detach the parameters: the flat buffer must not require grad"


# ---- shared: the model and the data ---------------------------------------------------


def _model(device=None):
    torch.manual_seed(0)
    return GPT(CFG).to(device)  # seeded on the host, then on the rank's device


# ---- 03.zero1_step ---------------------------------------------------------------------


def _train_dp(ctx, opt_name, steps):
    """The reference: plain data parallelism, full optimizer state on every rank."""
    from ultrascale.parallel import NaiveDataParallel

    model = _model(ctx.device)
    dp = NaiveDataParallel(model)
    return train(
        model,
        DATA.rank_stream(ctx.rank, ctx.world_size),
        steps,
        opt_name,
        module=dp,
        after_backward=dp.finish_gradient_synchronization,
        device=ctx.device,
    )


def _train_zero1(ctx, zero1_step, opt_name, steps):
    from ultrascale.comm import CommLogger

    model = _model(ctx.device)
    params = list(model.parameters())
    flat = reference_flatten_padded(params, ctx.world_size)
    shard = flat.numel() // ctx.world_size
    master = flat[ctx.rank * shard : (ctx.rank + 1) * shard].float().clone()
    opt = make_optimizer([master], opt_name)
    traffic = []

    def step():  # the learner's step, in place of an optimizer's
        with CommLogger() as log:
            zero1_step(ctx, params, master, opt)
        traffic.append(log.totals())

    learner = SimpleNamespace(step=step, zero_grad=lambda: model.zero_grad(set_to_none=True))
    weights = train(model, DATA.rank_stream(ctx.rank, ctx.world_size), steps, learner, device=ctx.device)
    state = [t.numel() for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    return {
        "params": weights,
        "master": master.detach().clone(),
        "traffic": traffic,
        "state_numel": state,
        "padded": flat.numel(),
    }


@exercise("03.zero1_step", points=2)
def test_zero1_step(zero1_step, world_size: int = 3, quick: bool = True, timeout: float = 120):
    from ultrascale.runtime import grading_cluster

    steps = 3 if quick else 6
    for size in _sizes(world_size, quick):
        cluster = grading_cluster(size)
        for opt_name, shown in OPTIMIZERS.items():
            tol = tolerance(opt_name)
            expected = cluster.run(_train_dp, opt_name, steps, timeout=timeout)[0]
            results = cluster.run(_train_zero1, zero1_step, opt_name, steps, timeout=timeout)
            where = f"{size} ranks, {shown}, after {steps} steps"
            psi = sum(p.numel() for p in expected.values())
            shard = results[0]["padded"] // size
            flat_expected = torch.cat([p.reshape(-1) for p in expected.values()])
            for rank, out in enumerate(results):
                _check_traffic(out["traffic"], size, psi, out["padded"], f"{where}, rank {rank}")
                for name, want in expected.items():
                    got = out["params"][name]
                    if not torch.allclose(got, want, **tol):
                        raise AssertionError(
                            f"{where}, rank {rank}: parameter {name} {tuple(want.shape)} differs "
                            f"from plain data parallelism by up to {max_difference(got, want):.3g}."
                            f"{_zero1_hint(opt_name)}"
                        )
                mine = flat_expected[rank * shard : min((rank + 1) * shard, psi)]
                assert torch.allclose(out["master"][: mine.numel()], mine, **tol), (
                    f"{where}, rank {rank}: the fp32 master slice does not hold the updated weights of "
                    f"elements [{rank * shard}, {rank * shard + mine.numel()}); did you update `master` in place "
                    "through the optimizer?"
                )
                assert all(n == shard for n in out["state_numel"]), (
                    f"{where}: the optimizer's state must cover only this rank's slice ({shard} elements)"
                )


def _zero1_hint(opt_name) -> str:
    if opt_name == "sgd":
        return (
            " With SGD a wrong gradient scale shows: the reduce-scatter sums the ranks' gradients, "
            "divide by the world size to average them."
        )
    return " Check the slice each rank owns and how the gathered values are copied back into each parameter."


def _check_traffic(traffic, n, psi, padded, where):
    """No all-reduce; a reduce-scatter and an all-gather of the (padded) model per step."""
    for step, totals in enumerate(traffic):
        ops = set(totals)
        banned = ops & {"all_reduce", "broadcast", "reduce", "all_to_all", "all_to_all_single", "send", "isend"}
        assert not banned, (
            f"{where}, step {step}: ZeRO-1 communicates with a reduce-scatter and an all-gather "
            f"only, but the step called {sorted(banned)}"
        )
        scatter = sum(t["bytes_sent"] for op, t in totals.items() if op.startswith("reduce_scatter"))
        gather = sum(t["bytes_sent"] for op, t in totals.items() if op.startswith("all_gather"))
        assert scatter > 0, f"{where}, step {step}: no reduce-scatter was called; average the gradients with one"
        assert gather > 0, f"{where}, step {step}: no all-gather was called; share the updated slices with one"
        # A ring moves (n-1)/n of the buffer from each rank; fp32 is 4 bytes per element.
        for name, sent in (("reduce-scatter", scatter), ("all-gather", gather)):
            elements = sent * n / (n - 1) / 4
            assert 0.99 * psi <= elements <= 1.01 * padded, (
                f"{where}, step {step}: the {name}s moved {elements:,.0f} elements' worth; one {name} of the "
                f"flat (padded) model moves {padded:,}"
            )


# ---- 03.zero3_gather_free --------------------------------------------------------------


def shard_module(ctx, module):
    """Keep only this rank's slice of ``module``'s parameters, ZeRO-3 style.

    The parameters are flattened into one buffer padded to a multiple of the world size
    (``reference_flatten_padded``); rank r keeps elements [r s, (r+1) s) as
    ``module.zero3_shard``. ``module.zero3_layout`` lists ``(parameter, offset, shape)``:
    parameter p's elements are ``flat[offset : offset + p.numel()]``, in ``shape``. Every
    parameter is then emptied (``p.data`` becomes a 0-element tensor), so the full values
    exist on no rank until someone gathers them.
    """
    params = list(dict.fromkeys(module.parameters()))
    flat = reference_flatten_padded(params, ctx.world_size)
    shard = flat.numel() // ctx.world_size
    module.zero3_shard = flat[ctx.rank * shard : (ctx.rank + 1) * shard].clone()
    layout, offset = [], 0
    for p in params:
        layout.append((p, offset, tuple(p.shape)))
        offset += p.numel()
    module.zero3_layout = layout
    for p in params:
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return module


def _gathered_blocks(model) -> list:
    return [i for i, block in enumerate(model.blocks) if any(p.numel() for p in block.parameters())]


ALL_GATHERS = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base", "all_gather")


class _GatheredMemory:
    """Weak references to the memory a block's forward gathers, to see whether it is freed.

    While a block runs, the outputs of every all-gather and the storages its parameters
    point at are tracked without keeping them alive (``StorageWeakRef``). Right after the
    block's forward hooks (the learner's free included), every one of them must be gone:
    a reference kept anywhere (a closure variable, a list, a global, an attribute) keeps
    the full parameters in memory, which is what ZeRO-3 exists to avoid.
    """

    def __init__(self):
        self.tracked = []  # (StorageWeakRef, bytes) of the block now running
        self.kept = []  # per block forward: bytes of gathered memory still alive after it

    def track(self, tensors) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        for t in tensors:
            if torch.is_tensor(t) and t.numel():
                storage = t.untyped_storage()
                self.tracked.append((StorageWeakRef(storage), storage.nbytes()))

    @contextlib.contextmanager
    def installed(self):
        """Track the output of every all-gather called as ``dist.<name>`` while open."""
        saved = []
        for name in ALL_GATHERS:
            original = getattr(dist, name, None)
            if original is None:
                continue
            saved.append((name, original))
            setattr(dist, name, self._watch(original))
        try:
            yield self
        finally:
            for name, original in reversed(saved):
                setattr(dist, name, original)

    def _watch(self, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def watched(*args, **kwargs):
            result = original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs).arguments
            output = bound.get("output_tensor", bound.get("tensor_list"))
            self.track(output if isinstance(output, (list, tuple)) else [output])
            return result

        return watched

    def still_alive(self) -> int:
        """Bytes of the tracked memory that something still references (after a garbage collection)."""
        alive = [(ref, n) for ref, n in self.tracked if not ref.expired()]
        if alive:
            gc.collect()  # a reference cycle is garbage, not a reference kept on purpose
        for _ in range(20):  # gloo's worker thread may hold a finished collective (and its
            alive = [(ref, n) for ref, n in alive if not ref.expired()]  # output) a moment longer
            if not alive:
                break
            time.sleep(0.002)
        seen, total = set(), 0
        for ref, n in alive:
            if ref.cdata not in seen:
                seen.add(ref.cdata)
                total += n
        return total


def _run_zero3(ctx, install_zero3_hooks, inputs):
    from ultrascale.comm import CommLogger

    reference = _model(ctx.device)
    model = _model(ctx.device)
    inputs = [tokens.to(ctx.device) for tokens in inputs]
    full_sizes = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    for block in model.blocks:
        shard_module(ctx, block)
        install_zero3_hooks(ctx, block)
    shards = [block.zero3_shard.clone() for block in model.blocks]
    seen = []  # which blocks hold full parameters while each block computes
    memory = _GatheredMemory()

    def starting(module, args):  # before the learner's pre-hook
        memory.tracked = []

    def computing(module, args):  # after it: the parameters point at the gathered memory
        seen.append(_gathered_blocks(model))
        memory.track([p for p in module.parameters()])

    def done(module, args, output):  # after the learner's forward hook
        memory.kept.append(memory.still_alive())
        memory.tracked = []

    for block in model.blocks:  # around the learner's hooks, so they see their effect
        block.register_forward_pre_hook(starting, prepend=True)
        block.register_forward_pre_hook(computing)
        block.register_forward_hook(done)
    out = {
        "logits": [],
        "expected": [],
        "seen": seen,
        "traffic": [],
        "after": [],
        "kept_bytes": memory.kept,
        "full_bytes": [4 * n for n in full_sizes],
    }
    with torch.no_grad():
        for tokens in inputs:
            with CommLogger() as log, memory.installed():
                out["logits"].append(model(tokens))
            out["traffic"].append(log.totals())
            out["after"].append(_gathered_blocks(model))
            out["expected"].append(reference(tokens))
    out["shards_unchanged"] = all(torch.equal(a, b.zero3_shard) for a, b in zip(shards, model.blocks))
    # Anything as large as a block's full parameters left on the module is a full copy kept alive.
    out["kept"] = [
        name
        for block, size in zip(model.blocks, full_sizes)
        for name, value in vars(block).items()
        if torch.is_tensor(value) and value.numel() >= size
    ]
    return out


@exercise("03.zero3_gather_free", points=2)
def test_zero3_gather_free(install_zero3_hooks, world_size: int = 3, quick: bool = True, timeout: float = 120):
    from ultrascale.runtime import grading_cluster

    layers = CFG.layers
    inputs = [DATA.global_batch(step).inputs for step in range(2)]
    for size in _sizes(world_size, quick):
        results = grading_cluster(size).run(_run_zero3, install_zero3_hooks, inputs, timeout=timeout)
        for rank, out in enumerate(results):
            where = f"{size} ranks, rank {rank}"
            for call, (got, want) in enumerate(zip(out["logits"], out["expected"])):
                assert got.shape == want.shape, (
                    f"{where}: logits of shape {tuple(got.shape)}, expected {tuple(want.shape)}"
                )
                if not torch.allclose(got, want, **tolerance(None)):  # one forward: rounding only
                    raise AssertionError(
                        f"{where}, forward {call + 1}: the logits differ from the unsharded model's by up to "
                        f"{max_difference(got, want):.3g}. Each rank's shard is one slice of the padded flat "
                        "buffer, in rank order; every parameter is flat[offset : offset + numel] viewed in its shape."
                    )
            for call, after in enumerate(out["after"]):
                assert not after, (
                    f"{where}: after forward {call + 1}, blocks {after} still hold their full "
                    "parameters; the forward hook must free them (an empty p.data)"
                )
            for i, gathered in enumerate(out["seen"]):
                block = i % layers
                assert gathered == [block], (
                    f"{where}: while block {block} computed, the blocks holding full parameters were {gathered}; "
                    f"expected only [{block}]: gather in the block's pre-hook, free in its forward hook"
                )
            assert out["shards_unchanged"], f"{where}: the hooks changed module.zero3_shard; leave the shard alone"
            assert not out["kept"], (
                f"{where}: a full-size tensor stays attached to a block ({out['kept']}); "
                "free the gathered buffer, do not keep it on the module"
            )
            for i, kept in enumerate(out["kept_bytes"]):
                block = i % layers
                assert not kept, (
                    f"{where}, forward {i // layers + 1}: after block {block}'s forward, {kept:,} bytes of the "
                    f"memory gathered for it (its full parameters are {out['full_bytes'][block]:,} bytes) are "
                    "still alive: something still references the gathered buffer (a closure variable, a list or "
                    "dict, a global, an attribute). Setting p.data to an empty tensor frees the memory only when "
                    "nothing else holds it: keep the buffer in a local variable of the pre-hook, not anywhere "
                    "that outlives the forward"
                )
            for call, totals in enumerate(out["traffic"]):
                banned = set(totals) & {"all_reduce", "broadcast", "send", "isend"}
                assert not banned, f"{where}: gather the shards with an all-gather, not {sorted(banned)}"
                calls = sum(t["calls"] for op, t in totals.items() if op.startswith("all_gather"))
                assert calls == layers, (
                    f"{where}, forward {call + 1}: {calls} all-gather calls for {layers} blocks; "
                    "expected one per block per forward"
                )


# ---- 03.shard_gradient -----------------------------------------------------------------
# 7 and 9 rows split unevenly over 2 and 3 ranks; 2 rows over 3 ranks leave the last one empty.
SHARD_SHAPES = [(7, 3), (2, 5), (6,), (9, 4)]
# (the dtype the gradient was computed in, the master weights' dtype it must come back in)
SHARD_DTYPES = [(torch.float64, torch.float64), (torch.bfloat16, torch.float32)]


def rank_gradient(shape, rank: int, seed: int) -> torch.Tensor:
    """Rank ``rank``'s gradient of a whole parameter: other on every rank, reproducible anywhere."""
    gen = torch.Generator().manual_seed(7919 * seed + rank)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def chunk_rows(rows: int, n: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of member ``index``'s rows under ``torch.chunk``'s cut."""
    per = -(-rows // n)
    start = min(index * per, rows)
    return start, min(per, rows - start)


def _shard_on_rank(ctx, shard_gradient, split, seed):
    _, group, ranks = split.group_of(ctx)
    results = []
    for shape in SHARD_SHAPES:
        for compute, master in SHARD_DTYPES:
            full = rank_gradient(shape, ctx.rank, seed).to(compute).to(ctx.device)
            with only_group(group, "shard_gradient"):
                got = shard_gradient(full, group, master)
            results.append(got.detach().cpu() if torch.is_tensor(got) else got)
    return ranks, results


@exercise("03.shard_gradient", points=2)
def test_shard_gradient(shard_gradient, world_size: int = 3, quick: bool = True, seed: int = 0, timeout: float = 60):
    """Each rank returns its rows of the gradient averaged over its group, in the master's dtype:
    on the whole world and on a group of ranks [1, 2] beside rank 0 alone."""
    splits = [Split([0], [1, 2]), Split([0, 1, 2])]  # groups of 1, 2 and 3 ranks; the telling one first
    for split in splits:
        per_rank = split.run(_shard_on_rank, shard_gradient, split, seed, what="03.shard_gradient", timeout=timeout)
        for rank, (ranks, results) in enumerate(per_rank):
            cases = iter(results)
            for shape in SHARD_SHAPES:
                for compute, master in SHARD_DTYPES:
                    where = f"on {split}, rank {rank}: a {shape} gradient in {compute}, masters in {master}"
                    _check_shard(next(cases), shape, compute, master, ranks, rank, seed, where, split.world_size)


def _check_shard(got, shape, compute, master, ranks, rank, seed, where, world):
    n, index = len(ranks), ranks.index(rank)
    start, length = chunk_rows(shape[0], n, index)
    inputs = [rank_gradient(shape, r, seed).to(compute).to(master) for r in ranks]
    total = torch.stack(inputs).sum(dim=0)[start : start + length]
    want = total / n
    assert torch.is_tensor(got), f"{where}: return a tensor, got {type(got).__name__}"
    per = -(-shape[0] // n)
    assert tuple(got.shape) == tuple(want.shape), (
        f"{where}: expected this rank's {length} rows (rows {start}..{start + length} of {shape[0]}), shape "
        f"{tuple(want.shape)}, got {tuple(got.shape)}. The rows are cut as torch.chunk cuts them: "
        f"ceil({shape[0]} / {n}) = {per} per member of the group, the last members short or empty; pad to "
        f"{per * n} rows for the reduce-scatter, then drop the padding"
    )
    assert got.dtype == master, (
        f"{where}: return the gradient in {master}, the master weights' dtype (the optimizer steps those), "
        f"not {got.dtype}" + (": a gradient left in the compute dtype loses bits" if got.dtype == compute else "")
    )
    tol = tolerance(None, master)
    if torch.allclose(got, want, **tol):
        return
    if torch.allclose(got, total, **tol) and n > 1:
        raise AssertionError(
            f"{where}: these are the sums over the group's {n} ranks; divide by the group's size to average them"
        )
    if world != n and torch.allclose(got, total / world, **tol):
        raise AssertionError(
            f"{where}: divided by the world's size ({world}), not the group's ({n}): ask the "
            "group for its size, not the world"
        )
    reduced_low = torch.stack([rank_gradient(shape, r, seed).to(compute) for r in ranks]).sum(dim=0)
    if compute != master and torch.allclose(
        got, reduced_low[start : start + length].to(master) / n, rtol=1e-2, atol=1e-2
    ):
        raise AssertionError(
            f"{where}: close, but off by {max_difference(got, want):.3g}: the values look "
            f"reduced in {compute}; cast to {master} first, then reduce-scatter"
        )
    raise AssertionError(
        f"{where}: wrong values (off by up to {max_difference(got, want):.3g}); rank {rank} is "
        f"member {index} of the group {ranks} and keeps rows {start}..{start + length} of the "
        "average over the group"
    )


# ---- 03.muon_rows ------------------------------------------------------------------------
# (rows, cols): wide, tall (Newton-Schulz works on its transpose), rows the groups do not divide
MUON_SHAPES = [(5, 8), (9, 4), (6, 6), (2, 3)]


def _muon_on_rank(ctx, muon_rows, split, seed):
    _, group, ranks = split.group_of(ctx)
    n, member = len(ranks), ranks.index(ctx.rank)
    results = []
    for shape in MUON_SHAPES:
        for dtype in (torch.float64, torch.float32):
            whole = rank_gradient(shape, 0, seed + 1).to(dtype)  # the same matrix on every rank of every group
            start, length = chunk_rows(shape[0], n, member)
            mine = whole[start : start + length].clone().to(ctx.device)
            with only_group(group, "muon_rows"):
                got = muon_rows(mine, shape[0], group)
            results.append(got.detach().cpu() if torch.is_tensor(got) else got)
    return ranks, results


@exercise("03.muon_rows", points=2)
def test_muon_rows(muon_rows, world_size: int = 3, quick: bool = True, seed: int = 0, timeout: float = 60):
    """Each rank returns its rows of the whole matrix orthogonalised by Newton-Schulz, computed in
    the rows' dtype: on a group of ranks [1, 2] beside rank 0 alone, and on the whole world."""
    from ultrascale.parallel.sharded_muon import newton_schulz

    for split in (Split([0], [1, 2]), Split([0, 1, 2])):  # groups of 1, 2 and 3 ranks
        per_rank = split.run(_muon_on_rank, muon_rows, split, seed, what="03.muon_rows", timeout=timeout)
        for rank, (ranks, results) in enumerate(per_rank):
            n, member = len(ranks), ranks.index(rank)
            cases = iter(results)
            for shape in MUON_SHAPES:
                for dtype in (torch.float64, torch.float32):
                    got, where = next(cases), f"on {split}, rank {rank}: a {shape} matrix in {dtype}"
                    whole = rank_gradient(shape, 0, seed + 1).to(dtype)
                    start, length = chunk_rows(shape[0], n, member)
                    want = newton_schulz(whole, dtype=dtype)[start : start + length]
                    assert torch.is_tensor(got), f"{where}: return a tensor, got {type(got).__name__}"
                    assert tuple(got.shape) == tuple(want.shape), (
                        f"{where}: expected this rank's {length} rows (rows {start}..{start + length} of {shape[0]}, "
                        f"torch.chunk's cut over the group's {n} ranks), shape {tuple(want.shape)}, got "
                        f"{tuple(got.shape)}; drop the padding rows after the gather"
                    )
                    assert got.dtype == dtype, f"{where}: return the rows in {dtype}, got {got.dtype}"
                    if torch.allclose(got, want, **tolerance(None, dtype)):
                        continue
                    alone = newton_schulz(whole[start : start + length], dtype=dtype) if length else want
                    if n > 1 and alone.shape == got.shape and torch.allclose(got, alone, **tolerance(None, dtype)):
                        raise AssertionError(
                            f"{where}: you orthogonalised this rank's rows alone. Newton-Schulz multiplies the whole "
                            "matrix by its transpose, so every row depends on every other: gather the whole matrix "
                            "from the group first, orthogonalise it, then keep this rank's rows"
                        )
                    low = newton_schulz(whole, dtype=torch.bfloat16)[start : start + length].to(dtype)
                    if dtype != torch.bfloat16 and torch.allclose(got, low, rtol=1e-3, atol=1e-3):
                        raise AssertionError(
                            f"{where}: these rows were orthogonalised in bfloat16 (newton_schulz's "
                            "default); compute in the rows' own dtype (its dtype= argument)"
                        )
                    raise AssertionError(
                        f"{where}: wrong values (off by up to {max_difference(got, want):.3g}); "
                        f"rank {rank} is member {member} of {ranks} and keeps rows "
                        f"{start}..{start + length} of the whole orthogonalised matrix"
                    )
