"""Faults on 2 CPU ranks: a crash in the middle of a checkpoint save, and a rank killed mid-training."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from crash_during_save import CRASH_EXIT_CODE
from pretrain_fixtures import prepare_data, spawn_ranks, train_losses, wait_all, wait_for_step, write_config

from distaff.train.run.weights import fp32_state_dict

pytestmark = pytest.mark.integration


def _log(tmp: Path) -> str:
    return "\n".join(f"--- rank{r}.log\n" + (tmp / f"rank{r}.log").read_text()[-4000:] for r in (0, 1))


@pytest.mark.timeout(300)
def test_crash_during_save_keeps_the_previous_checkpoint(sample_data, tmp_path_factory, tmp_path):
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", data, run_dir, train={"max_steps": 9},
                          checkpoint={"every": 3, "keep": 3})
    crash_at_step_6 = (str(Path(__file__).with_name("crash_during_save.py")), "6")
    procs = spawn_ranks(config, tmp_path, program=crash_at_step_6)
    assert wait_all(procs, timeout=180) == [CRASH_EXIT_CODE, CRASH_EXIT_CODE], _log(tmp_path)

    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-00000003"
    assert (ckpts / ".partial-step-00000006").is_dir()         # the interrupted save, never published
    assert not (ckpts / "step-00000006").exists()
    weights = fp32_state_dict(ckpts / "step-00000003")         # the previous checkpoint is whole
    assert weights and all(t.isfinite().all() for t in weights.values())

    procs = spawn_ranks(config, tmp_path)                      # resume=auto picks step 3
    assert wait_all(procs, timeout=180) == [0, 0], _log(tmp_path)
    assert f"resuming from {ckpts / 'step-00000003'}" in (tmp_path / "rank0.log").read_text()
    assert sorted(train_losses(run_dir)) == list(range(1, 10))
    assert not list(ckpts.glob(".partial-*"))                   # leftovers cleaned up
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000003", "step-00000006", "step-00000009"]
    assert json.loads((ckpts / "step-00000009" / "distaff" / "meta.json").read_text())["step"] == 9


@pytest.mark.serial
@pytest.mark.timeout(200)
def test_killed_rank_makes_the_job_fail_within_the_timeout(sample_data, tmp_path_factory, tmp_path):
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    timeout_s = 30
    config = write_config(tmp_path / "run.yaml", data, tmp_path / "run", train={"max_steps": 100000},
                          distributed={"timeout_s": timeout_s})
    procs = spawn_ranks(config, tmp_path)
    wait_for_step(tmp_path / "run", 2, procs)
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    code = procs[0].wait(timeout=timeout_s + 60)
    elapsed = time.monotonic() - killed_at
    procs[1].wait()
    log = (tmp_path / "rank0.log").read_text()
    assert code != 0, log
    assert elapsed < timeout_s + 30, f"rank 0 took {elapsed:.0f} s to notice"
    assert "distaff pretrain: rank 0: failed" in log
