#!/usr/bin/env bash
# Rerun the commands whose output README.md quotes and rewrite its measured spans
# (<!-- measured: NAME -->...<!-- /measured -->, scripts/refresh_doc_numbers.py) with what they print now; and
# docs/pretraining.md's from benchmarks/results/evals_side.json (benchmarks/evals_side.py --json writes it).
# Run it on the machine the README names (a 2-core CPU machine, idle for the "idle" figures): about 5 minutes.
#
#   bash scripts/refresh-doc-numbers.sh && git diff README.md
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT="${DISTAFF_DEMO_DIR:-runs/demo}"
LOG="$(mktemp)"
SECONDS=0
bash scripts/demo.sh --fresh | tee "$LOG"
ELAPSED=$SECONDS
sed -n '/^== distaff demo summary/,$p' "$LOG" > "$OUT/summary.txt"
.venv/bin/python scripts/refresh_doc_numbers.py README.md "$OUT/summary.txt" "$OUT/run/summary.json" "$ELAPSED"
rm -f "$LOG"
# docs/pretraining.md's evaluation figures from benchmarks/evals_side.py's last results (rerun it to change them)
.venv/bin/python scripts/refresh_doc_numbers.py --evals-side docs/pretraining.md benchmarks/results/evals_side.json
