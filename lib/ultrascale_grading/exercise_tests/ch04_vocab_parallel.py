"""Tests of chapter 4's vocabulary-parallel loss (solutions/04_tensor_parallelism_exercises.ipynb),
apart from the tests of its layers (``ch04.py``, which says how every chapter 4 test runs: on
clusters of 2 and 3 ranks and on 3 ranks cut into two tp groups, with the incoming gradient shared
with another branch, everything computed on the ranks before anything is judged).

* ``04.vocab_parallel_cross_entropy``: ``vocab_parallel_cross_entropy(local_logits, targets,
  vocab_start, group)``: the mean cross-entropy of the full logits, on every rank, from
  this rank's vocabulary slice only. Graded against ``F.cross_entropy`` of the full logits
  (value, and the gradient of ``local_logits``) on moderate logits, on logits of ~1e3
  (where ``exp`` overflows float32 without the max subtraction), with targets on every
  rank's slice (the first and last id of each slice included) and with all targets on the
  last slice; and by the traffic: no single collective may move as many bytes as this
  rank's slice of the logits (that is gathering them), and the total must stay below a
  quarter of the full logits' bytes (a correct answer moves a few numbers per token).

While the learner's code runs, the library's own ``vocab_parallel_cross_entropy`` refuses to run
(``grading.guards.forbid_library``), and so does a plain ``dist.all_reduce`` on a tensor that
autograd tracks. Tolerances: ``ultrascale.parity.tolerance(None)`` in float32, as in ``ch04.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ultrascale_grading import exercise

from ._common import (
    SharedBranch,
    close,
    collectives,
    describe,
    group_sizes,
    off_by,
    randn,
    refused_library,
    run_layouts,
    shared_problem,
    tp_group,
    untracked_collectives,
    untracked_problem,
    wrong_group,
)


# ---- 04.vocab_parallel_cross_entropy ----------------------------------------------------

TOKENS = 24
LOCAL_VOCAB = 64  # per rank: the full vocabulary is 64 N, its logits 4 * 24 * 64 N bytes


def _targets(vocab: int, local: int, n: int, seed: int, last_only: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if last_only:  # every target on the last rank's slice: the others hold none
        return torch.randint(vocab - local, vocab, (TOKENS,), generator=gen)
    targets = torch.randint(0, vocab, (TOKENS,), generator=gen)
    edges = [v for q in range(n) for v in (q * local, q * local + local - 1)][: TOKENS // 2]
    targets[: len(edges)] = torch.tensor(edges)  # the first and last id of every slice
    return targets


def _cases(n: int, seed: int) -> dict:
    vocab = LOCAL_VOCAB * n
    return {
        "moderate logits": (3 * randn((TOKENS, vocab), seed, 8), _targets(vocab, LOCAL_VOCAB, n, seed, False)),
        "logits of size ~1e3": (1e3 * randn((TOKENS, vocab), seed, 9), _targets(vocab, LOCAL_VOCAB, n, seed, False)),
        "all targets on the last rank's slice": (
            3 * randn((TOKENS, vocab), seed, 10),
            _targets(vocab, LOCAL_VOCAB, n, seed + 1, True),
        ),
    }


def _per_rank_max_loss(logits, targets, n) -> torch.Tensor:
    """What a rank gets when every rank subtracts its own maximum (not the global one)."""
    blocks = logits.split(LOCAL_VOCAB, dim=-1)
    tops = [b.max(-1, keepdim=True).values for b in blocks]
    total = sum((b - m).exp().sum(-1) for b, m in zip(blocks, tops))
    shift = torch.cat([m.expand_as(b) for b, m in zip(blocks, tops)], -1).gather(-1, targets[:, None])[:, 0]
    return (total.log() - (logits.gather(-1, targets[:, None])[:, 0] - shift)).mean()


def _ce_on_rank(ctx, fn, seed, split):
    from ultrascale.comm import CommLogger
    from ultrascale.parallel import vocab_parallel

    group, layout = tp_group(ctx, split)
    r, n = dist.get_rank(group), dist.get_world_size(group)
    cols = slice(r * LOCAL_VOCAB, (r + 1) * LOCAL_VOCAB)
    runs = []
    for case, (logits, targets) in _cases(n, seed).items():
        logits, targets = logits.to(ctx.device), targets.to(ctx.device)  # drawn on the host, then moved
        full = logits.clone().requires_grad_()
        expected = F.cross_entropy(full, targets)  # one process, the whole vocabulary
        expected.backward()
        local = logits[:, cols].clone().requires_grad_()
        forbid = (
            [vocab_parallel.vocab_parallel_cross_entropy, vocab_parallel._cross_entropy],
            "04.vocab_parallel_cross_entropy",
            "build it from the maximum, the sum of exponentials and the target's logit",
        )
        loss, branch = None, SharedBranch(torch.tensor(1.0))  # the loss's gradient shared with another term
        with untracked_collectives() as untracked, refused_library(forbid) as refusal, CommLogger() as log:
            loss = fn(local, targets.clone(), r * LOCAL_VOCAB, group)
            shared = branch.backward(loss)
        if refusal.message:
            return f"{layout}, rank {ctx.rank}: {refusal.message}"
        got = {
            "loss": loss,
            "grad": local.grad,
            "ops": collectives(log),
            "untracked": untracked,
            "shared": shared,
            "sizes": group_sizes(log),
            "changed": not torch.equal(local.detach(), logits[:, cols]),
        }
        runs.append((case, logits, targets, expected.detach(), full.grad[:, cols], got))
    for case, logits, targets, expected, grad, got in runs:
        problem = _judge_ce(logits, targets, expected, grad, got, n)
        if problem:
            return f"{layout}, rank {ctx.rank}, {case} ({TOKENS} tokens, vocabulary {LOCAL_VOCAB} x {n}): {problem}"
    return None


def _judge_ce(logits, targets, expected, grad, got, n) -> str | None:
    loss, got_grad, ops = got["loss"], got["grad"], got["ops"]
    problem = wrong_group(got["sizes"], n)
    if problem:
        return problem
    if not torch.is_tensor(loss) or loss.dim() != 0:
        shape = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
        return f"return the mean loss as a 0-dimensional tensor, got {shape}"
    if not torch.isfinite(loss):
        return (
            f"the loss is {loss.item()}. exp overflows float32 above about 88: subtract the maximum logit "
            "of each token over the *whole* vocabulary (all-reduce the ranks' maxima with "
            "op=dist.ReduceOp.MAX) before exp"
        )
    if not close(loss, expected):
        if n > 1 and close(loss, _per_rank_max_loss(logits, targets, n)):
            return (
                "every rank subtracted its own maximum. The ranks' sums of exponentials only add up when "
                "they are shifted by the same number: all-reduce the maximum (op=dist.ReduceOp.MAX) first"
            )
        return (
            f"the loss is {loss.item():.6g}, F.cross_entropy of the full logits is {expected.item():.6g}. "
            "loss = mean over tokens of log(sum over the whole vocabulary of exp(z - m)) - (z_target - m): "
            "sum the exponentials over the ranks, and count the target's logit on the one rank whose slice "
            "holds it (vocab_start <= target < vocab_start + V/tp), zero elsewhere"
        )
    if not loss.requires_grad or got_grad is None:
        return (
            "the loss is right but not differentiable with respect to local_logits: keep the sum of "
            "exponentials and the target's logit on the autograd graph (sum them with f_star)"
        )
    if not close(got_grad, grad):
        return (
            f"the loss is right but the gradient of local_logits differs from this rank's slice of the full "
            f"one by up to {off_by(got_grad, grad)}: keep the sum of exponentials and the target's logit on "
            "the autograd graph, summed over the ranks with f_star (whose backward is the identity); only "
            "the maximum may be detached"
        )
    if got["changed"]:
        return (
            "the loss and its gradient are right, but your function changed local_logits in place (e.g. "
            "local_logits -= max under torch.no_grad()). The caller's logits are the model's output, still "
            "needed: compute the shifted logits as a new tensor (local_logits - max)"
        )
    problem = shared_problem(got, torch.tensor(1.0))
    if problem:
        return problem
    problem = untracked_problem(
        got["untracked"],
        "f_star for the sums, which stay on the graph, and compute the maximum "
        "under torch.no_grad() (it needs no gradient)",
    )
    if problem:
        return problem
    local_bytes = TOKENS * LOCAL_VOCAB * 4
    full_bytes = local_bytes * n
    for op, sent in ops:
        if n > 1 and sent >= local_bytes:
            return (
                f"one {op} call sent {sent:,} bytes from this rank, as much as its whole slice of the logits "
                f"({local_bytes:,} bytes): that gathers the logits. No rank may hold the full (tokens x "
                "vocabulary) logits; exchange a few numbers per token (the maximum, the sum of "
                "exponentials, the target's logit)"
            )
    sent = sum(b for _, b in ops)
    if n > 1 and sent * 4 >= full_bytes:
        return (
            f"this rank sent {sent:,} bytes ({describe(ops)}); the full logits are {full_bytes:,} bytes. "
            "Exchange a few numbers per token (the maximum, the sum of exponentials, the target's logit), "
            "not tensors the size of the vocabulary"
        )
    return None


@exercise("04.vocab_parallel_cross_entropy", points=2)
def test_vocab_parallel_cross_entropy(
    vocab_parallel_cross_entropy, world_size: int = 3, quick: bool = True, seed: int = 0, timeout: float = 60
):
    assert callable(vocab_parallel_cross_entropy), f"pass your function, got {vocab_parallel_cross_entropy!r}"
    run_layouts(_ce_on_rank, (vocab_parallel_cross_entropy, seed), world_size, quick, timeout)
