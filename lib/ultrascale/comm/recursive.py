"""A latency-optimal all-reduce (recursive doubling), and a choice by size against the ring.

The ring (``ring.py``) is bandwidth-optimal: each rank sends ``2 (N-1) K / N`` bytes, the least
possible, but in ``2 (N-1)`` steps, and every step pays the start-up latency ``alpha`` of one
message. For a small buffer that latency is the whole cost.

**Recursive doubling** needs only ``log2 N`` steps. In step ``k`` rank ``r`` swaps its *whole*
running sum with rank ``r XOR 2**k`` and adds what it receives: after step 0 pairs hold the sum
of two inputs, after step 1 groups of four, and after ``log2 N`` steps everyone holds all ``N``.
The price is bandwidth: every step sends all ``K`` bytes, ``K log2 N`` in total.

A world size that is not a power of two is folded first: with ``P`` the largest power of two
not above ``N``, rank ``P + i`` hands its input to rank ``i`` and waits; the first ``P`` ranks
run recursive doubling; then rank ``i`` hands the result back. Two more steps, each of ``K``.

Under the alpha-beta model (``cost_model.AlphaBeta``, ``n`` = ``K`` bytes)::

    ring                      2 (N-1) alpha + 2 (N-1)/N * n / beta
    recursive doubling        S alpha + S * n / beta,   S = log2 P + (2 if N > P else 0)

so doubling wins below a crossover size and the ring above it. A third contender,
halving-doubling (``halving_doubling.py``), sends the ring's bytes in ``2 log2 P - 1`` messages.
``all_reduce`` picks whichever of the three the alpha-beta model, fitted on the spot
(``fit_on_the_spot``), predicts to be fastest, as NCCL and gloo pick an algorithm by size
instead of using one for everything. A fourth, direct exchange (``direct.py``), sends the ring's
bytes in two rounds of messages all in flight together; the model, which sends one message at
a time, cannot place it, so its crossover against halving-doubling is measured on the spot
(``direct_crossover_on_the_spot``) and ``all_reduce(..., direct_from=...)`` uses it above that.

Sums come out bitwise the same on every rank: each addition pairs the same two partial sums
on both partners, and ``a + b == b + a`` exactly in floating point.
"""

from __future__ import annotations

import math

import torch

from .cost_model import AlphaBeta, fit_alpha_beta
from .direct import direct_all_reduce
from .halving_doubling import halving_doubling_all_reduce, halving_doubling_time, largest_power_of_two
from .logger import record_op, wait_for_device
from .ring import (
    collective_rank_and_size,
    keeping_exchanges,
    normalise_op,
    receive_buffer,
    reduce_into,
    ring_all_reduce,
    send_recv,
)

NOTHING = torch.empty(0)


