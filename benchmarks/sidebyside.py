"""What the side-by-side benchmarks share: the model's command-line options and the timing.

Implementations are timed in alternating rounds (A B, B A, ...), so that a slow spell of a
shared machine hits all of them alike, and a step's time is the slowest rank's (the
others wait for it at the next collective). The result is the median step.
"""

from __future__ import annotations

import argparse
import statistics

from ultrascale.comm.bandwidth import balanced_orders
from ultrascale.model import GPTConfig


def model_arguments(doc: str, **defaults) -> argparse.ArgumentParser:
    """A parser with the course GPT's shape and the timing options; ``defaults`` override."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    options = dict(world_size=4, hidden=128, layers=4, heads=4, vocab=1024, seq=64, mbs=2, warmup=2, steps=5, rounds=3)
    options.update(defaults)
    for name, value in options.items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    return parser


def config_of(args) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads, seq_len=args.seq)


def measure_rounds(cluster, impls, rounds, time_steps, *args) -> dict:
    """Each implementation's steps, round by round: ``{impl: [[seconds per step] per round]}``.
    ``time_steps(ctx, impl, *args)`` returns one rank's step times; the rounds take the
    implementations in balanced orders (``balanced_orders``: A B, B A, ... for two), so none
    always runs after the same one; a step's time is the slowest rank's."""
    samples = {impl: [] for impl in impls}
    for order in balanced_orders(list(impls), rounds):
        for impl in order:
            per_rank = cluster.run(time_steps, impl, *args, timeout=600)
            samples[impl].append([max(step) for step in zip(*per_rank)])
    return samples


def median_step(per_round) -> float:
    """The median step over all rounds of ``measure_rounds``' list for one implementation."""
    return statistics.median(t for steps in per_round for t in steps)


def median_steps(samples: dict) -> dict:
    """``{impl: median step}`` from ``measure_rounds``' samples, over all of each one's rounds."""
    return {impl: median_step(per_round) for impl, per_round in samples.items()}


def measure(cluster, impls, rounds, time_steps, *args) -> dict:
    """Median step time of each implementation, over all its rounds' steps (``measure_rounds``)."""
    return median_steps(measure_rounds(cluster, impls, rounds, time_steps, *args))


def round_ratios(samples: dict, impl: str, baseline: str) -> list:
    """``impl`` / ``baseline``, round by round (the median step of each): how far the ratio moves
    between rounds a few seconds apart, which is what one run's ratio can be trusted to."""
    return [statistics.median(a) / statistics.median(b) for a, b in zip(samples[impl], samples[baseline])]


def ratio_interval(
    samples: dict, impl: str, baseline: str, level: float = 0.9, resamples: int = 2000
) -> tuple[float, float]:
    """The range the median ratio ``impl`` / ``baseline`` keeps when the rounds are redrawn:
    a bootstrap over ``measure_rounds``' rounds, each drawn with both implementations' steps
    in it (they ran seconds apart), ``level`` of the redrawn ratios falling inside. A target
    closer to the ratio than this range is wide cannot be told apart on this machine.
    Seeded, so the same samples always give the same range."""
    import random

    rng, count = random.Random(0), len(samples[impl])
    ratios = []
    for _ in range(resamples):
        drawn = [rng.randrange(count) for _ in range(count)]
        ratios.append(
            statistics.median(t for i in drawn for t in samples[impl][i])
            / statistics.median(t for i in drawn for t in samples[baseline][i])
        )
    ratios.sort()
    tail = (1 - level) / 2
    return ratios[int(tail * resamples)], ratios[int((1 - tail) * resamples) - 1]


def verdict(value: float, low: float | None = None, high: float | None = None, digits: int = 3) -> str:
    """``"OK"`` when ``value`` lies in ``[low, high]`` (either bound may be left open), else ``"MISSED"``.

    Judged on the value rounded to the ``digits`` it is printed with, so that a line never reads
    "1.15x (target <= 1.15) MISSED" because the unprinted digits were 1.153.
    """
    shown = round(value, digits)
    return "OK" if (low is None or shown >= low) and (high is None or shown <= high) else "MISSED"


def timed_steps(ctx, step, warmup: int, steps: int, barrier: bool = True) -> list:
    """This rank's wall-clock seconds for ``step()``, ``steps`` times after ``warmup`` untimed ones.

    With ``barrier`` the ranks line up before each step, so that no rank's clock starts while
    another is still finishing the last one; on a GPU the device is synchronized before the
    clock stops, since kernels return before they finish.
    """
    import time

    import torch
    import torch.distributed as dist

    times = []
    for i in range(warmup + steps):
        if barrier:
            dist.barrier()
        start = time.perf_counter()
        step()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times
