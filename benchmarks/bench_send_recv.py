"""One exchange (send to one rank while receiving from another), as our collectives make it.

Every step of the hand-written collectives is one ``send_recv``, so its cost is their alpha.
Four versions take turns on 4 ranks, each making many exchanges back to back, in two patterns:
pairs (``r <-> r XOR 1``, a step of recursive doubling or halving-doubling) and a ring (send
right, receive left). The slowest rank's median time per exchange is reported.

  * ``before``          - ``send_recv`` until issue 22: ``dist.batch_isend_irecv``, its Work
                          objects let go as soon as the exchange is done;
  * ``batch, kept``     - the same, every Work kept until the collective (here: the run of
                          exchanges) ends;
  * ``now, let go``     - today's ``send_recv`` outside ``keeping_exchanges()``: ``dist.isend`` +
                          ``dist.irecv`` posted directly on the CPU (gloo);
  * ``now, kept``       - today's ``send_recv`` inside ``keeping_exchanges()``, as every collective
                          in ``ultrascale.comm`` calls it.

    .venv/bin/python benchmarks/bench_send_recv.py [--world-size 4] [--exchanges 100]

Ratios are against ``before``. Why gloo is slower when a Work is let go early is not settled
here, only measured: on the 2-core machine some exchanges then last about one kernel tick
(4 ms) instead of a fraction of a millisecond, depending on the order the Works are destroyed in.
Destroying a Work itself takes microseconds; the time is lost in the next exchange's wait, and
it comes and goes with microseconds of timing (a 50 us pause before letting go once removed it,
200 us brought it back): thread wake-ups on an oversubscribed machine, most likely.
"""

from __future__ import annotations

import argparse
import statistics

VARIANTS = ("before", "batch, kept", "now, let go", "now, kept")


def _before(send, recv, right, left, kept):
    """send_recv as it was: one batch, its Works dropped when the loop over them ends."""
    import torch.distributed as dist

    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, send, group_peer=right), dist.P2POp(dist.irecv, recv, group_peer=left)]
    )
    for work in works:
        work.wait()
    if kept is not None:
        kept.extend(works)


def exchanges(ctx, nbytes: int, pattern: str, count: int, rounds: int) -> dict:
    """Median seconds per exchange of each variant on this rank, the variants alternating by round."""
    import contextlib
    import time

    import torch
    import torch.distributed as dist

    from ultrascale.comm.ring import keeping_exchanges, send_recv

    right, left = (
        (ctx.rank ^ 1, ctx.rank ^ 1)
        if pattern == "pairs"
        else ((ctx.rank + 1) % ctx.world_size, (ctx.rank - 1) % ctx.world_size)
    )
    send, recv = torch.zeros(nbytes // 4), torch.empty(nbytes // 4)
    times = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name in VARIANTS:
            kept = [] if name == "batch, kept" else None
            scope = keeping_exchanges() if name == "now, kept" else contextlib.nullcontext()
            samples = []
            dist.barrier()
            with scope:
                for _ in range(count):
                    start = time.perf_counter()
                    if name.startswith("now"):
                        send_recv(send, recv, right, left, None)
                    else:
                        _before(send, recv, right, left, kept)
                    samples.append(time.perf_counter() - start)
            times[name].append(statistics.median(samples))
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> dict:
    from ultrascale.runtime import Cluster

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--exchanges", type=int, default=100, help="back-to-back exchanges per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.world_size < 2 or args.world_size % 2:
        parser.error("--world-size must be even and at least 2: the pairs pattern needs a partner for every rank")

    results = {}
    with Cluster(args.world_size, backend="gloo") as cluster:
        print(
            f"one send_recv, {args.world_size} ranks, gloo: median of {args.exchanges} back-to-back exchanges, "
            f"slowest rank, median of {args.rounds} rounds; microseconds (ratio to 'before')"
        )
        print(f"{'pattern':>7} {'size':>9} " + " ".join(f"{name:>16}" for name in VARIANTS))
        for pattern in ("pairs", "ring"):
            for nbytes in (4 << 10, 1 << 20):
                per_rank = cluster.run(exchanges, nbytes, pattern, args.exchanges, args.rounds, timeout=600)
                t = {name: max(r[name] for r in per_rank) for name in VARIANTS}
                results[pattern, nbytes] = t
                cells = " ".join(f"{1e6 * t[n]:>8.0f} ({t['before'] / t[n]:4.1f}x)" for n in VARIANTS)
                print(f"{pattern:>7} {nbytes >> 10:>5} KiB {cells}")
    return results


if __name__ == "__main__":
    main()
