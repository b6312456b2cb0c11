#!/usr/bin/env bash
# The prepared check for the day a GPU is lent (issue 30): on one GPU, in under 8 minutes, the kernel tests on
# CUDA (bf16 included), the attention peers at the bar's shapes, the fused-op benchmark, a short pretraining
# benchmark (deberta-v3-base, distaff vs HF eager) and a 100-step pretraining run with a checkpoint and a
# resume; the steps' time limits add up to 8 minutes. Writes ONE markdown report: the device (nvidia-smi),
# every measured table, and the measured attention times beside the static judge's estimates with their ratio.
#
#   scripts/gpu-check.sh [--dry-run] [--out DIR] [--judge FILE]
#
#   --dry-run  on any machine (CPU): checks that every step resolves (test collection, the attention peers at
#              smoke size through the report's join, the other scripts' --help, the run config) and writes
#              the report skeleton. tests/test_benchmarks.py runs it.
#   --out      where the report and logs go (default: $OUT when set, as on a lent machine, else runs/gpu-check)
#   --judge    the judge's estimates, `python benchmarks/attention_judge.py --json FILE` run beforehand on
#              any machine (default: benchmarks/results/attention_judge.json); absent, the report says so.
#
# Environment: $PYTHON if set, else ./.venv/bin/python (scripts/setup-env.sh on a machine with a GPU build of
# torch), else python3 (a lent machine's image: torch, triton, transformers, no internet). When distaff is not
# installed, the repository is put on the path through a folder of links (no install needed); wheels of
# missing packages (deepspeed, webdataset, ...) carried in ./.whl are installed into that folder, offline.
# A step whose needs are missing is reported as skipped with the reason; the others still run.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=0
DEST=${OUT:-$ROOT/runs/gpu-check}
JUDGE=$ROOT/benchmarks/results/attention_judge.json
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --out) DEST=$2; shift ;;
        --judge) JUDGE=$2; shift ;;
        *) echo "distaff gpu-check: unknown argument $1; use --dry-run, --out DIR or --judge FILE" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$DEST/logs"
DEST=$(cd "$DEST" && pwd)
REPORT=$DEST/gpu-check.md
LOGS=$DEST/logs
SECONDS=0

# ------------------------------------------------------------------ environment
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=$ROOT/.venv/bin/python
else PY=python3
fi
SITE=$DEST/site
if ! "$PY" -c "import distaff.kernels" 2>/dev/null; then
    mkdir -p "$SITE/distaff"
    for part in kernels train launch configs; do ln -sfn "$ROOT/$part" "$SITE/distaff/$part"; done
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} WANDB_MODE=disabled WANDB_SILENT=true \
    TOKENIZERS_PARALLELISM=false
missing() {  # the modules of "$@" that do not import
    "$PY" - "$@" <<'PYEOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
PYEOF
}
if [ "$DRY" = 0 ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "distaff gpu-check: $PY sees no CUDA GPU; run on a GPU machine, or use --dry-run to check the script" >&2
    exit 2
fi

# ------------------------------------------------------------------ report helpers
: > "$REPORT"
say() { printf '%s\n' "$@" >> "$REPORT"; }
# step NAME SECONDS NEEDS -- COMMAND...: runs COMMAND (its output to logs/NAME.log) under a time limit, unless a
# module in NEEDS (space-separated) is missing; notes the outcome in the report.
step() {
    local name=$1 limit=$2 needs=$3; shift 4
    local log=$LOGS/$name.log absent started=$SECONDS
    absent=$(missing $needs)
    if [ -n "$absent" ]; then
        say "- **$name**: skipped, missing Python modules: $absent (carry their wheels in .whl)"
        echo "skipped: missing $absent" > "$log"
        return 1
    fi
    echo "== $name: $*"
    timeout "$limit" "$@" > "$log" 2>&1
    local rc=$?
    local outcome="ok"
    [ $rc = 124 ] && outcome="stopped at its ${limit}s limit"
    [ $rc != 0 ] && [ $rc != 124 ] && outcome="failed (exit $rc), see logs/$name.log"
    say "- **$name**: $outcome, $((SECONDS - started)) s: \`$*\`"
    return $rc
}
fenced() { say '```' "$(tail -n "${2:-40}" "$1")" '```'; }

MODE=$([ "$DRY" = 1 ] && echo "DRY RUN on $(hostname) (no GPU: smoke sizes, every timing meaningless)" || echo "GPU run")
say "# distaff GPU check ($MODE)" "" "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" ""
say "## Device" ""
if command -v nvidia-smi >/dev/null && [ "$DRY" = 0 ]; then
    say '```' "$(nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv)" '```'
else
    say "no GPU (dry run)"
fi
say "" "$("$PY" -c 'import torch, triton; print(f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}")' 2>&1)" ""
say "## Steps" ""

# ------------------------------------------------------------------ 1. kernel tests on CUDA (bf16 included)
TESTS="tests/kernels/test_attention_triton.py tests/kernels/test_attention_features.py \
tests/kernels/test_attention_saturated.py tests/kernels/test_layer_norm.py tests/kernels/test_bias_gelu.py \
tests/kernels/test_masked_lm_loss.py tests/kernels/test_no_host_sync.py tests/kernels/test_tta.py \
tests/kernels/test_entropy_scale.py tests/model/test_compile_layer.py"
if [ "$DRY" = 1 ]; then
    step kernel-tests 300 "pytest" -- "$PY" -m pytest -q -p no:cacheprovider --collect-only $TESTS
