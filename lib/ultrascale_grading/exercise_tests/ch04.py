"""Tests of the chapter 4 exercises (solutions/04_tensor_parallelism_exercises.ipynb):
tensor parallelism built from its two communication primitives. The vocabulary-parallel loss
(``04.vocab_parallel_cross_entropy``) is tested in ``ch04_vocab_parallel.py``, the same way.

* ``04.conjugate_pair``: ``Copy`` and ``Reduce``, two ``torch.autograd.Function``s called as
  ``apply(x, group)``: the book's f (identity forward, all-reduce of the gradient backward)
  and f* (all-reduce forward, identity backward). Graded against the library's
  ``comm.functional.f`` and ``f_star``: the output and ``x.grad``, with a different input
  and upstream gradient on every rank (so that a sum, an average and a rank's own tensor
  all differ); the collectives of each direction, from a ``CommLogger`` (f: none forward,
  one all-reduce backward; f*: the other way round, the same bytes as the library's); and
  the input, which the forward must leave unchanged.
* ``04.column_parallel_linear``: ``column_parallel_forward(x, weight_shard, bias_shard,
  group)`` returns this rank's slice of the output features. Graded against one
  ``nn.Linear`` in one process: the output slice, ``x.grad`` (the *full* gradient: x must go
  through f), and the weight and bias shards' gradients (slices of the full ones); no
  collective in forward, one all-reduce in backward, as the library's ``ColumnParallelLinear``.
* ``04.row_parallel_linear``: ``row_parallel_forward(x_shard, weight_shard, bias, group)``:
  the partial product, summed over the ranks by f*, the bias added once after the sum.
  Graded against the full layer: the output on every rank, the gradients of the input
  slice, the weight shard and the (replicated) bias on every rank; one all-reduce forward,
  none backward, as the library's ``RowParallelLinear``.

Every test runs on clusters of 2 and 3 ranks (and the notebook's ``WORLD_SIZE``) with the
whole cluster as the tp group, then with 3 ranks cut into two tp groups, [0, 1] and [2], and
into [0] and [1, 2] (a group whose ranks are not the global ones): a collective that leaves out
``group=group`` runs on a group of the wrong size there, which the ``CommLogger`` shows.

Every backward runs with its incoming gradient shared with another branch (``SharedBranch``,
out = y + 2 side, as a residual shares it): a backward that changes that tensor in place fails.

All computations on the ranks run first, the judging after, so that a rank that finds a
mistake never leaves the others waiting in a collective. Each rank returns its first
problem as text and the test raises it.

While the learner's code runs, the library's own answer refuses to run
(``grading.guards.forbid_library``): ``comm.functional``'s all-reduce helper behind f and
f* for the first exercise, ``ColumnParallelLinear.forward`` and ``RowParallelLinear.forward``
for the layers (``f`` and ``f_star`` themselves are allowed there: they are the previous
exercise). A plain ``dist.all_reduce`` on a tensor that autograd tracks is refused too: it has no
backward, and PyTorch only warns.

Tolerances: ``ultrascale.parity.tolerance(None)`` in float32 (rtol 1e-5, atol 5e-6, the
reason is written in ``parity.TOLERANCES``): the ranks add the same products as one
process in another order (a sum over ranks of partial matmuls, against one matmul), which
changes the last bits only (~1e-7 relative). A missing sum, a bias counted twice or a
wrong slice is off by far more.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ultrascale_grading import exercise

from ._common import (
    SharedBranch,
    run_pair,
    close,
    collectives,
    describe,
    group_sizes,
    off_by,
    randn,
    refused_library,
    run_layouts,
    same_collectives,
    shape_problem,
    shared_problem,
    tp_group,
    untracked_collectives,
    untracked_problem,
    wrong_group,
)

SHAPE = (2, 3, 4)  # (batch, sequence, features) of the conjugate-pair inputs


# ---- 04.conjugate_pair ------------------------------------------------------------------


def _pair_on_rank(ctx, Copy, Reduce, seed, split):
    from ultrascale.comm import functional
    from ultrascale.comm.functional import f, f_star

    group, layout = tp_group(ctx, split)
    n = dist.get_world_size(group)
    x = randn(SHAPE, seed, 1, ctx.rank, device=ctx.device)  # a different input on every rank
    upstream = randn(SHAPE, seed, 2, ctx.rank, device=ctx.device)  # and a different upstream gradient
    # Everything runs before anything is judged: no rank may leave the others in a collective.
    library = {"Copy": run_pair(f, x, upstream, group), "Reduce": run_pair(f_star, x, upstream, group)}
    forbid = (
        [functional._all_reduce],
        "04.conjugate_pair",
        "f and f_star are what you are writing here: call dist.all_reduce yourself",
    )
    learner = {
        "Copy": run_pair(Copy.apply, x, upstream, group, forbid),
        "Reduce": run_pair(Reduce.apply, x, upstream, group, forbid),
    }
    judge = {"Copy": _judge_copy, "Reduce": _judge_reduce}
    for name in ("Copy", "Reduce"):
        problem = judge[name](learner[name], library, x, upstream, n)
        if problem:
            return f"{name}, {layout}, rank {ctx.rank}: {problem}"
    return None


def _judge_copy(got, library, x, upstream, n) -> str | None:
    if "forbidden" in got:
        return got["forbidden"]
    problem = wrong_group(got["sizes"], n)
    if problem:
        return problem
    y, grad = got["y"], got["grad"]
    problem = shape_problem("Copy.apply(x, group)", y, x)
    if problem:
        return problem
    if got["changed"]:
        return "the forward changed x in place. f's forward is the identity: return x and leave it alone"
    if not close(y, x):
        if close(y, library["Reduce"]["y"]):
            return (
                "the forward returned the sum of x over the ranks. f is the identity in forward: in tensor "
                "parallelism every rank already holds the same x. Its all-reduce belongs in backward"
            )
        return f"the forward must return x unchanged; it differs from x by up to {off_by(y, x)}"
    if grad is None:
        return "x.grad is None after backward: backward must return the gradient of x (and None for group)"
    want = library["Copy"]["grad"]
    if not close(grad, want):
        if close(grad, upstream) and n > 1:
            return (
                "x.grad is this rank's own upstream gradient. The loss depends on x through every rank's "
                "slice of the computation, so dL/dx is the sum of all ranks' gradients: all-reduce "
                "(sum) the gradient in backward"
            )
        if close(grad * n, want) and n > 1:
            return (
                f"x.grad is the average over the {n} ranks; it must be the sum (the ranks' contributions "
                "add up, they are not copies of one gradient): no division"
            )
        return f"x.grad differs from the sum over ranks of the upstream gradients by up to {off_by(grad, want)}"
    problem = shared_problem(got, upstream)
    if problem:
        return problem
    if got["forward"]:
        return (
            f"the forward called {describe(got['forward'])}. f needs no communication in forward "
            "(x is already the same on every rank); its all-reduce belongs in backward"
        )
    problem = same_collectives(got["backward"], library["Copy"]["backward"], "the backward")
    if problem:
        return problem + ". f's backward is exactly one all-reduce (sum) of the gradient"
    return None


def _judge_reduce(got, library, x, upstream, n) -> str | None:
    if "forbidden" in got:
        return got["forbidden"]
    problem = wrong_group(got["sizes"], n)
    if problem:
        return problem
    y, grad = got["y"], got["grad"]
    problem = shape_problem("Reduce.apply(x, group)", y, x)
    if problem:
        return problem
    if got["changed"]:
        return (
            "the forward changed its input x in place (an all-reduce on x itself). The caller's tensor "
            "may still be needed (by autograd, or elsewhere in the model): all-reduce a copy, x.clone()"
        )
    want = library["Reduce"]["y"]
    if not close(y, want):
        if close(y, x) and n > 1:
            return (
                "the forward returned x unchanged. f* sums the ranks' partial results: all-reduce "
                "(sum) a copy of x and return it"
            )
        if close(y * n, want) and n > 1:
            return f"the forward returned the average over the {n} ranks; f* returns their sum (no division)"
        return f"the forward differs from the sum of x over the ranks by up to {off_by(y, want)}"
    if grad is None:
        return "x.grad is None after backward: backward must return the gradient of x (and None for group)"
    if not close(grad, upstream):
        if close(grad, library["Copy"]["grad"]) and n > 1:
            return (
                "backward all-reduced the gradient. f*'s backward is the identity: every rank's output is "
                "the same sum, so the gradient each rank receives is already the gradient of its input; "
                "summing it again adds the other ranks' (N times the gradient in a real model, where all "
                "ranks receive the same one)"
            )
        return f"x.grad must be the upstream gradient as it is; it differs by up to {off_by(grad, upstream)}"
    problem = shared_problem(got, upstream)
    if problem:
        return problem
    problem = same_collectives(got["forward"], library["Reduce"]["forward"], "the forward")
    if problem:
        return problem + ". f* is exactly one all-reduce (sum) in forward"
    if got["backward"]:
        return (
            f"the backward called {describe(got['backward'])}. f*'s backward is the identity and communicates nothing"
        )
    return None


@exercise("04.conjugate_pair", points=2)
def test_conjugate_pair(Copy, Reduce, world_size: int = 3, quick: bool = True, seed: int = 0, timeout: float = 60):
    for name, cls in (("Copy", Copy), ("Reduce", Reduce)):
        assert isinstance(cls, type) and issubclass(cls, torch.autograd.Function), (
            f"pass your {name} class itself (a subclass of torch.autograd.Function), got {cls!r}"
        )
    run_layouts(_pair_on_rank, (Copy, Reduce, seed), world_size, quick, timeout)


# ---- 04.column_parallel_linear and 04.row_parallel_linear --------------------------------


def _full_linear(in_features: int, out_features: int, seed: int, device=None) -> nn.Linear:
    """The same layer in every process (seeded on the host, then moved to ``device``); its bias
    away from zero, so a lost bias shows."""
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features)
    with torch.no_grad():
        layer.bias.copy_(randn((out_features,), seed, 5))
    return layer.to(device)


def _reference(layer: nn.Linear, x, dy) -> dict:
    """One process: the full layer's output and gradients for the loss sum(y * dy)."""
    x = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = layer(x)
    (y * dy).sum().backward()
    return {"y": y.detach(), "x": x.grad, "weight": layer.weight.grad.clone(), "bias": layer.bias.grad.clone()}


