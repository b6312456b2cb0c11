#!/usr/bin/env bash
# The test suite on a fresh machine: environment, a local Slurm's packages (root only), pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
if [ -f scripts/install-slurm.sh ]; then bash scripts/install-slurm.sh; fi
exec .venv/bin/python -m pytest "$@"
