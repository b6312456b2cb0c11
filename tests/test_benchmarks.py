"""The benchmark scripts stay runnable: each has a tiny CPU mode that measures every row it prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from distaff.train.plan.memory import attention_band

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


@pytest.mark.timeout(180)
def test_attention_backward_memory_stays_within_its_gradients():
    """The fused backward's temporaries (measured from its host code at deberta-v3-base shapes and at 16k tokens
    with N = 8192) are at most the bytes of dq + dk + dv; the dense position gradients' add one [H, tokens, 2k]
    buffer and head-major copies of Q and K (two thirds of dq + dk + dv), the dense scores two [H, tokens, 2k]
    buffers (and the same copies), both together a band scratch per item (a row at most the sequence's distances,
    or the table's unsaturated middle and two tiles: ``one_item_per_program``), nothing N x N."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # launches are recorded, not run
    run = subprocess.run([sys.executable, str(BENCHMARKS / "attention.py"), "--memory"], capture_output=True,
                         text=True, timeout=170, env=env)
    assert run.returncode == 0, run.stderr
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in run.stdout.splitlines()
            if line.startswith("| 32 |") or line.startswith("| 2 |")]
    designs = [(g, s) for g in ("dense", "fused") for s in ("dense", "fused")]
    assert sorted((r[0], r[2], r[3]) for r in rows) == [(b, *d) for b in ("2", "32") for d in designs]
    for batch, n, design, scores, grads, previous, now in rows:
        tokens, heads, two_span = int(batch) * int(n), 12, 512          # the benchmark's H and 2k, bf16
        buffer, copies = (heads * tokens * two_span * 2) / 2**20, 2 / 3 * float(grads)
        bound = float(grads) + (buffer if design == "dense" else 0.0) + (2 * buffer if scores == "dense" else 0.0)
        bound += copies if "dense" in (design, scores) else 0.0
        band = attention_band(int(n), 256, 512)                          # the benchmark's buckets and max relative
        bound += heads * tokens * band * 2 / 2**20 if design == scores == "dense" else 0.0
        assert 0 < float(now) <= bound and float(grads) < float(previous), (batch, n, design, scores, now, bound)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("objective", ["mlm", "rtd"])
def test_packing_benchmark_runs_both_layouts_on_real_text(tmp_path, sample_data, objective):
    """benchmarks/packing.py end to end on a slice of the bundled Shakespeare, MLM and RTD: both rows measured,
    padding only in the padded run, the objective's held-out figures in the table and the load stated."""
    import gzip

    text = tmp_path / "plays.txt"
    with gzip.open(sample_data / "shakespeare.txt.gz", "rt") as handle:
        text.write_text(handle.read(120_000))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(BENCHMARKS / "packing.py"), "--text", str(text), "--vocab-size", "800",
                          "--seq-len", "64", "--batch-size", "4", "--tokens", "1500", "--ranks", "1",
                          "--objective", objective, "--work-dir", str(tmp_path / "work")],
                         capture_output=True, text=True, timeout=290, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in run.stdout.splitlines()
            if line.startswith("| padded |") or line.startswith("| varlen |")}
    assert rows.keys() == {"padded", "varlen"}, run.stdout
    padding = {mode: float(cells[3].strip(" %")) for mode, cells in rows.items()}
    assert padding["varlen"] == 0.0 < padding["padded"]
    assert all(float(cells[5].replace(",", "")) > 0 for cells in rows.values())  # measured tokens/s
    assert all(len(cells) == (7 if objective == "mlm" else 9) for cells in rows.values()), run.stdout
    if objective == "rtd":      # the discriminator's held-out accuracy, with its all-"original" baseline
        assert all(0.0 < float(cells[6].split()[0]) <= 1.0 for cells in rows.values()), run.stdout
    assert f"{objective}, tiny preset" in run.stdout and "load average (1/5/15 min)" in run.stdout


@pytest.mark.timeout(120)
def test_attention_tile_paths_table_accounts_for_every_tile():
    """The tile-path table: each row's paths add up to its tiles (one sequence, N/BM x N/BN), no tile
    saturates at N = 512 with DeBERTa-v3's buckets and most do at 8192."""
    run = subprocess.run([sys.executable, str(BENCHMARKS / "attention.py"), "--tile-paths"], capture_output=True,
                         text=True, timeout=110)
    assert run.returncode == 0, run.stderr
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith(("| fwd", "| dkdv", "| dq"))]
    assert len(rows) == 3 * 3 * 2, run.stdout  # kernels x lengths x head dims
    for kernel, d, tile, n, tiles, saturated, general, percent in rows:
        block_m, block_n = map(int, tile.split("x"))
        assert int(tiles) == -(-int(n) // block_m) * -(-int(n) // block_n) == int(saturated) + int(general), (
            kernel, d, n)
        if int(n) == 512:
            assert float(percent) == 0.0, (kernel, d)
        if int(n) == 8192:
            assert float(percent) > 80.0, (kernel, d)


@pytest.mark.timeout(120)
def test_sift_benchmark_cpu_smoke_measures_every_row():
    smoke = subprocess.run([sys.executable, str(BENCHMARKS / "sift.py"), "--cpu-smoke"], capture_output=True, text=True,
                           timeout=110, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert smoke.returncode == 0, smoke.stderr
    rows = [line.split("|")[1:-1] for line in smoke.stdout.splitlines()
            if line.startswith("| off |") or " ascent step" in line]
    assert [row[0].strip() for row in rows] == ["off", "0 ascent steps", "1 ascent step", "2 ascent steps"], smoke.stdout
    assert all(float(row[1]) > 0 for row in rows), smoke.stdout
