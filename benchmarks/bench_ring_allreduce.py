"""Our ring all-reduce (send/recv only) against the backend's own all-reduce.

Both run on the same tensors in the same ranks, alternating, and the table shows the
bus bandwidth (nccl-tests convention, busbw = size / time * 2 (N-1) / N) of each and
their ratio. Every time is the slowest rank's per call, the median of alternating rounds.

    .venv/bin/python benchmarks/bench_ring_allreduce.py            # 4 ranks, 4 KiB .. 64 MiB
    .venv/bin/python benchmarks/bench_ring_allreduce.py --quick    # small sizes, seconds

On a CPU machine the backend is gloo (every message crosses loopback TCP); on a GPU
node with enough GPUs it is NCCL.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from ultrascale.comm import bus_factor, fit_ring_all_reduce, format_bytes, ring_all_reduce, time_collective
from ultrascale.runtime import Cluster


def _iterations(nbytes: int) -> int:
    # Calls per timing: several for small sizes (timer noise), one for big ones.
    return max(1, min(10, (16 << 20) // max(nbytes, 1)))


def measure(ctx, sizes, rounds):
    """On every rank: [(size, builtin_seconds, ring_seconds)], the slowest rank's.

    The two implementations alternate round by round on the same tensor and each
    reports its median over the rounds, so a burst of load from other programs on the
    machine hits both alike instead of one of them.
    """
    implementations = {
        "builtin": lambda t: dist.all_reduce(t, group=ctx.group),
        "ring": lambda t: ring_all_reduce(t, group=ctx.group),
    }
    rows = []
    for nbytes in sizes:
        x = torch.randn(nbytes // 4, device=ctx.device)
        times = {name: [] for name in implementations}
        for all_reduce in implementations.values():  # warm up: buffers, connections
            all_reduce(x)
        for _ in range(rounds):
            for name, all_reduce in implementations.items():
                x.normal_()  # fresh values, so repeated sums never overflow
                times[name].append(time_collective(lambda: all_reduce(x), _iterations(nbytes),
                                                   warmup=0, group=ctx.group, device=ctx.device))
        rows.append((nbytes, statistics.median(times["builtin"]), statistics.median(times["ring"])))
    return rows


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--min-bytes", type=int, default=4 << 10)
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="4 KiB to 1 MiB, three rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_bytes, args.rounds = 1 << 20, 3
    sizes, size = [], args.min_bytes
    while size <= args.max_bytes:
        sizes.append(size)
        size *= 4

    with Cluster(args.world_size, backend="auto") as cluster:
        rows = cluster.run(measure, sizes, args.rounds, timeout=600)[0]
        backend = cluster.backend
    n = args.world_size
    factor = bus_factor("all_reduce", n)
    print(f"all-reduce, {n} ranks, backend {backend}, float32, busbw = size/time * {factor:g}")
    print(f"{'size':>10} {'builtin ms':>11} {'busbw GB/s':>11} {'ring ms':>9} {'busbw GB/s':>11} "
          f"{'ring/builtin':>13}")
    for nbytes, builtin, ring in rows:
        print(f"{format_bytes(nbytes):>10} {1e3 * builtin:>11.3f} {nbytes / builtin * factor / 1e9:>11.3f} "
              f"{1e3 * ring:>9.3f} {nbytes / ring * factor / 1e9:>11.3f} {builtin / ring:>13.2f}")
    if n > 1 and len(rows) >= 2:
        model = fit_ring_all_reduce([r[0] for r in rows], [r[2] for r in rows], n)
        print(f"alpha-beta fit of the ring: alpha = {1e6 * model.alpha:.1f} us per message, "
              f"beta = {model.beta / 1e9:.2f} GB/s, crossover n* = {format_bytes(model.crossover_bytes)}")
    return rows


if __name__ == "__main__":
    main()
