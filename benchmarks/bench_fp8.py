"""FP8 against bf16 on the GPU's tensor cores: ``torch._scaled_mm`` (e4m3, one scale per tensor)
against a bf16 ``torch.matmul`` over square sizes, side by side in one run.

    python benchmarks/bench_fp8.py            # 1024, 2048, 4096, 8192
    python benchmarks/bench_fp8.py --quick    # 1024, 2048

For each size it first checks that the FP8 product is the bf16 product up to FP8's rounding,
then times three things with ``triton.testing.do_bench`` (median, warm-up, L2 flushed):
the bf16 GEMM, the FP8 GEMM alone, and the FP8 GEMM with both casts to FP8 included (what
a layer that quantises its inputs every step pays). The book says FP8 GEMMs run up to 2x
bf16's on an H100; the target here is 1.6x or more at 8192. The record goes to
results/fp8_<device>.json with its provenance; chapter 12 shows it on machines without a GPU.

Without a CUDA GPU with FP8 tensor cores (compute capability 8.9 or newer: not an A100 or a T4)
the script checks the same FP8 product on the CPU (``_scaled_mm`` runs there too), says why
nothing is timed, and writes nothing. The measurement itself lives in
``ultrascale.precision.gemm_speed``, which chapter 12 runs too.
"""

from __future__ import annotations

import argparse
import sys

import torch

from sidebyside import verdict
from ultrascale import records
from ultrascale.precision.gemm_speed import (
    FP8_PRODUCT_TOLERANCE,
    check_fp8_product,
    fp8_gpu_refusal,
    measure_fp8_gemm,
    print_fp8_rows,
)

TARGET_AT_8192 = 1.6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="sizes 1024 and 2048 only")
    parser.add_argument("--out", default=str(records.RESULTS), help="folder for the JSON record")
    args = parser.parse_args(argv)
    sizes = (1024, 2048) if args.quick else (1024, 2048, 4096, 8192)
    refusal = fp8_gpu_refusal()
    if refusal:
        errors = [check_fp8_product(n, "cpu") for n in (64, 256)]
        print(f"bench_fp8: {refusal}: nothing is timed or recorded here.")
        print(
            f"FP8 product checked on the CPU: relative error {max(errors):.3f} (tolerance {FP8_PRODUCT_TOLERANCE}): OK"
        )
        return 0
    device = torch.cuda.get_device_name(0)
    rows = [measure_fp8_gemm(n) for n in sizes]
    print(f"{device}: e4m3 torch._scaled_mm (one scale per tensor, bf16 out) against bf16 torch.matmul")
    print_fp8_rows(rows)
    if 8192 in sizes:
        ratio = rows[-1]["fp8_over_bf16"]
        print(
            f"FP8/bf16 at 8192^3 = {ratio:.2f}x (target >= {TARGET_AT_8192}x): "
            f"{verdict(ratio, low=TARGET_AT_8192, digits=2)}"
        )
    path = records.write(
        "fp8",
        dict(
            records.provenance(device),
            sizes="quick" if args.quick else "full",
            target_at_8192=TARGET_AT_8192,
            rows=rows,
        ),
        args.out,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
