"""Tests of the chapter 8 exercises (solutions/08_expert_parallelism_exercises.ipynb): the
pieces of expert parallelism, one at a time. The expert-parallel layer (``08.dispatch_combine``)
and its gradients (``08.expert_gradients``) are tested in ``ch08_expert_parallel.py``.

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
  runs; on the split, so is a collective over another group than the one given:
  ``_groups.only_group``). Counting choices instead of tokens, and receive = send (the
  sender's view) are named.
"""

from __future__ import annotations

import contextlib

import torch

from ultrascale_grading.exercise_tests._groups import HINT, Split, only_group
from ultrascale_grading import exercise

DT = torch.float64
# 4 ranks cut into groups that work side by side, each on inputs of its own: [1, 2, 3] has an odd
# size and does not start at rank 0.
SPLIT = Split([0], [1, 2, 3])


def on_split(problem: str) -> str:
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


def chosen_experts(seed: int, rank: int, tokens: int, experts: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])


def only_group_if_split(group, what):
    """On a split, refuse at once a collective over another group than the rank's own."""
    return contextlib.nullcontext() if group is None else only_group(group, what)


def split_layout(ctx, split):
    """(group, index of the group, rank within it, its size, a description) of this rank: the
    world, or its group of ``split`` (each group has inputs of its own: ``seed + index``)."""
    if split is None:
        return None, 0, ctx.rank, ctx.world_size, f"{ctx.world_size} ranks"
    index, group, ranks = split.group_of(ctx)
    return group, index, ranks.index(ctx.rank), len(ranks), f"{split}, the group {ranks}"


def _split_sizes_on_rank(ctx, split_sizes, seed, split=None):
    from ultrascale_grading.guards import forbid_library
    from ultrascale.parallel import expert_parallel as ep

    group, index, r, n, layout = split_layout(ctx, split)
    problems = []
    for k in (1, 2):
        per_rank = 2
        chosen = chosen_experts(seed + index, r, 12, per_rank * n, k).to(ctx.device)  # drawn on the host, then moved
        plan = ep.dispatch_plan(chosen, torch.ones(chosen.shape, device=chosen.device), n, per_rank)
        want_send, want_receive = plan.send_counts, ep.exchange_counts(plan.send_counts, group, ctx.device)
        try:
            with (
                forbid_library(
                    [ep.dispatch_plan, ep.exchange_counts],
                    "08.split_sizes",
                    "count the rows per rank and send the counts with an all-to-all yourself",
                ),
                only_group_if_split(group, "split_sizes"),
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
            raise AssertionError(on_split(problems[0]))
