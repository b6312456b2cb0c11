"""benchmarks/plan_time.py's rows each carry the machine they ran on: a probe before and after the run, averaged,
which docs/plan.md's plan columns use; ``--update`` remeasures some rows of a committed result and keeps the rest."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = _script(REPO / "benchmarks" / "plan_time.py")
PLAN_DOC = _script(REPO / "scripts" / "refresh_plan_doc.py")
COMMITTED = json.loads((REPO / "benchmarks" / "results" / "plan_time_cpu.json").read_text())


def test_the_bracketing_probe_is_the_mean_of_the_probes_before_and_after_the_run():
    before = copy.deepcopy(COMMITTED["probe"])
    after = {**copy.deepcopy(before), "copy_gb_s": before["copy_gb_s"] * 3, "load_average": 5.0,
             "gemm_gflops": [[k, fp32 * 2, bf16 * 4] for k, fp32, bf16 in before["gemm_gflops"]]}
    machine = BENCH.bracketing_probe(before, after)
    assert machine["copy_gb_s"] == pytest.approx(before["copy_gb_s"] * 2)
    assert machine["load_average"] == pytest.approx((before["load_average"] + 5.0) / 2)
    for (k, fp32, bf16), (_, fp32_before, bf16_before) in zip(machine["gemm_gflops"], before["gemm_gflops"]):
        assert (fp32, bf16) == pytest.approx((fp32_before * 1.5, bf16_before * 2.5)), k
    assert machine["cores"] == after["cores"] and machine["date"] == before["date"] and machine["bracketed"]


def test_update_replaces_only_the_remeasured_rows_and_keeps_the_others_and_their_probe():
    first, second = COMMITTED["runs"][0], COMMITTED["runs"][1]
    fresh = {**first, "measured_cpu_step_s": 123.0, "probe": COMMITTED["probe"]}
    new_run = {**second, "run": "not-in-the-result"}
    merged = BENCH.merged(copy.deepcopy(COMMITTED), [fresh, new_run])
    assert [r["run"] for r in merged["runs"]] == [r["run"] for r in COMMITTED["runs"]] + ["not-in-the-result"]
    assert merged["runs"][0]["measured_cpu_step_s"] == 123.0 and merged["runs"][1] == second
    assert merged["probe"] == COMMITTED["probe"]


def test_a_row_with_its_own_probe_is_planned_on_it_and_the_others_on_the_results(tmp_path, monkeypatch):
    """Twice the probed rates and bandwidth on one row's own probe: that row's plan is shorter, the others' are not."""
    recorded = copy.deepcopy(COMMITTED)
    for run in recorded["runs"]:
        run.pop("probe", None)
    faster = copy.deepcopy(recorded["probe"])
    faster.update(copy_gb_s=faster["copy_gb_s"] * 2,
                  gemm_gflops=[[k, fp32 * 2, bf16 * 2] for k, fp32, bf16 in faster["gemm_gflops"]])
    (tmp_path / "plain.json").write_text(json.dumps(recorded))
    recorded["runs"][0]["probe"] = faster
    (tmp_path / "own.json").write_text(json.dumps(recorded))
    monkeypatch.setattr(PLAN_DOC, "RESULTS", tmp_path)
    _, _, plain = PLAN_DOC._timed_runs("plain.json")
    _, probe, own = PLAN_DOC._timed_runs("own.json")
    assert own[0]["plan_step_s"] < 0.75 * plain[0]["plan_step_s"]
    assert [r["plan_step_s"] for r in own[1:]] == [r["plan_step_s"] for r in plain[1:]]
    assert f"{own[0]['run']} {faster['gemm_gflops'][0][1]:.0f} GFLOP/s" in PLAN_DOC._probes_line(probe, own)
