"""Data parallelism and ZeRO against PyTorch's own, side by side in one run.

    python benchmarks/bench_dp_zero.py [--world-size 4] [--hidden 128] [--layers 4] ...

Prints, on 4 ranks (gloo on CPU, NCCL with 4 GPUs):
  * step time of our overlapped + bucketed DP against DistributedDataParallel with the
    same bucket size (target: ratio <= 1.0, issue 22; it was 1.15, and 0.98-1.14 while our
    buckets closed before the cap, one more all-reduce per step than DDP);
  * step time of our ZeRO-3 with prefetch against FSDP2 ``fully_shard`` with the same
    units, one per block plus the root (target: ratio <= 1.3); ZeRO-1/2 for reference;
  * measured per-rank state bytes for ZeRO stages 0-3 against the book's formulas at
    this run's byte widths (target: within 2%).

Implementations are timed in alternating rounds (A B, B A, ...), so a slow spell of a
shared machine hits all of them alike; we report the median step over all rounds. DDP and
our DP race alone, 12 rounds by default (``--dp-rounds``), and the round-by-round ratios
are printed: their spread is what one run's ratio can be trusted to.
A step's time is the slowest rank's: data parallelism waits for the last replica.
Data, loss and PyTorch's wrappers come from ``ultrascale.parity``, as in the tests.
"""

from __future__ import annotations

import torch

from ultrascale.data import Batches
from ultrascale.memory import zero_formula_bytes
from ultrascale.model import GPT, count_params
from ultrascale.parallel import BucketedDataParallel, ZeRO
from ultrascale.parity import ddp, device_mesh_1d, fsdp2
from ultrascale.runtime import Cluster
from ultrascale.train import OPTIMIZERS, make_optimizer
from sidebyside import (
    config_of,
    measure_rounds,
    median_steps,
    model_arguments,
    ratio_interval,
    round_ratios,
    timed_steps,
    verdict,
)


_ADAM = dict(optimizer_cls=OPTIMIZERS["adam"][0], **OPTIMIZERS["adam"][1])  # ZeRO's optimizer, as the others'


def build(ctx, impl, cfg, bucket_mb):
    """Model + whatever makes it data-parallel; returns (module to call, step function)."""
    torch.manual_seed(0)
    model = GPT(cfg).to(ctx.device)
    if impl == "ddp":
        wrapped = ddp(model, bucket_cap_mb=bucket_mb)
        opt = make_optimizer(model.parameters(), "adam")
        return wrapped, lambda: (opt.step(), opt.zero_grad())
    if impl == "ours_dp":
        wrapped = BucketedDataParallel(model, bucket_cap_mb=bucket_mb)
        opt = make_optimizer(model.parameters(), "adam")
        return wrapped, lambda: (wrapped.finish_gradient_synchronization(), opt.step(), opt.zero_grad())
    if impl == "fsdp2":
        model = fsdp2(model, device_mesh_1d(ctx))  # the same units as our ZeRO-3: each block, then the root
        opt = make_optimizer(model.parameters(), "adam")
        return model, lambda: (opt.step(), opt.zero_grad())
    stage = int(impl[-1])  # "zero1", "zero2", "zero3"
    zero = ZeRO(model, stage=stage, prefetch=True, **_ADAM)
    return model, lambda: (zero.step(), zero.zero_grad())


def time_steps(ctx, impl, cfg, mbs, bucket_mb, warmup, steps):
    module, finish = build(ctx, impl, cfg, bucket_mb)
    batch = Batches(cfg, mbs).rank_batch(ctx.rank, ctx.world_size, step=0).to(ctx.device)

    def step():
        batch.loss(module).backward()
        finish()

    return timed_steps(ctx, step, warmup, steps)


def state_bytes(ctx, stage, cfg, param_dtype):
    torch.manual_seed(0)
    model = GPT(cfg).to(ctx.device)
    zero = ZeRO(model, stage=stage, param_dtype=param_dtype, **_ADAM)
    Batches(cfg, mbs=1).rank_batch(ctx.rank, ctx.world_size, step=0).to(ctx.device).loss(model).backward()
    zero.step()  # Adam creates its moments at the first step
    return zero.state_bytes(), zero_formula_bytes(zero, k=12)


