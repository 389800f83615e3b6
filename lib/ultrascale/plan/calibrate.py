"""The planner against reality on this machine: calibrate it, predict, measure, compare.

1. **Calibrate** (:func:`measure_machine`, on every rank at once, so that the ranks share the
   cores as they will in the steps): the FLOP/s the course GPT achieves in a forward and
   backward of one rank's micro-batch without any communication, and gloo's all-reduce
   times over a sweep of sizes, fitted with chapter A0's alpha-beta model. Together they
   make a :class:`~ultrascale.plan.hardware.Hardware` for this machine (one "node" holding
   all the ranks, fp32 on the wire).
2. **Predict** each configuration's step with ``steptime.step_time`` on that hardware.
3. **Measure** (:func:`measure_steps`): the same configuration run for real with the
   chapters' techniques (``apply_data_parallel``, ``apply_zero``, ``apply_tp``,
   ``apply_pp``), each step timed by its slowest rank and paired with an unsharded compute
   step run just before it; :func:`compare` sets the median quotient against the predicted one.
4. **Count** (:func:`count_steps`, :func:`compare_counts`): the FLOPs and the bytes one step
   of each configuration really costs its busiest rank, against what the step-time model
   charges (:func:`counting_hardware`). Times on a shared machine move with its load;
   counts depend on the shapes alone, so a check on them can be tight and still never
   flake.

The planner itself stays arithmetic: this is the one module of ``ultrascale.plan`` that
runs anything, and it imports the parallel techniques inside the functions that use them.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..comm.bandwidth import bus_bandwidth_sweep
from ..comm.cost_model import AlphaBeta, fit_ring_all_reduce
from ..comm.logger import CommLogger, wait_for_device
from ..data import Batches
from ..model import GPT, GPTConfig
from .enumerate import ParallelConfig
from .hardware import Hardware, hardware_from_measurements
from .steptime import micro_batch_flops, step_time

CALIBRATION_MODEL = GPTConfig(vocab_size=256, hidden=128, layers=4, heads=4, seq_len=64)
SWEEP_BYTES = (2**12, 2**16, 2**20, 2**22)


def calibration_configs(world_size: int, model=CALIBRATION_MODEL, mbs: int = 2) -> dict:
    """A few single-axis layouts of ``world_size`` ranks sharing one global batch of
    ``mbs * world_size`` sequences: DP (bucketed), ZeRO-3, TP (with SP, when it divides the
    heads) and PP (1F1B with 2 * world_size micro-batches)."""
    w = world_size
    configs = {"DP": ParallelConfig(dp=w, mbs=mbs), "ZeRO-3": ParallelConfig(dp=w, zero=3, mbs=mbs)}
    if model.heads % w == 0:
        configs["TP"] = ParallelConfig(tp=w, mbs=mbs * w)
    if w <= model.layers and mbs % 2 == 0:
        configs["PP"] = ParallelConfig(pp=w, mbs=mbs // 2, gas=2 * w)
    return configs


def _slowest(seconds: float, device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def measure_bandwidth(ctx, sizes=SWEEP_BYTES, repeats: int = 5) -> dict:
    """gloo all-reduce times (the slowest rank's) for buffers of ``sizes`` bytes: for each size
    the fastest of ``repeats`` sweeps, since other work on the machine only ever adds time."""
    times = None
    for _ in range(repeats):
        points = bus_bandwidth_sweep(ctx, list(sizes), op="all_reduce", iters=3, warmup=1)
        sweep = [p["time_s"] for p in points]
        times = sweep if times is None else [min(a, b) for a, b in zip(times, sweep)]
    return {"sizes": [p["size"] for p in points], "times": times}


def machine_hardware(
    compute_seconds: list, bandwidth: dict, world_size: int, model=CALIBRATION_MODEL, mbs: int = 2
) -> Hardware:
    """This machine as a ``Hardware``: the FLOP/s of one rank's unsharded forward and backward
    (median seconds of ``mbs`` sequences), the alpha-beta fit of the all-reduce times, fp32 on
    the wire, all ranks in one node, and no overlap (gloo computes on the same cores)."""
    flops = micro_batch_flops(model, mbs, model.seq_len) / statistics.median(compute_seconds)
    link = fit_ring_all_reduce(bandwidth["sizes"], bandwidth["times"], world_size)
    return hardware_from_measurements(
        peak_flops=flops,
        link=link,
        memory_bytes=1e12,
        gpus_per_node=world_size,
        name=f"this machine, {world_size} gloo ranks",
    )


def _setup(ctx, name: str, c: ParallelConfig, model, seed: int):
    """One training step of configuration ``name`` as a function of the step number."""
    from ..parallel import apply_data_parallel, apply_pp, apply_tp, apply_zero

    torch.manual_seed(seed)
    net = GPT(model).to(ctx.device)
    data = Batches(model, mbs=c.mbs, seed=seed)  # drawn on the CPU; each batch is moved to ctx.device
    if name == "compute":  # the unsharded model on one rank's micro-batch, no communication

        def step(i):
            data.global_batch(i).to(ctx.device).loss(net).backward()
            net.zero_grad(set_to_none=True)
    elif name == "DP":
        wrapped = apply_data_parallel(net, None, kind="bucketed")

        def step(i):
            data.rank_batch(ctx.rank, ctx.world_size, i).to(ctx.device).loss(wrapped).backward()
            wrapped.finish_gradient_synchronization()
            net.zero_grad(set_to_none=True)
    elif name == "ZeRO-3":
        zero = apply_zero(net, None, stage=3, prefetch=True, lr=1e-3).zero_optimizer

        def step(i):
            data.rank_batch(ctx.rank, ctx.world_size, i).to(ctx.device).loss(net).backward()
            zero.step()
            zero.zero_grad()
    elif name == "TP":
        apply_tp(net, None, sequence_parallel=True)

        def step(i):
            data.global_batch(i).to(ctx.device).loss(net).backward()
            net.zero_grad(set_to_none=True)
    elif name == "PP":
        pipe = apply_pp(net, None, schedule="1f1b", microbatches=c.gas)

        def step(i):
            pipe.step([data.global_batch(i, 1, micro).to(ctx.device) for micro in range(c.gas)])
            pipe.zero_grad(set_to_none=True)
    else:
        raise ValueError(f"no measurement for {name!r}: choose compute, DP, ZeRO-3, TP or PP")
    return step


def measure_steps(
    ctx, configs: dict, model=CALIBRATION_MODEL, mbs: int = 2, rounds: int = 5, seed: int = 0, progress: bool = False
) -> dict:
    """Seconds of real training steps (forward, backward, gradient synchronisation), each the
    slowest rank's: for every configuration in ``configs``, and paired with each, a
    ``"compute"`` step (one rank's unsharded step on ``mbs`` sequences, every rank at once).

    Returns ``{name: [(compute seconds, configuration seconds) per round]}``. Each pair is
    timed back to back, after a warm-up round: on a machine whose load changes (other work
    sharing the cores), the two members of a pair meet nearly the same load, so their
    quotient, the step in units of the compute step, is far steadier than either time."""
    compute = _setup(ctx, "compute", ParallelConfig(mbs=mbs), model, seed)
    steps = {name: _setup(ctx, name, c, model, seed) for name, c in configs.items()}
    pairs = {name: [] for name in steps}
    for r in range(rounds + 1):
        for name, step in steps.items():
            pair = []
            for fn in (compute, step):
                wait_for_device(ctx.device)
                dist.barrier()
                start = time.perf_counter()
                fn(r)
                wait_for_device(ctx.device)  # the step's kernels, not their launch
                pair.append(_slowest(time.perf_counter() - start, ctx.device))
            if r:
                pairs[name].append(tuple(pair))
        if progress:
            ctx.log(round=r + 1, rounds=rounds + 1)
    return pairs


def compare(pairs: dict, configs: dict, hardware: Hardware, model=CALIBRATION_MODEL) -> dict:
    """Measured against predicted, for each configuration: the median over rounds of
    (configuration step / paired compute step), over the predicted same quotient."""
    compute = step_time(model, ParallelConfig(mbs=configs_mbs(configs)), model.seq_len, hardware)["step"]
    out = {}
    for name, c in configs.items():
        predicted = step_time(model, c, model.seq_len, hardware)
        measured = statistics.median(b / a for a, b in pairs[name])
        out[name] = {
            "predicted": predicted,
            "predicted_units": predicted["step"] / compute,
            "measured_units": measured,
            "ratio": measured / (predicted["step"] / compute),
        }
    return out


def configs_mbs(configs: dict) -> int:
    """The per-rank micro-batch of the DP layout, which the compute step runs."""
    return configs["DP"].mbs


COMMUNICATION_PARTS = ("TP", "CP", "EP", "PP", "DP")


def counting_hardware(world_size: int) -> Hardware:
    """A ``Hardware`` on which the step-time model counts instead of timing: one FLOP/s at full
    efficiency at any size, links of one byte per second without latency, fp32 on the wire,
    nothing hidden. Each part of ``step_time`` is then what the model charges the busiest rank:
    ``compute`` in FLOPs, every communication part in bytes sent (a ring phase sends
    ``(n - 1) / n`` of its buffer, as ``CommLogger`` counts it). Only ``bubble`` is no count."""
    return hardware_from_measurements(
        peak_flops=1.0,
        link=AlphaBeta(0.0, 1.0),
        memory_bytes=1e12,
        gpus_per_node=world_size,
        name="counting: 1 FLOP/s, 1 B/s",
    )


def count_steps(ctx, configs: dict, model=CALIBRATION_MODEL, mbs: int = 2, seed: int = 0) -> dict:
    """What one training step of each configuration costs this rank, counted, not timed:
    ``{name: {"flops": ..., "bytes": ..., "ops": {op: [calls, bytes sent]}}}``, with the
    unsharded ``"compute"`` step first. FLOPs are ``torch.utils.flop_counter``'s (matmuls and
    attention, forward and backward), bytes the ``CommLogger``'s (sent, by the ring algorithm's
    volume for a built-in collective). One step is run first, uncounted, so one-time work
    (buffers, first gathers) stays out."""
    from torch.utils.flop_counter import FlopCounterMode

    out = {}
    for name, c in {"compute": ParallelConfig(mbs=mbs), **configs}.items():
        step = _setup(ctx, name, c, model, seed)
        step(0)
        with CommLogger() as log, FlopCounterMode(display=False) as flops:
            step(1)
        out[name] = {
            "flops": flops.get_total_flops(),
            "bytes": log.bytes_sent,
            "ops": {op: [t["calls"], t["bytes_sent"]] for op, t in log.totals().items()},
        }
    return out


def compare_counts(per_rank: list, configs: dict, model=CALIBRATION_MODEL, world_size: int | None = None) -> dict:
    """The busiest rank's counts (the largest over ``per_rank``, :func:`count_steps`'s results)
    against the step-time model's: ``{name: {"flops", "predicted_flops", "flops_ratio",
    "bytes", "predicted_bytes", "bytes_ratio"}}`` (a ratio is measured / predicted; None
    where the model predicts no traffic)."""
    hw = counting_hardware(world_size or len(per_rank))
    out = {}
    for name, c in configs.items():
        predicted = step_time(model, c, model.seq_len, hw)
        flops = max(r[name]["flops"] for r in per_rank)
        nbytes = max(r[name]["bytes"] for r in per_rank)
        predicted_bytes = sum(predicted[k] for k in COMMUNICATION_PARTS)
        out[name] = {
            "flops": flops,
            "predicted_flops": predicted["compute"] + predicted["recompute"],
            "bytes": nbytes,
            "predicted_bytes": predicted_bytes,
        }
        out[name]["flops_ratio"] = flops / out[name]["predicted_flops"]
        out[name]["bytes_ratio"] = nbytes / predicted_bytes if predicted_bytes else None
    return out
