"""Tests of chapter 8's expert-parallel layer (solutions/08_expert_parallelism_exercises.ipynb):
its forward and backward, and its gradients under data parallelism. Routing (``08.router``,
``08.split_sizes``), and the helpers and groups these tests share with it, are in ``ch08.py``.

* ``08.dispatch_combine``: ``ep_forward(tokens, chosen, weights, experts, group) -> y``, the
  expert-parallel MoE layer on one rank, from ``dispatch_plan``, ``exchange_counts``,
  ``apply_experts`` and ``comm.functional.all_to_all`` (allowed) but not the library's
  ``ExpertParallelDispatch`` (refused). Graded by parity with the one-process layer: outputs,
  the gradients of the tokens, the router weights and the experts, in float64 (on the whole
  world, then on the groups [0] and [1, 2, 3] of 4 ranks, where a collective over another group
  than the one given is refused: ``_groups.only_group``); the upstream gradient must be left
  unchanged; and by its communication (``CommLogger``): all-to-alls only, with exactly the bytes
  ``dispatch_volume`` predicts for the dispatch and combine. A combine that forgets the
  permutation, non-differentiable all-to-alls and a dispatch by all-gather are named.
* ``08.expert_gradients``: ``reduce_gradient(grad, expert, data_group, expert_group)``, the
  gradient hook of EP with DP. The test installs it on every parameter of an MoE GPT under
  ``apply_ep(..., sync_gradients=False)`` and trains it (ep = 2; dp = 2 x ep = 2) against one
  process with ``parity.expert_runs``; then on 4 ranks cut into the groups [0, 2] and [1, 3],
  each training its own model with ep = 2 (there the data group is not the world, so a
  reduction over the default group, or a division by the world's size, shows). Expert
  gradients averaged over the replicas only, or reduced over the data group, and dense
  gradients summed but not divided are named; the gradient the hook is given must be left
  unchanged (a hook must not modify its argument).

Tolerances: ``parity.TOLERANCES`` (float64 for the layer, float32 for training): the ranks
add a token's k outputs and the gradients in another order than one process, which changes
the last bits only.
"""

from __future__ import annotations

import torch

from ultrascale_grading import exercise
from ultrascale_grading.exercise_tests._groups import Split
from ultrascale_grading.exercise_tests.ch08 import (
    DT,
    SPLIT,
    chosen_experts,
    split_layout,
    on_split,
    only_group_if_split,
)

# The groups of the EP-with-DP test: one size, as GroupContext needs.
EP_SPLIT = Split([0, 2], [1, 3])


# ---- 08.dispatch_combine -------------------------------------------------------------------


def _layer_problem(
    seed: int, n: int, k: int, experts_per_rank: int = 2, tokens: int = 10, hidden: int = 6, device=None
):
    """Every rank's tokens, choices, weights and all E experts: the same in every process (drawn on the
    host, then moved to ``device``, a rank's ``ctx.device``)."""
    g = torch.Generator().manual_seed(seed)
    experts = [torch.nn.Linear(hidden, hidden, dtype=DT) for _ in range(n * experts_per_rank)]
    with torch.no_grad():
        for e in experts:
            e.weight.copy_(torch.randn(e.weight.shape, generator=g, dtype=DT))
            e.bias.copy_(torch.randn(e.bias.shape, generator=g, dtype=DT))
    x = torch.randn(n, tokens, hidden, generator=g, dtype=DT)
    chosen = torch.stack([chosen_experts(seed, r, tokens, n * experts_per_rank, k) for r in range(n)])
    w = torch.rand(n, tokens, k, generator=g, dtype=DT)
    upstream = torch.randn(n, tokens, hidden, generator=g, dtype=DT)
    w = w / w.sum(-1, keepdim=True)
    return [e.to(device) for e in experts], x.to(device), chosen.to(device), w.to(device), upstream.to(device)


