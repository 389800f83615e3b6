"""What an FP8 GEMM buys over bf16 on a GPU's tensor cores: the one measurement that
``benchmarks/bench_fp8.py`` records and chapter 12 runs (or shows, from the record).

``torch._scaled_mm`` multiplies e4m3 operands with one scale per tensor; it is timed against a
bf16 ``torch.matmul`` of the same square size, alone and with both casts to FP8 included (what
a layer that quantises its inputs every step pays). Each size is first checked: the FP8
product must be the float32 product up to FP8's rounding, or the timing would be of a wrong
answer. The check runs on a CPU too; the timings need a CUDA GPU with FP8 tensor cores.
"""

from __future__ import annotations

import torch

from .scaling import E4M3, quantize_per_tensor, relative_error

# e4m3 keeps 3 mantissa bits: each factor is rounded by at most 2^-4 relative, and a dot
# product of n such terms averages those roundings out, so the relative Frobenius error of
# the product is a few percent (about 0.03-0.04 measured on random normal matrices);
# a wrong scale or a transposed operand gives errors of order 1.
FP8_PRODUCT_TOLERANCE = 0.1

# FP8 tensor cores arrived with compute capability 8.9 (Ada: L4, L40, RTX 40) and 9.0 (Hopper:
# H100, H200); an A100 (8.0) or a T4 (7.5) has none, and torch._scaled_mm raises there.
FP8_MIN_CAPABILITY = (8, 9)


def fp8_gpu_refusal(device=None) -> str | None:
    """None where ``device`` (default: the current CUDA GPU) has FP8 tensor cores, else the
    reason it has not, in a sentence to print (no CUDA GPU, or one older than 8.9)."""
    if not torch.cuda.is_available():
        return "FP8 GEMMs need a CUDA GPU with FP8 tensor cores; this machine has no CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= FP8_MIN_CAPABILITY:
        return None
    return (
        f"{torch.cuda.get_device_name(device)} has compute capability {major}.{minor}; FP8 tensor cores "
        f"need {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or newer (Ada: L4, L40; Hopper: H100, H200), "
        "and torch._scaled_mm refuses FP8 operands here"
    )


def fp8_operands(a: torch.Tensor, b: torch.Tensor):
    """Quantise a (row-major) and b (column-major, as _scaled_mm wants it) with one scale each."""
    qa, sa = quantize_per_tensor(a, E4M3)
    qbt, sb = quantize_per_tensor(b.t().contiguous(), E4M3)
    return qa, sa, qbt.t(), sb


def fp8_matmul(qa, sa, qb, sb) -> torch.Tensor:
    return torch._scaled_mm(qa, qb, scale_a=sa.float(), scale_b=sb.float(), out_dtype=torch.bfloat16)


def check_fp8_product(n: int, device) -> float:
    """Relative error of the FP8 product of two random n x n matrices against their float32
    product; raises above ``FP8_PRODUCT_TOLERANCE``."""
    g = torch.Generator(device=device).manual_seed(n)
    a, b = (torch.randn(n, n, device=device, generator=g) for _ in range(2))
    error = relative_error(fp8_matmul(*fp8_operands(a, b)).float(), a @ b)
    if error > FP8_PRODUCT_TOLERANCE:
        raise AssertionError(
            f"FP8 product at {n}^3 is off by {error:.3f} relative (tolerance "
            f"{FP8_PRODUCT_TOLERANCE}): a scale or a layout is wrong"
        )
    return error


def gpu_milliseconds(fn) -> float:
    """Median time of ``fn()`` on the GPU (Triton's ``do_bench``: warm-up, L2 flushed between runs)."""
    import triton.testing

    return triton.testing.do_bench(fn, return_mode="median")


def measure_fp8_gemm(n: int) -> dict:
    """One row: the FP8 and bf16 GEMMs of size n^3 on the GPU, their TFLOP/s and ratios."""
    refusal = fp8_gpu_refusal()
    if refusal:
        raise RuntimeError(
            f"measure_fp8_gemm: {refusal}. Show the recorded result instead (ultrascale.records, results/fp8_*.json)."
        )
    error = check_fp8_product(n, "cuda")
    a, b = (torch.randn(n, n, device="cuda") for _ in range(2))
    a16, b16 = a.bfloat16(), b.bfloat16()
    operands = fp8_operands(a, b)
    tflops = lambda ms: 2 * n**3 / (ms * 1e-3) / 1e12  # noqa: E731
    bf16_ms = gpu_milliseconds(lambda: a16 @ b16)
    fp8_ms = gpu_milliseconds(lambda: fp8_matmul(*operands))
    cast_ms = gpu_milliseconds(lambda: fp8_matmul(*fp8_operands(a16, b16)))
    return dict(
        n=n,
        relative_error=error,
        bf16_ms=bf16_ms,
        fp8_ms=fp8_ms,
        fp8_with_casts_ms=cast_ms,
        bf16_tflops=tflops(bf16_ms),
        fp8_tflops=tflops(fp8_ms),
        fp8_with_casts_tflops=tflops(cast_ms),
        fp8_over_bf16=bf16_ms / fp8_ms,
        fp8_with_casts_over_bf16=bf16_ms / cast_ms,
    )


def print_fp8_rows(rows) -> None:
    """The table of ``measure_fp8_gemm`` rows, measured now or read from a record."""
    print(
        f"{'size':>6s} {'bf16 TFLOP/s':>13s} {'FP8 TFLOP/s':>12s} {'FP8/bf16':>9s} "
        f"{'FP8+casts/bf16':>15s} {'FP8 rel. error':>15s}"
    )
    for r in rows:
        print(
            f"{r['n']:>6d} {r['bf16_tflops']:13.0f} {r['fp8_tflops']:12.0f} {r['fp8_over_bf16']:8.2f}x "
            f"{r['fp8_with_casts_over_bf16']:14.2f}x {r['relative_error']:15.3f}"
        )