else
    # Kernel compiles dominate: spread the tests over 8 processes when pytest-xdist is there (the image has it).
    PARALLEL=$([ -z "$(missing xdist)" ] && echo "-n 8" || true)
    step kernel-tests 130 "pytest" -- env DISTAFF_TEST_GPU=1 "$PY" -m pytest -q -p no:cacheprovider $PARALLEL $TESTS
fi

# ------------------------------------------------------------------ 2. attention at the bar's shapes
if [ "$DRY" = 1 ]; then
    step attention-peers 300 "torch triton" -- "$PY" benchmarks/attention.py --peers --cpu-smoke --dropout 0
else
    step attention-peers 90 "torch triton" -- "$PY" benchmarks/attention.py --peers --head-dims 64 \
        --dropout 0 0.1 --warmup 3 --iters 10
fi

# ------------------------------------------------------------------ 3. fused ops
if [ "$DRY" = 1 ]; then
    step ops 120 "torch triton" -- "$PY" benchmarks/ops.py --help  # its --cpu-smoke has its own test
else
    step ops 45 "torch triton" -- "$PY" benchmarks/ops.py --repeats 10 --output "$LOGS/ops.md"
fi

# ------------------------------------------------------------------ 4. pretraining throughput, v3-base
if [ "$DRY" = 1 ]; then
    step pretrain-bench 60 "torch deepspeed transformers" -- "$PY" benchmarks/pretrain.py --help
else
    step pretrain-bench 70 "torch deepspeed transformers" -- "$PY" benchmarks/pretrain.py --steps 10 --warmup 3
fi

# ------------------------------------------------------------------ 5. 100 steps with a checkpoint, then a resume
RUN=$DEST/run
DATA=$DEST/data
CLI=(-c "from distaff.launch.cli import console_main; console_main()")
TRAIN_ARGS=(--config configs/run/deberta-v3-base.yaml "run.out_dir=$RUN" "data.dir=$DATA" data.batch_size=32
            data.num_workers=0 train.grad_accum=1 optim.warmup_steps=10 logging.every=10 eval.every=0
            checkpoint.every=50 checkpoint.keep=2 checkpoint.resume=auto wandb.mode=disabled)
# One rank on GPU 0 (no launcher needed).
PRETRAIN=(env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29500 + RANDOM % 1000))
          "$PY" -m distaff.train.pretrain "${TRAIN_ARGS[@]}")
NEEDS="torch deepspeed sentencepiece webdataset pyarrow"
if [ "$DRY" = 1 ]; then
    step train-config 120 "$NEEDS" -- "$PY" -c "import sys; from distaff.train.run.config import load_config; \
load_config(sys.argv[1], sys.argv[2:] + ['train.max_steps=100'])" "${TRAIN_ARGS[@]:1}"
    step train-cli 120 "$NEEDS" -- "$PY" "${CLI[@]}" data prepare --help
else
    rm -rf "$RUN" "$DATA"
    step tokenizer 20 "$NEEDS" -- "$PY" "${CLI[@]}" tokenizer train --input data/austen-emma-pride.txt.gz \
        data/movie-unlabelled.txt.gz --vocab-size 4000 --out "$DEST/tokenizer" &&
    step shards 25 "$NEEDS" -- "$PY" "${CLI[@]}" data prepare --input data/austen-emma-pride.txt.gz \
        data/movie-unlabelled.txt.gz --tokenizer "$DEST/tokenizer" --seq-len 128 --pack-documents \
        --heldout-fraction 0.02 --shard-mb 1 --out "$DATA" --no-progress &&
    step train-to-60 55 "$NEEDS" -- "${PRETRAIN[@]}" train.max_steps=60 &&
    step resume-to-100 45 "$NEEDS" -- "${PRETRAIN[@]}" train.max_steps=100
    if grep -q "resuming from" "$LOGS/resume-to-100.log" 2>/dev/null; then
        say "- resume: $(grep -m1 'resuming from' "$LOGS/resume-to-100.log")"
    else
        say "- resume: **not seen** in logs/resume-to-100.log"
    fi
fi

# ------------------------------------------------------------------ the tables
say "" "## Attention (measured) beside the judge's estimate" ""
if [ -s "$LOGS/attention-peers.log" ]; then
    say "$("$PY" benchmarks/gpu_report.py --peers "$LOGS/attention-peers.log" --judge "$JUDGE" --cc 90 2>&1)" ""
    say "### Full measured table" ""
    fenced "$LOGS/attention-peers.log" 200
fi
say "" "## Fused ops" ""
[ -s "$LOGS/ops.md" ] && say "$(cat "$LOGS/ops.md")"
say "" "## Pretraining benchmark (deberta-v3-base, distaff vs HF eager)" ""
[ -s "$LOGS/pretrain-bench.log" ] && fenced "$LOGS/pretrain-bench.log" 30
say "" "## Pretraining run (100 steps, checkpoint at 50 and 60, resumed to 100)" ""
for part in train-to-60 resume-to-100; do
    [ -s "$LOGS/$part.log" ] && say "### $part" "" && fenced "$LOGS/$part.log" 25
done
say "" "Total: ${SECONDS} s. Logs: $LOGS"
echo "distaff gpu-check: report in $REPORT (${SECONDS} s)"