def _one_process_layer(experts, x, chosen, w, upstream):
    from ultrascale.moe import apply_experts

    n, t, h = x.shape
    x, w = x.reshape(n * t, h).clone().requires_grad_(), w.reshape(n * t, -1).clone().requires_grad_()
    y = apply_experts(experts, x, chosen.reshape(n * t, -1), w)
    y.backward(upstream.reshape(n * t, h))
    return (
        y.detach().view(n, t, h),
        x.grad.view(n, t, h),
        w.grad.view(n, t, -1),
        [(e.weight.grad.clone(), e.bias.grad.clone()) for e in experts],
    )


def _dispatch_on_rank(ctx, ep_forward, seed, k, split=None):
    from ultrascale.comm import CommLogger
    from ultrascale_grading.guards import forbid_library
    from ultrascale.parallel import expert_parallel as ep

    group, index, r, n, _ = split_layout(ctx, split)
    experts, x, chosen, w, upstream = _layer_problem(seed + index, n, k, device=ctx.device)
    per_rank = len(experts) // n
    mine = experts[r * per_rank : (r + 1) * per_rank]
    tokens, weights = x[r].clone().requires_grad_(), w[r].clone().requires_grad_()
    plan = ep.dispatch_plan(chosen[r], w[r], n, per_rank)
    volume = ep.dispatch_volume(
        plan.send_counts, ep.exchange_counts(plan.send_counts, group, ctx.device), r, x.shape[-1], k, 8
    )
    out = {"error": None}
    try:
        with (
            forbid_library(
                [ep.ExpertParallelDispatch.__call__, ep.ExpertParallelDispatch._local_experts],
                "08.dispatch_combine",
                "send the rows with all_to_all and combine them yourself",
            ),
            CommLogger() as log,
            only_group_if_split(group, "ep_forward"),
        ):
            y = ep_forward(tokens, chosen[r].clone(), weights, mine, group)
    except NotImplementedError:
        raise
    except Exception as err:  # noqa: BLE001 (reported to the learner)
        out["error"] = f"{type(err).__name__}: {err}"
        return out
    out["ops"] = sorted({e.op for e in log.events})
    out["sent"] = sum(e.bytes_sent for e in log.events if e.op == "all_to_all_single")
    # what dispatch and combine must send (the counts and the ids are allowed on top)
    out["needed"] = volume["ep dispatch"] + volume["ep combine"]
    out["ids_and_counts"] = volume["ep routing"]
    if not torch.is_tensor(y) or tuple(y.shape) != tuple(tokens.shape):
        out["error"] = f"ep_forward must return a tensor shaped like tokens {tuple(tokens.shape)}, got " + (
            f"{tuple(y.shape)}" if torch.is_tensor(y) else type(y).__name__
        )
        return out
    out["y"] = y.detach()
    if not y.requires_grad:
        out["error"] = (
            "the output does not require grad: the all-to-alls must be differentiable "
            "(ultrascale.comm.functional.all_to_all), or no gradient reaches the tokens and the router"
        )
        return out
    incoming = upstream[r].clone()
    y.backward(incoming)
    out["grads"] = (tokens.grad, weights.grad, [(e.weight.grad, e.bias.grad) for e in mine])
    out["upstream kept"] = torch.equal(incoming, upstream[r])
    return out