def _run_linear(forward, x, weight, bias, group, dy, forbid=None) -> dict:
    """Call ``forward(x, weight, bias, group)`` on leaves, then backward with the gradient ``dy``
    shared with another branch (``SharedBranch``), with the collectives of each direction."""
    from ultrascale.comm import CommLogger

    x = x.clone().requires_grad_()
    weight, bias = nn.Parameter(weight.detach().clone()), nn.Parameter(bias.detach().clone())
    branch = SharedBranch(dy)
    with untracked_collectives() as untracked, refused_library(forbid) as refusal:
        with CommLogger() as fwd:
            y = forward(x, weight, bias, group)
        with CommLogger() as bwd:
            shared = branch.backward(y)
    if refusal.message:
        return {"forbidden": refusal.message}
    return {
        "y": y.detach() if torch.is_tensor(y) else y,
        "x": x.grad,
        "weight": weight.grad,
        "bias": bias.grad,
        "forward": collectives(fwd),
        "backward": collectives(bwd),
        "untracked": untracked,
        "shared": shared,
        "sizes": group_sizes(fwd, bwd),
    }


def _grads_problem(got, want, names) -> str | None:
    for name, what in names:
        if got[name] is None:
            return f"{what}.grad is None after backward: {what} must be used, on the autograd graph"
        if not close(got[name], want[name]):
            return (
                f"{what}.grad differs from the full layer's by up to {off_by(got[name], want[name])}"
                if got[name].shape == want[name].shape
                else f"{what}.grad has shape {tuple(got[name].shape)}, expected {tuple(want[name].shape)}"
            )
    return None