def doubling_steps(world_size: int) -> int:
    """Messages each rank takes part in: ``log2 P``, plus the fold and unfold when ``N != P``."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    power = largest_power_of_two(world_size)
    return int(math.log2(power)) + (2 if world_size != power else 0)


def doubling_time(model: AlphaBeta, nbytes, world_size: int):
    """Seconds for a recursive-doubling all-reduce of ``nbytes`` under the alpha-beta model."""
    return doubling_steps(world_size) * model.message_time(nbytes)


def crossover_bytes(model: AlphaBeta, world_size: int) -> float:
    """Buffer size above which the ring beats recursive doubling (``inf``: never, ``0``: always).

    Setting the two times equal: ``n* = alpha beta (2(N-1) - S) / (S - 2(N-1)/N)``.
    """
    n, steps = world_size, doubling_steps(world_size)
    latency_saved = 2 * (n - 1) - steps  # in units of alpha
    bandwidth_lost = steps - 2 * (n - 1) / n  # in units of n / beta
    if n < 2 or latency_saved <= 0:
        return 0.0
    if bandwidth_lost <= 0:
        return math.inf
    return model.alpha * model.beta * latency_saved / bandwidth_lost


@torch.no_grad()
def recursive_doubling_all_reduce(tensor: torch.Tensor, op="sum", group=None) -> torch.Tensor:
    """All-reduce ``tensor`` in place by recursive doubling; returns ``tensor``. Any world size."""
    op = normalise_op(op, tensor.dtype)
    rank, n = collective_rank_and_size(group)
    power = largest_power_of_two(n)
    with record_op("recursive_doubling_all_reduce", group), keeping_exchanges():
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        incoming = receive_buffer(flat.numel(), flat)
        if rank >= power:  # an extra rank: fold in, wait for the answer
            send_recv(flat, NOTHING, rank - power, rank - power, group)
            send_recv(NOTHING, flat, rank - power, rank - power, group)
        else:
            if rank + power < n:  # take the extra rank's input first
                send_recv(NOTHING, incoming, rank + power, rank + power, group)
                reduce_into(flat, incoming, op)
            distance = 1
            while distance < power:  # log2 P swaps of the whole running sum
                partner = rank ^ distance
                send_recv(flat, incoming, partner, partner, group)
                reduce_into(flat, incoming, op)
                distance *= 2
            if op == "avg":
                flat.div_(n)
            if rank + power < n:  # and hand the result back
                send_recv(flat, NOTHING, rank + power, rank + power, group)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
    return tensor


ALGORITHMS = {
    "recursive_doubling": recursive_doubling_all_reduce,
    "halving_doubling": halving_doubling_all_reduce,
    "ring": ring_all_reduce,
    "direct": direct_all_reduce,
}


def predicted_times(model: AlphaBeta, nbytes, world_size: int) -> dict:
    """Seconds for each algorithm of ``ALGORITHMS`` under the alpha-beta ``model``."""
    return {
        "recursive_doubling": doubling_time(model, nbytes, world_size),
        "halving_doubling": halving_doubling_time(model, nbytes, world_size),
        "ring": model.ring_all_reduce_time(nbytes, world_size),
    }


def choose_algorithm(nbytes: int, world_size: int, model: AlphaBeta, direct_from: int | None = None) -> str:
    """The name of the algorithm the model predicts to be fastest (the first of a tie).

    Recursive doubling for small buffers; above ``crossover_bytes`` the ring, or halving-doubling
    where ``N`` is a power of two: it has the ring's bytes in fewer messages, so under this model
    it never loses to the ring. (With a fold, its two whole-buffer messages make it lose to one
    or the other at every size.) From ``direct_from`` bytes up (a crossover measured by
    ``direct_crossover_on_the_spot``; None: never), direct exchange.
    """
    if direct_from is not None and nbytes >= direct_from and world_size > 1:
        return "direct"
    times = predicted_times(model, nbytes, world_size)
    return min(times, key=times.get)


def all_reduce(
    tensor: torch.Tensor, op="sum", group=None, *, model: AlphaBeta, direct_from: int | None = None
) -> torch.Tensor:
    """All-reduce in place with the algorithm ``choose_algorithm`` picks for its size."""
    _, n = collective_rank_and_size(group)
    nbytes = tensor.numel() * tensor.element_size()
    return ALGORITHMS[choose_algorithm(nbytes, n, model, direct_from)](tensor, op, group)


DIRECT_RACE_SIZES = (1 << 20, 4 << 20, 16 << 20)  # bytes at which direct_crossover_on_the_spot races


def direct_crossover_on_the_spot(group=None, sizes=DIRECT_RACE_SIZES, rounds: int = 6, device=None) -> int | None:
    """The smallest of ``sizes`` from which direct exchange beat halving-doubling at every larger
    size too, raced on the spot (``race_all_reduces``, median of ``rounds``); None if it lost at
    the largest, or on a GPU (direct exchange is gloo-only). Call on every rank: the times are
    the slowest rank's, so every rank gets the same answer.

    Why measure instead of model: the two send the same bytes, and under the alpha-beta model,
    which sends one message at a time, direct exchange costs what the ring costs. What it gains
    is what the model leaves out: its messages are in flight together, and each addition
    overlaps the transfers still coming in.
    """
    if device is not None and torch.device(device).type == "cuda":
        return None
    contenders = {
        "halving": lambda t: halving_doubling_all_reduce(t, group=group),
        "direct": lambda t: direct_all_reduce(t, group=group),
    }
    crossover = None
    for nbytes, times in reversed(race_all_reduces(contenders, sorted(sizes), rounds, group, device)):
        if times["direct"] >= times["halving"]:
            break
        crossover = nbytes
    return crossover


def fit_on_the_spot(group=None, sizes=(4 << 10, 64 << 10, 1 << 20, 4 << 20), iters: int = 7, device=None) -> AlphaBeta:
    """Fit alpha and beta from exchanges timed while *every* rank exchanges at once.

    Call on every rank. Rank ``r`` swaps a buffer with rank ``r XOR 1`` (a last, unpaired rank
    waits), as in a step of either algorithm, so the fit sees the same load on the machine's
    cores and links as the collectives will; each size's time is the slowest rank's median try. Every
    rank gets the same model and so chooses the same algorithm for the same size.
    """
    import statistics
    import time

    import torch.distributed as dist

    rank, n = collective_rank_and_size(group)
    if n < 2:
        raise ValueError("fitting alpha-beta needs at least two ranks")
    partner = rank ^ 1
    buffers = [(torch.zeros(nbytes // 4, device=device), torch.empty(nbytes // 4, device=device)) for nbytes in sizes]
    tries = [[0.0] if partner >= n else [] for _ in sizes]
    with keeping_exchanges():  # as inside the collectives (see ring.keeping_exchanges)
        if partner < n:
            for send, receive in buffers:
                send_recv(send, receive, partner, partner, group)  # warm the connection and buffers up
        dist.barrier(group=group)
        # Each try times every size once, so that a slow spell of the machine (another process taking
        # a core for a few milliseconds) spoils one try of each size rather than all tries of one: a
        # whole size measured slow bends the line, and one fit once came out with alpha near 2 ms.
        for _ in range(iters if partner < n else 0):
            for i, (send, receive) in enumerate(buffers):
                wait_for_device(device)  # so that the fit is of transfer times, not of launch times
                start = time.perf_counter()
                send_recv(send, receive, partner, partner, group)
                wait_for_device(device)
                tries[i].append(time.perf_counter() - start)
    # The median try, not the fastest: inside a collective a message usually waits a little for its
    # partner (with more ranks than cores, for a core), and the fastest try is the rare one that
    # did not. Fitted on the fastest try, alpha came out 165-225 us (4 ranks, 2 cores) and the model
    # picked halving-doubling at 1 MiB in 3 fits of 14, where recursive doubling is measured faster
    # (the two cross at 2-3 MiB there); on the median of the same tries, alpha 215-350 us (once 614),
    # it picked doubling at 1 MiB in 14 of 14 and halving-doubling at 4 MiB in 14 of 14. (That was
    # halving-doubling in 4 messages; with its innermost level merged, 3, the model has the two
    # cross at 2 alpha beta, 0.5-0.9 MiB here, and measured they are within noise at 1 MiB.)
    elapsed = torch.tensor([statistics.median(t) for t in tries], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return fit_alpha_beta(sizes, elapsed.tolist())


def all_reduce_contenders(
    group=None,
    model: AlphaBeta | None = None,
    again: bool = False,
    direct: bool = False,
    direct_from: int | None = None,
) -> dict:
    """The all-reduces to compare, by name: the backend's, the ring, doubling, halving-doubling and (with
    a model) the choice among them, with direct exchange from ``direct_from`` bytes up. With
    ``direct`` direct exchange races too. With ``again`` the backend's runs a second time, as
    ``"again"``: its ratio to ``"builtin"`` is how far the machine's noise alone moves a ratio."""
    import torch.distributed as dist

    contenders = {
        "builtin": lambda t: dist.all_reduce(t, group=group),
        "ring": lambda t: ring_all_reduce(t, group=group),
        "doubling": lambda t: recursive_doubling_all_reduce(t, group=group),
        "halving": lambda t: halving_doubling_all_reduce(t, group=group),
    }
    if direct:
        contenders["direct"] = lambda t: direct_all_reduce(t, group=group)
    if model is not None:
        contenders["chosen"] = lambda t: all_reduce(t, group=group, model=model, direct_from=direct_from)
    if again:
        contenders["again"] = contenders["builtin"]
    return contenders


