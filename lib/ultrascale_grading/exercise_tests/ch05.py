"""Tests of the chapter 5 exercises (solutions/05_sequence_parallelism_exercises.ipynb):
sequence parallelism's collectives, and the gradients of the norms it leaves split.

* ``05.sequence_gather_scatter``: ``Gather`` and ``ReduceScatter``, two
  ``torch.autograd.Function``s called as ``apply(x, dim, group)``: the book's g (all-gather
  along ``dim`` forward, reduce-scatter backward) and g* (reduce-scatter along ``dim``
  forward, all-gather backward). Graded against the library's ``comm.functional.g`` and
  ``g_star`` along dims 1 (the sequence), 0 and 2, with a different input and upstream
  gradient on every rank: the output, ``x.grad``, the input left unchanged, and the
  collectives of each direction (``CommLogger``): exactly one all-gather or one
  reduce-scatter, moving the library's bytes. An all-reduce followed by a slice gives the
  right numbers but moves twice the bytes of a reduce-scatter, and fails with a message
  that says so.
* ``05.sequence_parallel_norm_grads``: ``sync_norm_gradients(module, group)`` registers
  hooks so that a norm run on this rank's slice of the sequence ends with the gradient of
  the whole sequence (the sum over the tp ranks) in ``.grad``. Graded against one
  ``nn.LayerNorm`` in one process on the full sequence (weight and bias moved away from 1
  and 0): its output and input gradient (which must stay local), and ``.grad`` after one
  backward and after a second one that accumulates (a hook that all-reduces ``.grad``
  after accumulation counts the first micro-batch again); and the gradients must be
  bit-identical on the ranks of a tp group, since each rank's optimizer then applies them.
* ``05.activation_memory``: ``activation_bytes_per_rank(config, seq, micro_batch, tp=1,
  sequence_parallel=False, recompute="none")``, the activation bytes one rank keeps for
  backward in section 7's model (Korthikanti et al.), under TP alone or TP+SP and for the three
  recomputation modes. Graded against ``ultrascale.memory.activation_bytes`` (refused while
  the learner's code runs) on Llama 3 70B at 16k tokens, small and odd shapes, and tp 1 to 16
  (3 included, which divides nothing evenly); classic mistakes (TP alone dividing everything,
  SP leaving the 10·sbh whole, the scores not split by heads) are named.

Clusters, tp groups (the whole cluster, then 3 ranks cut into [0, 1] and [2]), the order of
work (everything runs before anything is judged) and the refusal of the library's own
answer (here ``g``/``g_star``'s gather and scatter helpers, and the hook of
``parallel.tensor_parallel``) are those of ``ch04``, whose helpers (``_common``) these tests
share. Tolerances: ``ultrascale.parity.tolerance(None)`` in float32 (rtol 1e-5,
atol 5e-6): the sums over ranks add the same numbers as one process in another order.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from ultrascale_grading import exercise

from ._common import (
    run_pair,
    close,
    describe,
    group_sizes,
    layouts,
    off_by,
    randn,
    refused_library,
    same_collectives,
    shape_problem,
    shared_problem,
    tp_group,
    wrong_group,
)

BASE = (2, 3, 4)  # what one rank holds: (batch, its slice of the sequence, hidden)
DIMS = (1, 0, 2)  # the sequence first; dims 0 and 2 catch code that ignores dim


def _long(dim: int, n: int) -> tuple:
    """BASE with ``dim`` ``n`` times longer: the whole tensor the slices make up."""
    return tuple(size * n if d == dim else size for d, size in enumerate(BASE))


# ---- 05.sequence_gather_scatter ---------------------------------------------------------


def _run_region(apply, x, dim, upstream, group, forbid=None) -> dict:
    """Forward and backward of ``apply(x, dim, group)`` with the collectives of each direction
    (chapter 04's harness for f / f*, with ``dim`` fixed)."""
    return run_pair(lambda t, g: apply(t, dim, g), x, upstream, group, forbid)


def _sequence_on_rank(ctx, Gather, ReduceScatter, seed, split):
    from ultrascale.comm import functional
    from ultrascale.comm.functional import g, g_star

    forbid = (
        [functional._all_gather, functional._reduce_scatter],
        "05.sequence_gather_scatter",
        "g and g_star are what you are writing here: use all_gather_into and reduce_scatter_into",
    )
    group, layout = tp_group(ctx, split)
    r, n = dist.get_rank(group), dist.get_world_size(group)
    runs = []  # everything runs before anything is judged
    for dim in DIMS:
        x = randn(BASE, seed, 11, dim, ctx.rank, device=ctx.device)
        upstream = randn(_long(dim, n), seed, 12, dim, ctx.rank, device=ctx.device)
        runs.append(
            (
                "Gather",
                dim,
                x,
                upstream,
                _run_region(g, x, dim, upstream, group),
                _run_region(Gather.apply, x, dim, upstream, group, forbid),
            )
        )
        x = randn(_long(dim, n), seed, 13, dim, ctx.rank, device=ctx.device)
        upstream = randn(BASE, seed, 14, dim, ctx.rank, device=ctx.device)
        runs.append(
            (
                "ReduceScatter",
                dim,
                x,
                upstream,
                _run_region(g_star, x, dim, upstream, group),
                _run_region(ReduceScatter.apply, x, dim, upstream, group, forbid),
            )
        )
    for name, dim, x, upstream, library, got in runs:
        judge = _judge_gather if name == "Gather" else _judge_reduce_scatter
        problem = judge(got, library, x, upstream, dim, r, n)
        if problem:
            return f"{name}, dim {dim}, {layout}, rank {ctx.rank}: {problem}"
    return None


def _front(dim: int) -> str:
    if dim == 0:
        return ""
    return (
        f". A collective works along dim 0 of contiguous buffers: for dim {dim} move it to the front "
        f"(x.movedim({dim}, 0).contiguous()), communicate, and move it back; a view or reshape to the final "
        "shape interleaves the slices"
    )


def _double_traffic(got_ops, library_ops, who: str) -> str | None:
    if not any(op == "all_reduce" for op, _ in got_ops):
        return None
    sent, wanted = sum(b for _, b in got_ops), sum(b for _, b in library_ops)
    return (
        f"{who} all-reduced the whole tensor and kept one slice ({describe(got_ops)}, {sent:,} bytes sent by "
        f"this rank; one reduce-scatter sends {wanted:,}). The numbers are right, but a ring all-reduce moves "
        "2(N-1)/N of the tensor through every rank where a reduce-scatter moves (N-1)/N: double the traffic, "
        "which sequence parallelism exists to avoid. Use one reduce-scatter (reduce_scatter_into)"
    )


def _judge_gather(got, library, x, upstream, dim, r, n) -> str | None:
    if "forbidden" in got:
        return got["forbidden"]
    problem = wrong_group(got["sizes"], n)
    if problem:
        return problem
    y, want = got["y"], library["y"]
    if torch.is_tensor(y) and dim != 0 and n > 1 and tuple(y.shape) == _long(0, n):
        return (
            f"the output has shape {tuple(y.shape)}: the slices were concatenated along dim 0, expected "
            f"{tuple(want.shape)} (along dim {dim})" + _front(dim)
        )
    problem = shape_problem("the output", y, want)
    if problem:
        return problem + f" (x's shape with dim {dim} N times longer)"
    if got["changed"]:
        return "the forward changed x in place; gather into a new tensor and leave x alone"
    if not close(y, want):
        return (
            f"the output is not every rank's x concatenated along dim {dim} in rank order (off by up to "
            f"{off_by(y, want)})" + _front(dim)
        )
    grad = got["grad"]
    if grad is None:
        return "x.grad is None after backward: backward must return the gradient of x (then None, None)"
    piece = x.shape[dim]
    if not close(grad, library["grad"]):
        if n > 1 and close(grad, upstream.narrow(dim, r * piece, piece)):
            return (
                "x.grad is this rank's slice of its own upstream gradient. Every rank used the whole gathered "
                "tensor, so the gradient of this rank's slice is the sum over ranks of their gradients for "
                "it: a reduce-scatter"
            )
        return (
            f"x.grad differs from this rank's slice (along dim {dim}) of the sum over ranks of the upstream "
            f"gradients by up to {off_by(grad, library['grad'])}" + _front(dim)
        )
    problem = shared_problem(got, upstream)
    if problem:
        return problem
    problem = same_collectives(got["forward"], library["forward"], "the forward")
    if problem:
        return problem + ": g's forward is one all-gather"
    problem = _double_traffic(got["backward"], library["backward"], "the backward")
    problem = problem or same_collectives(got["backward"], library["backward"], "the backward")
    if problem:
        return problem + ("" if "double the traffic" in problem else ": g's backward is one reduce-scatter")
    return None


def _judge_reduce_scatter(got, library, x, upstream, dim, r, n) -> str | None:
    if "forbidden" in got:
        return got["forbidden"]
    problem = wrong_group(got["sizes"], n)
    if problem:
        return problem
    y, want = got["y"], library["y"]
    if torch.is_tensor(y) and n > 1 and tuple(y.shape) == tuple(x.shape):
        return (
            f"the output has x's shape {tuple(x.shape)}: the whole sum. g* keeps only this rank's slice along "
            f"dim {dim}, shape {tuple(want.shape)}"
        )
    problem = shape_problem("the output", y, want)
    if problem:
        return problem + f" (x's shape with dim {dim} N times shorter)"
    if got["changed"]:
        return (
            "the forward changed x in place (an all-reduce on x itself?). The caller may still need it: "
            "reduce-scatter into a new tensor"
        )
    piece = want.shape[dim]
    if not close(y, want):
        if n > 1 and close(y, x.narrow(dim, r * piece, piece)):
            return "the output is this rank's slice of its own x: the sum over the ranks is missing"
        return (
            f"the output is not slice {r} (along dim {dim}) of the sum over ranks of x (off by up to "
            f"{off_by(y, want)})" + _front(dim)
        )
    grad = got["grad"]
    if grad is None:
        return "x.grad is None after backward: backward must return the gradient of x (then None, None)"
    if not close(grad, library["grad"]):
        return (
            f"x.grad must be every rank's upstream gradient concatenated along dim {dim} in rank order (an "
            "all-gather): each rank's x contributed to every slice of the sum. It differs by up to "
            f"{off_by(grad, library['grad'])}" + _front(dim)
        )
    problem = shared_problem(got, upstream)
    if problem:
        return problem
    problem = _double_traffic(got["forward"], library["forward"], "the forward")
    problem = problem or same_collectives(got["forward"], library["forward"], "the forward")
    if problem:
        return problem + ("" if "double the traffic" in problem else ": g*'s forward is one reduce-scatter")
    problem = same_collectives(got["backward"], library["backward"], "the backward")
    if problem:
        return problem + ": g*'s backward is one all-gather"
    return None


@exercise("05.sequence_gather_scatter", points=2)
def test_sequence_gather_scatter(
    Gather, ReduceScatter, world_size: int = 3, quick: bool = True, seed: int = 0, timeout: float = 60
):
    from ultrascale.runtime import grading_cluster

    for name, cls in (("Gather", Gather), ("ReduceScatter", ReduceScatter)):
        assert isinstance(cls, type) and issubclass(cls, torch.autograd.Function), (
            f"pass your {name} class itself (a subclass of torch.autograd.Function), got {cls!r}"
        )
    for size, split in layouts(world_size, quick):
        for problem in grading_cluster(size).run(
            _sequence_on_rank, Gather, ReduceScatter, seed, split, timeout=timeout
        ):
            if problem:
                raise AssertionError(problem)


# ---- 05.sequence_parallel_norm_grads ----------------------------------------------------

HIDDEN, PER_RANK, BATCH = 8, 3, 2  # each rank holds PER_RANK tokens of every sequence
MICRO_BATCHES = 2  # two backward passes accumulate into .grad


def _layer_norm(seed: int, device=None) -> nn.LayerNorm:
    """The same norm in every process (made on the host, then moved to ``device``), weight and
    bias away from 1 and 0."""
    norm = nn.LayerNorm(HIDDEN)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * randn((HIDDEN,), seed, 20))
        norm.bias.copy_(randn((HIDDEN,), seed, 21))
    return norm.to(device)