def _judge_dispatch(per_rank, reference, where, k) -> str | None:
    """``per_rank``: the results of one group's ranks, in their order within it (the world's, or
    a split's group); ``where`` names the group."""
    from ultrascale.parity import tolerance

    tol = tolerance(None, DT)
    y, gx, gw, gexperts = reference
    where = f"{where}, top-{k}"
    for r, out in enumerate(per_rank):
        if out["error"]:
            return f"{where}, rank {r}: {out['error']}"
        bad = [op for op in out["ops"] if "all_to_all" not in op]
        if bad:
            return (
                f"{where}: your layer called {bad}; move the rows with all-to-alls only (an all-gather sends "
                "every token to every rank, ep times the traffic)"
            )
        if not torch.allclose(out["y"], y[r], **tol):
            if torch.allclose(out["y"].sort(0).values, y[r].sort(0).values, **tol):
                return (
                    f"{where}, rank {r}: the right outputs in the wrong order: put each returned row back on "
                    "its token (index_add over plan.rows), the inverse of the dispatch permutation"
                )
            return f"{where}, rank {r}: the output differs from the one-process MoE layer"
        tokens_grad, weights_grad, expert_grads = out["grads"]
        if tokens_grad is None or weights_grad is None:
            return f"{where}, rank {r}: no gradient reached the tokens or the weights (use the autograd all_to_all)"
        if not (torch.allclose(tokens_grad, gx[r], **tol) and torch.allclose(weights_grad, gw[r], **tol)):
            return f"{where}, rank {r}: the gradients of the tokens or of the router weights differ from one process"
        per_rank_e = len(expert_grads)
        for i, (gw_e, gb_e) in enumerate(expert_grads):
            want = gexperts[r * per_rank_e + i]
            if gw_e is None or not (torch.allclose(gw_e, want[0], **tol) and torch.allclose(gb_e, want[1], **tol)):
                return f"{where}, rank {r}: the gradient of local expert {i} differs from one process"
        if not out["upstream kept"]:
            return (
                f"{where}, rank {r}: the gradient that backward was given for the output changed: an autograd "
                "function must not modify grad_output in place (all-to-all a copy)"
            )
        if not out["needed"] <= out["sent"] <= out["needed"] + out["ids_and_counts"]:
            return (
                f"{where}, rank {r}: all-to-alls sent {out['sent']} bytes; dispatch and combine need "
                f"{out['needed']} (plus at most {out['ids_and_counts']} for the counts and ids)"
            )
    return None


@exercise("08.dispatch_combine", points=2)
def test_dispatch_combine(ep_forward, world_size: int = 2, quick: bool = True, seed: int = 0, timeout: float = 60):
    from ultrascale.runtime import grading_cluster

    assert callable(ep_forward), f"pass your function, got {ep_forward!r}"
    for n in sorted({2, 4, world_size}):
        for k in (1, 2):
            per_rank = grading_cluster(n).run(_dispatch_on_rank, ep_forward, seed, k, timeout=timeout)
            reference = _one_process_layer(*_layer_problem(seed, n, k))
            problem = _judge_dispatch(per_rank, reference, f"{n} ranks", k)
            if problem:
                raise AssertionError(problem)
    k = 2  # on the split: top-2, where a token may go to two ranks
    per_rank = SPLIT.run(_dispatch_on_rank, ep_forward, seed, k, SPLIT, what="ep_forward", timeout=timeout)
    for i in SPLIT.order():
        ranks = SPLIT.groups[i]
        reference = _one_process_layer(*_layer_problem(seed + i, len(ranks), k))
        problem = _judge_dispatch(
            [per_rank[g] for g in ranks], reference, f"{SPLIT}, the group {list(ranks)} (rank = rank within it)", k
        )
        if problem:
            raise AssertionError(on_split(problem))


# ---- 08.expert_gradients -------------------------------------------------------------------


def _hooked(reduce_gradient, changed):
    """``apply`` for expert_runs.ep_rank_run: EP without its own gradient hooks, and the
    learner's ``reduce_gradient`` on every parameter instead. A hook must not modify the
    gradient it is given: ``changed`` notes it if one did."""

    def apply(model, mesh):
        from ultrascale_grading.guards import without_library
        from ultrascale.parallel import expert_parallel as ep, grad_sync

        ep.apply_ep(model, mesh, sync_gradients=False)
        data_group, expert_group = ep.data_groups(mesh, ep.axis_group(mesh, "ep"))
        library = [ep._reduce, ep.average_gradients, grad_sync.reduce_gradient, grad_sync.sync_in_backward]
        guarded = without_library(reduce_gradient, library, "08.expert_gradients")

        def hook(grad, expert):
            given = grad.clone()
            out = guarded(grad, expert, data_group, expert_group)
            if not torch.equal(grad, given):
                changed.append(True)
            return out

        experts = {id(p) for p in ep.expert_parameters(model)}
        for p in model.parameters():
            p.register_hook(lambda g, e=id(p) in experts: hook(g, e))
        return model

    return apply


