"""The static performance judge (benchmarks/attention_judge.py) run on the bar's matrix: distaff against
DisentangledFlash 1.1.1 and FlashDeBERTa 0.0.8, compiled for an H100 (sm_90) from each project's own host
code, with no GPU. The figures are estimates; the test asserts the design bar they must meet:
distaff's forward and backward (kernels plus outside work) at or below 0.8x DisentangledFlash's and below
FlashDeBERTa's at N=512 (B=32) and N=8192 (B=2), d=64, dropout 0 and 0.1; Hopper's warpgroup MMA in every
forward; no product repeated across warps; no spill. Compiles are cached with the compile check's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BAR = 0.8


@pytest.mark.integration
def test_distaff_beats_both_peers_in_the_static_estimate(tmp_path: Path) -> None:
    pytest.importorskip("disentangled_flash", reason="the peers are a benchmark extra: pip install '.[test]'")
    pytest.importorskip("flashdeberta", reason="the peers are a benchmark extra: pip install '.[test]'")
    out = tmp_path / "judge.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "benchmarks/attention_judge.py", "--targets", "90", "--head-dims", "64",
                          "--kernels", "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=1500)
    print(run.stdout)  # the side-by-side table, in the test log
    assert run.returncode == 0, run.stderr[-4000:]
    records = json.loads(out.read_text())
    totals = {(json.dumps(r["workload"]), r["impl"], r["pass_"]): r["total_ms"] for r in records if "pass_" in r}
    workloads = {json.dumps(r["workload"]) for r in records}
    assert len(workloads) == 4, workloads  # two shapes x two dropouts
    for w in workloads:
        for p in ("fwd", "bwd"):
            ours, flash = totals[(w, "distaff", p)], totals[(w, "DisentangledFlash", p)]
            assert ours <= BAR * flash, (w, p, ours, flash)
            if (w, "FlashDeBERTa", p) in totals:  # FlashDeBERTa has no dropout
                assert ours < totals[(w, "FlashDeBERTa", p)], (w, p, ours)
    ours = [launch for r in records if r["impl"] == "distaff" and "launches" in r for launch in r["launches"]]
    attention = [launch for launch in ours if launch["kernel"] in ("_attn_fwd", "_attn_bwd_dq", "_attn_bwd_dkdv")]
    assert attention and all(launch["spills"] == 0 for launch in ours), [(x["kernel"], x["spills"]) for x in ours]
    assert all(launch["wgmma"] for launch in attention if launch["kernel"] == "_attn_fwd")
    assert max(launch["repetition"] for launch in attention) <= 1.1
