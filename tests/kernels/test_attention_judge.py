"""The static performance judge (benchmarks/attention_judge.py) run on the bar's matrix: distaff against
DisentangledFlash 1.1.1 and FlashDeBERTa 0.0.8, compiled for an H100 (sm_90) from each project's own host
code, with no GPU, and a content-only FlashAttention-2 at the same shapes. The figures are ESTIMATES (a
latency-aware model over the compiled SASS, calibrated on published timings of two kernel designs). The test
asserts what holds after issue 38's fixed judge: every fitted calibration anchor within 1.5x of its published
time at both latency ends (the one unfitted anchor says why); the bar at its high (600-cycle) end in every cell
(distaff at or below 0.8x DisentangledFlash and 0.9x FlashDeBERTa, forward and backward, N=512 and 8192, both
dropouts where the peer has them); the JSON a planner reads; Hopper's warpgroup MMA in every forward; no product
repeated across warps; no spill. Compiles are cached with the compile check's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BAR, FD_BAR, RESIDUAL = 0.8, 0.9, 1.5
# (N, dropout, pass, peer) cells where the high-end estimate meets the bar (FlashDeBERTa has no attention dropout).
MET = {*((n, p, pass_, "DisentangledFlash") for n in (512, 8192) for p in (0.0, 0.1) for pass_ in ("fwd", "bwd")),
       *((n, 0.0, pass_, "FlashDeBERTa") for n in (512, 8192) for pass_ in ("fwd", "bwd"))}
CONTENT = "FlashAttention-2 (content only)"


@pytest.mark.integration
def test_judge_is_calibrated_and_distaff_meets_the_bar(tmp_path: Path) -> None:
    pytest.importorskip("disentangled_flash", reason="the peers are a benchmark extra: pip install '.[test]'")
    pytest.importorskip("flashdeberta", reason="the peers are a benchmark extra: pip install '.[test]'")
    out = tmp_path / "judge.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "benchmarks/attention_judge.py", "--targets", "90", "--head-dims", "64",
                          "--kernels", "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=2400)
    print(run.stdout)  # the calibration and the side-by-side table, in the test log
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(out.read_text())
    anchors = report["calibration"]["anchors"]
    fitted = [a for a in anchors if a["fitted"]]
    assert len({a["source"] for a in fitted}) >= 2 and len(fitted) >= 8  # two designs, forward and backward
    for anchor in fitted:
        assert all(1 / RESIDUAL <= r <= RESIDUAL for r in anchor["residual"].values()), anchor
    assert all(a["unfitted"] for a in anchors if not a["fitted"])  # an anchor left out says why
    records = [r for r in report["records"] if "pass_" in r]
    assert all(r["estimated"] and r["gpu"] == "H100 SXM" and r["ms_high"] > 0 and r["ms_low"] > 0 for r in records)
    high = {(json.dumps(r["workload"]), r["impl"], r["pass_"]): r["ms_high"] for r in records}
    workloads = {json.dumps(r["workload"]) for r in report["records"]}
    assert len(workloads) == 4, workloads  # two shapes x two dropouts
    for w in workloads:
        shape = json.loads(w)
        for p in ("fwd", "bwd"):
            for peer, bar in (("DisentangledFlash", BAR), ("FlashDeBERTa", FD_BAR)):
                if (shape["n"], shape["dropout"], p, peer) in MET:
                    ours, theirs = high[(w, "distaff", p)], high[(w, peer, p)]
                    assert ours <= bar * theirs, (w, p, peer, ours / theirs)
    assert {(json.dumps(r["workload"]), r["pass_"]) for r in records if r["impl"] == CONTENT} == {
        (w, p) for w in workloads for p in ("fwd", "bwd")}
    ours = [launch for r in records if r["impl"] == "distaff" for launch in r["kernels"]]
    attention = [launch for launch in ours if launch["kernel"] in ("_attn_fwd", "_attn_bwd_dq", "_attn_bwd_dkdv")]
    assert attention and all(launch["spills"] == 0 for launch in ours), [(x["kernel"], x["spills"]) for x in ours]
    assert all(launch["wgmma"] for launch in attention if launch["kernel"] == "_attn_fwd")
    assert max(launch["repetition"] for launch in attention) <= 1.1
    assert all(launch["l2_bytes"] > 0 and launch["hbm_bytes"][1] >= launch["hbm_bytes"][0] for launch in attention)