def _ep_on_rank(ctx, reduce_gradient, config, sizes, seed, split=None):
    """One EP step with the learner's hook: on the world's mesh of ``sizes``, or with a ``split``
    inside this rank's group (a model and data of its own, ``seed + index``)."""
    from ultrascale.parity.expert_runs import ep_rank_run

    if split is not None:
        ctx = split.context(ctx)
        seed += ctx.index
    changed = []
    out = ep_rank_run(ctx, config, 1, "sgd", seed=seed, mesh_sizes=sizes, apply=_hooked(reduce_gradient, changed))
    out["grad changed"] = bool(changed)
    return out


def _judge_ep(per_rank, reference, what, hint) -> None:
    from ultrascale.parity.expert_runs import assert_ep_matches

    try:
        assert_ep_matches(per_rank, reference, what="")
    except AssertionError as err:
        first = str(err).splitlines()[0].strip()
        raise AssertionError(
            f"{what}: training with your reduce_gradient differs from one process ({first}). {hint}"
        ) from None
    if any(r["grad changed"] for r in per_rank):
        raise AssertionError(
            f"{what}: reduce_gradient changed the gradient it was given (dist.all_reduce works in "
            "place). A hook must not modify its argument: all-reduce a copy, grad = grad.clone(), "
            "and return it"
        )


@exercise("08.expert_gradients", points=1)
def test_expert_gradients(
    reduce_gradient, world_size: int = 2, quick: bool = True, seed: int = 0, timeout: float = 120
):
    from ultrascale.model import GPTConfig
    from ultrascale.parity.expert_runs import one_process_run
    from ultrascale.runtime import grading_cluster

    assert callable(reduce_gradient), f"pass your function, got {reduce_gradient!r}"
    config = GPTConfig(vocab_size=32, hidden=16, heads=2, layers=1, seq_len=8, experts=4, top_k=2)
    hint = (
        "Dense gradients: all-reduce over data_group and divide by its size. Expert gradients: sum over "
        "expert_group (the replicas; None: no replica) and divide by the size of data_group too"
    )
    for sizes in ({"ep": 2}, {"dp": 2, "ep": 2}):
        n = 1
        for s in sizes.values():
            n *= s
        per_rank = grading_cluster(n).run(_ep_on_rank, reduce_gradient, config, sizes, seed, timeout=timeout)
        _judge_ep(
            per_rank,
            one_process_run(config, n, steps=1, seed=seed),
            " x ".join(f"{a}={s}" for a, s in sizes.items()),
            hint,
        )
    # Each group of the split trains with ep=2: its data_group is the group, not the world.
    per_rank = EP_SPLIT.run(
        _ep_on_rank, reduce_gradient, config, {"ep": 2}, seed, EP_SPLIT, what="reduce_gradient", timeout=timeout
    )
    for i in EP_SPLIT.order():
        ranks = EP_SPLIT.groups[i]
        _judge_ep(
            [per_rank[g] for g in ranks],
            one_process_run(config, len(ranks), steps=1, seed=seed + i),
            f"ep=2 on each of {EP_SPLIT}, the group {list(ranks)}",
            f"Here data_group is the group {list(ranks)}, not the world. Did you pass group=? All-reduce "
            "dense gradients over data_group, not over the default group, and divide by the size of "
            "data_group, not by the world's size",
        )
