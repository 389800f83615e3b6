"""GPU results kept in ``results/``: where each was measured, and how a notebook shows it.

A CPU cannot say how fast a Triton kernel, an FP8 GEMM or a training step is on a GPU, so
the benchmarks that need one write what they measured to ``results/<kind>_<device>.json``,
and the notebooks show those files, labelled as recorded, on machines without a GPU. Each
record starts with its provenance (device, versions, commit, date) so that a reader can
tell where a number came from; ``results/README.md`` lists the kinds and their fields.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"


def git_commit() -> str:
    """The course's commit, with ``-dirty`` when tracked files had uncommitted changes.

    A launcher that copies the course to a GPU machine passes the commit it sent in
    ``ULTRASCALE_COMMIT``, which wins: the copy may have no ``.git`` folder, or a stale one
    (one GPU run here read an older commit, "-dirty", from a copied ``.git``).
    """
    if os.environ.get("ULTRASCALE_COMMIT"):
        return os.environ["ULTRASCALE_COMMIT"]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance(device: str) -> dict:
    """Where and when a record was made: device, torch/triton/CUDA/Python versions, commit, date."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return dict(
        device=device,
        torch=torch.__version__,
        triton=triton_version,
        cuda=torch.version.cuda,
        python=platform.python_version(),
        commit=git_commit(),
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    )


def device_slug(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia_h100_80gb_hbm3``: the device part of a file name."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def write(kind: str, record: dict, out_dir: Path = RESULTS) -> Path:
    """Save ``record`` (which must carry its provenance) as ``out_dir/<kind>_<device>.json``."""
    missing = {"device", "torch", "commit", "date"} - set(record)
    if missing:
        raise ValueError(f"a record needs its provenance; missing {sorted(missing)} (use records.provenance)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{kind}_{device_slug(record['device'])}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def recorded(kind: str, results: Path = RESULTS) -> list:
    """Every record of one kind, as ``(path, record)`` pairs sorted by file name.

    No kind's name starts another's (``kernels``, ``fp8``, ``one_gpu_mfu``, ``mfu_bench_350m``),
    so ``<kind>_*.json`` finds that kind's files only.
    """
    return [(path, json.loads(path.read_text())) for path in sorted(Path(results).glob(f"{kind}_*.json"))]


def label(record: dict, path: Path | None = None) -> str:
    """One line saying where a record was measured: printed above every recorded number."""
    versions = ", ".join(f"{name} {record[name]}" for name in ("torch", "triton", "cuda") if record.get(name))
    where = f"; from results/{Path(path).name}" if path is not None else ""
    return (
        f"RECORDED on {record['device']} ({versions}), commit {record['commit'][:12]}, {record['date']}"
        f"{where}, not measured on this machine"
    )