def race_all_reduces(
    contenders: dict, sizes, rounds: int = 3, group=None, device=None, callback=None, keep=None
) -> list[tuple[int, dict]]:
    """Time every contender on every size; ``[(bytes, {name: seconds per call})]``, the same on all ranks.

    Call on every rank. The contenders take turns round by round on the same tensor, in the
    balanced orders of ``bandwidth.balanced_orders`` (each runs in every position and after
    every other one equally often), and each keeps its median over the rounds (or
    ``keep(times)``: ``min`` for the least disturbed round), so a burst of load from another
    program on the machine hits all of them alike instead of one. Each time is the slowest
    rank's. ``callback`` gets each row on rank 0 as soon as it is measured (for a live plot).
    """
    import statistics

    import torch.distributed as dist

    from .bandwidth import balanced_orders, time_collective

    keep = keep or statistics.median

    rows = []
    for nbytes in sizes:
        x = torch.randn(max(1, nbytes // 4), device=device)
        calls = max(1, min(10, (16 << 20) // max(nbytes, 1)))  # several calls when one is too short to time
        times = {name: [] for name in contenders}
        for run in contenders.values():  # warm up: buffers, connections
            run(x)
        # what ran just before can cost the next call (on gloo, 4 ranks, 1 MiB recursive doubling
        # came out 1.3x the backend in one fixed order and 1.5-2.4x in another): balanced orders
        # spread that over all of them
        for order in balanced_orders(list(contenders), rounds):
            for name in order:
                x.normal_()  # fresh values: repeated sums never overflow
                run = contenders[name]
                times[name].append(time_collective(lambda: run(x), calls, warmup=0, group=group, device=device))
        rows.append((x.numel() * x.element_size(), {name: keep(t) for name, t in times.items()}))
        if callback is not None and dist.get_rank(group) == 0:
            callback(rows[-1])
    return rows