def _column_on_rank(ctx, forward, seed, split):
    from ultrascale.parallel.tensor_parallel import ColumnParallelLinear

    group, layout = tp_group(ctx, split)
    r, n = dist.get_rank(group), dist.get_world_size(group)
    local = 4  # output features per rank: 4n in all
    layer = _full_linear(6, local * n, seed, ctx.device)
    x, dy = (
        randn((2, 3, 6), seed, 3, device=ctx.device),  # the same on every rank
        randn((2, 3, local * n), seed, 4, device=ctx.device),
    )
    rows = slice(r * local, (r + 1) * local)
    full = _reference(layer, x, dy)
    w, b = layer.weight.detach()[rows], layer.bias.detach()[rows]
    library = _run_linear(lambda *a: ColumnParallelLinear(a[1], a[2], a[3])(a[0]), x, w, b, group, dy[..., rows])
    got = _run_linear(
        forward,
        x,
        w,
        b,
        group,
        dy[..., rows],
        (
            [ColumnParallelLinear.forward],
            "04.column_parallel_linear",
            "its ColumnParallelLinear is the answer; use f and F.linear",
        ),
    )
    want = {"y": full["y"][..., rows], "x": full["x"], "weight": full["weight"][rows], "bias": full["bias"][rows]}
    problem = _judge_column(got, want, library, w, b, dy[..., rows], n)
    return f"{layout}, rank {ctx.rank}: {problem}" if problem else None


