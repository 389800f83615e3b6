"""Tests of the chapter 8 exercises (solutions/08_expert_parallelism_exercises.ipynb): the
pieces of expert parallelism, one at a time.

* ``08.router``: ``route(logits, k) -> (weights, chosen)``, top-k routing from the router's
  logits (T, E). Graded against the library's ``moe.Router`` (whose ``forward`` refuses to run
  meanwhile) by the routing matrix R (T, E), R[t, chosen[t, j]] = weights[t, j], so the order
  of a token's k choices does not matter. k = 1 must keep the probability itself (Switch); k > 1
  must renormalise. Weights from the logits, k > 1 not renormalised and k = 1 renormalised
  (always 1) are named.
* ``08.split_sizes``: ``split_sizes(chosen, per_rank, group) -> (send, receive)`` on every rank:
  rows sent to each rank (one per token and destination rank) and rows received from each,
  exchanged with an all-to-all. Graded on clusters of 2 and 4 ranks (and the notebook's
  ``WORLD_SIZE``), top-1 and top-2, against ``dispatch_plan`` and ``exchange_counts`` (refused
  while the learner's code runs). Counting choices instead of tokens, and receive = send (the
  sender's view) are named.
* ``08.dispatch_combine``: ``ep_forward(tokens, chosen, weights, experts, group) -> y``, the
  expert-parallel MoE layer on one rank, from ``dispatch_plan``, ``exchange_counts``,
  ``apply_experts`` and ``comm.functional.all_to_all`` (allowed) but not the library's
  ``ExpertParallelDispatch`` (refused). Graded by parity with the one-process layer: outputs,
  the gradients of the tokens, the router weights and the experts, in float64; and by its
  communication (``CommLogger``): all-to-alls only, with exactly the bytes
  ``dispatch_volume`` predicts for the dispatch and combine. A combine that forgets the
  permutation, non-differentiable all-to-alls and a dispatch by all-gather are named.
* ``08.expert_gradients``: ``reduce_gradient(grad, expert, data_group, expert_group)``, the
  gradient hook of EP with DP. The test installs it on every parameter of an MoE GPT under
  ``apply_ep(..., sync_gradients=False)`` and trains it (ep = 2; dp = 2 x ep = 2) against one
  process with ``parallel.expert_runs``. Expert gradients averaged over the replicas only, or
  reduced over the data group, and dense gradients summed but not divided are named.

Tolerances: ``parity.TOLERANCES`` (float64 for the layer, float32 for training): the ranks
add a token's k outputs and the gradients in another order than one process, which changes
the last bits only.
"""

from __future__ import annotations

import torch

from ultrascale.grading import exercise

DT = torch.float64


def _routing_matrix(weights, chosen, experts: int) -> torch.Tensor:
    """R (T, E): the weight of expert e for token t, 0 where t did not choose e."""
    return torch.zeros(chosen.shape[0], experts, dtype=weights.dtype).scatter_add(1, chosen.long(), weights)


# ---- 08.router -----------------------------------------------------------------------------

