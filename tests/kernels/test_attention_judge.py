"""The static performance judge (benchmarks/attention_judge.py) run on the bar's matrix: distaff against
DisentangledFlash 1.1.1 and FlashDeBERTa 0.0.8, compiled for an H100 (sm_90) and an A100 (sm_80) from each
project's own host code, with no GPU, beside a content-only FlashAttention-2 and Hugging Face's eager DeBERTa-v2
attention at the same shapes. The figures are ESTIMATES (a latency-aware model over the compiled SASS, calibrated
on published timings of two kernel designs). The test asserts: every fitted calibration anchor within 1.5x of its
published time at both latency ends (the one unfitted anchor says why); DisentangledFlash's backward held to both
its published figures (its README's and its bundled profile's) and every verdict on the issue's bars computed from
the records under both; the cells that meet a bar today still meet it (the others are printed, not hidden: the
verdict table is in the log), on both GPUs; the JSON a planner reads; Hopper's warpgroup MMA in every sm_90
forward; no product repeated across warps; no spill. Compiles are cached with the compile check's."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESIDUAL = 1.5
# (target, N, dropout, pass, against) cells that meet their bar at the high end with the fixed judge (issue 47)
# and the merged kernels of issue 47 (sm_80's forward with its paths apart, the backward's end terms ahead, the
# backward's scores from dense products and sm_80's larger tiles with them; the dense forward's buckets from the
# mirrored table on 64 x 64 tiles in two stages; sm_90's 64-row backward blocks with their buckets a tile ahead;
# sm_80's 64-row backward blocks, a program per item): 16 on sm_90, 20 on sm_80; FlashDeBERTa has no attention
# dropout.
MET = {*((90, n, p, "fwd", "DisentangledFlash") for n in (512, 8192) for p in (0.0, 0.1)),
       *((cc, n, p, "bwd", "DisentangledFlash (profile)") for cc in (90, 80) for n in (512, 8192) for p in (0.0, 0.1)),
       *((cc, 8192, p, "bwd", "DisentangledFlash (README)") for cc in (90, 80) for p in (0.0, 0.1)),
       *((90, 512, p, "bwd", "DisentangledFlash (README)") for p in (0.0, 0.1)),
       *((80, 512, p, "bwd", "DisentangledFlash (README)") for p in (0.0, 0.1)),
       *((90, n, 0.0, pass_, "FlashDeBERTa") for n in (512, 8192) for pass_ in ("fwd", "bwd")),
       *((80, n, 0.0, "bwd", "FlashDeBERTa") for n in (512, 8192)),
       *((80, 8192, p, "fwd", "DisentangledFlash") for p in (0.0, 0.1)),
       (80, 8192, 0.0, "fwd", "FlashDeBERTa"),
       *((80, 512, p, "bwd", "FlashAttention-2 (content only)") for p in (0.0, 0.1)),
       *((80, 512, p, pass_, against) for p in (0.0, 0.1) for pass_, against in (
           ("fwd", "DisentangledFlash"), ("fwd", "FlashAttention-2 (content only)"))),
       (80, 512, 0.0, "fwd", "FlashDeBERTa"),
       *((90, 512, p, "bwd", "FlashAttention-2 (content only)") for p in (0.0, 0.1))}
GPU = {90: "H100 SXM", 80: "A100 SXM 80GB"}
CONTENT = "FlashAttention-2 (content only)"


def _judge():
    """The sibling script as a module (its dataclasses need it in ``sys.modules``)."""
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    return importlib.import_module("attention_judge")


@pytest.mark.unit
def test_a_launch_at_its_floor_loses_its_waits_and_keeps_its_bytes() -> None:
    judge = _judge()
    gpu = judge.static_perf.GPUS[90]
    launch = judge.KernelEstimate(impl="distaff", kernel="k", tile="64x64", warps=4, stages=2, registers=128, spills=0,
                                  shared=0, blocks_per_sm=2, programs=264, waves=1.0, paths=[], repetition=1.0,
                                  wgmma=False, cycles=1e6, span={"low": 1.5e6, "high": 2e6}, l2_bytes=0.0,
                                  hbm_bytes=(1e8, 4e9))
    calibrated = lambda cycles: 2.0 * cycles / (gpu.clock_ghz * 1e9) * 1e3  # noqa: E731
    hbm_ms = 4e9 / (gpu.hbm_tb_s * 1e12) * 1e3
    assert calibrated(1e6) < hbm_ms < calibrated(2e6)  # the HBM floor between the issue floor and the makespan
    assert judge.kernel_ms(launch, gpu, 2.0, "high") == pytest.approx(calibrated(2e6))
    assert judge.kernel_ms(launch, gpu, 2.0, "high", waits=False) == pytest.approx(hbm_ms)
    assert judge.kernel_ms(launch, gpu, 2.0, "low", waits=False) == pytest.approx(calibrated(1e6))


@pytest.mark.integration
def test_judge_is_calibrated_and_judges_every_bar_under_both_df_figures(tmp_path: Path) -> None:
    pytest.importorskip("disentangled_flash", reason="the peers are a benchmark extra: pip install '.[test]'")
    pytest.importorskip("flashdeberta", reason="the peers are a benchmark extra: pip install '.[test]'")
    out = tmp_path / "judge.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "benchmarks/attention_judge.py", "--targets", "90", "80", "--head-dims", "64",
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
    assert all(r["estimated"] and r["gpu"] == GPU[r["workload"]["cc"]] and r["ms_high"] > 0 and r["ms_low"] > 0
               for r in records)
    high = {(json.dumps(r["workload"]), r["impl"], r["pass_"]): r["ms_high"] for r in records}
    workloads = {json.dumps(r["workload"]) for r in report["records"]}
    assert len(workloads) == 8, workloads  # two GPUs x two shapes x two dropouts
    figures = report["disentangled_flash_backward_figures"]
    assert figures["README"]["published_ms"] == 45.26 and 82 < figures["profile"]["published_ms"] < 84
    assert 0 < figures["README"]["scale"]["high"] < figures["profile"]["scale"]["high"]
    verdicts = {(v["target"], v["workload"], v["pass_"], v["against"]): v for v in report["verdicts"]}
    for w in workloads:
        shape = json.loads(w)
        name = f"N={shape['n']} B={shape['batch']} d={shape['head_dim']} p={shape['dropout']:g}"
        target = f"sm_{shape['cc']}"
        for figure in ("profile", "README"):  # every backward verdict under both of DF's figures
            v = verdicts[(target, name, "bwd", f"DisentangledFlash ({figure})")]
            theirs = high[(w, "DisentangledFlash", "bwd")] * figures[figure]["scale"]["high"]
            assert v["ratio"] == pytest.approx(high[(w, "distaff", "bwd")] / theirs, abs=1e-3), v
        # the presets' setting keeps the forward's dense scores: the same forward, a backward without two GEMMs
        assert high[(w, "distaff", "fwd")] == pytest.approx(high[(w, "distaff, scores recomputed", "fwd")])
        assert high[(w, "distaff", "bwd")] < high[(w, "distaff, scores recomputed", "bwd")]
        if shape["n"] == 512:  # the HF eager bar is on fwd + bwd
            v = verdicts[(target, name, "fwd+bwd", "HF eager")]
            ours, hf = (sum(high[(w, impl, p)] for p in ("fwd", "bwd")) for impl in ("distaff", "HF eager"))
            assert v["ratio"] == pytest.approx(ours / hf, abs=1e-3) and v["bar"] == 0.5
        for (cc, n, p, pass_, against) in MET:
            if (shape["cc"], shape["n"], shape["dropout"]) == (cc, n, p):
                verdict = verdicts[(target, name, pass_, against)]
                assert verdict["met"], verdict
    assert all(v["met"] == (v["ratio"] <= v["bar"]) for v in report["verdicts"])
    for v in report["verdicts"]:  # the same passes with no dependent wait: never above the estimate
        assert v["floor_ratio"] <= v["ratio"] + 1e-3 and v["met_at_floor"] == (v["floor_ratio"] <= v["bar"]), v
    hf_records = [r for r in records if r["impl"] == "HF eager"]
    assert len(hf_records) == 16 and all(not r["kernels"] and r["launches"] > 20 for r in hf_records)
    assert {(json.dumps(r["workload"]), r["pass_"]) for r in records if r["impl"] == CONTENT} == {
        (w, p) for w in workloads for p in ("fwd", "bwd")}
    ours = [(r["workload"]["cc"], launch) for r in records if r["impl"] == "distaff" for launch in r["kernels"]]
    attention = [(cc, launch) for cc, launch in ours
                 if launch["kernel"] in ("_attn_fwd", "_attn_bwd_dq", "_attn_bwd_dkdv")]
    spills = [(cc, launch["kernel"], launch["spills"]) for cc, launch in ours]
    assert attention and all(spilled == 0 for _, _, spilled in spills), spills
    assert all(launch["wgmma"] for cc, launch in attention if cc == 90 and launch["kernel"] == "_attn_fwd")
    assert max(launch["repetition"] for _, launch in attention) <= 1.1
    assert all(launch["l2_bytes"] > 0 and launch["hbm_bytes"][1] >= launch["hbm_bytes"][0] for _, launch in attention)
