"""Measure collective bandwidth the way nccl-tests reports it.

For one operation on a buffer of ``size`` bytes taking ``t`` seconds:

* algorithm bandwidth ``algbw = size / t``: how fast the caller's data moved;
* bus bandwidth ``busbw = algbw * factor``: the speed each link must sustain for a
  ring to achieve that time. It is comparable across operations and world sizes and
  against the hardware's peak link speed.

The factors follow nccl-tests (``N`` ranks): all-reduce ``2 (N-1) / N`` (each rank
sends about twice the buffer), all-gather and reduce-scatter ``(N-1) / N``, broadcast
and reduce ``1``. ``size`` is always the full buffer: the all-gather output, the
reduce-scatter input.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from .logger import wait_for_device
from .ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' ratio busbw / algbw for ``op`` on ``world_size`` ranks."""
    n = world_size
    factors = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "broadcast": 1.0,
        "reduce": 1.0,
    }
    if op not in factors:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return factors[op]


def _all_gather_base(output, input, group):
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single; support both.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group)


def _reduce_scatter_base(output, input, group):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group)


def _torch_op(op: str, group) -> Callable[[torch.Tensor, torch.Tensor], None]:
    # Each function takes (full_buffer, chunk_buffer), the two buffers an op may need.
    if op == "all_reduce":
        return lambda full, chunk: dist.all_reduce(full, group=group)
    if op == "all_gather":
        return lambda full, chunk: _all_gather_base(full, chunk, group)
    if op == "reduce_scatter":
        return lambda full, chunk: _reduce_scatter_base(chunk, full, group)
    if op == "broadcast":
        return lambda full, chunk: dist.broadcast(full, group_src=0, group=group)
    return lambda full, chunk: dist.reduce(full, group_dst=0, group=group)


def _ring_op(op: str, group) -> Callable[[torch.Tensor, torch.Tensor], None]:
    if op == "all_reduce":
        return lambda full, chunk: ring_all_reduce(full, group=group)
    if op == "all_gather":
        return lambda full, chunk: ring_all_gather(chunk, group=group)
    if op == "reduce_scatter":
        return lambda full, chunk: ring_reduce_scatter(full, group=group)
    raise ValueError(
        f"impl='ring' has all_reduce, all_gather and reduce_scatter, not {op!r}; "
        "use impl='torch' for broadcast and reduce"
    )


def _max_over_ranks(seconds: float, group, device) -> float:
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value.item()


def balanced_orders(names: list, rounds: int) -> list[list]:
    """The order to run ``names`` in, round by round, when timing them against each other.

    What ran just before can cost a call (buffers left in the caches, a rank still waking up),
    so in a fixed order, or one merely rotated, each contender keeps the same predecessor and
    carries its cost. These rounds follow a Williams design: every ``len(names)`` rounds (twice
    that for an odd count) each contender runs once in every position and runs right after
    every other contender equally often. The first round is ``names`` itself.
    """
    n = len(names)
    # the first round's indices 0, 1, n-1, 2, n-2, ...: the steps between neighbours, +1, -2, +3,
    # ... (mod n), all differ, so the shifted rounds below pair every two contenders once each way
    first = [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]
    rows = [[(i + shift) % n for i in first] for shift in range(n)]
    if n % 2:  # an odd count needs the mirrored square as well
        rows += [row[::-1] for row in rows]
    name_of = {index: name for index, name in zip(first, names)}  # so that the first round is ``names``
    return [[name_of[i] for i in rows[r % len(rows)]] for r in range(rounds)]


def time_collective(
    fn: Callable[[], object], iters: int = 10, warmup: int = 2, group=None, device: torch.device | None = None
) -> float:
    """Seconds per call of ``fn`` (a collective every rank calls), the slowest rank's.

    A barrier lines the ranks up before the clock starts; the result is the maximum
    over ranks, because a collective is finished only when its last rank is. On a
    CUDA ``device`` the GPU is synchronized, since kernels return before they finish.
    """
    device = torch.device(device or "cpu")
    for _ in range(warmup):
        fn()
    wait_for_device(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    wait_for_device(device)
    return _max_over_ranks((time.perf_counter() - start) / iters, group, device)


def bus_bandwidth_sweep(
    ctx,
    sizes,
    op: str = "all_reduce",
    impl="torch",
    iters: int = 10,
    warmup: int = 2,
    dtype: torch.dtype = torch.float32,
    callback: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Time ``op`` for each buffer size in ``sizes`` (bytes) and report bandwidths.

    ``ctx`` is the rank context from ``Cluster.run`` (its ``group`` and ``device``
    are used; ``None`` means the default group on the CPU). ``impl`` is ``"torch"``
    (the built-in collectives), ``"ring"`` (ours, from ``ring.py``) or a function
    ``fn(full, chunk)`` doing the operation on those buffers. Sizes are rounded down to
    a multiple of ``world_size`` elements so every rank gets the same chunk.

    Returns one dict per size, the same on every rank: ``size`` (bytes), ``time_s``,
    ``algbw`` and ``busbw`` (bytes/s), ``op``, ``impl``, ``world_size``. ``callback``
    gets each dict as soon as it is measured, on group rank 0 only (for live plots:
    pass ``lambda p: ctx.log(**p)``).
    """
    group = getattr(ctx, "group", None)
    device = getattr(ctx, "device", None) or torch.device("cpu")
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    factor = bus_factor(op, n)
    run = _ring_op(op, group) if impl == "ring" else _torch_op(op, group) if impl == "torch" else impl
    impl_name = impl if isinstance(impl, str) else getattr(impl, "__name__", "custom")
    element = torch.empty((), dtype=dtype).element_size()
    points = []
    for size in sizes:
        numel = max(n, size // element // n * n)
        full = torch.randn(numel, device=device).to(dtype)
        chunk = full[: numel // n].clone()
        seconds = time_collective(lambda: run(full, chunk), iters, warmup, group, device)
        nbytes = numel * element
        algbw = nbytes / seconds
        point = {
            "op": op,
            "impl": impl_name,
            "world_size": n,
            "size": nbytes,
            "time_s": seconds,
            "algbw": algbw,
            "busbw": algbw * factor,
        }
        points.append(point)
        if callback is not None and rank == 0:
            callback(point)
    return points
