#!/usr/bin/env bash
# Multi-node training with torchrun's c10d rendezvous. Run the same command on every node:
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0.example MASTER_PORT=29500 bash launch/multinode.sh --config configs/train/demo.json
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0.example MASTER_PORT=29500 bash launch/multinode.sh --config configs/train/demo.json
#
# NPROC_PER_NODE defaults to the number of GPUs (or 2 on a CPU-only node). All arguments go to
# ``python -m shardopt.train`` (e.g. --resume, --set train.steps=1000). Every node must see the same
# config file and dataset paths; the tokenizer cache (data.cache_dir) may be node-local, because global
# rank 0 trains the tokenizer and broadcasts it. Checkpoints (checkpoint.dir) should be on a shared
# filesystem for --resume. MAX_RESTARTS=N (default 0) lets torchrun restart every worker up to N times when one
# fails; with --resume the restarted run continues from the last complete checkpoint (docs/reliability.md).
# Loopback test of this script on one machine:
#   NNODES=2 NODE_RANK=0 bash launch/multinode.sh --config configs/train/demo.json &
#   NNODES=2 NODE_RANK=1 bash launch/multinode.sh --config configs/train/demo.json; wait
set -euo pipefail
case " $* " in
    *" --config "*|*" --config="*) ;;
    *) echo "usage: [NNODES=N NODE_RANK=R MASTER_ADDR=host MASTER_PORT=port] bash launch/multinode.sh" \
            "--config configs/train/<name>.json [--resume] [--set key=value ...]" >&2
       exit 2 ;;
esac
cd "$(dirname "$0")/.."

PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ID=${RDZV_ID:-shardopt-${USER:-job}}
MAX_RESTARTS=${MAX_RESTARTS:-0}
if [ -z "${NPROC_PER_NODE:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1; then NPROC_PER_NODE=$(nvidia-smi -L | wc -l); else NPROC_PER_NODE=2; fi
fi
if [ -z "${DS_ACCELERATOR:-}" ] && ! command -v nvidia-smi >/dev/null 2>&1; then export DS_ACCELERATOR=cpu; fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

echo "node $NODE_RANK/$NNODES: $NPROC_PER_NODE processes, rendezvous $MASTER_ADDR:$MASTER_PORT (id $RDZV_ID)," \
    "up to $MAX_RESTARTS restarts"
exec "$PY" -m torch.distributed.run \
    --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" --node_rank "$NODE_RANK" --max-restarts "$MAX_RESTARTS" \
    --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$RDZV_ID" \
    -m shardopt.train "$@"
