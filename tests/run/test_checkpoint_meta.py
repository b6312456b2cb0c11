"""A checkpoint's ``meta.json`` is inside what is verified, and what it lacks is a difference (issue 41, cause 3).

Before: ``files.json`` listed every file but ``meta.json``, and a ``format`` below 3 in ``meta.json`` turned the check
off, so editing one number let export write altered weights with exit 0; a model field missing from ``meta.json``
was never compared, so ``--check`` said OK for 4 -> 2 layers and the resume failed with a traceback. Also the weak
case of a save that hits the file-size limit (``ulimit -f``), reported as torch's ``unexpected pos``.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import StepCounter
from distaff.train.data.errors import DataError
from distaff.train.model.config import ModelConfig
from distaff.train.run.checkpoint import Checkpointer, resolve_resume
from distaff.train.run.checkpoint_files import FILES, META, checkpoint_problem, read_meta, write_file_list
from distaff.train.run.resume_check import RunIdentity, check_resumable, resume_problem
from distaff.train.run.weights import find_checkpoint

pytestmark = pytest.mark.unit

MODEL = ModelConfig(vocab_size=100, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                    intermediate_size=64).to_dict()


class _Engine:
    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool) -> None:
        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        (Path(save_dir) / tag / "weights.bin").write_bytes(b"w" * 64)


def _saved(root: Path, *steps: int, model: dict = MODEL) -> list[Path]:
    checkpointer = Checkpointer(root, _Engine(), per_rank={"data": StepCounter()}, shared={},
                                meta={"config": {"run": {"seed": 7}, "zero": {"stage": 2}, "train": {"objective": "mlm"}},
                                      "model_config": model},
                                every=1, keep=5, rank=0, world_size=1, barrier=lambda: None)
    return [checkpointer.save(step) for step in steps]


def _identity(**model) -> RunIdentity:
    return RunIdentity(model={**MODEL, **model}, seed=7, zero_stage=2, objective="mlm",
                       data_problem=lambda state, where: None)


def _edit_meta(folder: Path, old: str, new: str) -> None:
    text = (folder / META).read_text()
    assert old in text
    (folder / META).write_text(text.replace(old, new))


def test_meta_json_is_in_the_file_list_and_its_format_cannot_turn_the_check_off(tmp_path):
    older, newest = _saved(tmp_path, 1, 2)
    assert META.as_posix() in json.loads((newest / FILES).read_text()) and checkpoint_problem(newest) is None
    _edit_meta(newest, '"format": 4', '"format": 2')
    assert checkpoint_problem(newest) == "distaff/meta.json has changed since it was saved (sha256 differs)"
    with pytest.raises(DataError, match="damaged checkpoint: distaff/meta.json has changed"):
        find_checkpoint(newest)                                         # export, model folders, init_from
    said: list[str] = []
    assert resolve_resume("auto", tmp_path, said.append) == older       # resume falls back, and says why
    assert said == [f"distaff: skipping checkpoint {newest}: distaff/meta.json has changed since it was saved "
                    "(sha256 differs)"]


def test_a_checkpoint_without_its_file_list_or_meta_entry_is_refused(tmp_path):
    (folder,) = _saved(tmp_path, 3)
    files = json.loads((folder / FILES).read_text())
    (folder / FILES).write_text(json.dumps({k: v for k, v in files.items() if k != META.as_posix()}))
    assert checkpoint_problem(folder) == ("distaff/meta.json is not in distaff/files.json (every checkpoint of "
                                          "format 4 on lists it)")
    _edit_meta(folder, '"format": 4', '"format": 3')     # a format-3 checkpoint: meta.json written after the list
    assert checkpoint_problem(folder) is None
    (folder / "weights.bin").write_bytes(b"x" * 64)      # and its other files are still verified
    assert checkpoint_problem(folder) == "weights.bin has changed since it was saved (sha256 differs)"
    (folder / FILES).unlink()
    assert checkpoint_problem(folder).startswith("distaff/files.json is missing: without its file list the "
                                                 "checkpoint cannot be verified")


@pytest.mark.parametrize("field, value, message", [
    ("world_size", 0, "world_size: expected a whole number >= 1, got 0"),
    ("step", -1, "step: expected a whole number >= 0, got -1"), ("format", 4.5, "format: expected a whole number"),
])
def test_meta_numbers_are_range_checked_where_read(tmp_path, field, value, message):
    (folder,) = _saved(tmp_path, 1)
    meta = json.loads((folder / META).read_text())
    (folder / META).write_text(json.dumps({**meta, field: value}))
    with pytest.raises(DataError, match=message):
        read_meta(folder)
    (folder / META).write_bytes(b'{"step": 1\xff}')
    with pytest.raises(DataError, match=r"meta.json, line 1, byte 11: byte 0xff is not UTF-8"):
        read_meta(folder)


def test_a_model_field_the_checkpoint_lacks_is_a_difference_not_a_match(tmp_path):
    default_layers = next(f.default for f in dataclasses.fields(ModelConfig) if f.name == "num_hidden_layers")
    lacking = {k: v for k, v in MODEL.items() if k != "num_hidden_layers"}
    (folder,) = _saved(tmp_path, 1, model=lacking)
    assert checkpoint_problem(folder) is None
    problem = resume_problem(folder, _identity(num_hidden_layers=2))
    assert problem.startswith(f"model.num_hidden_layers: missing (default {default_layers}) in checkpoint {folder}, "
                              "2 in this run"), problem
    with pytest.raises(Exception, match="model.num_hidden_layers: missing"):
        check_resumable("auto", tmp_path, _identity(num_hidden_layers=2))
    # a field added after the checkpoint was saved compares as its default: older checkpoints still resume
    assert resume_problem(folder, _identity(num_hidden_layers=default_layers)) is None


def test_a_run_value_the_checkpoint_lacks_is_a_difference(tmp_path):
    (folder,) = _saved(tmp_path, 1)
    meta = json.loads((folder / META).read_text())
    del meta["config"]["run"]["seed"]
    (folder / META).write_text(json.dumps(meta))
    write_file_list(folder)
    assert resume_problem(folder, _identity()).startswith("run.seed: '(missing)' in checkpoint")


def test_a_save_that_hits_the_file_size_limit_is_named_as_such(tmp_path):
    """torch's zip writer under ``ulimit -f`` fails with ``[enforce fail at inline_container.cc] unexpected pos``:
    the save says it reached the file-size limit instead (in a process of its own: the limit is per process)."""
    script = f"""
import resource, sys, torch
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).parents[1] / "support")!r})
from helpers import StepCounter
from distaff.train.run.checkpoint import Checkpointer, CheckpointSaveError

class Engine:
    def save_checkpoint(self, save_dir, tag, save_latest):
        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        torch.save({{"w": torch.zeros(1 << 20)}}, Path(save_dir) / tag / "model.pt")

resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
ckpt = Checkpointer(Path({str(tmp_path)!r}), Engine(), per_rank={{"s": StepCounter()}}, shared={{}}, meta={{}}, every=1,
                    keep=2, rank=0, world_size=1, barrier=lambda: None)
try:
    ckpt.save(1)
except CheckpointSaveError as err:
    print(err)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith(f"a file reached the file-size limit (1,048,576 bytes; `ulimit -f`) under {tmp_path}; "
                                 "raise it (ulimit -f unlimited in the job script)"), run.stdout
    assert "while saving step 1; there is no previous checkpoint" in run.stdout
