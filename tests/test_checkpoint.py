"""Checkpoint bookkeeping that needs no training run: RNG states as JSON, atomic files, finding checkpoints.

The multi-rank save/crash/resume behaviour is covered by test_pretrain_faults.py and test_pretrain_resume.py.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from distaff.train.checkpoint import (META, CheckpointManager, atomic_write_text, capture_rng_state,
                                      restore_rng_state, tag_for_step)


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(1)), float(np.random.randn())


def test_rng_state_round_trips_through_json():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # leave a cached gaussian in numpy's state
    state = json.loads(json.dumps(capture_rng_state()))
    expected = _draws()
    _draws()
    restore_rng_state(state)
    assert _draws() == expected


def test_atomic_write_replaces_whole_files(tmp_path):
    path = tmp_path / "latest"
    atomic_write_text(path, "step-00000001\n")
    atomic_write_text(path, "step-00000002\n")
    assert path.read_text() == "step-00000002\n"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]   # no temporary left behind


def _fake_complete(root, step):
    """A folder that has our completion marker (the DeepSpeed files do not matter for finding)."""
    folder = root / tag_for_step(step)
    (folder / META).parent.mkdir(parents=True)
    (folder / META).write_text(json.dumps({"step": step}))
    return folder


def test_latest_follows_the_marker_and_falls_back_to_the_newest_complete(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2, rank=0, world_size=1, barrier=lambda: None)
    assert manager.resolve("auto") is None
    s2, s4 = _fake_complete(tmp_path, 2), _fake_complete(tmp_path, 4)
    (tmp_path / ".partial-step-00000006" / "distaff").mkdir(parents=True)   # an interrupted save
    atomic_write_text(tmp_path / "latest", "step-00000002\n")
    assert manager.resolve("auto") == s2
    (tmp_path / "latest").write_text("step-00000009\n")                     # marker names a missing folder
    assert manager.resolve("auto") == s4
    (tmp_path / "latest").unlink()
    assert manager.resolve("auto") == s4
    assert manager.resolve("none") is None
    assert manager.resolve(str(s2)) == s2
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        manager.resolve(str(tmp_path / ".partial-step-00000006"))
    manager.remove_partial()
    assert not list(tmp_path.glob(".partial-*"))
    _fake_complete(tmp_path, 8)
    manager._prune()
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000004", "step-00000008"]
