"""Side-by-side timings of the course's Triton kernels against their PyTorch baselines.

On a CUDA GPU every kernel is first checked against its baseline, then both are
timed with ``triton.testing.do_bench`` and printed with their ratio:

* memory-bound kernels (vector add, ELU, softmax, RMSNorm, LayerNorm) as GB/s,
  next to a measured device-to-device copy (the practical bandwidth ceiling);
* matmul as TFLOP/s against ``torch.matmul`` (bf16, 4096^3);
* FlashAttention forward (and forward + backward) as TFLOP/s against
  ``scaled_dot_product_attention`` restricted to its flash backend (bf16,
  seq 4096, head dim 128, causal).

The results go to results/kernels_<device>.json with their provenance (device,
torch and triton versions, git commit, date).

Without a GPU it says so and exits 0, after timing the kernels in Triton's CPU
interpreter at small sizes. Those numbers measure a Python interpreter, not a
GPU, and are printed under that label only (nothing is written to results/).

Usage:  python benchmarks/bench_kernels.py [--quick] [--out results/]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import ultrascale.kernels as K
from ultrascale import records

# ---- What to run, and at which sizes --------------------------------------------------------

SIZES = {
    "full": dict(n=2**28, rows=16384, cols=(1024, 4096, 16384), mm=4096, attn=(4, 16, 4096, 128), copy=2**30),
    "quick": dict(n=2**24, rows=4096, cols=(1024, 4096, 16384), mm=2048, attn=(1, 16, 2048, 128), copy=2**28),
    # Triton's CPU interpreter runs each program instance as a Python loop step: tiny sizes only.
    "interpreter": dict(n=100_000, rows=64, cols=(1000,), mm=128, attn=(1, 2, 128, 64), copy=2**24),
}


def timer(on_gpu: bool):
    """Median milliseconds of a call: do_bench on a GPU (warm-up, L2 flush, CUDA events), wall clock on CPU."""
    if on_gpu:
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, return_mode="median")
    return wall_ms


def wall_ms(fn, repeats: int = 3) -> float:
    fn()  # warm-up: the first call also sets up the interpreter's per-kernel state
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def gb_per_s(bytes_moved: int, ms: float) -> float:
    return bytes_moved / (ms * 1e-3) / 1e9


def tflop_per_s(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def copy_bandwidth(n_bytes: int, device, bench) -> float:
    """Measured device-to-device copy bandwidth in GB/s (counting the read and the write)."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return gb_per_s(2 * n_bytes, bench(lambda: dst.copy_(src)))


def short_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def tolerance(dtype: torch.dtype) -> dict:
    # bf16 keeps 8 bits of mantissa (~4e-3 relative per rounding); fp32 results differ only in
    # summation order here (the interpreter's tl.dot is exact fp32; see tests/test_kernels.py).
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)


def timed(name, size, bench, ours, base, baseline, metric, amount, copy_gbs=None) -> dict:
    """Time both sides; ``amount`` is bytes moved (metric GB/s) or FLOPs (metric TFLOP/s)."""
    ours_ms, base_ms = bench(ours), bench(base)
    rate = gb_per_s if metric == "GB/s" else tflop_per_s
    r = dict(
        kernel=name,
        size=size,
        ours_ms=ours_ms,
        baseline=baseline,
        baseline_ms=base_ms,
        speedup_vs_baseline=base_ms / ours_ms,
        metric=metric,
        ours=rate(amount, ours_ms),
        baseline_value=rate(amount, base_ms),
    )
    if copy_gbs is not None and metric == "GB/s":
        r["fraction_of_copy"] = r["ours"] / copy_gbs
    return r


def memory_bound_rows(sizes, device, dtype, bench, copy_gbs) -> list:
    rows = []
    n = sizes["n"]
    x, y = (torch.randn(n, device=device) for _ in range(2))
    torch.testing.assert_close(K.vector_add(x, y), x + y)
    torch.testing.assert_close(K.elu(x), torch.nn.functional.elu(x), **tolerance(torch.float32))
    rows.append(
        timed(
            "vector_add fp32",
            n,
            bench,
            lambda: K.vector_add(x, y),
            lambda: x + y,
            "torch eager",
            "GB/s",
            3 * 4 * n,
            copy_gbs,
        )
    )
    rows.append(
        timed(
            "elu fp32",
            n,
            bench,
            lambda: K.elu(x),
            lambda: torch.nn.functional.elu(x),
            "torch eager",
            "GB/s",
            2 * 4 * n,
            copy_gbs,
        )
    )
    tag = short_name(dtype)
    for n_cols in sizes["cols"]:
        size = [sizes["rows"], n_cols]
        x = torch.randn(*size, device=device, dtype=dtype)
        w, b = (torch.randn(n_cols, device=device, dtype=dtype) for _ in range(2))
        torch.testing.assert_close(K.softmax(x), torch.softmax(x, -1), **tolerance(dtype))
        torch.testing.assert_close(K.rms_norm(x, w), K.rms_norm_reference(x, w), **tolerance(dtype))
        torch.testing.assert_close(K.layer_norm(x, w, b), K.layer_norm_reference(x, w, b), **tolerance(dtype))
        moved = 2 * x.numel() * x.element_size()  # read x once, write the output once
        rows.append(
            timed(
                f"softmax {tag}",
                size,
                bench,
                lambda: K.softmax(x),
                lambda: torch.softmax(x, -1),
                "torch.softmax",
                "GB/s",
                moved,
                copy_gbs,
            )
        )
        rows.append(
            timed(
                f"rms_norm fwd {tag}",
                size,
                bench,
                lambda: K.rms_norm_forward(x, w),
                lambda: torch.nn.functional.rms_norm(x, (n_cols,), w),
                "F.rms_norm",
                "GB/s",
                moved,
                copy_gbs,
            )
        )
        rows.append(
            timed(
                f"layer_norm fwd {tag}",
                size,
                bench,
                lambda: K.layer_norm(x, w, b),
                lambda: torch.nn.functional.layer_norm(x, (n_cols,), w, b),
                "F.layer_norm",
                "GB/s",
                moved,
                copy_gbs,
            )
        )
    return rows