def _judge_column(got, want, library, w, b, dy, n) -> str | None:
    if "forbidden" in got:
        return got["forbidden"]
    problem = wrong_group(got["sizes"], n)
    if problem:
        return problem
    y = got["y"]
    if torch.is_tensor(y) and y.dim() == want["y"].dim() and y.shape[-1] == want["y"].shape[-1] * n and n > 1:
        return (
            f"the output has shape {tuple(y.shape)}: all {y.shape[-1]} output features. A column-parallel "
            f"layer returns only this rank's slice, {tuple(want['y'].shape)}; the row-parallel layer "
            "after it takes the slices as they are"
        )
    problem = shape_problem("the output", y, want["y"])
    if problem:
        return problem
    if not close(y, want["y"]):
        if close(y + b, want["y"]):
            return "the output is missing the bias: y_r = x W_r^T + b_r"
        if close(y, n * (want["y"] - b) + b) and n > 1:
            return (
                f"the output is {n} times too large: x was summed over the ranks in forward (f* instead of "
                "f?). x is already whole on every rank; f is the identity in forward"
            )
        return (
            f"the output differs from this rank's slice of the full layer's output by up to "
            f"{off_by(y, want['y'])}: y_r = x W_r^T + b_r, with W_r and b_r as given"
        )
    if got["x"] is None:
        return "x.grad is None after backward: compute the output from x, on the autograd graph"
    if not close(got["x"], want["x"]) and close(got["x"], dy @ w) and n > 1:
        return (
            "x.grad holds only this rank's share of the gradient (from its own output features). The loss "
            "depends on x through every rank's slice, so x.grad must be the sum of all ranks' shares: "
            "route x through f (f(x, group)) before the matmul; its backward all-reduces them"
        )
    problem = _grads_problem(got, want, (("x", "x"), ("weight", "weight_shard"), ("bias", "bias_shard")))
    problem = problem or shared_problem(got, dy)
    if problem:
        return problem
    problem = untracked_problem(got["untracked"], "f(x, group), the autograd-aware copy")
    if problem:
        return problem
    if got["forward"]:
        return (
            f"the forward called {describe(got['forward'])}. A column-parallel layer needs no communication "
            "in forward: x is whole on every rank and the output stays split"
        )
    problem = same_collectives(got["backward"], library["backward"], "the backward")
    if problem:
        return problem + ": one all-reduce of x's gradient, from f"
    return None


@exercise("04.column_parallel_linear", points=1)
def test_column_parallel_linear(
    column_parallel_forward, world_size: int = 3, quick: bool = True, seed: int = 0, timeout: float = 60
):
    assert callable(column_parallel_forward), f"pass your function, got {column_parallel_forward!r}"
    run_layouts(_column_on_rank, (column_parallel_forward, seed), world_size, quick, timeout)


