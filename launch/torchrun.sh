#!/usr/bin/env bash
# Run a course experiment function (the same one you pass to cluster.run) under torchrun.
#
#   launch/torchrun.sh MODULE:FUNCTION '[json args]'               # one node, all its GPUs
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 launch/torchrun.sh ...  # on each of several nodes
#
# NPROC defaults to the number of GPUs (or 2 on a CPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
NPROC=${NPROC:-$($PY -c "import torch; print(torch.cuda.device_count() or 2)")}
exec $PY -m torch.distributed.run \
  --nnodes="${NNODES:-1}" --node_rank="${NODE_RANK:-0}" --nproc_per_node="$NPROC" \
  --master_addr="${MASTER_ADDR:-127.0.0.1}" --master_port="${MASTER_PORT:-29500}" \
  -m ultrascale.runtime.torchrun "$@"
