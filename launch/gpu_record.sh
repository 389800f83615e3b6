#!/usr/bin/env bash
# Record the course's GPU results on a machine with a CUDA GPU, from the repository root:
#
#     bash launch/gpu_record.sh            # every step below
#     bash launch/gpu_record.sh kernels fp8   # some of them
#
# Steps: kernels (bench_kernels.py, full sizes), fp8 (bench_fp8.py), mfu-350m and mfu-1b
# (bench_mfu.py), runtime (the runtime's GPU tests), batch (chapters 00, 01, 02, 03, a0 and 11 headless with
# papermill at WORLD_SIZE=2), kernel-tests (tests/test_kernels.py compiled for the GPU).
# The records land in results/ (see results/README.md); commit them. Each step has its own
# time limit (STEP_LIMIT seconds, 300 by default) and a failing step does not stop the next,
# so one broken kernel does not cost the MFU record. Exit status: the number of failed steps.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONPATH="$PWD/lib${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LIMIT=${STEP_LIMIT:-300}
STEPS=${*:-kernels fp8 mfu-350m runtime batch mfu-1b kernel-tests}
failed=0

step() {  # step NAME COMMAND...: run one command under the time limit and report how it ended
    local name=$1 start=$SECONDS rc
    shift
    echo "=== $name: $*"
    timeout "$LIMIT" "$@"
    rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
for name in $STEPS; do
    case $name in
        kernels) step kernels "$PY" benchmarks/bench_kernels.py ;;
        fp8) step fp8 "$PY" benchmarks/bench_fp8.py ;;
        mfu-350m) step mfu-350m "$PY" benchmarks/bench_mfu.py --size 350m ;;
        mfu-1b) step mfu-1b "$PY" benchmarks/bench_mfu.py --size 1b --micro-batch 4 ;;
        runtime) step runtime "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_runtime.py ;;
        batch) step batch "$PY" launch/batch.py --record --world-size 2 --out out/gpu_batch chapters/00_orientation.ipynb \
                   chapters/a0_collectives.ipynb chapters/01_one_gpu.ipynb chapters/02_data_parallelism.ipynb \
                   chapters/03_zero.ipynb chapters/11_gpu_kernels.ipynb ;;
        kernel-tests) step kernel-tests "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py ;;
        *) echo "unknown step $name (kernels fp8 mfu-350m mfu-1b runtime batch kernel-tests)"; failed=$((failed + 1)) ;;
    esac
done
echo "=== $failed step(s) failed"
exit "$failed"
