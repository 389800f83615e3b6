"""Tests of the chapter 8 exercises (solutions/08_expert_parallelism_exercises.ipynb): the
pieces of expert parallelism, one at a time.

* ``08.router``: ``route(logits, k) -> (weights, chosen)``, top-k routing from the router's
  logits (T, E). Graded against the library's ``moe.Router`` (whose ``forward`` refuses to run
  meanwhile) by the routing matrix R (T, E), R[t, chosen[t, j]] = weights[t, j], so the order
  of a token's k choices does not matter. k = 1 must keep the probability itself (Switch); k > 1
  must renormalise. Weights from the logits, k > 1 not renormalised and k = 1 renormalised
  (always 1) are named. The gradient the weights send back to the router (the gate's weight,
  through the logits, under a random upstream gradient) must equal the library's: detached
  weights, a detached softmax or a detached renormalising sum are named. The logits must be
  left unchanged.
* ``08.split_sizes``: ``split_sizes(chosen, per_rank, group) -> (send, receive)`` on every rank:
  rows sent to each rank (one per token and destination rank) and rows received from each,
  exchanged with an all-to-all. Graded on clusters of 2 and 4 ranks (and the notebook's
  ``WORLD_SIZE``), then on 4 ranks cut into the groups [0] and [1, 2, 3] (``_groups.Split``:
  a group of odd size that does not start at rank 0; each group has its own tokens), top-1 and
  top-2, against ``dispatch_plan`` and ``exchange_counts`` (refused while the learner's code
  runs; on the split, so is a collective over another group than the one given, for this
  exercise and the next: ``_groups.only_group``). Counting choices instead of tokens, and receive = send (the
  sender's view) are named.
* ``08.dispatch_combine``: ``ep_forward(tokens, chosen, weights, experts, group) -> y``, the
  expert-parallel MoE layer on one rank, from ``dispatch_plan``, ``exchange_counts``,
  ``apply_experts`` and ``comm.functional.all_to_all`` (allowed) but not the library's
  ``ExpertParallelDispatch`` (refused). Graded by parity with the one-process layer: outputs,
  the gradients of the tokens, the router weights and the experts, in float64 (on the whole
  world, then on the groups [0] and [1, 2, 3] of 4 ranks); the upstream gradient must be left
  unchanged; and by its
  communication (``CommLogger``): all-to-alls only, with exactly the bytes
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

import contextlib

import torch

from ultrascale_grading.exercise_tests._groups import HINT, Split, only_group
from ultrascale_grading import exercise

DT = torch.float64
# 4 ranks cut into groups that work side by side, each on inputs of its own: [1, 2, 3] has an odd
# size and does not start at rank 0. EP_SPLIT's groups have one size, as GroupContext needs.
SPLIT = Split([0], [1, 2, 3])
EP_SPLIT = Split([0, 2], [1, 3])


def _on_split(problem: str) -> str:
    return f"{problem}. Did you pass group=? {HINT}"


def _routing_matrix(weights, chosen, experts: int) -> torch.Tensor:
    """R (T, E): the weight of expert e for token t, 0 where t did not choose e."""
    return torch.zeros(chosen.shape[0], experts, dtype=weights.dtype).scatter_add(1, chosen.long(), weights)


# ---- 08.router -----------------------------------------------------------------------------


@exercise("08.router", points=1)
def test_router(route, world_size: int = 2, quick: bool = True, seed: int = 0, timeout: float = 60):
    from ultrascale_grading.guards import call_learner, forbid_library
    from ultrascale.moe import Router

    assert callable(route), f"pass your function, got {route!r}"
    g = torch.Generator().manual_seed(seed)
    for experts, k in [(4, 1), (4, 2), (8, 2), (6, 3)]:
        router = Router(16, experts, k)
        x = torch.randn(20, 16, generator=g)
        upstream = torch.randn(20, experts, generator=g)  # d loss / d R: every routing weight matters
        want_w, want_c, probs = router(x)
        logits = router.gate(x)  # not detached: the weights' gradient must reach the gate
        given = logits.detach().clone()
        with forbid_library([Router.forward], "08.router", "softmax, topk and (for k > 1) a division"):
            got = call_learner(route, logits, k, call=f"route(logits of shape {tuple(logits.shape)}, k={k})")
        assert isinstance(got, (tuple, list)) and len(got) == 2, "return a pair (weights, chosen)"
        weights, chosen = got
        assert torch.is_tensor(chosen) and tuple(chosen.shape) == (20, k), (
            f"k={k}: chosen must have shape (tokens, k) = (20, {k}), got {getattr(chosen, 'shape', chosen)}"
        )
        assert torch.is_tensor(weights) and tuple(weights.shape) == (20, k), f"k={k}: weights must have shape (20, {k})"
        assert torch.equal(logits.detach(), given), f"E={experts}, k={k}: route changed the logits in place"
        got_r = _routing_matrix(weights.detach().to(probs.dtype), chosen, experts)
        want_r = _routing_matrix(want_w.detach(), want_c, experts)
        if not torch.allclose(got_r, want_r, rtol=1e-5, atol=1e-6):
            raise AssertionError(_router_value_problem(weights, got_r, want_r, probs, want_c, experts, k))
        problem = _router_gradient_problem(router, x, weights, chosen, want_w, want_c, upstream, k)
        if problem:
            raise AssertionError(f"E={experts}, k={k}: {problem}")


def _router_value_problem(weights, got_r, want_r, probs, want_c, experts, k) -> str:
    if not torch.equal(got_r != 0, want_r != 0):
        return f"E={experts}, k={k}: some tokens chose other experts than their k most probable"
    if k == 1 and torch.allclose(weights.detach(), torch.ones_like(weights)):
        return (
            "k=1: every weight is 1. With one expert, keep its probability as the weight (Switch): a "
            "renormalised single weight is always 1 and the router would get no gradient from the loss"
        )
    if k > 1 and torch.allclose(got_r, _routing_matrix(probs.gather(1, want_c).detach(), want_c, experts)):
        return (
            f"k={k}: the weights are the softmax probabilities of the whole row; renormalise the k chosen ones "
            "so that they sum to 1"
        )
    return f"E={experts}, k={k}: the right experts, but weights differ from softmax(logits) restricted to the top k" + (
        " and renormalised" if k > 1 else ""
    )


def _gate_gradient(router, weights, chosen, upstream):
    """The gradient the loss sum(R * upstream) sends to the gate's weight through ``weights``."""
    r = _routing_matrix(weights.to(upstream.dtype), chosen, upstream.shape[1])
    (grad,) = torch.autograd.grad((r * upstream).sum(), router.gate.weight, allow_unused=True)
    return grad


