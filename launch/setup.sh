#!/usr/bin/env bash
# Create the course's virtual environment (if missing) and install the course into it. Safe to run again.
#
# torch (a torch the library supports: 2.11 to 2.13, see lib/ultrascale/__init__.py):
# - a GPU node whose python already has a CUDA build of torch keeps it: the venv sees the
#   system packages instead of replacing torch (and its triton);
# - a machine without a CUDA GPU gets the CPU build of torch==$TORCH_VERSION (default 2.13.0)
#   from PyTorch's own CPU wheel index, the one PyTorch's install page gives for CPU-only Linux
#   (about 200 MB). If that index cannot be reached, pip's configured index is used instead,
#   and the script says so: on PyPI that is the CUDA build with its nvidia packages (several GB),
#   unless a CPU wheel lies where pip looks (as on the course's CI machines);
# - a GPU machine without torch gets the CUDA build from pip's configured index.
# triton: installed only when missing, since a CUDA torch pins the triton it was built with.
#
# VENV=...  another environment (make test-compat keeps one per torch version in ~/.cache);
# TORCH_VERSION=...  the torch to install where none is kept;
# TORCH_FRESH=1  never keep the system's torch (make test-compat: the oldest torch, even on a GPU node);
# TORCH_CPU_INDEX=...  another CPU wheel index (a mirror).
#
# On a GPU cluster, run it on a GPU node (srun --gpus=1 bash launch/setup.sh): on a login node
# there is no GPU, so the CPU build is installed, and every GPU job would then run its ranks on
# the CPU with gloo. It warns at the end when the GPUs and the torch it kept do not match;
# `bash launch/setup.sh --check-gpu` runs only that check, on the environment as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

# grep -c, not grep -q: -q exits at the first match, and under pipefail the nvidia-smi still writing
# its next GPU's line then dies of SIGPIPE and fails the pipe (a node with GPUs read as one without,
# now and then: seen in the suite under load)
has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -c GPU >/dev/null; }
warn() { echo "[setup] WARNING: $*" >&2; }

# Where setup ran, against the torch it left: a GPU that torch cannot use, or no GPU where GPUs
# are expected (a SLURM job, CUDA_VISIBLE_DEVICES, or a SLURM cluster whose nodes have GPUs: a
# login node, likely) with the CPU build installed. Both end with GPU jobs run as gloo ranks on the CPU, silently.
gpu_warnings() {
  local found version cuda usable context=""
  found=$("$VENV/bin/python" -c "import torch; print(torch.__version__, torch.version.cuda or 'cpu', int(torch.cuda.is_available()))" 2>/dev/null) || return 0
  read -r version cuda usable <<<"$found"
  if has_gpu; then
    if [ "$cuda" = cpu ]; then
      warn "nvidia-smi lists $(nvidia-smi -L | grep -c GPU) GPU(s), but $VENV has torch $version, a CPU build:" \
           "every cluster and GPU job would run its ranks on the CPU with gloo. Set it up again here, on" \
           "this GPU node: rm -rf $VENV && bash launch/setup.sh"
    elif [ "$usable" != 1 ]; then
      warn "nvidia-smi lists a GPU, but torch $version (CUDA $cuda) cannot use it: the NVIDIA driver is" \
           "probably older than CUDA $cuda needs (nvidia-smi's header names the newest CUDA it supports)"
    fi
    return 0
  fi
  [ "$cuda" = cpu ] || return 0   # a CUDA build (from pip's index) would use the GPUs of a GPU node
  if [ -n "${SLURM_JOB_ID:-}" ]; then
    context="this is SLURM job $SLURM_JOB_ID"
  elif [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    context="CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES is set"
  elif command -v sinfo >/dev/null 2>&1 && timeout 15 sinfo -h -o %G 2>/dev/null | grep -c gpu >/dev/null; then
    # on a login node: SLURM's partitions offer GPUs (their generic resources, gpu:N), this node has none
    context="SLURM's nodes have GPUs (sinfo) and this one has none: a login node, likely"
  fi
  if [ -n "$context" ]; then
    warn "no GPU is visible (nvidia-smi lists none), though $context; so $VENV has torch $version, the" \
         "CPU build, and GPU jobs run with it would use the CPU (gloo), not the GPUs. To use them, set" \
         "up on a GPU node: rm -rf $VENV && srun --gpus=1 bash launch/setup.sh (README: GPU clusters)." \
         "On a cluster without GPUs, ignore this."
  fi
}
if [ "${1:-}" = "--check-gpu" ]; then
  gpu_warnings
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  if [ -z "${TORCH_FRESH:-}" ] && "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "[setup] $PY has a CUDA build of torch: keeping it (venv with --system-site-packages)"
    "$PY" -m venv --system-site-packages "$VENV"
  else
    echo "[setup] creating $VENV"
    "$PY" -m venv "$VENV"
  fi
fi
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip

reachable() { "$VENV/bin/python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=15)" "$1" 2>/dev/null; }

# pip's own log says where each file came from: "Downloading <url> (<size>)", or a local path.
report_torch_install() {
  "$VENV/bin/python" - "$1" "$2" <<'PY'
import re, sys
log, where = open(sys.argv[1]).read(), sys.argv[2]
units = {"kB": 1e-3, "MB": 1.0, "GB": 1e3}
def megabytes(verb):
    return [float(n) * units[u] for n, u in re.findall(verb + r" \S+ \(([\d.]+) (kB|MB|GB)\)", log)]
fetched, cached = megabytes("Downloading"), megabytes("Using cached")
local = len(re.findall(r"^Processing /", log, re.MULTILINE))
print(f"[setup] torch from {where}: downloaded {sum(fetched):.0f} MB in {len(fetched)} files"
      + (f", {sum(cached):.0f} MB in {len(cached)} files from pip's cache" if cached else "")
      + (f", {local} files from this machine's disk" if local else ""))
PY
}

install_torch() {
  local where="pip's configured index" index=() log
  if has_gpu; then
    echo "[setup] a CUDA GPU and no torch: installing torch==$TORCH_VERSION (CUDA build) from pip's configured index"
  elif reachable "$TORCH_CPU_INDEX/torch/"; then
    echo "[setup] no CUDA GPU: installing torch==$TORCH_VERSION, CPU build, from $TORCH_CPU_INDEX"
    where=$TORCH_CPU_INDEX index=(--index-url "$TORCH_CPU_INDEX")
  else
    echo "[setup] no CUDA GPU, but $TORCH_CPU_INDEX cannot be reached: installing torch==$TORCH_VERSION from pip's configured index instead"
  fi
  log=$(mktemp)
  pip install "${index[@]}" "torch==$TORCH_VERSION" >"$log" 2>&1 || { cat "$log"; exit 1; }
  report_torch_install "$log" "$where"
  rm -f "$log"
  if ! has_gpu && ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)" 2>/dev/null; then
    echo "[setup] note: that index served a CUDA build of torch (it runs on the CPU too, but is several GB)"
  fi
}

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  install_torch
fi
if ! "$VENV/bin/python" -c "import triton" 2>/dev/null; then
  echo "[setup] installing triton==3.9.0"
  pip install -q "triton==3.9.0"
