#!/usr/bin/env bash
# Tokens/s of the demo's pretraining (150 steps, 2 CPU ranks) with distaff's even share of the cores per rank
# and with torch's default (OMP_NUM_THREADS=<cores>: every rank takes every core), idle, beside two CPU-bound
# processes and beside another PyTorch job. Reads the shards of a finished `bash scripts/demo.sh`.
#
#   bash scripts/measure-threads.sh          # the README's figures (about 10 minutes on 2 cores)
#   STEPS=20 bash scripts/measure-threads.sh # a quick look
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
DATA="${DISTAFF_DEMO_DIR:-runs/demo}/data"
OUT="${DISTAFF_THREADS_DIR:-runs/threads}"
STEPS="${STEPS:-150}"
[ -f "$DATA/manifest.json" ] || { echo "no shards at $DATA: run bash scripts/demo.sh first" >&2; exit 2; }
PY="$REPO/.venv/bin/python"
CORES=$(nproc)
unset OMP_NUM_THREADS
export WANDB_MODE=offline WANDB_SILENT=true TOKENIZERS_PARALLELISM=false

start_load() {  # $1: none | cpu (two spinning processes) | torch (a matmul loop with torch's default threads)
  case "$1" in
    cpu) (exec yes > /dev/null) & (exec yes > /dev/null) & ;;
    torch) "$PY" -c "import torch; a = torch.randn(512, 512)
while True: a = torch.tanh(a @ a)" & ;;
  esac
}

measure() {  # $1: load, $2: threads per rank ("" = distaff's share)
  local label="$1-${2:-share}" load_pids
  start_load "$1"; load_pids=$(jobs -p)
  rm -rf "$OUT/$label"
  env ${2:+OMP_NUM_THREADS=$2} "$REPO/.venv/bin/distaff" launch --config tiny-cpu --gpus-per-node 2 \
      --master-port $((29600 + RANDOM % 300)) run.out_dir="$OUT/$label" data.dir="$DATA" \
      logging.progress_bar=false train.max_steps="$STEPS" eval.every=0 checkpoint.every=0 > "$OUT/$label.log" 2>&1
  [ -z "$load_pids" ] || kill $load_pids
  wait 2> /dev/null || true
  "$PY" -c "import json, sys; s = json.load(open(sys.argv[1])); print(f'{sys.argv[2]:<16} {s[\"tokens_per_s\"]:>9,.0f} tokens/s')" \
      "$OUT/$label/summary.json" "$label"
}

mkdir -p "$OUT"
echo "LOAD-THREADS (share: distaff's even share of the cores per rank; $CORES: OMP_NUM_THREADS=$CORES)"
echo "demo pretraining, $STEPS steps, 2 ranks on $CORES cores"
for load in none cpu torch; do
  measure "$load" ""
  measure "$load" "$CORES"
done