def _router_gradient_problem(router, x, weights, chosen, want_w, want_c, upstream, k) -> str | None:
    """The right weights must carry the right gradient back to the router: the loss is what trains it."""
    if not weights.requires_grad:
        return (
            "the weights do not require grad, so the loss never trains the router (its gate gets no "
            "gradient). Keep them in the autograd graph: no .detach(), torch.no_grad() or .tolist() on the "
            "softmax or the weights"
        )
    got, want = _gate_gradient(router, weights, chosen, upstream), _gate_gradient(router, want_w, want_c, upstream)
    if got is None or not bool(got.any()):
        return (
            "no gradient reaches the router's gate through the weights: compute them from the logits you are "
            "given (softmax, then top-k), not from a detached copy"
        )
    if torch.allclose(got, want, rtol=1e-4, atol=1e-6):
        return None
    if k > 1:
        chosen_probs = torch.softmax(router.gate(x), dim=-1).gather(1, want_c)
        if torch.allclose(
            got,
            _gate_gradient(router, chosen_probs / chosen_probs.sum(-1, keepdim=True).detach(), want_c, upstream),
            rtol=1e-4,
            atol=1e-6,
        ):
            return (
                "the right weights, but the renormalising sum is detached: it depends on the logits too, and "
                "its gradient is part of the router's. Divide by the sum itself, not by a detached copy"
            )
    return (
        f"the right weights, but the router's gradient through them differs from that of softmax -> top-k"
        f"{' -> divide by their sum' if k > 1 else ''} by up to {(got - want).abs().max().item():.3g}: is a "
        "part of the computation detached or done outside autograd?"
    )


# ---- 08.split_sizes ------------------------------------------------------------------------


def _chosen(seed: int, rank: int, tokens: int, experts: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])


def _only_group(group, what):
    """On a split, refuse at once a collective over another group than the rank's own."""
    return contextlib.nullcontext() if group is None else only_group(group, what)


def _layout(ctx, split):
    """(group, index of the group, rank within it, its size, a description) of this rank: the
    world, or its group of ``split`` (each group has inputs of its own: ``seed + index``)."""
    if split is None:
        return None, 0, ctx.rank, ctx.world_size, f"{ctx.world_size} ranks"
    index, group, ranks = split.group_of(ctx)
    return group, index, ranks.index(ctx.rank), len(ranks), f"{split}, the group {ranks}"