@exercise("08.router", points=1)
def test_router(route, world_size: int = 2, quick: bool = True, seed: int = 0, timeout: float = 60):
    from ultrascale.grading.guards import call_learner, forbid_library
    from ultrascale.moe import Router

    assert callable(route), f"pass your function, got {route!r}"
    g = torch.Generator().manual_seed(seed)
    for experts, k in [(4, 1), (4, 2), (8, 2), (6, 3)]:
        router = Router(16, experts, k)
        x = torch.randn(20, 16, generator=g)
        want_w, want_c, probs = router(x)
        logits = router.gate(x).detach()
        with forbid_library([Router.forward], "08.router", "softmax, topk and (for k > 1) a division"):
            got = call_learner(route, logits.clone(), k, call=f"route(logits of shape {tuple(logits.shape)}, k={k})")
        assert isinstance(got, (tuple, list)) and len(got) == 2, "return a pair (weights, chosen)"
        weights, chosen = got
        assert torch.is_tensor(chosen) and tuple(chosen.shape) == (20, k), \
            f"k={k}: chosen must have shape (tokens, k) = (20, {k}), got {getattr(chosen, 'shape', chosen)}"
        assert tuple(weights.shape) == (20, k), f"k={k}: weights must have shape (20, {k})"
        got_r = _routing_matrix(weights.detach().to(probs.dtype), chosen, experts)
        want_r = _routing_matrix(want_w.detach(), want_c, experts)
        if torch.allclose(got_r, want_r, rtol=1e-5, atol=1e-6):
            continue
        if not torch.equal(got_r != 0, want_r != 0):
            raise AssertionError(f"E={experts}, k={k}: some tokens chose other experts than their k most probable")
        if k == 1 and torch.allclose(weights.detach(), torch.ones_like(weights)):
            raise AssertionError("k=1: every weight is 1. With one expert, keep its probability as the weight "
                                 "(Switch): a renormalised single weight is always 1 and the router would get no "
                                 "gradient from the loss")
        if k > 1 and torch.allclose(got_r, _routing_matrix(probs.gather(1, want_c).detach(), want_c, experts)):
            raise AssertionError(f"k={k}: the weights are the softmax probabilities of the whole row; renormalise "
                                 "the k chosen ones so that they sum to 1")
        raise AssertionError(f"E={experts}, k={k}: the right experts, but weights differ from softmax(logits) "
                             "restricted to the top k" + (" and renormalised" if k > 1 else ""))


# ---- 08.split_sizes ------------------------------------------------------------------------

def _chosen(seed: int, rank: int, tokens: int, experts: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])


