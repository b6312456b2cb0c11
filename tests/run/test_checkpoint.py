"""Checkpoint bookkeeping that needs no training run: RNG states as JSON, atomic files, finding checkpoints.

The multi-rank save/crash/resume behaviour is covered by test_pretrain_faults.py and test_pretrain_resume.py.
"""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch

from distaff.train.run.checkpoint import (FORMAT_VERSION, META, Checkpointer, RNGState, latest_checkpoint, prune, remove_partial,
                                      resolve_resume, tag_for_step)
from distaff.train.core.files import atomic_write_text
from distaff.train.run.checkpoint_files import write_file_list
from distaff.train.data.errors import DataError

pytestmark = pytest.mark.unit


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(1)), float(np.random.randn())


def test_rng_state_round_trips_through_json():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # leave a cached gaussian in numpy's state
    state = json.loads(json.dumps(RNGState().state_dict()))
    expected = _draws()
    _draws()
    RNGState().load_state_dict(state)
    assert _draws() == expected


def test_atomic_write_replaces_whole_files(tmp_path):
    path = tmp_path / "latest"
    atomic_write_text(path, "step-00000001\n")
    atomic_write_text(path, "step-00000002\n")
    assert path.read_text() == "step-00000002\n"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]   # no temporary left behind


def _fake_complete(root, step):
    """A folder that has our completion marker and its file list (the DeepSpeed files do not matter for finding)."""
    folder = root / tag_for_step(step)
    (folder / META).parent.mkdir(parents=True)
    (folder / META).write_text(json.dumps({"format": FORMAT_VERSION, "step": step, "world_size": 1}))
    write_file_list(folder)
    return folder


def test_latest_follows_the_marker_and_falls_back_to_the_newest_complete(tmp_path):
    assert resolve_resume("auto", tmp_path / "not-yet") is None
    assert resolve_resume("auto", tmp_path) is None
    s2, s4 = _fake_complete(tmp_path, 2), _fake_complete(tmp_path, 4)
    (tmp_path / ".partial-step-00000006" / "distaff").mkdir(parents=True)   # an interrupted save
    atomic_write_text(tmp_path / "latest", "step-00000002\n")
    assert resolve_resume("auto", tmp_path) == s2
    (tmp_path / "latest").write_text("step-00000009\n")                     # marker names a missing folder
    assert resolve_resume("auto", tmp_path) == s4
    (tmp_path / "latest").unlink()
    assert resolve_resume("auto", tmp_path) == s4
    assert resolve_resume("none", tmp_path) is None
    assert resolve_resume(str(s2), tmp_path) == s2
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        resolve_resume(str(tmp_path / ".partial-step-00000006"), tmp_path)
    remove_partial(tmp_path)
    assert not list(tmp_path.glob(".partial-*"))
    _fake_complete(tmp_path, 8)
    prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000004", "step-00000008"]


@pytest.mark.parametrize("marker", ["../../other/checkpoints/step-00000040", "step-00000040"])
def test_latest_naming_a_checkpoint_outside_the_run_is_refused(tmp_path, marker):
    """A ``latest`` that leads out of the run (a path, or a step-* link to another run) is refused, not resumed."""
    root = tmp_path / "run" / "checkpoints"
    _fake_complete(root, 8)
    outside = _fake_complete(tmp_path / "other" / "checkpoints", 40)
    if "/" not in marker:
        (root / marker).symlink_to(outside, target_is_directory=True)
    (root / "latest").write_text(marker + "\n")
    for find in (lambda: latest_checkpoint(root), lambda: resolve_resume("auto", root)):
        with pytest.raises(DataError, match=rf"{re.escape(str(root / 'latest'))}: names {re.escape(repr(marker))}, "
                                            rf"which is not a checkpoint folder inside {re.escape(str(root))}"):
            find()


def test_a_nul_byte_in_latest_is_one_line(tmp_path):
    """Path.resolve raises ValueError on a NUL byte: the marker is checked before any path is made of it."""
    root = tmp_path / "checkpoints"
    _fake_complete(root, 8)
    (root / "latest").write_bytes(b"step-00\x0000008\n")
    with pytest.raises(DataError, match=r"latest: names 'step-00\\x0000008', which is not a checkpoint folder"):
        latest_checkpoint(root)


class _FakeEngine:
    """Stands in for DeepSpeed, whose own files are not what these tests are about."""

    def __init__(self) -> None:
        self.saves = 0

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool) -> None:
        self.saves += 1

    def load_checkpoint(self, load_dir: str, tag: str, **options) -> tuple[str, dict]:
        return load_dir, {}


class _Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def _checkpointer(root, engine, per_rank, shared) -> Checkpointer:
    return Checkpointer(root, engine, per_rank={"position": per_rank}, shared={"totals": shared}, meta={"run": "t"},
                        every=3, keep=2, rank=0, world_size=1, barrier=lambda: None)


def test_checkpointer_saves_on_schedule_signal_and_last_step_once_and_restores(tmp_path):
    engine, position, totals = _FakeEngine(), _Counter(), _Counter()
    checkpointer = _checkpointer(tmp_path, engine, position, totals)
    for step in range(1, 8):
        position.value, totals.value = step, 10 * step
        checkpointer.maybe_save(step, signalled=step == 5)
    checkpointer.maybe_save(7, last=True)
    checkpointer.maybe_save(7, last=True)
    assert engine.saves == 4                                               # steps 3, 5, 6 and 7
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000006", "step-00000007"]
    meta = json.loads((tmp_path / "step-00000007" / META).read_text())
    assert (meta["step"], meta["run"], meta["totals"]) == (7, "t", {"value": 70})

    restored_position, restored_totals = _Counter(), _Counter()
    resumed = _checkpointer(tmp_path, _FakeEngine(), restored_position, restored_totals)
    assert resumed.restore_chosen(resolve_resume("auto", tmp_path)) == tmp_path / "step-00000007"
    assert (restored_position.value, restored_totals.value) == (7, 70)
    resumed.maybe_save(7, last=True)                                       # already saved: nothing to do
    assert resumed.engine.saves == 0


@pytest.mark.parametrize("damage", ["truncate", "delete", "flip"])
def test_resume_auto_skips_a_damaged_newest_checkpoint_and_prune_keeps_the_good_one(tmp_path, damage):
    engine, position, totals = _FakeEngine(), _Counter(), _Counter()
    checkpointer = _checkpointer(tmp_path, engine, position, totals)
    for step in (3, 6):
        position.value = step
        checkpointer.save(step)
    rank_file = tmp_path / "step-00000006" / "distaff" / "rank-00000.json"
    text = rank_file.read_text()
    if damage == "delete":
        rank_file.unlink()
    else:
        rank_file.write_text(text[:-3] if damage == "truncate" else text.replace("6", "7"))
    messages: list[str] = []
    assert resolve_resume("auto", tmp_path, messages.append) == tmp_path / "step-00000003"
    assert messages == [f"distaff: skipping checkpoint {tmp_path / 'step-00000006'}: distaff/rank-00000.json "
                        + {"delete": "is missing", "truncate": f"is {len(text) - 3} bytes, {len(text)} when saved "
                           "(truncated?)", "flip": "has changed since it was saved (sha256 differs)"}[damage]]
    with pytest.raises(FileNotFoundError, match="damaged checkpoint: distaff/rank-00000.json"):
        resolve_resume(str(tmp_path / "step-00000006"), tmp_path)
    prune(tmp_path, keep=1)                     # the newest is damaged: the older good one must stay
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000003", "step-00000006"]
