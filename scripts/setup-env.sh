#!/usr/bin/env bash
# Create ./.venv and install distaff with everything the main job and the tests need.
# Idempotent: re-running with unchanged setup.cfg/constraints.txt does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=.venv/.distaff-install-stamp
wanted=$(cat setup.cfg constraints.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    # Every install is constrained to torch==2.13.0: left free, pip would pull a multi-GB CUDA
    # build on a CPU-only machine (deepspeed only asks for torch>=2.0).
    .venv/bin/pip install -q --disable-pip-version-check -c constraints.txt torch
    .venv/bin/pip install -q --disable-pip-version-check -c constraints.txt -e ".[test]"
    echo "$wanted" > "$stamp"
fi
