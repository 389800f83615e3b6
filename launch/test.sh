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

echo "== exercises/ in sync with solutions/"
$BIN/python -m ultrascale.grading.generate --check

echo "== pytest: library, runtime faults, grading, papermill runs, and nbval on chapters/"
$BIN/pytest -q -p no:cacheprovider --durations=15 tests chapters \
  --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-current-env "$@"
