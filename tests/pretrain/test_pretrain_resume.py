"""Preemption and exact resume on 2 CPU ranks: SIGUSR1 -> checkpoint + exit 75; the resumed run
reproduces the uninterrupted run's per-step losses exactly; W&B keeps the run id."""

from __future__ import annotations

import json

import pytest

from pretrain_fixtures import (metrics, prepare_data, preempted_run, rank_logs, spawn_ranks, train_losses, wait_all,
                               wandb_runs, write_config)

pytestmark = pytest.mark.integration

STEPS = 40
SECTIONS = dict(train={"max_steps": STEPS}, model={"emd": True},   # dropout and EMD on: RNG state matters
                checkpoint={"every": 0, "keep": 2}, eval={"every": 0, "batches": 2})


@pytest.mark.timeout(400)
def test_sigusr1_checkpoints_exits_75_and_resume_is_exact(sample_data, tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    data = prepare_data(base, sample_data)

    full_dir = tmp_path_factory.mktemp("uninterrupted")
    full = spawn_ranks(write_config(full_dir / "run.yaml", data, full_dir / "run", **SECTIONS), full_dir)
    assert wait_all(full, timeout=240) == [0, 0], rank_logs(full_dir)
    expected = train_losses(full_dir / "run")
    assert sorted(expected) == list(range(1, STEPS + 1))

    # Interrupted: SIGUSR1 to rank 1 only; both ranks must stop at the same step boundary.
    tmp = tmp_path_factory.mktemp("interrupted")
    run_dir = tmp / "run"
    config = write_config(tmp / "run.yaml", data, run_dir, **SECTIONS)
    stopped_at, latest = preempted_run(config, tmp, run_dir, after_step=3, signal_rank=1,
                                       env={"WANDB_RUN_ID": "resume-test-1"})
    assert 3 <= stopped_at < STEPS
    meta = json.loads((latest / "distaff" / "meta.json").read_text())
    assert meta["step"] == stopped_at and meta["train_state"]["wandb_run_id"] == "resume-test-1"
    assert sorted(p.name for p in (latest / "distaff").glob("rank-*.json")) == ["rank-00000.json", "rank-00001.json"]

    # Resumed (WANDB_RUN_ID now differs: the checkpoint's id wins).
    procs = spawn_ranks(config, tmp, env={"WANDB_RUN_ID": "some-other-id"})
    assert wait_all(procs, timeout=240) == [0, 0], rank_logs(tmp)
    assert f"resuming from {latest}" in (tmp / "rank0.log").read_text()
    resumed = train_losses(run_dir)
    assert resumed == expected                       # every step, bit-exact (floats compared with ==)

    # W&B: two offline runs with the same id; their history holds exactly the logged metrics.
    runs = wandb_runs(run_dir)
    assert [run_id for run_id, _ in runs] == ["resume-test-1", "resume-test-1"]
    first, second = runs[0][1], runs[1][1]
    assert {s: h["train/loss"] for s, h in first.items() if "train/loss" in h} == \
        {s: expected[s] for s in range(1, stopped_at + 1)}
    assert {s: h["train/loss"] for s, h in second.items() if "train/loss" in h} == \
        {s: expected[s] for s in range(stopped_at + 1, STEPS + 1)}
    final_eval = [r for r in metrics(run_dir) if "eval_loss" in r]
    assert [r["step"] for r in final_eval] == [STEPS]
    assert second[STEPS]["eval/loss"] == final_eval[0]["eval_loss"]
