"""Packed training (data.packing=varlen) on 2 CPU ranks under DeepSpeed ZeRO-3, on real text prepared
one paragraph per sequence: it learns, evaluates, counts no padding, and resumes exactly."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from pretrain_fixtures import (SEQ_LEN, metrics, prepare_data, spawn_ranks, train_losses, wait_all, wait_for_step,
                               write_config)

from distaff.train.pretrain.trainer import EXIT_PREEMPTED

pytestmark = pytest.mark.integration

STEPS = 14
BUDGET = 3 * SEQ_LEN  # tokens per micro-batch; with grad_accum 2 the trainer weighs micro-batches by labels
SECTIONS = dict(train={"max_steps": STEPS, "grad_accum": 2}, model={"emd": True}, zero={"stage": 3},
                data={"packing": "varlen", "tokens_per_batch": BUDGET, "batch_size": 2},
                checkpoint={"every": 0, "keep": 2}, eval={"every": 7, "batches": 3})


def _log(tmp: Path) -> str:
    return "\n".join(f"--- rank{r}.log\n" + (tmp / f"rank{r}.log").read_text()[-4000:] for r in (0, 1))


def _run(tmp: Path, data: Path, env: dict | None = None) -> tuple[Path, list]:
    run_dir = tmp / "run"
    return run_dir, spawn_ranks(write_config(tmp / "run.yaml", data, run_dir, **SECTIONS), tmp, env=env)


@pytest.mark.timeout(500)
def test_packed_zero3_run_learns_evaluates_and_resumes_exactly(sample_data, tmp_path_factory):
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data, pack_documents=False)

    full_dir = tmp_path_factory.mktemp("packed-uninterrupted")
    run_dir, procs = _run(full_dir, data)
    assert wait_all(procs, timeout=240) == [0, 0], _log(full_dir)
    expected = train_losses(run_dir)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert sum(expected[s] for s in (12, 13, 14)) < sum(expected[s] for s in (1, 2, 3)) - 1.0, expected
    records = metrics(run_dir)
    train = [r for r in records if "loss" in r]
    assert all(r["padding_fraction"] == 0.0 for r in train)
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [7, 14] and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["packing"] == "varlen" and summary["padding_fraction"] == 0.0
    # every micro-batch holds whole paragraphs within the budget: at most 2 ranks x 2 x 14 budgets,
    # and many more samples than the padded layout's batch_size would give
    assert summary["tokens"] == summary["positions"] <= STEPS * 2 * 2 * BUDGET
    assert summary["samples"] > STEPS * 2 * 2 * 3

    tmp = tmp_path_factory.mktemp("packed-interrupted")
    run_dir, procs = _run(tmp, data)
    wait_for_step(run_dir, 3, procs)
    procs[0].send_signal(signal.SIGUSR1)
    assert wait_all(procs, timeout=120) == [EXIT_PREEMPTED, EXIT_PREEMPTED], _log(tmp)
    stopped_at = max(train_losses(run_dir))
    assert 3 <= stopped_at < STEPS
    _, procs = _run(tmp, data)
    assert wait_all(procs, timeout=240) == [0, 0], _log(tmp)
    assert train_losses(run_dir) == expected          # every step bit-exact after the resume
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert (resumed["tokens"], resumed["samples"]) == (summary["tokens"], summary["samples"])
    assert resumed["eval_loss"] == summary["eval_loss"]
