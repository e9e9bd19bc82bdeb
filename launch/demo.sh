#!/usr/bin/env bash
# The one-command demo: a tiny LLaMA trained on Shakespeare with SCALE under DeepSpeed ZeRO-2,
# 2 processes on CPU (gloo). Prints progress and the validation perplexity at start and end; writes
# runs/demo/{metrics.jsonl,loss.png,summary.json}. Extra arguments go to the trainer, e.g.
#   bash launch/demo.sh --set train.steps=100
# NPROC=4 bash launch/demo.sh      # more processes;  CONFIG=configs/train/fsdp2_sinkgd.json bash launch/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
CONFIG=${CONFIG:-configs/train/demo.json}
NPROC=${NPROC:-2}
if [ -z "${DS_ACCELERATOR:-}" ] && ! command -v nvidia-smi >/dev/null 2>&1; then export DS_ACCELERATOR=cpu; fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-true}
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::FutureWarning}

echo "== shardopt demo: $CONFIG on $NPROC processes (DS_ACCELERATOR=${DS_ACCELERATOR:-auto}) =="
echo "== the first run builds DeepSpeed's CPU communication op and trains the tokenizer (1-2 minutes); later runs reuse both =="
start=$(date +%s)
"$PY" -m torch.distributed.run --nproc_per_node "$NPROC" --master_addr 127.0.0.1 \
    --master_port "${MASTER_PORT:-$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}" \
    -m shardopt.train --config "$CONFIG" "$@"
end=$(date +%s)

RUN_DIR=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("run_dir","runs/default"))' "$CONFIG")
prev=""
for a in "$@"; do
    case "$a" in
        run_dir=*) RUN_DIR=${a#run_dir=} ;;
        --run_dir=*|--run-dir=*) RUN_DIR=${a#*=} ;;
    esac
    case "$prev" in --run_dir|--run-dir) RUN_DIR=$a ;; esac
    prev=$a
done
if [ -f "$RUN_DIR/summary.json" ]; then
    "$PY" - "$RUN_DIR/summary.json" <<'PYEOF'
import json, sys
s = json.load(open(sys.argv[1]))
start = s.get("start_val_ppl")
print("== validation perplexity: "
      + (f"{start:.1f} at start -> " if start else "")
      + f"{s['end_val_ppl']:.1f} after {s['steps']} steps ({s['tokens_per_s']:,.0f} tokens/s) ==")
PYEOF
fi
echo "== done in $((end - start))s; metrics: $RUN_DIR/metrics.jsonl, plot: $RUN_DIR/loss.png =="