def matmul_rows(sizes, device, dtype, bench) -> list:
    n = sizes["mm"]
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    # bf16 output of sums of n products: compare relative to the O(sqrt(n)) magnitude.
    torch.testing.assert_close(K.matmul(a, b), a @ b, atol=0.1 if dtype == torch.bfloat16 else 1e-3, rtol=2e-2)
    return [
        timed(
            f"matmul {short_name(dtype)}",
            [n, n, n],
            bench,
            lambda: K.matmul(a, b),
            lambda: torch.matmul(a, b),
            "torch.matmul",
            "TFLOP/s",
            2 * n**3,
        )
    ]


def attention_rows(sizes, device, dtype, bench, on_gpu) -> list:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, heads, seq, d = sizes["attn"]
    q, k, v = (torch.randn(batch, heads, seq, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    # On a GPU, pin SDPA to its FlashAttention backend; on a CPU let it choose.
    backend = SDPBackend.FLASH_ATTENTION if on_gpu else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    baseline = "SDPA flash backend" if on_gpu else "SDPA (CPU)"

    def sdpa():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    with torch.no_grad():
        torch.testing.assert_close(K.flash_attention_forward(q, k, v, True)[0], sdpa(), **tolerance(dtype))
    fwd_flops = 4 * batch * heads * seq * seq * d / 2  # two matmuls of 2*s*s*d; causal skips half
    tag = short_name(dtype)
    size = [batch, heads, seq, d]
    rows = [
        timed(
            f"flash_attention fwd {tag} causal",
            size,
            bench,
            lambda: K.flash_attention_forward(q, k, v, True),
            sdpa,
            baseline,
            "TFLOP/s",
            fwd_flops,
        )
    ]
    # The backward does 5 matmuls to the forward's 2, so forward + backward is 3.5x the forward's work.
    rows.append(
        timed(
            f"flash_attention fwd+bwd {tag} causal",
            size,
            bench,
            lambda: torch.autograd.grad(K.flash_attention(q, k, v, True), (q, k, v), do),
            lambda: torch.autograd.grad(sdpa(), (q, k, v), do),
            baseline,
            "TFLOP/s",
            3.5 * fwd_flops,
        )
    )
    return rows


def print_rows(rows) -> None:
    print(
        f"{'kernel':38s} {'size':>22s} {'ours ms':>10s} {'base ms':>9s} {'speedup':>8s} {'metric':>8s} "
        f"{'ours':>9s} {'base':>9s}  baseline"
    )
    for r in rows:
        extra = f"  (ours = {100 * r['fraction_of_copy']:.0f}% of copy)" if "fraction_of_copy" in r else ""
        print(
            f"{r['kernel']:38s} {str(r['size']):>22s} {r['ours_ms']:10.3f} {r['baseline_ms']:9.3f} "
            f"{r['speedup_vs_baseline']:7.2f}x {r['metric']:>8s} {r['ours']:9.3g} {r['baseline_value']:9.3g}  "
            f"{r['baseline']}{extra}"
        )


def run(sizes_name: str) -> dict:
    on_gpu = K.on_gpu()
    device = K.kernel_device()
    dtype = torch.bfloat16 if on_gpu else torch.float32  # the interpreter cannot tl.dot bf16
    sizes, bench = SIZES[sizes_name], timer(on_gpu)
    copy_gbs = copy_bandwidth(sizes["copy"], device, bench)
    rows = (
        memory_bound_rows(sizes, device, dtype, bench, copy_gbs if on_gpu else None)
        + matmul_rows(sizes, device, dtype, bench)
        + attention_rows(sizes, device, dtype, bench, on_gpu)
    )
    return dict(sizes=sizes_name, copy_gb_per_s=copy_gbs, rows=rows)


def run_gpu(quick: bool, out_dir: Path) -> Path:
    name = torch.cuda.get_device_name(0)
    print(f"device: {name}")
    result = run("quick" if quick else "full")
    print(f"measured device-to-device copy: {result['copy_gb_per_s']:.0f} GB/s")
    print_rows(result["rows"])
    path = records.write("kernels", dict(records.provenance(name), **result), out_dir)
    print(f"wrote {path}")
    return path


def run_interpreter() -> None:
    print("bench_kernels: GPU timings need a CUDA GPU; there is none here, so nothing is recorded.")
    print("Timing the kernels in Triton's CPU interpreter at QUICK sizes instead.\n")
    result = run("interpreter")
    print("INTERPRETER TIMINGS: each program instance is a step of a Python loop on the CPU.")
    print("They show that the kernels run, not how fast they are; these are NOT GPU numbers.")
    print_rows(result["rows"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Time the Triton kernels against PyTorch baselines.")
    parser.add_argument("--quick", action="store_true", help="smaller sizes on the GPU (CPU is always quick)")
    parser.add_argument("--out", type=Path, default=records.RESULTS, help="folder for the JSON record")
    args = parser.parse_args(argv)
    if K.on_gpu():
        run_gpu(args.quick, args.out)
    else:
        run_interpreter()
    return 0


if __name__ == "__main__":
    sys.exit(main())
