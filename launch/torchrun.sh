#!/usr/bin/env bash
# Run a course experiment function (the same one you pass to cluster.run) under torchrun.
#
#   launch/torchrun.sh MODULE:FUNCTION '[json args]'        # this node: all its GPUs (or 2 CPU ranks)
#   launch/torchrun.sh my_experiment.py:run '[1024]'        # a file, relative to where you are
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29400 launch/torchrun.sh ...   # on node0,
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 MASTER_PORT=29400 launch/torchrun.sh ...   # and on node1
#
# It runs from the directory you call it from, so your own module (mymodule.py beside you) or
# a relative FILE.py is found there; the course library comes from the repository's .venv.
# Knobs (environment variables):
#   NPROC        ranks on this node; default: the GPUs torch sees here, else SLURM_CPUS_ON_NODE
#                (the CPUs SLURM gave the job on this node), else 2
#   NNODES       number of nodes (default 1); NODE_RANK: this node's index, 0..NNODES-1
#   MASTER_ADDR  the address of node 0 (default 127.0.0.1; needed when NNODES > 1)
#   MASTER_PORT  a port free on node 0; default: a free port picked here (one node only:
#                with several nodes every node must be given the same port)
#   PY           the Python to run (default: the repository's .venv/bin/python)
# Extra arguments after the JSON go to ultrascale.runtime.torchrun (e.g. --out results.json).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
if [[ ! -x $PY ]]; then
  echo "torchrun.sh: no Python at $PY: run 'make setup' in $ROOT first, or set PY" >&2
  exit 2
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
NPROC=${NPROC:-$("$PY" -c "from ultrascale.runtime.torchrun import ranks_per_node; print(ranks_per_node())")}
if [[ -z ${MASTER_PORT:-} ]]; then
  if [[ $NNODES != 1 ]]; then
    echo "torchrun.sh: with NNODES=$NNODES set MASTER_ADDR and MASTER_PORT, the same on every node" >&2
    exit 2
  fi
  # A port the OS says is free now; torchrun binds it a moment later.
  MASTER_PORT=$("$PY" -c "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])")
fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
echo "torchrun.sh: node $NODE_RANK of $NNODES, $NPROC ranks here, rendezvous $MASTER_ADDR:$MASTER_PORT," \
     "in $PWD: $*" >&2
exec "$PY" -m torch.distributed.run \
  --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC" \
  --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" \
  -m ultrascale.runtime.torchrun "$@"
