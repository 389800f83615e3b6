#!/usr/bin/env bash
# Create .venv (if missing) and install the course into it. Safe to run again.
#
# torch: a CPU machine gets torch==2.13.0 (a small CPU build, no CUDA wheels);
# a GPU node whose python already has a CUDA torch keeps it: the venv then sees
# the system packages instead of replacing torch. triton likewise: installed only
# when missing, since a CUDA torch pins the triton it was built with.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv

if [ ! -x "$VENV/bin/python" ]; then
  if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "[setup] $PY has a CUDA build of torch: keeping it (venv with --system-site-packages)"
    "$PY" -m venv --system-site-packages "$VENV"
  else
    echo "[setup] creating $VENV"
    "$PY" -m venv "$VENV"
  fi
fi
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0"
  pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
if ! "$VENV/bin/python" -c "import triton" 2>/dev/null; then
  echo "[setup] installing triton==3.9.0"
  pip install -q "triton==3.9.0"
fi
echo "[setup] installing the course's requirements"
pip install -q -r requirements-dev.txt
pip install -q --no-deps -e .
"$VENV/bin/python" -m ipykernel install --user --name ultrascale --display-name "ultrascale (.venv)" >/dev/null
# The notebooks' kernel is "python3" (display name "Python 3", their metadata): inside .venv
# (make lab, papermill) that is this Python. The display name must match the metadata, or
# JupyterLab rewrites it and marks every notebook modified as soon as it opens.
"$VENV/bin/python" -m ipykernel install --sys-prefix --name python3 --display-name "Python 3" >/dev/null
"$VENV/bin/python" - <<'PY'
import torch, triton, ultrascale
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU (gloo + Triton interpreter)"
print(f"[setup] ready: torch {torch.__version__}, triton {triton.__version__}, {gpu}")
PY
