#!/usr/bin/env bash
# What did the demo's pretraining teach the model? `distaff probe` builds SentEval-style probing tasks (word
# order: bshift, coordinv; length: sentlen; words: wc) from the bundled movie-review sentences
# (data/movie-snippets.tsv.gz, none of which the demo pretrained on: the command checks every sentence against
# the demo's training shards), probes the frozen demo model beside the same architecture with random weights
# and a bag-of-words baseline, fine-tunes both models on 1,000 bshift labels, seeds 1-3, and prints the table
# (results.json beside it). Run scripts/demo.sh first.
#
#   bash scripts/probe-demo.sh                      # writes runs/probe-demo/ (replaced on each run)
#   SEEDS="1" FINETUNE="200 1000" bash scripts/probe-demo.sh optim.lr=1e-3   # extra args: fine-tuning overrides
#   FINETUNE="" bash scripts/probe-demo.sh          # probes only
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
BIN="$REPO/.venv/bin"
PRETRAINED="${DISTAFF_DEMO_DIR:-runs/demo}/run"
OUT="${DISTAFF_PROBE_DIR:-runs/probe-demo}"
SEEDS="${SEEDS:-1 2 3}"
FINETUNE="${FINETUNE-1000}"

if [ ! -f "$PRETRAINED/summary.json" ]; then
    echo "probe-demo: $PRETRAINED/summary.json not found: run scripts/demo.sh first" >&2
    exit 2
fi
export WANDB_MODE="${WANDB_MODE:-offline}" WANDB_SILENT=true TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# shellcheck source=scripts/out-dir.sh
source scripts/out-dir.sh
refuse_out_over_inputs probe-demo.sh "$BIN/python" "$OUT" "$PRETRAINED" data/movie-snippets.tsv.gz
rm -rf "$OUT"

# shellcheck disable=SC2086  # SEEDS and FINETUNE are lists
"$BIN/distaff" probe --text data/movie-snippets.tsv.gz --text-column 1 --model demo="$PRETRAINED" \
    --random --bow --seeds $SEEDS ${FINETUNE:+--finetune $FINETUNE} --out "$OUT" -- "$@"
