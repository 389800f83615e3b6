"""Training-step throughput and MFU of the course model on one GPU (bf16).

    python benchmarks/bench_mfu.py                # ~350M-parameter GPT, seq 2048
    python benchmarks/bench_mfu.py --size 1b      # ~1.3B parameters

MFU = (6·N + attention FLOPs per token) × tokens per second / the GPU's dense bf16
peak (ultrascale.model.training_flops). Side by side in one run: the same model with
eager attention and with SDPA (FlashAttention), and with torch.compile. The record is
written to results/one_gpu_mfu_bench_<device>.json with its provenance (device,
versions, commit, date). Target of the foundation course: 40% MFU or more.

Without a CUDA GPU the script says so and exits 0: a CPU number is not an MFU to
compare with a GPU's.
"""

import argparse
import datetime
import json
import pathlib
import re
import subprocess
import sys
import time

import torch

from ultrascale.model import GPT, GPTConfig, count_params, lm_loss, mfu

# Dense bf16 tensor-core peaks from the vendors' data sheets (no sparsity).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}
SIZES = {  # hidden, layers, heads: GPT-2 medium-like and a ~1.3B
    "350m": dict(hidden=1024, layers=24, heads=16),
    "1b": dict(hidden=2048, layers=24, heads=16),
}


def peak_flops(name: str):
    for key, value in PEAK_BF16.items():
        if key in name:
            return value
    return None


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


def git_commit() -> str:
    try:
        commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
        dirty = subprocess.call(["git", "diff", "--quiet", "HEAD"]) != 0
        return commit + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="350m")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_mfu needs a CUDA GPU; nothing measured (a CPU number is not a GPU MFU).")
        return 0
    device = torch.cuda.get_device_name(0)
    peak = peak_flops(device)
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = []
    for label, attention, compiled in [("eager attention", "eager", False), ("SDPA", "sdpa", False),
                                       ("SDPA + torch.compile", "sdpa", True)]:
        config = GPTConfig(vocab_size=50304, seq_len=args.seq, attention=attention, **SIZES[args.size])
        model = GPT(config).cuda()
        if compiled:
            model = torch.compile(model)
        idx = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq), device="cuda")
        try:
            step = time_steps(model, (idx, torch.roll(idx, -1, 1)), args.steps, args.warmup)
        except torch.OutOfMemoryError:
            print(f"{label}: out of memory at micro-batch {args.micro_batch}; try --micro-batch smaller")
            continue
        tokens_per_s = args.micro_batch * args.seq / step
        row = {"variant": label, "step_s": step, "tokens_per_s": tokens_per_s,
               "mfu": mfu(tokens_per_s, config, peak, seq_len=args.seq, causal=True) if peak else None}
        rows.append(row)
        del model
        torch.cuda.empty_cache()
    n = count_params(GPTConfig(vocab_size=50304, seq_len=args.seq, **SIZES[args.size]))
    print(f"\n{device}: GPT {n / 1e6:.0f}M parameters, seq {args.seq}, micro-batch {args.micro_batch}, bf16")
    print(f"{'variant':24s} {'step (ms)':>10s} {'tokens/s':>10s} {'MFU':>7s} {'vs eager':>9s}")
    for row in rows:
        ratio = rows[0]["step_s"] / row["step_s"]
        mfu_text = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
        print(f"{row['variant']:24s} {row['step_s'] * 1e3:10.1f} {row['tokens_per_s']:10.0f} {mfu_text:>7s} {ratio:8.2f}x")
    if peak is None:
        print(f"(no bf16 peak known for {device!r}: MFU not computed)")
    record = {
        "device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": sys.version.split()[0], "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "params": n, "seq": args.seq, "micro_batch": args.micro_batch, "peak_flops": peak,
        "mfu_formula": "training_flops(config, tokens/s, causal=True) / peak (6N + causal attention)",
        "rows": rows,
    }
    slug = re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")
    out = pathlib.Path(__file__).resolve().parent.parent / "results" / f"one_gpu_mfu_bench_{slug}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"recorded in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
