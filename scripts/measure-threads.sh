#!/usr/bin/env bash
# Tokens/s with distaff's default threads against 1 thread and an even share of the cores, for single-process
# fine-tuning (`distaff finetune --config sentiment-cpu`, one process) and 2-rank pretraining (`distaff launch
# --config tiny-cpu --gpus-per-node 2`), with no load added and beside two CPU-bound processes (`yes`). Each
# row gives the 1-minute load average read at the end of its run: "no load added" is idle only where that
# reads near 0. Uses the shards and run of a finished `bash scripts/demo.sh` when there are some, else makes
# small ones (a tokenizer, shards and a 10-step pretraining of the demo text) under $OUT first.
#
#   bash scripts/measure-threads.sh                          # about 8 minutes on a loaded 2-core machine
#   FT_STEPS=40 PT_STEPS=60 bash scripts/measure-threads.sh # longer runs, steadier figures
#   LOADS=cpu bash scripts/measure-threads.sh                # only the rows beside two CPU-bound processes
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
DEMO="${DISTAFF_DEMO_DIR:-runs/demo}"
OUT="${DISTAFF_THREADS_DIR:-runs/threads}"
FT_STEPS="${FT_STEPS:-10}"
PT_STEPS="${PT_STEPS:-12}"
LOADS="${LOADS:-none cpu}"
PY="$REPO/.venv/bin/python"
BIN="$REPO/.venv/bin"
CORES=$(nproc)
unset OMP_NUM_THREADS OMP_WAIT_POLICY
export WANDB_MODE=offline WANDB_SILENT=true TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"

port() { "$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

setup() {  # DATA and INIT: the demo's, or small ones made here
  if [ -f "$DEMO/data/manifest.json" ] && [ -d "$DEMO/run" ]; then DATA="$DEMO/data" INIT="$DEMO/run"; return; fi
  DATA="$OUT/setup/data" INIT="$OUT/setup/run"
  [ -f "$INIT/summary.json" ] && return
  echo "(no demo run at $DEMO: making a tokenizer, shards and a 10-step pretraining under $OUT/setup)"
  rm -rf "$OUT/setup"
  OMP_NUM_THREADS=1 "$BIN/distaff" tokenizer train --input data/austen-emma-pride.txt.gz --vocab-size 4000 \
      --out "$OUT/setup/tokenizer" > "$OUT/setup.log" 2>&1
  OMP_NUM_THREADS=1 "$BIN/distaff" data prepare --input data/austen-emma-pride.txt.gz --tokenizer "$OUT/setup/tokenizer" \
      --seq-len 128 --pack-documents --shard-mb 0.2 --out "$DATA" --no-progress >> "$OUT/setup.log" 2>&1
  OMP_NUM_THREADS=1 "$BIN/distaff" launch --config tiny-cpu --gpus-per-node 2 --master-port "$(port)" \
      run.out_dir="$INIT" data.dir="$DATA" logging.progress_bar=false train.max_steps=10 eval.every=0 \
      >> "$OUT/setup.log" 2>&1
}

start_load() {  # $1: none | cpu (two spinning processes)
  [ "$1" = cpu ] && { (exec yes > /dev/null) & (exec yes > /dev/null) & }
  return 0
}

run_one() {  # $1: finetune | pretrain, $2: run dir; threads from the environment
  if [ "$1" = finetune ]; then
    "$BIN/distaff" finetune --config sentiment-cpu model.init_from="$INIT" run.out_dir="$2" \
        train.max_steps="$FT_STEPS" eval.every=0 checkpoint.every=0 logging.every=10
  else
    "$BIN/distaff" launch --config tiny-cpu --gpus-per-node 2 --master-port "$(port)" run.out_dir="$2" \
        data.dir="$DATA" logging.progress_bar=false train.max_steps="$PT_STEPS" eval.every=0 checkpoint.every=0
  fi
}

measure() {  # $1: finetune | pretrain, $2: load, $3: threads per rank ("" = distaff's default), $4: label
  local dir="$OUT/$1-$2-$4" load_pids seconds
  start_load "$2"; load_pids=$(jobs -p)
  rm -rf "$dir"
  SECONDS=0
  ( [ -z "$3" ] || export OMP_NUM_THREADS="$3"; run_one "$1" "$dir" ) > "$dir.log" 2>&1 || {
      [ -z "$load_pids" ] || kill $load_pids; echo "$1 $2 $4 failed: see $dir.log" >&2; exit 1; }
  seconds=$SECONDS
  local loadavg; loadavg=$(cut -d' ' -f1 /proc/loadavg)
  [ -z "$load_pids" ] || kill $load_pids
  wait 2> /dev/null || true
  "$PY" - "$dir" "$1" "$2" "$4" "$seconds" "$loadavg" <<'PYEOF'
import json, re, sys
from pathlib import Path
run, task, load, label, seconds, loadavg = sys.argv[1:]
summary = json.loads((Path(run) / "summary.json").read_text())
if "tokens_per_s" not in summary:   # fine-tuning: the training records' rate (startup and evaluation excluded)
    records = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    summary["tokens_per_s"] = [r for r in records if "tokens_per_s" in r][-1]["tokens_per_s"]
log = Path(run + ".log").read_text()
chosen = re.search(r"x (\d+) CPU thread", log)
print(f"| {task} | {'two `yes`' if load == 'cpu' else 'none added'} | {label} | {chosen.group(1) if chosen else '?'} "
      f"| {summary['tokens_per_s']:,.0f} | {seconds} | {loadavg} |")
PYEOF
}

setup
SHARE_FT=$CORES SHARE_PT=$(( CORES / 2 > 0 ? CORES / 2 : 1 ))
echo "threads: distaff's default against 1 thread and the even share ($SHARE_FT for one process, $SHARE_PT per rank"
echo "for 2 ranks) on $CORES cores; fine-tuning $FT_STEPS steps, pretraining $PT_STEPS steps; $(date -u +%Y-%m-%d)"
echo
echo "| run | load added | threads | threads/rank | tokens/s | seconds | load avg |"
echo "| --- | --- | --- | --- | ---: | ---: | ---: |"
for load in $LOADS; do
  measure finetune "$load" "" default
  measure finetune "$load" 1 one
  [ "$SHARE_FT" = 1 ] || measure finetune "$load" "$SHARE_FT" share
  measure pretrain "$load" "" default
  measure pretrain "$load" 1 one
  [ "$SHARE_PT" = 1 ] || measure pretrain "$load" "$SHARE_PT" share
done
