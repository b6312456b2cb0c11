"""Damaged or crafted DeepSpeed checkpoints (real 2-rank runs): ``resume=auto`` falls back past a truncated
or deleted file to the newest sound checkpoint, no checkpoint file is ever unpickled (resume and export), and
export leaves a non-empty folder alone unless told to overwrite it."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from helpers import CreatesMarker
from pretrain_fixtures import prepare_data, run_log, torchrun, train_losses, write_config

from distaff.train.run.checkpoint_files import write_file_list
from distaff.train.tools.export import main as export_main

pytestmark = pytest.mark.integration

MODEL_STATES = "mp_rank_00_model_states.pt"
OPTIM_STATES = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def _two_checkpoints(base: Path, sample_data: Path) -> Path:
    """A finished 8-step run with checkpoints at steps 4 and 8 (cached per session; tests damage copies)."""
    run = base / "two-checkpoints-run"
    if not (run / "checkpoints" / "step-00000008").is_dir():
        data = prepare_data(base, sample_data)
        config = write_config(base / "two-checkpoints.yaml", data, run, train={"max_steps": 8},
                              checkpoint={"every": 4, "keep": 2})
        proc = torchrun(config, base)
        assert proc.returncode == 0, run_log(proc)
    return run


def _copy(run: Path, tmp: Path, sample_data: Path, max_steps: int = 10) -> tuple[Path, Path]:
    """A copy of the run and a config that resumes it to ``max_steps``."""
    copy = shutil.copytree(run, tmp / "run")
    data = prepare_data(run.parent, sample_data)
    return copy, write_config(tmp / "resume.yaml", data, copy, train={"max_steps": max_steps},
                              checkpoint={"every": 4, "keep": 2})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_resume_auto_falls_back_past_a_damaged_newest_checkpoint(damage, sample_data, tmp_path_factory, tmp_path):
    run = _two_checkpoints(tmp_path_factory.getbasetemp(), sample_data)
    copy, config = _copy(run, tmp_path, sample_data)
    ckpts = copy / "checkpoints"
    victim = ckpts / "step-00000008" / (MODEL_STATES if damage == "truncate" else OPTIM_STATES)
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    else:
        victim.unlink()
    proc = torchrun(config, tmp_path)
    assert proc.returncode == 0, run_log(proc)
    assert f"distaff: skipping checkpoint {ckpts / 'step-00000008'}: {victim.name} " in proc.stdout
    assert f"resuming from {ckpts / 'step-00000004'}" in proc.stdout
    assert sorted(train_losses(copy)) == list(range(1, 11))


@pytest.mark.timeout(300)
def test_resume_refuses_a_pickled_payload(sample_data, tmp_path_factory, tmp_path):
    run = _two_checkpoints(tmp_path_factory.getbasetemp(), sample_data)
    copy, config = _copy(run, tmp_path, sample_data)
    newest, marker = copy / "checkpoints" / "step-00000008", tmp_path / "code-ran"
    torch.save({"module": CreatesMarker(marker)}, newest / MODEL_STATES)
    write_file_list(newest)                     # a crafted checkpoint can carry a matching file list
    proc = torchrun(config, tmp_path)
    assert proc.returncode != 0
    assert f"{newest / MODEL_STATES}: refusing to load" in proc.stdout + proc.stderr, run_log(proc)
    assert not marker.exists()


@pytest.mark.timeout(300)
def test_export_refuses_a_pickled_payload(sample_data, tmp_path_factory, tmp_path, capsys):
    run = _two_checkpoints(tmp_path_factory.getbasetemp(), sample_data)
    newest = shutil.copytree(run / "checkpoints" / "step-00000008", tmp_path / "checkpoints" / "step-00000008")
    marker = tmp_path / "code-ran"
    torch.save({"optimizer_state_dict": CreatesMarker(marker)}, newest / OPTIM_STATES)
    write_file_list(newest)                     # else the file list alone refuses it (test_export)
    assert export_main([str(newest), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "refusing to load" in err and OPTIM_STATES in err
    assert not marker.exists()


@pytest.mark.timeout(300)
def test_export_keeps_a_non_empty_folder_unless_overwrite(sample_data, tmp_path_factory, tmp_path, capsys):
    run = _two_checkpoints(tmp_path_factory.getbasetemp(), sample_data)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("the user's own\n")
    assert export_main([str(run), str(out)]) == 2
    assert f"{out}: exists and is not an empty folder; pass --overwrite" in capsys.readouterr().err
    assert (out / "config.json").read_text() == "the user's own\n"
    umask = os.umask(0o022)
    try:
        assert export_main([str(run), str(out), "--overwrite"]) == 0
    finally:
        os.umask(umask)
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o644   # not safetensors' 0600
    assert (out / "config.json").read_text() != "the user's own\n"


@pytest.mark.timeout(300)
def test_a_pickled_payload_met_while_resizing_is_one_line_on_every_rank(sample_data, tmp_path_factory, tmp_path):
    """The 2-rank checkpoint resumed on 3 ranks goes through rank 0's conversion to a universal checkpoint: the
    refusal reaches every rank as the same line (exit 2), none dies on a closed connection, no code runs."""
    from pretrain_fixtures import spawn_ranks, wait_all

    run = _two_checkpoints(tmp_path_factory.getbasetemp(), sample_data)
    copy, config = _copy(run, tmp_path, sample_data)
    newest, marker = copy / "checkpoints" / "step-00000008", tmp_path / "code-ran"
    torch.save({"optimizer_state_dict": CreatesMarker(marker)}, newest / OPTIM_STATES)
    write_file_list(newest)                     # a crafted checkpoint can carry a matching file list
    codes = wait_all(spawn_ranks(config, tmp_path, world_size=3), timeout=240)
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(3)]
    assert codes == [2, 2, 2], "\n".join(logs)[-4000:]
    for rank, log in enumerate(logs):
        errors = [line for line in log.splitlines() if line.startswith("distaff pretrain:")]
        assert len(errors) == 1 and f"rank {rank}: " in errors[0] and "refusing to load" in errors[0], log[-2000:]
        assert OPTIM_STATES in errors[0] and "Traceback" not in log
    assert not marker.exists()