fi
echo "[setup] installing the course's requirements"
pip install -q -r requirements-dev.txt
pip install -q --no-deps -e .
# rfc3987-syntax (jupyter-events asks for it through jsonschema's format-nongpl extra) builds a Lark
# grammar each time jsonschema is imported: 1.2 s of CPU in every process that imports nbformat
# (papermill, nbval, the grader, the Jupyter server; papermill's import takes 1.7 s with it, 0.3 s
# without). It only checks the "iri" string format, which nothing here validates; without it
# jsonschema skips that one check (and `pip check` does not ask for an extra's packages).
if "$VENV/bin/python" -c "import rfc3987_syntax" 2>/dev/null; then
  pip uninstall -q -y rfc3987-syntax
fi
# Without a GPU the kernels run in Triton's interpreter; triton 3.6's (torch 2.11's CUDA build pins
# it) fails on numpy 2.4, so there numpy stays below 2.4 (launch/check_triton_interpreter.py).
if ! has_gpu && ! "$VENV/bin/python" launch/check_triton_interpreter.py; then
  echo "[setup] keeping numpy below 2.4 for this triton's interpreter (triton-lang/triton#9171)"
  pip install -q "numpy<2.4"
  "$VENV/bin/python" launch/check_triton_interpreter.py
fi
if [ "$VENV" = .venv ]; then
  # Other Jupyter front ends find the course's kernel under this name (only the main environment's).
  "$VENV/bin/python" -m ipykernel install --user --name ultrascale --display-name "ultrascale (.venv)" >/dev/null
fi
# The notebooks' kernel is "python3" (display name "Python 3", their metadata): inside the venv
# (make lab, papermill) that is this Python. The display name must match the metadata, or
# JupyterLab rewrites it and marks every notebook modified as soon as it opens.
"$VENV/bin/python" -m ipykernel install --sys-prefix --name python3 --display-name "Python 3" >/dev/null
"$VENV/bin/python" - <<'PY'
import torch, triton, ultrascale
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU (gloo + Triton interpreter)"
print(f"[setup] ready: torch {torch.__version__}, triton {triton.__version__}, {gpu}")
PY
gpu_warnings   # last, where it is read