def _split_sizes_on_rank(ctx, split_sizes, seed, split=None):
    from ultrascale_grading.guards import forbid_library
    from ultrascale.parallel import expert_parallel as ep

    group, index, r, n, layout = _layout(ctx, split)
    problems = []
    for k in (1, 2):
        per_rank = 2
        chosen = _chosen(seed + index, r, 12, per_rank * n, k).to(ctx.device)  # drawn on the host, then moved
        plan = ep.dispatch_plan(chosen, torch.ones(chosen.shape, device=chosen.device), n, per_rank)
        want_send, want_receive = plan.send_counts, ep.exchange_counts(plan.send_counts, group, ctx.device)
        try:
            with (
                forbid_library(
                    [ep.dispatch_plan, ep.exchange_counts],
                    "08.split_sizes",
                    "count the rows per rank and send the counts with an all-to-all yourself",
                ),
                _only_group(group, "split_sizes"),
            ):
                got = split_sizes(chosen.clone(), per_rank, group)
        except NotImplementedError:
            raise
        except AssertionError as err:
            problems.append(str(err))
            continue
        except Exception as err:  # noqa: BLE001 (reported to the learner)
            problems.append(f"{layout}, top-{k}: split_sizes raised {type(err).__name__}: {err}")
            continue
        send, receive = ([int(v) for v in x] for x in got)
        where = f"{layout}, top-{k}, rank {r}" + ("" if split is None else f" within it (global rank {ctx.rank})")
        if len(send) != n or len(receive) != n:
            problems.append(
                f"{where}: send and receive must hold one count per rank of the group ({n}), got "
                f"{len(send)} and {len(receive)}: take the size from the group, not from the world"
            )
            continue
        choices = torch.bincount((chosen // per_rank).flatten(), minlength=n).tolist()
        if send != want_send:
            if send == choices:
                problems.append(
                    f"{where}: send counts every (token, expert) choice, {send}; a token whose experts "
                    f"are on the same rank is sent there once: expected {want_send}"
                )
            else:
                problems.append(f"{where}: send {send}, expected {want_send} (tokens with an expert on each rank)")
        elif receive != want_receive:
            if receive == send:
                problems.append(
                    f"{where}: receive equals send, {send}: that is what this rank sends, not what the "
                    f"others send to it; exchange the counts with an all-to-all (expected {want_receive})"
                )
            else:
                problems.append(f"{where}: receive {receive}, expected {want_receive}")
    return problems


@exercise("08.split_sizes", points=1)
def test_split_sizes(split_sizes, world_size: int = 2, quick: bool = True, seed: int = 0, timeout: float = 60):
    from ultrascale.runtime import grading_cluster

    assert callable(split_sizes), f"pass your function, got {split_sizes!r}"
    for size in sorted({2, 4, world_size}):
        for problems in grading_cluster(size).run(_split_sizes_on_rank, split_sizes, seed, timeout=timeout):
            if problems:
                raise AssertionError(problems[0])
    per_rank = SPLIT.run(_split_sizes_on_rank, split_sizes, seed, SPLIT, what="split_sizes", timeout=timeout)
    for problems in (per_rank[r] for i in SPLIT.order() for r in SPLIT.groups[i]):
        if problems:
            raise AssertionError(_on_split(problems[0]))


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
    chosen = torch.stack([_chosen(seed, r, tokens, n * experts_per_rank, k) for r in range(n)])
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

    group, index, r, n, _ = _layout(ctx, split)
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
            _only_group(group, "ep_forward"),
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
            raise AssertionError(_on_split(problem))


# ---- 08.expert_gradients -------------------------------------------------------------------


def _hooked(reduce_gradient, changed):
    """``apply`` for expert_runs.ep_rank_run: EP without its own gradient hooks, and the
    learner's ``reduce_gradient`` on every parameter instead. A hook must not modify the
    gradient it is given: ``changed`` notes it if one did."""

    def apply(model, mesh):
        from ultrascale_grading.guards import without_library
        from ultrascale.parallel import expert_parallel as ep, grad_sync

        ep.apply_ep(model, mesh, sync_gradients=False)
        data_group, expert_group = ep._data_groups(mesh, ep.axis_group(mesh, "ep"))
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
