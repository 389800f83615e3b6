"""The course's self-test on a GPU node (``make test-gpu``): what a teacher runs before a class.

    .venv/bin/python launch/test_gpu.py              # all three steps
    .venv/bin/python launch/test_gpu.py --skip grader

1. **tests**: the GPU tests (``pytest -m "gpu or multigpu"``): the runtime after CUDA is
   initialised in the notebook, the Triton kernels compiled for this GPU, and every technique's
   parity tests (``multigpu``, the files tests/test_strict_device.py lists: the collectives, DP,
   ZeRO, TP, SP, CP, PP, EP and their compositions on 1 to 5 ranks, one GPU each and NCCL where
   the node has that many;
   ``Cluster`` says what it chose otherwise).
2. **chapters**: every chapter headless at QUICK with ``WORLD_SIZE`` = the GPUs of this node, so
   that each rank has a GPU of its own and the process group is NCCL. Each chapter asserts its
   techniques against one process and against PyTorch's own versions, so a pass is a parity
   check of every technique under NCCL.
3. **grader**: the command-line grader over ``solutions/``: every exercise's checks run on NCCL
   ranks and must give full marks.

It ends with one table (step, verdict, seconds) and writes it to ``out/test_gpu.json``; the
exit status is the number of steps that failed. Without a CUDA GPU it says so and exits 0: on a
CPU, ``make test`` proves the same code against a GPU node's rules (strict-device and strict
point-to-point modes, CONTRIBUTING.md).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEPS = ("tests", "chapters", "grader")


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def commands(gpus: int, out: pathlib.Path) -> dict:
    """The command of each step. A node with one GPU runs the chapters at 2 ranks: their ranks
    then share the CPU (gloo), as Cluster says when it starts, and the GPU cells use the GPU."""
    world = max(2, gpus)
    return {
        "tests": [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu or multigpu", "tests"],
        "chapters": [
            sys.executable,
            "launch/batch.py",
            "--world-size",
            str(world),
            "--out",
            str(out / "chapters"),
            "chapters",
        ],
        "grader": [sys.executable, "-m", "ultrascale_grading.cli", "solutions", "--json", str(out / "grades.json")],
    }


def run(name: str, command: list, log: pathlib.Path) -> dict:
    print(f"=== {name}: {' '.join(command)}", flush=True)
    start = time.monotonic()
    with log.open("w") as sink:
        rc = subprocess.call(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    seconds = round(time.monotonic() - start, 1)
    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    verdict = "ok" if rc == 0 else f"FAILED (exit {rc}; see {log})"
    print(f"=== {name}: {verdict} after {seconds} s", flush=True)
    return {"step": name, "verdict": verdict, "seconds": seconds, "last lines": tail}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip", nargs="*", default=[], choices=STEPS, help="steps to leave out")
    parser.add_argument("--out", default="out", help="folder for the logs and test_gpu.json")
    args = parser.parse_args(argv)
    gpus = gpu_count()
    if gpus == 0:
        # torch sees no GPU. On a GPU node whose .venv got the CPU build of torch (set up on a login
        # node) that is no reason for a clean exit: setup's own check says so, and this fails.
        check = subprocess.run(
            ["bash", str(ROOT / "launch" / "setup.sh"), "--check-gpu"], capture_output=True, text=True, timeout=120
        )
        if check.stderr.strip():
            print(f"test-gpu: torch sees no GPU here, and\n{check.stderr.strip()}")
            return 1
        print(
            "test-gpu: no CUDA GPU on this machine, so nothing to test here. On a CPU, `make test` "
            "holds every chapter and grader to a GPU node's rules (strict-device and strict "
            "point-to-point modes); run this on the GPU node before a class."
        )
        return 0
    import torch

    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"test-gpu: {gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}; chapters at "
        f"WORLD_SIZE={max(2, gpus)}"
        + (" (one GPU: the ranks share the CPU, see Cluster's notice)" if gpus == 1 else " (one rank per GPU, NCCL)"),
        flush=True,
    )
    rows = [
        run(name, command, out / f"test_gpu_{name}.log")
        for name, command in commands(gpus, out).items()
        if name not in args.skip
    ]
    print(f"\n{'step':<10} {'seconds':>8}  verdict")
    for row in rows:
        print(f"{row['step']:<10} {row['seconds']:8.1f}  {row['verdict']}")
    (out / "test_gpu.json").write_text(
        json.dumps(
            {"gpus": gpus, "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "steps": rows}, indent=1
        )
    )
    return sum(row["verdict"] != "ok" for row in rows)


if __name__ == "__main__":
    sys.exit(main())
