"""Our all-reduces (send/recv only) against the backend's own all-reduce.

Six implementations run on the same tensors in the same ranks, alternating: the backend's
all-reduce, our ring, our recursive doubling, our halving-doubling, our direct exchange, and our
size-based choice among them (``ultrascale.comm.recursive.all_reduce``: doubling or
halving-doubling by an alpha-beta model fitted on the spot, direct exchange from a crossover
raced on the spot against halving-doubling); the backend's runs once more ("again"), to show how far noise alone moves a ratio; and
halving-doubling once more with its additions skipped ("no adds": wrong sums, timed only), to
show what the additions between its exchanges cost: gloo's ring adds each 1 MiB segment while
the next one is on the wire, ours adds between exchanges.
The table shows the bus bandwidth (nccl-tests convention, busbw = size / time * 2 (N-1) / N) of
each, and the ratios against the backend: the target is the chosen one at 0.9x or better from
1 MiB up, and never slower than the ring. Every time is the slowest rank's per call, the median
of rounds in balanced orders (``balanced_orders``: each contender in every position, and after
every other one, equally often): 12 rounds below 1 MiB, 36 from 1 MiB up, where the targets are
judged (with 12, the same algorithm raced twice in one run read 0.91x and 0.98x gloo at 16 MiB).

    .venv/bin/python benchmarks/bench_ring_allreduce.py            # 4 ranks, 4 KiB .. 64 MiB
    .venv/bin/python benchmarks/bench_ring_allreduce.py --quick    # small sizes, seconds

On a CPU machine the backend is gloo (every message crosses loopback TCP); on a GPU
node with enough GPUs it is NCCL.
"""

from __future__ import annotations

import argparse
from unittest import mock

from ultrascale.comm import bus_factor, fit_ring_all_reduce, format_bytes, halving_doubling
from ultrascale.comm.recursive import (
    DIRECT_RACE_SIZES,
    all_reduce_contenders,
    choose_algorithm,
    crossover_bytes,
    direct_crossover_on_the_spot,
    fit_on_the_spot,
    race_all_reduces,
)
from ultrascale.runtime import Cluster
from sidebyside import verdict

TARGET_FROM = 1 << 20  # the chosen all-reduce must reach 0.9x the backend's from this size up


def halving_without_adds(group):
    """Halving-doubling with every addition skipped: the same messages, wrong sums. Timed only,
    to see how much of its time the additions between exchanges take."""

    def run(tensor):
        with mock.patch.object(halving_doubling, "reduce_into", lambda target, incoming, op: None):
            return halving_doubling.halving_doubling_all_reduce(tensor, group=group)

    return run