def main():
    parser = model_arguments(__doc__)
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="bucket_cap_mb for both DPs")
    parser.add_argument("--dp-rounds", type=int, default=12, help="rounds of DDP against our DP")
    args = parser.parse_args()
    cfg = config_of(args)
    psi = count_params(cfg)
    print(
        f"model: GPT h={cfg.hidden} L={cfg.layers} v={cfg.vocab_size} seq={cfg.seq_len} "
        f"mbs={args.mbs}: {psi:,} parameters; torch {torch.__version__}"
    )

    with Cluster(args.world_size) as cluster:
        print(f"{args.world_size} ranks, backend {cluster.backend}, {cluster.threads} thread(s) per rank\n")
        # DP against DDP gets rounds of its own, more of them: the two differ by a few percent, and
        # three rounds of six implementations left this ratio anywhere in 0.96-1.07 from run to run
        timing = (time_steps, cfg, args.mbs, args.bucket_mb, args.warmup, args.steps)
        rounds = measure_rounds(cluster, ["ddp", "ours_dp"], args.dp_rounds, *timing)
        rounds.update(measure_rounds(cluster, ["fsdp2", "zero3", "zero1", "zero2"], args.rounds, *timing))
        t = median_steps(rounds)
        print(f"{'implementation':<34}{'step (ms)':>10}")
        names = {
            "ddp": "PyTorch DDP",
            "ours_dp": "ours: overlapped + bucketed DP",
            "fsdp2": "PyTorch FSDP2 (fully_shard)",
            "zero3": "ours: ZeRO-3 + prefetch",
            "zero1": "ours: ZeRO-1",
            "zero2": "ours: ZeRO-2",
        }
        for impl, seconds in t.items():
            print(f"{names[impl]:<34}{1e3 * seconds:>10.1f}")
        # judged as printed (verdict): a run printing 1.000 once read MISSED (its ratio was 1.0003)
        dp_ratio, z3_ratio = t["ours_dp"] / t["ddp"], t["zero3"] / t["fsdp2"]
        print(
            f"\nours DP / DDP      = {dp_ratio:.3f}  (target <= 1.00, no slower than DDP) "
            f"{verdict(dp_ratio, high=1.00)}"
        )
        print(
            f"  round by round:    {', '.join(f'{r:.3f}' for r in round_ratios(rounds, 'ours_dp', 'ddp'))}"
            f"  (the spread is this machine's noise on the ratio)"
        )
        low, high = ratio_interval(rounds, "ours_dp", "ddp")
        # Redrawing one run's rounds misses what drifts between runs (five runs of this bench
        # read 0.95-1.07 on the 2-core machine), so this range is a floor on the uncertainty.
        print(
            f"  90% of rounds redrawn: {low:.3f}-{high:.3f}: "
            + (
                "faster than DDP in this run"
                if high < 1
                else "slower than DDP in this run"
                if low > 1
                else "this run cannot tell ours from DDP"
            )
        )
        print(f"ours ZeRO-3 / FSDP2 = {z3_ratio:.3f}  (target <= 1.30) {verdict(z3_ratio, high=1.30)}\n")

        for dtype, widths in (
            (torch.float32, "fp32 params/grads (4 B), k = 12"),
            (torch.bfloat16, "bf16 params/grads (2 B), k = 12: the book's widths"),
        ):
            print(f"per-rank state, {widths}")
            print(f"{'stage':<7}{'measured (MB)':>15}{'formula (MB)':>15}{'diff':>9}")
            for stage in (0, 1, 2, 3):
                measured, formula = cluster.run(state_bytes, stage, cfg, dtype)[0]
                m, f = sum(measured.values()), sum(formula.values())
                percent = 100 * (m - f) / f
                print(f"{stage:<7}{m / 1e6:>15.3f}{f / 1e6:>15.3f}{percent:>8.3f}%  {verdict(percent, -2, 2)}")
            print()


if __name__ == "__main__":
    main()
