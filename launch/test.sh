#!/usr/bin/env bash
# The whole test suite (what `make test` and CI run). Assumes .venv exists
# (`make test` creates it first).
set -euo pipefail
cd "$(dirname "$0")/.."
# (no MPLBACKEND here: the kernels must keep their inline backend, or pyplot figures vanish)
export PYTHONUNBUFFERED=1
BIN=.venv/bin

echo "== spelling (codespell over code, notebooks and docs)"
$BIN/codespell README.md lib chapters solutions launch benchmarks tests

echo "== lint (ruff check: pyflakes over the library, tests, benchmarks, launch scripts and chapter sources)"
$BIN/ruff check lib tests benchmarks launch chapters/*.py
echo "== format (ruff format --check: the same files in ruff's style; make format rewrites them)"
$BIN/ruff format --check lib tests benchmarks launch chapters/*.py

echo "== exercises/ in sync with solutions/"
$BIN/python -m ultrascale_grading.generate --check

# The chapters' outputs are saved with the default float path (make notebooks); they are
# compared here under another one (MKL without AVX, reproducible mode), so that an output
# which depends on a float's last bits fails on this machine before a learner's CPU does.
export MKL_ENABLE_INSTRUCTIONS=${MKL_ENABLE_INSTRUCTIONS:-SSE4_2} MKL_CBWR=${MKL_CBWR:-COMPATIBLE}

# Idle OpenMP threads sleep rather than spin (as importing ultrascale arranges for a notebook;
# here for the pytest processes too, which may import torch first): on 2 cores shared by two
# tests, their kernels and ranks, a spinning thread burns the core another process needs.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

# Two tests at a time (pytest-xdist; tests/conftest.py says what may run side by side and why):
# most of the suite's time is waiting on kernels and ranks, not arithmetic. TEST_WORKERS=0 runs
# everything in this one process, in order (e.g. to debug a test that fails only beside another).
WORKERS=${TEST_WORKERS:-2}

# The library compiled to bytecode once, here: where PYTHONDONTWRITEBYTECODE is set (it is on the
# course's CI machines) no process writes a .pyc, so each of the suite's few hundred processes that
# imports the library (kernels, ranks' fork servers, the grader's) compiled it again, about 0.1 s
# of CPU each. A .pyc older than its source is not used, so an edited module is compiled as before.
$BIN/python -m compileall -q lib

# Warm kernels (tests/warm_kernels.py): each notebook kernel the tests start (nbval's, papermill's,
# the grader's, JupyterLab's) is a fork of one process that has made a kernel's imports, not a new
# interpreter making them again (2.5 to 3 s of CPU each, about ninety times). A kernel that cannot
# be served exactly as a fresh one would be (another environment, a sandbox) is a fresh one.
# ULTRASCALE_WARM_KERNELS=0 starts every kernel fresh.
NBVAL_KERNEL=(--nbval-current-env)
if [ "${ULTRASCALE_WARM_KERNELS:-1}" != 0 ] && [ "$(uname -s)" = Linux ]; then
  WARM=$(mktemp -d)
  # the course's python3 kernel (launch/setup.sh), started through warm_kernels.py; the zygote runs
  # with the kernel's interpreter and options (-Xfrozen_modules=off)
  KERNEL_PYTHON=$($BIN/python tests/warm_kernels.py kernelspec "$WARM/jupyter")
  read -r -a KERNEL_PYTHON <<<"$KERNEL_PYTHON"
  export JUPYTER_PATH="$WARM/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}" ULTRASCALE_WARM_KERNEL_SOCKET="$WARM/zygote.sock"
  "${KERNEL_PYTHON[@]}" tests/warm_kernels.py serve "$ULTRASCALE_WARM_KERNEL_SOCKET" 2>"$WARM/zygote.log" &
  ZYGOTE=$!
  trap 'kill "$ZYGOTE" 2>/dev/null || true; grep -A30 Traceback "$WARM/zygote.log" || true; rm -rf "$WARM"' EXIT
  NBVAL_KERNEL=(--nbval-kernel-name python3)
fi

echo "== pytest: library, runtime faults, grading, papermill runs, and nbval on chapters/ ($WORKERS workers)"
status=0
$BIN/pytest -q -p no:cacheprovider --durations=25 -n "$WORKERS" tests chapters \
  --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg "${NBVAL_KERNEL[@]}" "$@" || status=$?
if [ -n "${WARM:-}" ]; then
  echo "== warm kernels: $(grep -c '^warm_kernels.*: forked' "$WARM/zygote.log" || true) forked," \
    "$(grep -c 'fresh kernel:' "$WARM/zygote.log" || true) fresh"
  grep 'fresh kernel:\|bad request\|ready (' "$WARM/zygote.log" | sed 's/^warm_kernels\[[0-9]*\]: /  /' | sort | uniq -c || true
fi
exit $status