def _grads(module) -> dict:
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in module.named_parameters()}


def _watch_hook_arguments(module) -> list:
    """Register, on every parameter, a hook that keeps the gradient it receives and a copy of it.

    It returns nothing, so the hooks registered after it receive that very tensor: if it no
    longer equals its copy after backward, a later hook changed its argument in place, which
    PyTorch forbids (``Tensor.register_hook``: "The hook should not modify its argument"), since
    autograd may hand the same tensor to other branches and hooks. The list fills as backward runs.
    """
    seen = []
    for name, p in module.named_parameters():
        p.register_hook(lambda grad, name=name: seen.append((name, grad, grad.clone())))
    return seen


def _norm_on_rank(ctx, sync_norm_gradients, seed, split):
    from ultrascale.comm import CommLogger
    from ultrascale.parallel import grad_sync, sequence_parallel

    group, layout = tp_group(ctx, split)
    r, n = dist.get_rank(group), dist.get_world_size(group)
    norm, reference, alone = (_layer_norm(seed, ctx.device) for _ in range(3))
    given = _watch_hook_arguments(norm)  # registered first: the learner's hooks get the same tensors
    forbid = (
        [
            sequence_parallel.sum_norm_gradients,
            sequence_parallel.sum_gradient_over_tp,
            grad_sync.sync_in_backward,
            grad_sync.reduce_gradient,
        ],
        "05.sequence_parallel_norm_grads",
        "register the hooks yourself",
    )
    with refused_library(forbid) as refusal:
        sync_norm_gradients(norm, group)
    if refusal.message:
        return {"problem": f"{layout}, rank {ctx.rank}: {refusal.message}", "group": [], "grads": {}}
    mine = slice(r * PER_RANK, (r + 1) * PER_RANK)
    steps = []
    for micro in range(MICRO_BATCHES):
        x = randn((BATCH, PER_RANK * n, HIDDEN), seed, 22, micro, device=ctx.device)  # the whole sequences
        dy = randn((BATCH, PER_RANK * n, HIDDEN), seed, 23, micro, device=ctx.device)  # on every rank
        mine_x = x[:, mine].clone().requires_grad_()
        out = norm(mine_x)
        with CommLogger() as log:
            if torch.is_tensor(out) and out.shape == mine_x.shape:
                out.backward(dy[:, mine])
        full = x.clone().requires_grad_()
        expected = reference(full)  # one process, the whole sequence
        expected.backward(dy)
        alone(x[:, mine]).backward(dy[:, mine])  # this rank's tokens only, nothing summed
        steps.append(
            {
                "out": out.detach() if torch.is_tensor(out) else out,
                "x": mine_x.grad,
                "sizes": group_sizes(log),
                "changed": [name for name, t, kept in given if not torch.equal(t, kept)],
                "grads": _grads(norm),
                "expected_out": expected.detach()[:, mine],
                "expected_x": full.grad[:, mine],
                "expected": _grads(reference),
                "alone": _grads(alone),
            }
        )
    problem = _judge_norm(steps, n)
    return {
        "problem": f"{layout}, rank {ctx.rank}: {problem}" if problem else None,
        "group": dist.get_process_group_ranks(group),
        "grads": steps[-1]["grads"],
    }


