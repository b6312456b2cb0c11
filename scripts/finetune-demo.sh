#!/usr/bin/env bash
# Does the demo's pretraining help a downstream task? Fine-tunes the model scripts/demo.sh pretrained
# (Austen + unlabelled movie-review sentences) on the bundled sentiment sample (data/movie-snippets.tsv.gz,
# 20% held out for dev), beside the same architecture fine-tuned from random weights and a bag-of-words
# logistic regression, each with seeds 1-3 (seed S: dev split S, run seed S), and linear probes of both frozen
# encoders (did pretraining put sentiment into the features?); prints a table and writes results.json.
# Run scripts/demo.sh first.
#
#   bash scripts/finetune-demo.sh                          # writes runs/finetune-demo/ (replaced on each run)
#   SEEDS="1 2" DISTAFF_FT_DIR=/tmp/ft bash scripts/finetune-demo.sh train.epochs=2   # extra args: config overrides
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="$REPO/.venv/bin/python"
BIN="$REPO/.venv/bin"
PRETRAINED="${DISTAFF_DEMO_DIR:-runs/demo}/run"
OUT="${DISTAFF_FT_DIR:-runs/finetune-demo}"
SEEDS="${SEEDS:-1 2 3}"
DATA=data/movie-snippets.tsv.gz
CONFIG=configs/finetune/sentiment-cpu.yaml
DEV_FRACTION=0.2
SECONDS=0

if [ ! -f "$PRETRAINED/summary.json" ]; then
    echo "finetune-demo: $PRETRAINED/summary.json not found: run scripts/demo.sh first" >&2
    exit 2
fi
export WANDB_MODE="${WANDB_MODE:-offline}" WANDB_SILENT=true TOKENIZERS_PARALLELISM=false
# shellcheck source=scripts/out-dir.sh
source scripts/out-dir.sh
refuse_out_over_inputs finetune-demo.sh "$PY" "$OUT" "$PRETRAINED" "$DATA" "$CONFIG"
rm -rf "$OUT"
mkdir -p "$OUT"

for seed in $SEEDS; do
    # The random arm: the pretrained model's architecture and tokenizer, fresh weights drawn with this seed.
    "$PY" - "$PRETRAINED" "$OUT/random-init-$seed" "$seed" <<'PYEOF'
import sys
import torch
from distaff.train.model.deberta import DebertaForMaskedLM
from distaff.train.run.model_folder import load_model, save_model_folder

pretrained, tokenizer = load_model(sys.argv[1])
torch.manual_seed(int(sys.argv[3]))
save_model_folder(DebertaForMaskedLM(pretrained.config), sys.argv[2], tokenizer=tokenizer)
PYEOF
    for arm in pretrained random; do
        init="$PRETRAINED"
        [ "$arm" = random ] && init="$OUT/random-init-$seed"
        echo "== fine-tuning from $arm weights, seed $seed"
        "$BIN/distaff" finetune --config "$CONFIG" model.init_from="$init" run.seed="$seed" \
            data.train="$DATA" data.dev_fraction="$DEV_FRACTION" data.split_seed="$seed" \
            run.out_dir="$OUT/$arm-$seed" logging.progress_bar=false "$@" > "$OUT/$arm-$seed.log" 2>&1 \
            || { tail -20 "$OUT/$arm-$seed.log" >&2; exit 1; }
    done
    echo "== bag-of-words baseline and linear probes of the frozen pretrained and random encoders, seed $seed"
    "$PY" -m distaff.train.tools.baselines --train "$DATA" --dev-fraction "$DEV_FRACTION" --seed "$seed" --json "$OUT/bow-$seed.json"
    for arm in pretrained random; do
        init="$PRETRAINED"
        [ "$arm" = random ] && init="$OUT/random-init-$seed"
        "$PY" -m distaff.train.tools.baselines --train "$DATA" --dev-fraction "$DEV_FRACTION" --seed "$seed" \
            --probe "$init" --json "$OUT/probe-$arm-$seed.json" 2> "$OUT/probe-$arm-$seed.log" \
            || { tail -20 "$OUT/probe-$arm-$seed.log" >&2; exit 1; }
    done
done

"$PY" - "$OUT" "$SECONDS" $SEEDS <<'PYEOF'
import json, statistics, sys
from pathlib import Path

out, seconds, seeds = Path(sys.argv[1]), int(sys.argv[2]), [int(s) for s in sys.argv[3:]]
runs = {
    "pretrained": [json.loads((out / f"pretrained-{s}" / "summary.json").read_text())["eval_accuracy"] for s in seeds],
    "random init": [json.loads((out / f"random-{s}" / "summary.json").read_text())["eval_accuracy"] for s in seeds],
    "bag of words": [json.loads((out / f"bow-{s}.json").read_text())["dev_accuracy"] for s in seeds],
    "probe of pretrained": [json.loads((out / f"probe-pretrained-{s}.json").read_text())["dev_accuracy"] for s in seeds],
    "probe of random": [json.loads((out / f"probe-random-{s}.json").read_text())["dev_accuracy"] for s in seeds],
}
std = lambda values: statistics.stdev(values) if len(values) > 1 else 0.0
results = {name: {"seeds": seeds, "dev_accuracy": values, "mean": statistics.mean(values), "std": std(values)}
           for name, values in runs.items()}
margin = [p - r for p, r in zip(runs["pretrained"], runs["random init"])]
results["pretrained_minus_random"] = {"per_seed": margin, "mean": statistics.mean(margin), "std": std(margin)}
(out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
print(f"\n== sentiment fine-tuning, dev accuracy over seeds {seeds} ({seconds // 60}m{seconds % 60:02d}s in all)")
for name, values in runs.items():
    cells = "  ".join(f"{v:.3f}" for v in values)
    print(f"  {name:<19} {results[name]['mean']:.3f} +- {results[name]['std']:.3f}   ({cells})")
print(f"  pretrained - random: {statistics.mean(margin):+.3f} +- {std(margin):.3f} per seed    {out / 'results.json'}")
PYEOF
