"""Pipeline parallelism against PyTorch's own, side by side in one run, and the bubble measured.

    python benchmarks/bench_pp.py [--world-size 4] [--microbatches 8] [--hidden 128] ...

Prints, on 4 ranks (gloo on CPU, NCCL with 4 GPUs):
  * the time of one training step (forward and backward of m micro-batches, SGD step) of
    the course GPT cut into p stages, run by our 1F1B (``apply_pp``) and by
    ``torch.distributed.pipelining.Schedule1F1B`` on the same stage modules and the same
    micro-batches (``pytorch_pipeline``). Target: ours / PyTorch's <= 1.1;
  * the bubble fraction measured on the ranks for several m: every rank logs its forward and
    backward bars in a ``Timeline``, and the bubble is the idle time over the busy time
    (``schedule.bubble_fraction``, the book's r_bubble). The compute is sleep-calibrated
    (``calibrate_compute``: every forward lasts t_f and every backward 2 t_f, sleeping what the
    compute leaves), so the book's t_b = 2 t_f holds whatever the machine. Target: within 15%
    of (p-1)/m. What remains above it is the messages' latency, which the formula leaves out:
    in 1F1B's steady phase every action waits for a neighbour's message, so it adds up over
    about 2(m+p-1) hops (``schedule.simulate(..., t_comm=...)`` shows the same).

Implementations are timed in alternating rounds (A B, B A, ...), so a slow spell of a
shared machine hits both alike; we report the median step over all rounds. A step's time
is the slowest rank's: the optimizer step follows the pipeline's flush.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from ultrascale.data import Batches
from ultrascale.model import GPT, count_params
from ultrascale.parallel.pipeline_parallel import apply_pp
from ultrascale.parallel.timeline import Timeline
from ultrascale.parity.pipeline_runs import calibrate_compute, pytorch_pipeline
from ultrascale.runtime import Cluster
from ultrascale.schedule import bubble_fraction, predicted_bubble_fraction
from ultrascale.train import make_optimizer
from sidebyside import config_of, measure, model_arguments, timed_steps, verdict

IMPLS = {"ours": "ours: apply_pp, 1F1B", "torch": "PyTorch Schedule1F1B"}


def build(ctx, impl, cfg, m, timeline=None):
    torch.manual_seed(0)
    model = GPT(cfg).to(ctx.device)
    if impl == "ours":
        return apply_pp(model, schedule="1f1b", microbatches=m, timeline=timeline)
    return pytorch_pipeline(model, schedule="1f1b", microbatches=m)


def time_steps(ctx, impl, cfg, m, mbs, warmup, steps):
    pipe = build(ctx, impl, cfg, m)
    opt = make_optimizer(pipe.parameters(), "sgd")
    batch = Batches(cfg, mbs * m).global_batch(0).to(ctx.device)  # cut into m micro-batches of mbs rows

    def step():
        pipe.step(batch)
        opt.step()
        opt.zero_grad()

    return timed_steps(ctx, step, warmup, steps)


def measured_bubble(ctx, cfg, m, mbs, t_f, steps):
    """Per step: this rank's Timeline rows of our 1F1B with sleep-calibrated compute."""
    timeline = Timeline(ctx.rank, device=ctx.device)
    pipe = build(ctx, "ours", cfg, m, timeline)
    calibrate_compute(pipe, t_f)
    batch = Batches(cfg, mbs * m).global_batch(0).to(ctx.device)
    rows = []
    for _ in range(1 + steps):  # the first step warms up (allocations, first messages): not kept
        dist.barrier()
        timeline.clear()
        pipe.step(batch)
        pipe.zero_grad()
        rows.append(timeline.rows())
    return rows[1:]


def main():
    parser = model_arguments(__doc__, microbatches=8, t_f_ms=100.0, bubble_m="4,8,16", bubble_steps=3)
    args = parser.parse_args()
    cfg, m, p = config_of(args), args.microbatches, args.world_size
    print(
        f"model: GPT h={cfg.hidden} L={cfg.layers} heads={cfg.heads} v={cfg.vocab_size} seq={cfg.seq_len}: "
        f"{count_params(cfg):,} parameters; m={m} micro-batches of {args.mbs} rows; torch {torch.__version__}"
    )

    with Cluster(p) as cluster:
        print(f"pp={p} ranks, backend {cluster.backend}, {cluster.threads} thread(s) per rank\n")
        t = measure(cluster, list(IMPLS), args.rounds, time_steps, cfg, m, args.mbs, args.warmup, args.steps)
        print(f"{'implementation':<30}{'step (ms)':>10}")
        for impl, seconds in t.items():
            print(f"{IMPLS[impl]:<30}{1e3 * seconds:>10.1f}")
        ratio = t["ours"] / t["torch"]
        print(f"\nours / PyTorch = {ratio:.3f}  (target <= 1.10) {verdict(ratio, high=1.10)}")

        t_f = args.t_f_ms / 1e3
        print(
            f"\nbubble fraction, 1F1B with t_f = {args.t_f_ms:g} ms and t_b = 2 t_f of sleep "
            f"(median of {args.bubble_steps} steps):"
        )
        print(f"{'m':>4}{'measured':>10}{'(p-1)/m':>10}{'ratio':>8}")
        for mb in [int(x) for x in args.bubble_m.split(",")]:
            per_rank = cluster.run(measured_bubble, cfg, mb, args.mbs, t_f, args.bubble_steps, timeout=600)
            measured = statistics.median(
                bubble_fraction([rows[s] for rows in per_rank]) for s in range(args.bubble_steps)
            )
            want = predicted_bubble_fraction(p, mb)
            of_model = measured / want
            print(
                f"{mb:>4}{measured:>10.3f}{want:>10.3f}{of_model:>8.3f}  (target within 15%) "
                f"{verdict(of_model, 0.85, 1.15)}"
            )


if __name__ == "__main__":
    main()