def _judge_norm(steps, n) -> str | None:
    for micro, step in enumerate(steps):
        when = "after one backward" if micro == 0 else f"after {micro + 1} backward passes (gradient accumulation)"
        problem = wrong_group(step["sizes"], n)
        if problem:
            return problem
        problem = shape_problem("the norm's output", step["out"], step["expected_out"])
        if problem or not close(step["out"], step["expected_out"]):
            return (problem or "the norm's output changed") + ": the hooks must leave the forward alone"
        if not close(step["x"], step["expected_x"]):
            return (
                f"{when}, the gradient of the norm's input differs from the one-process norm's. The norm works "
                "token by token, so its input gradient stays this rank's own: sum only the parameters' "
                "gradients"
            )
        for name, want in step["expected"].items():
            got = step["grads"][name]
            if got is None:
                return f"{when}, {name}.grad is None"
            if close(got, want):
                continue
            if micro == 0 and n > 1 and close(got, step["alone"][name]):
                return (
                    f"{name}.grad holds only the contribution of this rank's tokens. The norm's parameters are "
                    "replicated, but each rank saw a different slice of the sequence, so the gradient of the "
                    "whole sequence is the sum over the tp ranks: all-reduce each parameter's gradient in a "
                    "hook (Tensor.register_hook on the parameter), and return the sum from the hook: its "
                    "return value replaces the gradient"
                )
            if micro == 0 and n > 1 and close(got * n, want):
                return (
                    f"{name}.grad is the average over the {n} tp ranks; it must be the sum (each rank holds "
                    "different tokens, not a copy of the same gradient): no division"
                )
            if micro > 0:
                first = steps[0]["expected"][name]
                if close(got, n * first + (want - first)):
                    return (
                        f"{when}, {name}.grad counts the first micro-batch {n} times (it was right after one "
                        "backward): the hook summed the accumulated .grad over the ranks again. All-reduce "
                        "each new gradient before it is accumulated (Tensor.register_hook on the parameter), "
                        "not .grad after accumulation"
                    )
                return (
                    f"{when}, {name}.grad must be the sum of every micro-batch's full-sequence gradient; it "
                    f"differs by up to {off_by(got, want)}"
                )
            return f"{when}, {name}.grad differs from the one-process norm's by up to {off_by(got, want)}"
        if step["changed"]:
            return (
                f"the gradients are right, but your hook changed the gradient it was given in place "
                f"({step['changed'][0]}'s: a collective on grad itself, e.g. dist.all_reduce(grad)). A hook must "
                "not modify its argument: autograd may hand the same tensor to other hooks and branches. "
                "All-reduce a copy (grad.clone()) and return it: the returned tensor replaces the gradient"
            )
    return None


