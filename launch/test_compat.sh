#!/usr/bin/env bash
# The course under another torch than the one it is saved with (`make test-compat`: the oldest
# torch the library supports). With $VENV's Python it runs
#   1. the library's tests, and
#   2. every chapter headless with papermill at its defaults (QUICK), as launch/batch.py does.
# Left out, since they test nothing that depends on torch's version and the main run has them:
# nbval (it compares outputs saved under the newest torch; the papermill runs still execute
# every assertion of every chapter), the browser and JupyterLab tests, SLURM, the benchmarks'
# smoke runs, and grading the exercise notebooks end to end (the exercise tests themselves run,
# in the grader tests).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${VENV:?set VENV to the environment to test (make test-compat does)}"
BIN=$VENV/bin
export PYTHONUNBUFFERED=1
version=$($BIN/python -c "import torch; print(torch.__version__)")
echo "== the library's tests under torch $version"
# Both parts run, whatever the first gives; the exit status says whether both passed.
status=0
$BIN/pytest -q -p no:cacheprovider --durations=10 tests -k "not e2e_papermill" \
  --ignore=tests/test_browser.py --ignore=tests/test_lab.py --ignore=tests/test_notebooks.py \
  --ignore=tests/test_run_all.py --ignore=tests/test_slurm.py --ignore=tests/test_benchmarks.py "$@" || status=1
echo "== every chapter headless (papermill, QUICK) under torch $version, under a GPU node's rules"
# (the strict-device and strict point-to-point modes, CONTRIBUTING.md: GPU nodes often carry this torch)
ULTRASCALE_STRICT_DEVICE=1 ULTRASCALE_STRICT_P2P=1 $BIN/python launch/batch.py chapters --out "out/torch-$version" || status=1
exit $status
