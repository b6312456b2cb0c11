#!/usr/bin/env bash
# Rerun the commands whose output the docs quote and rewrite their measured spans
# (<!-- measured: NAME -->...<!-- /measured -->).
#
#   bash scripts/refresh-doc-numbers.sh            # all of the below
#   bash scripts/refresh-doc-numbers.sh readme     # reruns the demo (its duration: README.md), rewrites the spans
#                                                  # of README.md and of scripts/demo.sh's header
#   bash scripts/refresh-doc-numbers.sh plan       # remeasures the plan's memory and CPU time (15-40 minutes),
#                                                  # then rewrites docs/plan.md
#   bash scripts/refresh-doc-numbers.sh plan-tables  # docs/plan.md from the committed measurements (seconds)
#   bash scripts/refresh-doc-numbers.sh results    # docs/results/*.md and the evaluations section of
#                                                  # docs/pretraining.md from benchmarks/results/*.json (seconds)
#
# Run it on the machine the docs name (a 2-core CPU machine, idle for the timed figures), then `git diff`.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PART="${1:-all}"
PY=.venv/bin/python

if [[ "$PART" == all || "$PART" == readme ]]; then
    OUT="${DISTAFF_DEMO_DIR:-runs/demo}"
    LOG="$(mktemp)"
    SECONDS=0
    bash scripts/demo.sh --fresh | tee "$LOG"
    ELAPSED=$SECONDS
    sed -n '/^== distaff demo summary/,$p' "$LOG" > "$OUT/summary.txt"
    for doc in README.md scripts/demo.sh; do     # one duration in both: the demo's own summary's
        $PY scripts/refresh_doc_numbers.py "$doc" "$OUT/summary.txt" "$OUT/run/summary.json" "$ELAPSED"
    done
    rm -f "$LOG"
fi
if [[ "$PART" == all || "$PART" == plan ]]; then
    $PY benchmarks/plan_memory.py --json benchmarks/results/plan_memory.json
    $PY benchmarks/plan_time.py --json benchmarks/results/plan_time_cpu.json
    $PY benchmarks/plan_memory.py --long-and-packed --json benchmarks/results/plan_memory_long_packed.json
    $PY benchmarks/plan_time.py --out-of-sample --repeat 1 --json benchmarks/results/plan_time_oos.json
fi
if [[ "$PART" == all || "$PART" == plan || "$PART" == plan-tables ]]; then
    $PY scripts/refresh_plan_doc.py docs/plan.md
fi
if [[ "$PART" == all || "$PART" == results ]]; then
    $PY scripts/render_results.py    # docs/results/*.md from benchmarks/results/*.json
    # docs/pretraining.md's evaluation figures from benchmarks/evals_side.py's last results (rerun it to change them)
    $PY scripts/refresh_doc_numbers.py --evals-side docs/pretraining.md benchmarks/results/evals_side.json
fi
