"""A run against its plan: the stage furthest off named with what to change, at the first evaluation of real
2- and 3-rank runs and by ``distaff plan --compare RUN_DIR``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distaff.train.core.errors import ConfigError
from distaff.train.plan import cli
from distaff.train.plan.compare import (PEER_WAIT, Row, charge_peer_waits, check_line, device_kind, furthest,
                                        measured_means, rows)
from pretrain_fixtures import metrics, prepare_data, spawn_ranks, torchrun, wait_all, write_config

PLAN = {"data wait": 0.0, "forward": 0.030, "backward": 0.060, "gradient communication": 0.010, "optimizer": 0.005}


@pytest.mark.unit
def test_the_stage_furthest_off_is_named_by_the_seconds_it_costs():
    slow_data = rows(PLAN, {"data_wait": 0.090, "forward": 0.031, "backward": 0.070, "grad_comm": 0.010,
                            "optimizer": 0.005, "other": 0.001})
    assert furthest(slow_data).stage == "data wait"
    line = check_line(0.105, "2xcpu", 1, slow_data)
    assert line.startswith("distaff: plan check: step 0.207 s measured vs 0.105 s planned for 2xcpu (1.97x)")
    assert "furthest off: data wait 90 ms, plan 0: raise data.num_workers, or move the shards to local disk" in line
    # a slower device slows forward and backward alike: named together, as compute
    slow_device = rows(PLAN, {"forward": 0.045, "backward": 0.090, "grad_comm": 0.012, "optimizer": 0.005})
    assert furthest(slow_device).stage == "compute (forward + backward)"
    assert "compute is slower than planned" in check_line(0.105, "3xcpu", 1, slow_device)
    on_plan = rows(PLAN, {"forward": 0.030, "backward": 0.050})
    assert check_line(0.105, "8xA100-80GB", 2, on_plan).endswith("; no stage is slower than planned")
    assert furthest([Row("forward", 0, 1), Row("backward", 0, 1), Row("other", 0, 3)]).stage == "other"


@pytest.mark.unit
def test_on_shared_cores_a_wait_in_communication_is_compute():
    # 3 ranks on 2 cores: rank 0 computes on time by its CPU clock but waits 300 ms in the reduction for a peer
    wall = {"forward": 0.040, "backward": 0.080, "grad_comm": 0.300, "optimizer": 0.025, "other": 0.050}
    cpu = {"forward": 0.025, "backward": 0.050, "grad_comm": 0.004, "optimizer": 0.004, "other": 0.001}
    plain = rows(PLAN, wall)
    assert furthest(plain).stage == "gradient communication"            # what the wall clock alone says
    charged = charge_peer_waits(plain, cpu)
    by_name = {row.stage: row for row in charged}
    # each communication stage keeps the larger of its CPU seconds and its plan (10 ms; "other" is planned at 0)
    assert by_name["gradient communication"].measured_s == pytest.approx(0.010)
    assert by_name["other"].measured_s == pytest.approx(0.001)
    assert by_name["optimizer"].measured_s == pytest.approx(0.005)           # the all-gather's wait (ZeRO 1-2)
    assert by_name[PEER_WAIT].measured_s == pytest.approx(0.290 + 0.049 + 0.020)
    assert sum(row.measured_s for row in charged) == pytest.approx(sum(wall.values()))   # moved, not lost
    assert furthest(charged).stage == "compute (forward + backward)"
    line = check_line(0.105, "3xcpu", 1, charged)
    assert "furthest off: compute (forward + backward) 479 ms, plan 90 ms; 359 ms of it waiting in communication " \
           "for descheduled peers: compute is slower than planned" in line, line
    # cores not shared (the CPU time is most of the wall clock), or a GPU rank: a slow reduction stays the network's
    assert charge_peer_waits(plain, {**cpu, "grad_comm": 0.290, "optimizer": 0.020}) == plain
    assert charge_peer_waits(plain, None) == plain


@pytest.mark.unit
def test_device_names_map_to_the_plans_kinds():
    assert device_kind(None) == "cpu"
    assert device_kind("NVIDIA A100-SXM4-80GB") == "A100-80GB" and device_kind("NVIDIA A100-PCIE-40GB") == "A100-40GB"
    assert device_kind("NVIDIA H100 80GB HBM3") == "H100-SXM" and device_kind("NVIDIA H100 PCIe") == "H100-PCIe"
    assert device_kind("NVIDIA H200") == "H200" and device_kind("Tesla V100-SXM2-32GB") == "V100-32GB"
    with pytest.raises(ConfigError, match="no plan for 'NVIDIA T4'"):
        device_kind("NVIDIA T4")


@pytest.mark.unit
def test_compare_reads_a_run_folder_and_says_what_is_missing(tmp_path, capsys):
    lines = [{"step": 2, "loss": 1.0, "forward_s": 9.0, "backward_s": 9.0, "data_wait_s": 9.0},   # warm-up: left out
             {"step": 4, "loss": 1.0, "forward_s": 0.03, "backward_s": 0.07, "data_wait_s": 0.2, "grad_comm_s": 0.01},
             {"step": 4, "eval_loss": 1.0},
             {"step": 6, "loss": 1.0, "forward_s": 0.05, "backward_s": 0.05, "data_wait_s": 0.4, "grad_comm_s": 0.01}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert measured_means(tmp_path / "metrics.jsonl")[0]["data_wait"] == pytest.approx(0.3)
    assert cli.main(["--compare", str(tmp_path)]) == 2
    assert "plan.json not found; a run writes it at its first evaluation" in capsys.readouterr().err
    for damaged in ('{"gpus": "2xcpu", "nod', "null", json.dumps({"gpus": "2xcpu", "nodes": 1})):   # issue 48
        (tmp_path / "plan.json").write_text(damaged)
        assert cli.main(["--compare", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"distaff plan: {tmp_path / 'plan.json'}") or "not a plan record" in err, err
        assert err.count("\n") == 1, err
    (tmp_path / "plan.json").write_text(json.dumps({"gpus": "2xcpu", "nodes": 1, "plan_stage_seconds": PLAN,
                                                    "plan_step_total_s": 0.105}))
    assert cli.main(["--compare", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "| data wait | 0.0 | 300.0 | - |" in out and "| backward | 60.0 | 60.0 | 1.00 |" in out
    assert out[-1].startswith("distaff: plan check: ") and "furthest off: data wait 300 ms, plan 0" in out[-1]


def _check_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("distaff: plan check:")]


@pytest.mark.integration
def test_real_runs_name_a_slow_data_source_and_an_oversubscribed_cpu(sample_data, tmp_path):
    data = prepare_data(tmp_path / "data", sample_data)
    checks = {"eval": {"every": 4, "batches": 2}, "train": {"max_steps": 4}}
    slow = write_config(tmp_path / "slow.yaml", data, tmp_path / "slow", **checks)
    procs = spawn_ranks(slow, tmp_path, program=(str(Path(__file__).parents[1] / "support" / "slow_data_rank.py"),),
                        env={"SLOW_DATA_S": "1.0", "LOCAL_WORLD_SIZE": "2"})
    assert wait_all(procs, timeout=300) == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    line = _check_lines((tmp_path / "rank0.log").read_text())
    assert len(line) == 1 and "furthest off: data wait 1,0" in line[0] and "raise data.num_workers" in line[0], line
    assert all(r["data_wait_s"] > 0.9 for r in metrics(tmp_path / "slow") if "forward_s" in r)
    # 3 ranks on this 2-core machine: each plans a core of its own and gets two thirds of one
    crowded = write_config(tmp_path / "crowded.yaml", data, tmp_path / "crowded", **checks)
    done = torchrun(crowded, tmp_path, timeout=300, ranks=3)
    assert done.returncode == 0, done.stderr[-3000:]
    line = _check_lines(done.stdout)
    # gloo's waits for a descheduled rank are that rank's compute: the line names compute and the shared cores
    assert len(line) == 1 and "furthest off: compute (forward + backward)" in line[0], line
    assert "more ranks than cores, share its cores" in line[0], line
    assert cli.main(["--compare", str(tmp_path / "crowded")]) == 0