def measure(ctx, small, big, rounds, big_rounds):
    """On every rank: the model and the direct crossover measured on the spot, and
    ``race_all_reduces``' rows for the six, for
    the backend's all-reduce raced a second time ("again": its ratio to the first is what the
    machine's noise alone does to a ratio, the resolution of every other column), and for
    halving-doubling without its additions ("no adds")."""
    model = fit_on_the_spot(ctx.group, device=ctx.device)
    direct_from = direct_crossover_on_the_spot(ctx.group, device=ctx.device)
    contenders = all_reduce_contenders(ctx.group, model, again=True, direct=True, direct_from=direct_from)
    contenders["no adds"] = halving_without_adds(ctx.group)
    race = lambda sizes, n: race_all_reduces(contenders, sizes, n, ctx.group, ctx.device) if sizes else []  # noqa: E731
    return model, direct_from, race(small, rounds) + race(big, big_rounds)


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--min-bytes", type=int, default=4 << 10)
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument("--rounds", type=int, default=12, help="rounds below 1 MiB")
    parser.add_argument("--big-rounds", type=int, default=36, help="rounds from 1 MiB up, where the targets are")
    parser.add_argument("--quick", action="store_true", help="4 KiB to 1 MiB, three rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_bytes, args.rounds, args.big_rounds = 1 << 20, 3, 3
    sizes, size = [], args.min_bytes
    while size <= args.max_bytes:
        sizes.append(size)
        size *= 4

    with Cluster(args.world_size, backend="auto") as cluster:
        small, big = [b for b in sizes if b < TARGET_FROM], [b for b in sizes if b >= TARGET_FROM]
        model, direct_from, rows = cluster.run(measure, small, big, args.rounds, args.big_rounds, timeout=1800)[0]
        backend = cluster.backend
    n = args.world_size
    factor = bus_factor("all_reduce", n)
    busbw = lambda nbytes, seconds: nbytes / seconds * factor / 1e9  # noqa: E731
    print(f"all-reduce, {n} ranks, backend {backend}, float32, busbw = size/time * {factor:g} (GB/s)")
    print(
        f"fitted on the spot: alpha = {1e6 * model.alpha:.0f} us, beta = {model.beta / 1e9:.2f} GB/s; "
        f"ring beats doubling above {format_bytes(crossover_bytes(model, n))}"
    )
    print(
        "direct exchange beat halving-doubling, raced on the spot, "
        + (
            f"from {format_bytes(direct_from)} up"
            if direct_from
            else f"at none of {', '.join(map(format_bytes, DIRECT_RACE_SIZES))}: never chosen"
        )
    )
    print(
        f"{'size':>10} {'builtin':>8} {'ring':>8} {'doubling':>9} {'halving':>8} {'direct':>8} {'chosen':>8}   "
        f"{'ring/b':>6} {'doubl/b':>7} {'halv/b':>6} {'dir/b':>6} {'chosen/b':>8} {'again/b':>7} {'noadd/b':>7}"
        f"  chosen algorithm, target"
    )
    for nbytes, t in rows:
        ratio = {
            name: t["builtin"] / t[name]
            for name in ("ring", "doubling", "halving", "direct", "chosen", "again", "no adds")
        }
        target = "" if nbytes < TARGET_FROM else f"  >= 0.9x: {verdict(ratio['chosen'], low=0.9, digits=2)}"
        if ratio["chosen"] < 0.95 * ratio["ring"]:
            target += " (slower than the ring)"
        print(
            f"{format_bytes(nbytes):>10} {busbw(nbytes, t['builtin']):>8.3f} {busbw(nbytes, t['ring']):>8.3f} "
            f"{busbw(nbytes, t['doubling']):>9.3f} {busbw(nbytes, t['halving']):>8.3f} "
            f"{busbw(nbytes, t['direct']):>8.3f} {busbw(nbytes, t['chosen']):>8.3f}   {ratio['ring']:>6.2f} "
            f"{ratio['doubling']:>7.2f} {ratio['halving']:>6.2f} {ratio['direct']:>6.2f} {ratio['chosen']:>8.2f} "
            f"{ratio['again']:>7.2f} {ratio['no adds']:>7.2f}  {choose_algorithm(nbytes, n, model, direct_from)}{target}"
        )
    print("again/b: the backend against itself, raced as one more contender: how far noise alone moves a ratio")
    print(
        "noadd/b: halving-doubling with its additions skipped (wrong sums, timed only): halv/b below it is what "
        "the additions between exchanges cost"
    )
    if n > 1 and len(rows) >= 2:
        try:
            ring = fit_ring_all_reduce([r[0] for r in rows], [r[1]["ring"] for r in rows], n)
        except ValueError as err:  # --quick: below 1 MiB one slow call can outweigh the growth with size
            print(f"alpha-beta fit of the ring's own times: none ({err})")
        else:
            print(
                f"alpha-beta fit of the ring's own times: alpha = {1e6 * ring.alpha:.1f} us per message, "
                f"beta = {ring.beta / 1e9:.2f} GB/s"
            )
    return rows


if __name__ == "__main__":
    main()
