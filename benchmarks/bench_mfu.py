"""Training-step throughput and MFU of the course model on one GPU (bf16).

    python benchmarks/bench_mfu.py                # ~350M-parameter GPT, seq 2048
    python benchmarks/bench_mfu.py --size 1b      # ~1.3B parameters

MFU = (6·N + attention FLOPs per token) × tokens per second / the GPU's dense bf16
peak (ultrascale.model.training_flops). Side by side in one run: the same model with
eager attention and with SDPA (FlashAttention), with torch.compile, and with selective
and full recomputation (where HFU, which counts the recomputed FLOPs, exceeds MFU). The record is
written to results/mfu_bench_<size>_<device>.json with its provenance (device,
versions, commit, date). Target of the foundation course: 40% MFU or more.

Without a CUDA GPU the script says so and exits 0: a CPU number is not an MFU to
compare with a GPU's.
"""

import argparse
import sys
import time

import torch

from sidebyside import verdict
from ultrascale import records
from ultrascale.model import GPT, GPTConfig, count_params, hfu, lm_loss, mfu
from ultrascale.plan import datasheet

SIZES = {  # hidden, layers, heads: GPT-2 medium-like and a ~1.3B
    "350m": dict(hidden=1024, layers=24, heads=16),
    "1b": dict(hidden=2048, layers=24, heads=16),
}
# (label, attention, torch.compile, recomputation): the three ways to run the same model, then
# SDPA with recomputation, where HFU (which counts the recomputed FLOPs) exceeds MFU.
VARIANTS = [
    ("eager attention", "eager", False, "none"),
    ("SDPA", "sdpa", False, "none"),
    ("SDPA + torch.compile", "sdpa", True, "none"),
    ("SDPA, selective recompute", "sdpa", False, "selective"),
    ("SDPA, full recompute", "sdpa", False, "full"),
]


def time_steps(model, batch, steps: int, warmup: int) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    idx, targets = batch
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lm_loss(model(idx), targets)  # model(...) so a compiled model runs compiled
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def measure(label, attention, compiled, recompute, args, peak):
    config = GPTConfig(vocab_size=50304, seq_len=args.seq, attention=attention, **SIZES[args.size])
    model = GPT(config).cuda()
    model.set_recompute(recompute)
    runnable = torch.compile(model) if compiled else model
    idx = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq), device="cuda")
    try:
        step = time_steps(runnable, (idx, torch.roll(idx, -1, 1)), args.steps, args.warmup)
    except torch.OutOfMemoryError:
        print(f"{label}: out of memory at micro-batch {args.micro_batch}; try --micro-batch smaller")
        return None
    finally:
        del model, runnable
        torch.cuda.empty_cache()
    tokens_per_s = args.micro_batch * args.seq / step
    util = (
        dict(
            mfu=mfu(tokens_per_s, config, peak, seq_len=args.seq, causal=True),
            hfu=hfu(tokens_per_s, config, peak, recompute, seq_len=args.seq, causal=True),
        )
        if peak
        else {}
    )
    return dict(
        variant=label,
        recompute=recompute,
        step_s=step,
        tokens_per_s=tokens_per_s,
        peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30,
        **util,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="350m")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=str(records.RESULTS), help="folder for the JSON record")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_mfu needs a CUDA GPU; nothing measured (a CPU number is not a GPU MFU).")
        return 0
    device = torch.cuda.get_device_name(0)
    sheet = datasheet(device)  # MFU's denominator: the dense bf16 peak of the data sheet
    peak = sheet.bf16_flops if sheet else None
    rows = []
    for variant in VARIANTS:
        torch.cuda.reset_peak_memory_stats()
        row = measure(*variant, args, peak)
        if row is not None:
            rows.append(row)
    n = count_params(GPTConfig(vocab_size=50304, seq_len=args.seq, **SIZES[args.size]))
    print(
        f"\n{device}: GPT {n / 1e6:.0f}M parameters, seq {args.seq}, micro-batch {args.micro_batch}, bf16, "
        f"peak {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s"
    )
    print(
        f"{'variant':28s} {'step (ms)':>10s} {'tokens/s':>10s} {'MFU':>7s} {'HFU':>7s} {'memory':>8s} {'vs first':>9s}"
    )
    for row in rows:
        ratio = rows[0]["step_s"] / row["step_s"]
        util = f"{row['mfu']:7.1%} {row['hfu']:7.1%}" if "mfu" in row else f"{'n/a':>7s} {'n/a':>7s}"
        print(
            f"{row['variant']:28s} {row['step_s'] * 1e3:10.1f} {row['tokens_per_s']:10.0f} {util} "
            f"{row['peak_memory_gib']:6.1f}Gi {ratio:8.2f}x"
        )
    if peak is None:
        print(f"(no bf16 peak known for {device!r}: MFU not computed)")
    elif rows:
        best = max(rows, key=lambda r: r["mfu"])
        print(
            f"best MFU {best['mfu']:.1%} ({best['variant']}; target >= 40%): "
            f"{verdict(100 * best['mfu'], low=40, digits=1)}"
        )
    record = dict(
        records.provenance(device),
        params=n,
        size=args.size,
        seq=args.seq,
        micro_batch=args.micro_batch,
        steps=args.steps,
        warmup=args.warmup,
        peak_flops=peak,
        mfu_formula="training_flops(config, tokens/s, causal=True) / peak (6N + causal attention); "
        "HFU adds the recomputed forward FLOPs",
        rows=rows,
    )
    print(f"recorded in {records.write(f'mfu_bench_{args.size}', record, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
