#!/usr/bin/env bash
# The test suite on a fresh machine: environment, a local Slurm's packages (root only), pytest.
#
# With no arguments it runs in two phases: every test not marked `serial` under pytest-xdist, one worker per core
# (at most 4: each integration test may start two ranks of its own), then the `serial` tests (watchdogs, stalls,
# signals, the local Slurm cluster) alone, so their bounded waits are not measured on a machine the other phase
# crowds. Each phase lists its 15 slowest tests (where the suite's time goes). It ends with one line adding both
# phases up. With arguments, they go to a single pytest run unchanged
# (`bash scripts/test.sh -m unit -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
if [ -f scripts/install-slurm.sh ]; then bash scripts/install-slurm.sh; fi
if [ "$#" -gt 0 ]; then
    exec .venv/bin/python -m pytest "$@"
fi

workers=$(nproc)
[ "$workers" -gt 4 ] && workers=4
reports=$(mktemp -d)
trap 'rm -rf "$reports"' EXIT
status=0
started=$(date +%s)
if [ "$workers" -gt 1 ]; then
    .venv/bin/python -m pytest -m "not serial" -n "$workers" --dist worksteal --durations 15 \
        --junitxml "$reports/parallel.xml" || status=$?
else
    .venv/bin/python -m pytest -m "not serial" --durations 15 --junitxml "$reports/parallel.xml" || status=$?
fi
.venv/bin/python -m pytest -m serial --durations 15 --junitxml "$reports/serial.xml" \
    || { code=$?; [ "$status" -ne 0 ] || status=$code; }
.venv/bin/python scripts/test_totals.py "$reports/parallel.xml" "$reports/serial.xml" "$(( $(date +%s) - started ))"
exit "$status"