@exercise("05.sequence_parallel_norm_grads", points=1)
def test_sequence_parallel_norm_grads(
    sync_norm_gradients, world_size: int = 3, quick: bool = True, seed: int = 0, timeout: float = 60
):
    from ultrascale.runtime import grading_cluster

    assert callable(sync_norm_gradients), f"pass your function, got {sync_norm_gradients!r}"
    for size, split in layouts(world_size, quick):
        results = grading_cluster(size).run(_norm_on_rank, sync_norm_gradients, seed, split, timeout=timeout)
        for result in results:
            if result["problem"]:
                raise AssertionError(result["problem"])
        for rank, result in enumerate(results):  # the copies on one tp group must stay equal
            first = results[result["group"][0]]
            for name, grad in result["grads"].items():
                assert torch.equal(grad, first["grads"][name]), (
                    f"{size} ranks, tp group {result['group']}: {name}.grad on rank {rank} is not identical to "
                    f"rank {result['group'][0]}'s (off by {off_by(grad, first['grads'][name])}). Each rank's "
                    "optimizer updates its own copy of the norm: the copies drift apart unless every rank gets "
                    "the very same gradient, the result of one all-reduce"
                )


# ---- 05.activation_memory ---------------------------------------------------------------

RECOMPUTE = ("none", "selective", "full")


