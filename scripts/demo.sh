#!/usr/bin/env bash
# The main job, end to end on a fresh machine: environment, tokenizer, shards, 2-rank DeepSpeed
# pretraining of the `tiny` model (all GPUs when present), held-out evaluation, Hugging Face export,
# and a summary. It took <!-- measured: demo.elapsed -->10m18s<!-- /measured --> on a 2-core CPU machine (README.md
# says when and how loaded; scripts/refresh-doc-numbers.sh remeasures it).
#
#   bash scripts/demo.sh                 # writes runs/demo/; run again after a crash or Ctrl-C: it resumes
#   bash scripts/demo.sh --fresh         # starts afresh (deletes runs/demo/ first)
#   DISTAFF_DEMO_DIR=/tmp/d bash scripts/demo.sh train.max_steps=50   # extra args: run-config overrides
set -euo pipefail

FRESH=0
OVERRIDES=()
for arg in "$@"; do
    if [ "$arg" = --fresh ]; then FRESH=1; else OVERRIDES+=("$arg"); fi
done

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT="${DISTAFF_DEMO_DIR:-runs/demo}"
# Austen, and movie-review sentences that share none with the fine-tuning sample (data/README.md):
# scripts/finetune-demo.sh fine-tunes this model on movie-review sentiment.
SAMPLE=(data/austen-emma-pride.txt.gz data/movie-unlabelled.txt.gz)
SECONDS=0

bash scripts/setup-env.sh
PY="$REPO/.venv/bin/python"
BIN="$REPO/.venv/bin"

GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
# CPU: 2 ranks (gloo, DeepSpeed's CPU accelerator), each with its share of the cores (docs/launch.md)
RANKS=$(( GPUS > 0 ? GPUS : 2 ))
export WANDB_MODE="${WANDB_MODE:-offline}" WANDB_SILENT=true TOKENIZERS_PARALLELISM=false

# shellcheck source=scripts/out-dir.sh
source scripts/out-dir.sh
refuse_out_over_inputs demo.sh "$PY" "$OUT" "${SAMPLE[@]}"
if [ "$FRESH" = 1 ]; then
    rm -rf "$OUT"
elif [ -d "$OUT" ]; then    # an earlier demo, finished or interrupted: each step below picks up where it stopped
    echo "== resuming the demo in $OUT (bash scripts/demo.sh --fresh starts afresh)"
fi
mkdir -p "$OUT"
# The tokenizer's metadata file is written last: with it, the tokenizer is whole.
if [ -f "$OUT/tokenizer/distaff_tokenizer.json" ]; then
    echo "== tokenizer: kept from the earlier demo ($OUT/tokenizer)"
else
    echo "== distaff demo: tokenizer (SentencePiece, 4000 pieces) on ${SAMPLE[*]}"
    "$BIN/distaff" tokenizer train --input "${SAMPLE[@]}" --vocab-size 4000 --out "$OUT/tokenizer"
fi
# An interrupted prepare resumes by itself, keeping its finished blocks; the manifest is written last.
if [ -f "$OUT/data/manifest.json" ]; then
    echo "== shards: kept from the earlier demo ($OUT/data)"
else
    echo "== shards: 128-token sequences, enough documents held out for 20,000 held-out tokens"
    "$BIN/distaff" data prepare --input "${SAMPLE[@]}" --tokenizer "$OUT/tokenizer" --seq-len 128 --pack-documents \
        --shard-mb 0.2 --out "$OUT/data" --no-progress
fi
# checkpoint.resume=auto (the preset's): a run interrupted after a checkpoint goes on from it; a finished one says so.
echo "== pretraining the tiny-cpu preset on $RANKS rank(s) under the deepspeed launcher"
PORT=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
"$BIN/distaff" launch --config tiny-cpu --gpus-per-node "$RANKS" --master-port "$PORT" \
    run.out_dir="$OUT/run" data.dir="$OUT/data" logging.progress_bar=false ${OVERRIDES[@]+"${OVERRIDES[@]}"}
echo "== export to Hugging Face"
"$BIN/distaff" export-hf "$OUT/run" "$OUT/hf" --overwrite

"$PY" - "$OUT" "$SECONDS" <<'PYEOF'
import json, sys
from pathlib import Path

out, seconds = Path(sys.argv[1]), int(sys.argv[2])
s = json.loads((out / "run" / "summary.json").read_text())
hf = out / "hf"
try:  # the exported folder is a regular transformers model
    from transformers import AutoModelForMaskedLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()      # no "Loading weights" bar in the summary
    model, tok = AutoModelForMaskedLM.from_pretrained(hf), AutoTokenizer.from_pretrained(hf)
    loaded = f"loads with AutoModelForMaskedLM ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters)"
except ImportError:
    loaded = "(transformers not installed: load check skipped)"
base = s["unigram_baseline_accuracy"]
print(f"""
== distaff demo summary ({seconds // 60}m{seconds % 60:02d}s in all)
  trained      {s['steps']} steps, {s['tokens']:,} tokens on {s['world_size']} rank(s), {s['tokens_per_s']:,.0f} tokens/s
  held-out     loss {s['eval_loss']:.3f} (perplexity {s['eval_perplexity']:.1f}), MLM accuracy {s['eval_accuracy']:.3f}
  baseline     unigram-frequency MLM accuracy {base:.3f} (always the most frequent token)
  run dir      {s['run_dir']}  (config.yaml, metrics.jsonl, {Path(s['plot']).name if s['plot'] else 'no plot'}, wandb/)
  checkpoint   {s['checkpoint']}
  HF export    {hf}  {loaded}""")
if not s["eval_accuracy"] > base:
    sys.exit("distaff demo: held-out accuracy is not above the unigram baseline")
PYEOF