def _split_sizes_on_rank(ctx, split_sizes, seed):
    from ultrascale.grading.guards import forbid_library
    from ultrascale.parallel import expert_parallel as ep

    n, problems = ctx.world_size, []
    for k in (1, 2):
        per_rank = 2
        chosen = _chosen(seed, ctx.rank, 12, per_rank * n, k)
        plan = ep.dispatch_plan(chosen, torch.ones(chosen.shape), n, per_rank)
        want_send, want_receive = plan.send_counts, ep.exchange_counts(plan.send_counts)
        try:
            with forbid_library([ep.dispatch_plan, ep.exchange_counts], "08.split_sizes",
                                "count the rows per rank and send the counts with an all-to-all yourself"):
                got = split_sizes(chosen.clone(), per_rank, None)
        except NotImplementedError:
            raise
        except AssertionError as err:
            problems.append(str(err))
            continue
        except Exception as err:   # noqa: BLE001 (reported to the learner)
            problems.append(f"{n} ranks, top-{k}: split_sizes raised {type(err).__name__}: {err}")
            continue
        send, receive = ([int(v) for v in x] for x in got)
        where = f"{n} ranks, top-{k}, rank {ctx.rank}"
        choices = torch.bincount((chosen // per_rank).flatten(), minlength=n).tolist()
        if send != want_send:
            if send == choices:
                problems.append(f"{where}: send counts every (token, expert) choice, {send}; a token whose experts "
                                f"are on the same rank is sent there once: expected {want_send}")
            else:
                problems.append(f"{where}: send {send}, expected {want_send} (tokens with an expert on each rank)")
        elif receive != want_receive:
            if receive == send:
                problems.append(f"{where}: receive equals send, {send}: that is what this rank sends, not what the "
                                f"others send to it; exchange the counts with an all-to-all (expected {want_receive})")
            else:
                problems.append(f"{where}: receive {receive}, expected {want_receive}")
    return problems


@exercise("08.split_sizes", points=1)
def test_split_sizes(split_sizes, world_size: int = 2, quick: bool = True, seed: int = 0, timeout: float = 60):
    from ultrascale.runtime import shared_cluster

    assert callable(split_sizes), f"pass your function, got {split_sizes!r}"
    for size in sorted({2, 4, world_size}):
        for problems in shared_cluster(size).run(_split_sizes_on_rank, split_sizes, seed, timeout=timeout):
            if problems:
                raise AssertionError(problems[0])


# ---- 08.dispatch_combine -------------------------------------------------------------------

def _layer_problem(seed: int, n: int, k: int, experts_per_rank: int = 2, tokens: int = 10, hidden: int = 6):
    """Every rank's tokens, choices, weights and all E experts: the same in every process."""
    g = torch.Generator().manual_seed(seed)
    experts = [torch.nn.Linear(hidden, hidden, dtype=DT) for _ in range(n * experts_per_rank)]
    with torch.no_grad():
        for e in experts:
            e.weight.copy_(torch.randn(e.weight.shape, generator=g, dtype=DT))
            e.bias.copy_(torch.randn(e.bias.shape, generator=g, dtype=DT))
    x = torch.randn(n, tokens, hidden, generator=g, dtype=DT)
    chosen = torch.stack([_chosen(seed, r, tokens, n * experts_per_rank, k) for r in range(n)])
    w = torch.rand(n, tokens, k, generator=g, dtype=DT)
    return experts, x, chosen, w / w.sum(-1, keepdim=True), torch.randn(n, tokens, hidden, generator=g, dtype=DT)


def _one_process_layer(experts, x, chosen, w, upstream):
    from ultrascale.moe import apply_experts

    n, t, h = x.shape
    x, w = x.reshape(n * t, h).clone().requires_grad_(), w.reshape(n * t, -1).clone().requires_grad_()
    y = apply_experts(experts, x, chosen.reshape(n * t, -1), w)
    y.backward(upstream.reshape(n * t, h))
    return y.detach().view(n, t, h), x.grad.view(n, t, h), w.grad.view(n, t, -1), [
        (e.weight.grad.clone(), e.bias.grad.clone()) for e in experts]


def _dispatch_on_rank(ctx, ep_forward, seed, k):
    from ultrascale.comm import CommLogger
    from ultrascale.grading.guards import forbid_library
    from ultrascale.parallel import expert_parallel as ep

    r, n = ctx.rank, ctx.world_size
    experts, x, chosen, w, upstream = _layer_problem(seed, n, k)
    per_rank = len(experts) // n
    mine = experts[r * per_rank:(r + 1) * per_rank]
    tokens, weights = x[r].clone().requires_grad_(), w[r].clone().requires_grad_()
    plan = ep.dispatch_plan(chosen[r], w[r], n, per_rank)
    volume = ep.dispatch_volume(plan.send_counts, ep.exchange_counts(plan.send_counts), r, x.shape[-1], k, 8)
    out = {"error": None}
    try:
        with forbid_library([ep.ExpertParallelDispatch.__call__, ep.ExpertParallelDispatch._local_experts],
                            "08.dispatch_combine", "send the rows with all_to_all and combine them yourself"), \
                CommLogger() as log:
            y = ep_forward(tokens, chosen[r].clone(), weights, mine, None)
    except NotImplementedError:
        raise
    except Exception as err:   # noqa: BLE001 (reported to the learner)
        out["error"] = f"{type(err).__name__}: {err}"
        return out
    out["ops"] = sorted({e.op for e in log.events})
    out["sent"] = sum(e.bytes_sent for e in log.events if e.op == "all_to_all_single")
    # what dispatch and combine must send (the counts and the ids are allowed on top)
    out["needed"] = volume["ep dispatch"] + volume["ep combine"]
    out["ids_and_counts"] = volume["ep routing"]
    if not torch.is_tensor(y) or tuple(y.shape) != tuple(tokens.shape):
        out["error"] = f"ep_forward must return a tensor shaped like tokens {tuple(tokens.shape)}, got " + (
            f"{tuple(y.shape)}" if torch.is_tensor(y) else type(y).__name__)
        return out
    out["y"] = y.detach()
    if not y.requires_grad:
        out["error"] = ("the output does not require grad: the all-to-alls must be differentiable "
                        "(ultrascale.comm.functional.all_to_all), or no gradient reaches the tokens and the router")
        return out
    y.backward(upstream[r])
    out["grads"] = (tokens.grad, weights.grad, [(e.weight.grad, e.bias.grad) for e in mine])
    return out


def _judge_dispatch(per_rank, reference, n, k) -> str | None:
    from ultrascale.parity import tolerance

    tol = tolerance(None, DT)
    y, gx, gw, gexperts = reference
    where = f"{n} ranks, top-{k}"
    for r, out in enumerate(per_rank):
        if out["error"]:
            return f"{where}, rank {r}: {out['error']}"
        bad = [op for op in out["ops"] if "all_to_all" not in op]
        if bad:
            return (f"{where}: your layer called {bad}; move the rows with all-to-alls only (an all-gather sends "
                    "every token to every rank, ep times the traffic)")
        if not torch.allclose(out["y"], y[r], **tol):
            if torch.allclose(out["y"].sort(0).values, y[r].sort(0).values, **tol):
                return (f"{where}, rank {r}: the right outputs in the wrong order: put each returned row back on "
                        "its token (index_add over plan.rows), the inverse of the dispatch permutation")
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
        if not out["needed"] <= out["sent"] <= out["needed"] + out["ids_and_counts"]:
            return (f"{where}, rank {r}: all-to-alls sent {out['sent']} bytes; dispatch and combine need "
                    f"{out['needed']} (plus at most {out['ids_and_counts']} for the counts and ids)")
    return None


@exercise("08.dispatch_combine", points=2)
def test_dispatch_combine(ep_forward, world_size: int = 2, quick: bool = True, seed: int = 0, timeout: float = 60):
    from ultrascale.runtime import shared_cluster

    assert callable(ep_forward), f"pass your function, got {ep_forward!r}"
    for n in sorted({2, 4, world_size}):
        for k in (1, 2):
            per_rank = shared_cluster(n).run(_dispatch_on_rank, ep_forward, seed, k, timeout=timeout)
            reference = _one_process_layer(*_layer_problem(seed, n, k))
            problem = _judge_dispatch(per_rank, reference, n, k)
            if problem:
                raise AssertionError(problem)


# ---- 08.expert_gradients -------------------------------------------------------------------

def _hooked(reduce_gradient):
    """``apply`` for expert_runs.ep_rank_run: EP without its own gradient hooks, and the
    learner's ``reduce_gradient`` on every parameter instead."""
    def apply(model, mesh):
        from ultrascale.grading.guards import without_library
        from ultrascale.parallel import expert_parallel as ep

        ep.apply_ep(model, mesh, sync_gradients=False)
        data_group, expert_group = ep._data_groups(mesh, ep.axis_group(mesh, "ep"))
        guarded = without_library(reduce_gradient, [ep._reduce, ep.average_gradients], "08.expert_gradients")
        experts = {id(p) for p in ep.expert_parameters(model)}
        for p in model.parameters():
            is_expert = id(p) in experts
            p.register_hook(lambda g, e=is_expert: guarded(g, e, data_group, expert_group))
        return model
    return apply


@exercise("08.expert_gradients", points=1)
def test_expert_gradients(reduce_gradient, world_size: int = 2, quick: bool = True, seed: int = 0,
                          timeout: float = 120):
    from ultrascale.model import GPTConfig
    from ultrascale.parallel.expert_runs import assert_ep_matches, ep_rank_run, one_process_run
    from ultrascale.runtime import shared_cluster

    assert callable(reduce_gradient), f"pass your function, got {reduce_gradient!r}"
    config = GPTConfig(vocab_size=32, hidden=16, heads=2, layers=1, seq_len=8, experts=4, top_k=2)
    for sizes in ({"ep": 2}, {"dp": 2, "ep": 2}):
        n = 1
        for s in sizes.values():
            n *= s
        per_rank = shared_cluster(n).run(ep_rank_run, config, 1, "sgd", mesh_sizes=sizes,
                                         apply=_hooked(reduce_gradient), timeout=timeout)
        reference = one_process_run(config, n, steps=1)
        what = " x ".join(f"{a}={s}" for a, s in sizes.items())
        try:
            assert_ep_matches(per_rank, reference, what=what)
        except AssertionError as err:
            first = str(err).splitlines()[0]
            raise AssertionError(f"{what}: training with your reduce_gradient differs from one process ({first}). "
                                 "Dense gradients: all-reduce over data_group and divide by its size. Expert "
                                 "gradients: sum over expert_group (the replicas; None: no replica) and divide by "
                                 "the size of data_group too") from None