class Shape:
    """What the formula reads from a model's config: layers, hidden and heads (any sizes)."""

    def __init__(self, layers: int, hidden: int, heads: int):
        self.layers, self.hidden, self.heads = layers, hidden, heads

    def __repr__(self):
        return f"Shape(layers={self.layers}, hidden={self.hidden}, heads={self.heads})"


def _activation_variants(config, seq, mbs, tp, sp, recompute) -> dict:
    """The right count (from ``memory.activation_bytes``) and the counts of classic mistakes."""
    from ultrascale.memory import activation_bytes

    L, h, a = config.layers, config.hidden, config.heads
    sbh, scores = seq * mbs * h, (0 if recompute == "selective" else 5 * a * seq * seq * mbs)
    right = activation_bytes(config, seq, mbs, recompute=recompute, tp=tp, sequence_parallel=sp)
    wrong = {}
    if recompute != "full":
        wrong["everything split"] = L * (34 * sbh + scores) / tp
        wrong["TP alone"] = L * (10 * sbh + (24 * sbh + scores) / tp)
        wrong["scores whole"] = L * ((34 * sbh / tp + scores) if sp else (10 * sbh + 24 * sbh / tp + scores))
        if recompute == "selective":
            wrong["selective keeps scores"] = right + L * 5 * a * seq * seq * mbs / tp
    else:
        wrong["full split"] = L * 2 * sbh / tp
        wrong["full whole"] = L * 2 * sbh
    wrong["one layer"] = right / L
    return {"right": right, **wrong}


