"""The benchmarks behind ``make bench``: their verdicts judge what they print, and each still runs.

Timings are not asserted here (a shared CI machine's noise would decide them); the smoke runs
use each benchmark's smallest settings and check that it finishes, prints its table, and that
the verdicts which do not depend on timing (bytes against their formulas) read OK.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from sidebyside import ratio_interval, verdict  # noqa: E402


def test_verdict_judges_the_digits_it_is_printed_with():
    assert verdict(1.153, high=1.15, digits=2) == "OK"  # printed as 1.15
    assert verdict(1.156, high=1.15, digits=2) == "MISSED"  # printed as 1.16
    assert verdict(1.0003, high=1.00) == "OK"  # printed as 1.000
    assert verdict(1.0006, high=1.00) == "MISSED"
    assert verdict(0.894, low=0.9, digits=2) == "MISSED"
    assert verdict(0.851, 0.85, 1.15) == "OK" and verdict(0.849, 0.85, 1.15) == "MISSED"
    assert verdict(1.151, 0.85, 1.15) == "MISSED"
    assert verdict(-1.9, -2, 2) == "OK" and verdict(2.1, -2, 2) == "MISSED"
    assert verdict(499.6, low=500, digits=0) == "OK" and verdict(499.4, low=500, digits=0) == "MISSED"
    assert verdict(7.0) == "OK"  # no bounds: nothing to miss


# script -> (smallest arguments, patterns its output must contain); 2 ranks where a benchmark takes
# --world-size (the ring all-reduce's smoke run: 16 core-s at 4 ranks, 8 at 2; the pipeline's keeps
# its 4 stages, whose bubble row it checks)
SMOKE = {
    "bench_runtime.py": (
        ["--calls", "5", "--repeats", "1", "--world-size", "2"],
        [r"no-op call is .* \(target >= 500x\): (OK|MISSED)"],
    ),
    "bench_send_recv.py": (["--exchanges", "5", "--rounds", "1", "--world-size", "2"], [r"ring\s+1024 KiB"]),
    "bench_ring_allreduce.py": (
        ["--quick", "--world-size", "2"],
        [r"1\.00 MiB .* >= 0\.9x: (OK|MISSED)", r"fit of the ring's own times"],
    ),
    "bench_dp_zero.py": (
        ["--world-size", "2", "--steps", "1", "--warmup", "1", "--rounds", "1", "--dp-rounds", "1"],
        [
            r"ours DP / DDP\s+= [\d.]+ .* (OK|MISSED)",
            r"90% of rounds redrawn: [\d.]+-[\d.]+: \w",
            r"ours ZeRO-3 / FSDP2 = [\d.]+ .* (OK|MISSED)",
        ]
        + [rf"\n{stage}\s+[\d.]+\s+[\d.]+\s+-?[\d.]+%  OK" for stage in range(4)],
    ),
    "bench_tp.py": (
        ["--world-size", "2", "--steps", "1", "--warmup", "1", "--rounds", "1"],
        [r"ours / PyTorch, TP\+SP\s*= [\d.]+ .* (OK|MISSED)", r"measured / predicted = [\d.]+ .* OK"],
    ),
    "bench_pp.py": (
        ["--steps", "1", "--warmup", "1", "--rounds", "1", "--bubble-m", "4", "--bubble-steps", "1"],
        [r"ours / PyTorch = [\d.]+ .* (OK|MISSED)", r"\n\s+4\s+[\d.]+\s+0\.750 .* (OK|MISSED)"],
    ),
    "bench_cp.py": (
        ["--quick", "--world-size", "2"],
        [r"measured == model: True", r"zig-zag [\d.]+x \(target <= 1\.15\) (OK|MISSED)"],
    ),
    "bench_ep.py": (
        ["--world-size", "2", "--steps", "1", "--warmup", "1", "--rounds", "1"],
        [r"all-to-all bytes equal the prediction on every rank: OK"],
    ),
    "bench_kernels.py": ([], [r"flash_attention fwd\+bwd"]),
    "bench_mfu.py": (["--steps", "1", "--warmup", "0"], [r"needs a CUDA GPU; nothing measured"]),
    "bench_fp8.py": (["--quick"], [r"FP8 product checked on the CPU: relative error 0\.0\d\d \(tolerance 0\.1\): OK"]),
}


def test_ratio_interval_brackets_the_ratio_and_widens_with_the_noise():
    # two implementations, 12 rounds of 5 steps; "b" is 10% slower than "a" in every round
    import random

    rng = random.Random(1)
    steady = {"a": [[1.0] * 5 for _ in range(12)], "b": [[1.1] * 5 for _ in range(12)]}
    assert ratio_interval(steady, "b", "a") == pytest.approx((1.1, 1.1))
    noisy = {
        impl: [[t * rng.uniform(0.7, 1.3) for _ in range(5)] for _ in range(12)] for impl, t in (("a", 1.0), ("b", 1.1))
    }
    low, high = ratio_interval(noisy, "b", "a")
    assert low < 1.1 < high and high - low > 0.05  # it says how far one run can be trusted
    assert ratio_interval(noisy, "b", "a") == (low, high)  # the same samples give the same interval


def test_every_benchmark_in_make_bench_has_a_smoke_run():
    make_bench = re.findall(r"benchmarks/(bench_\w+\.py)", (BENCHMARKS.parent / "Makefile").read_text())
    assert sorted(make_bench) == sorted(SMOKE)


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_runs_and_prints_its_verdicts(script, tmp_path):
    args, patterns = SMOKE[script]
    if script == "bench_kernels.py":
        args = [*args, "--out", str(tmp_path)]  # its JSON record goes here, not into results/
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        cwd=BENCHMARKS.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    for pattern in patterns:
        assert re.search(pattern, done.stdout), f"{script}: no {pattern!r} in\n{done.stdout[-3000:]}"