def _row_on_rank(ctx, forward, seed, split):
    from ultrascale.parallel.tensor_parallel import RowParallelLinear

    group, layout = tp_group(ctx, split)
    r, n = dist.get_rank(group), dist.get_world_size(group)
    local, out = 4, 5  # input features per rank: 4n in all
    layer = _full_linear(local * n, out, seed, ctx.device)
    x, dy = (
        randn((2, 3, local * n), seed, 6, device=ctx.device),  # the same on every rank
        randn((2, 3, out), seed, 7, device=ctx.device),
    )
    cols = slice(r * local, (r + 1) * local)
    full = _reference(layer, x, dy)
    w, b = layer.weight.detach()[:, cols], layer.bias.detach()
    library = _run_linear(lambda *a: RowParallelLinear(a[1], a[2], a[3])(a[0]), x[..., cols], w, b, group, dy)
    got = _run_linear(
        forward,
        x[..., cols],
        w,
        b,
        group,
        dy,
        (
            [RowParallelLinear.forward],
            "04.row_parallel_linear",
            "its RowParallelLinear is the answer; use F.linear and f_star",
        ),
    )
    want = {"y": full["y"], "x": full["x"][..., cols], "weight": full["weight"][:, cols], "bias": full["bias"]}
    partial = F.linear(x[..., cols], w)  # this rank's term of the sum
    problem = _judge_row(got, want, library, partial, b, dy, n)
    return f"{layout}, rank {ctx.rank}: {problem}" if problem else None


def _judge_row(got, want, library, partial, bias, dy, n) -> str | None:
    if "forbidden" in got:
        return got["forbidden"]
    problem = wrong_group(got["sizes"], n)
    if problem:
        return problem
    y = got["y"]
    problem = shape_problem("the output", y, want["y"])
    if problem:
        return problem
    if not close(y, want["y"]):
        total = want["y"] - bias  # the sum over ranks of the partial products
        if close(y, partial + bias) and n > 1:
            return (
                "the output is this rank's partial product only. Each rank multiplies its slice of the input "
                "features; the output is the sum over ranks: f* (f_star(..., group)) all-reduces it"
            )
        if close(y, total + n * bias) and n > 1:
            return (
                f"the bias is counted {n} times: it was added on every rank before the sum. Add it once, "
                "after the all-reduce"
            )
        if close(y, total):
            return "the output is missing the bias: add it once, after the sum over ranks"
        if close(y, total / n + bias) and n > 1:
            return "the partial products are averaged over the ranks; they must be summed (no division)"
        return f"the output differs from the full layer's by up to {off_by(y, want['y'])}"
    if got["bias"] is None:
        return (
            "bias.grad is None on this rank: add the bias on every rank (after the all-reduce), so every "
            "rank's copy of it receives the same gradient and the copies stay equal"
        )
    if got["x"] is not None and close(got["x"], want["x"] * n) and n > 1:
        return (
            f"x_shard.grad is {n} times too large: the backward all-reduced the gradient. f*'s backward "
            "is the identity (every rank already has the gradient of the summed output)"
        )
    problem = _grads_problem(got, want, (("x", "x_shard"), ("weight", "weight_shard"), ("bias", "bias")))
    problem = problem or shared_problem(got, dy)
    if problem:
        return problem
    problem = untracked_problem(got["untracked"], "f_star(y, group), the autograd-aware all-reduce")
    if problem:
        return problem
    problem = same_collectives(got["forward"], library["forward"], "the forward")
    if problem:
        return problem + ": one all-reduce of the output, from f*"
    if got["backward"]:
        return (
            f"the backward called {describe(got['backward'])}. A row-parallel layer communicates nothing "
            "in backward: f*'s backward is the identity"
        )
    return None


@exercise("04.row_parallel_linear", points=1)
def test_row_parallel_linear(
    row_parallel_forward, world_size: int = 3, quick: bool = True, seed: int = 0, timeout: float = 60
):
    assert callable(row_parallel_forward), f"pass your function, got {row_parallel_forward!r}"
    run_layouts(_row_on_rank, (row_parallel_forward, seed), world_size, quick, timeout)