ACTIVATION_HINTS = {
    "everything split": (
        "tensor parallelism alone leaves 10·s·b·h bytes per layer whole on every rank (the two "
        "LayerNorms' inputs and outputs, the dropout masks): only the 24·s·b·h inside the blocks and "
        "the scores divide by tp. Dividing everything by tp is what sequence parallelism adds"
    ),
    "TP alone": (
        "with sequence parallelism the 10·s·b·h that TP leaves whole are split along the sequence too: "
        "every term divides by tp"
    ),
    "scores whole": (
        "the attention scores (5·a·s²·b per layer) are split by heads under tensor parallelism: "
        "divide them by tp as well"
    ),
    "selective keeps scores": (
        "selective recomputation recomputes the attention scores in backward: their 5·a·s²·b bytes are not kept"
    ),
    "full split": (
        "full recomputation keeps each layer's input, 2·s·b·h bytes: whole on every rank under TP alone, "
        "split by tp only with sequence parallelism"
    ),
    "full whole": (
        "with sequence parallelism each rank keeps only its slice of every layer's input under full "
        "recomputation: 2·s·b·h / tp"
    ),
    "one layer": "that is one layer's worth: multiply by the number of layers",
}


def _activation_cases(quick: bool):
    from ultrascale.model import LLAMA3_70B, GPTConfig

    configs = [LLAMA3_70B, GPTConfig(vocab_size=50, hidden=48, layers=3, heads=6), Shape(5, 7, 1), Shape(2, 64, 4)]
    lengths = [(16384, 1), (1000, 3), (7, 2)] if not quick else [(16384, 1), (7, 2)]
    tps = (1, 2, 3, 4, 8, 16) if not quick else (1, 3, 16)
    return [
        (c, s, b, tp, sp, r)
        for c in configs
        for s, b in lengths
        for tp in tps
        for sp in (False, True)
        for r in RECOMPUTE
    ]


@exercise("05.activation_memory", points=1)
def test_activation_memory(activation_bytes_per_rank, quick: bool = True):
    """Korthikanti et al.'s counts per rank, TP alone or with SP, for the three recomputation modes,
    against ``memory.activation_bytes`` (tp 3 does not divide the sizes; sp at tp 1 changes nothing)."""
    from ultrascale_grading.guards import call_learner, without_library
    from ultrascale.memory import activation_bytes, breakdown

    learner = without_library(
        activation_bytes_per_rank,
        [activation_bytes, breakdown],
        "05.activation_memory",
        "write the per-layer formulas and multiply by the layers",
    )
    for config, seq, mbs, tp, sp, recompute in _activation_cases(quick):
        variants = _activation_variants(config, seq, mbs, tp, sp, recompute)
        expected = variants.pop("right")
        name = type(config).__name__ if not isinstance(config, Shape) else repr(config)
        call = (
            f"activation_bytes_per_rank({name} with layers={config.layers}, hidden={config.hidden}, "
            f"heads={config.heads}; seq={seq}, micro_batch={mbs}, tp={tp}, sequence_parallel={sp}, "
            f"recompute={recompute!r})"
        )
        got = call_learner(
            learner,
            config,
            seq,
            mbs,
            tp=tp,
            sequence_parallel=sp,
            recompute=recompute,
            call=call,
            expected=f"{expected:,} bytes",
        )
        assert isinstance(got, (int, float)) and not isinstance(got, bool), (
            f"{call} returned {got!r}; return a number of bytes"
        )
        if math.isclose(got, expected, rel_tol=1e-9):
            continue
        hint = next((ACTIVATION_HINTS[k] for k, v in variants.items() if math.isclose(got, v, rel_tol=1e-9)), "")
        raise AssertionError(f"{call}: expected {expected:,} bytes, got {got:,}" + (f". Hint: {hint}" if hint else ""))
    default = call_learner(activation_bytes_per_rank, Shape(2, 64, 4), 32, 1)
    assert default is not None and math.isclose(default, activation_bytes(Shape(2, 64, 4), 32, 1), rel_tol=1e-9), (
        "activation_bytes_per_rank(config, seq, micro_batch) should default to tp=1, sequence_parallel=False, "
        f"recompute='none', giving {activation_bytes(Shape(2, 64, 4), 32, 1):,} bytes; got {default!r}"
    )
