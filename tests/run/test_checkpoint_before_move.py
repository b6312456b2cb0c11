"""A checkpoint written by the code before the package regrouping (flat ``train/``, commit bda9efe)
resumes after it: the resumed steps' losses are those the old code's uninterrupted run logged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pretrain_fixtures import rank_logs, spawn_ranks, train_losses, wait_all, write_config

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).with_name("fixtures") / "checkpoint-bda9efe"
# The settings the fixture was written with (its README).
MODEL = {"preset": "tiny", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
         "max_position_embeddings": 32, "position_buckets": 8, "emd": True}
SECTIONS = dict(model=MODEL, train={"max_steps": 8}, data={"batch_size": 4}, checkpoint={"every": 4, "keep": 2},
                eval={"every": 0, "batches": 2})


@pytest.mark.timeout(300)
def test_a_checkpoint_from_before_the_move_resumes_exactly(tmp_path):
    shutil.copytree(FIXTURE / "data", tmp_path / "data")
    shutil.copytree(FIXTURE / "run", tmp_path / "run")
    expected = {int(step): loss for step, loss in json.loads((FIXTURE / "losses.json").read_text())["losses"].items()}
    config = write_config(tmp_path / "run.yaml", tmp_path / "data", tmp_path / "run", **SECTIONS)

    procs = spawn_ranks(config, tmp_path)
    assert wait_all(procs, timeout=240) == [0, 0], rank_logs(tmp_path)
    assert f"resuming from {tmp_path / 'run' / 'checkpoints' / 'step-00000004'}" in (tmp_path / "rank0.log").read_text()
    resumed = train_losses(tmp_path / "run")
    assert sorted(resumed) == [5, 6, 7, 8]
    assert resumed == pytest.approx({step: expected[step] for step in (5, 6, 7, 8)}, rel=1e-6, abs=0)
