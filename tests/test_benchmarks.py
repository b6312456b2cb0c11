"""The benchmark scripts stay runnable: each has a tiny CPU mode that measures every row it prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.timeout(120)
def test_attention_benchmark_cpu_smoke_runs_end_to_end():
    smoke = subprocess.run([sys.executable, str(BENCHMARKS / "attention.py"), "--cpu-smoke", "--dropout", "0"],
                           capture_output=True, text=True, timeout=110)
    assert smoke.returncode == 0, smoke.stderr
    distaff_row = next(line for line in smoke.stdout.splitlines() if line.startswith("| distaff (Triton) | 32 |"))
    assert float(distaff_row.split("|")[5]) > 0, distaff_row  # a measured forward time
    assert "| FlashDeBERTa 0.0.8 | 32 | 2 | 0.0 |" in smoke.stdout  # a row, installed or not


@pytest.mark.timeout(120)
def test_ops_benchmark_cpu_smoke_runs_end_to_end():
    smoke = subprocess.run([sys.executable, str(BENCHMARKS / "ops.py"), "--cpu-smoke"], capture_output=True, text=True,
                           timeout=110, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert smoke.returncode == 0, smoke.stderr
    distaff_rows = [line for line in smoke.stdout.splitlines() if "| distaff |" in line]
    assert len(distaff_rows) == 3 and all(float(row.split("|")[4]) > 0 for row in distaff_rows), smoke.stdout
