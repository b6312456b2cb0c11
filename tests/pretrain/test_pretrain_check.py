"""What a resumed run may not change, refused before any engine is built (train/run/resume_check.py), and the
commands that look at a run without training it: ``distaff pretrain --check`` and ``--print-config``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from pretrain_fixtures import prepare_data, rank_logs, spawn_ranks, torchrun, run_log, wait_all, write_config

from distaff.train.pretrain.trainer import load_run_config, main
from distaff.train.run.config import config_to_dict

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def finished(sample_data, tmp_path_factory) -> tuple[Path, Path]:
    """A finished 2-step, 2-rank run (its checkpoint at step 2) and its config."""
    base = tmp_path_factory.mktemp("check")
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    config = write_config(base / "run.yaml", data, base / "run", train={"max_steps": 2, "precision": "fp32"})
    proc = torchrun(config, base)
    assert proc.returncode == 0, run_log(proc)
    return base / "run", config


def _check(config: Path, capsys, *overrides: str) -> tuple[int, str, str]:
    code = main(["--config", str(config), "--check", *overrides])
    out, err = capsys.readouterr()
    return code, out.strip(), err.strip()


def test_print_config_is_the_resolved_config_as_yaml(finished, capsys):
    _, config = finished
    assert main(["--config", str(config), "--print-config", "optim.lr=0.5"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == config_to_dict(load_run_config(str(config), ["optim.lr=0.5"])) and printed["optim"]["lr"] == 0.5


def test_check_says_what_a_run_would_do_without_training(finished, capsys, tmp_path):
    run, config = finished
    listing = sorted(p.name for p in run.rglob("*"))
    code, out, err = _check(config, capsys)
    assert code == 0 and err == "" and out.startswith("distaff pretrain: OK: ") and len(out.splitlines()) == 1, out
    assert f"resumes from {run / 'checkpoints' / 'step-00000002'}" in out
    code, out, _ = _check(config, capsys, f"run.out_dir={tmp_path / 'new'}")
    assert code == 0 and f"a new run in {tmp_path / 'new'}" in out and not (tmp_path / "new").exists()
    assert sorted(p.name for p in run.rglob("*")) == listing                    # nothing written
    moved = shutil.copytree(load_run_config(str(config), []).data.dir, tmp_path / "moved-data")
    code, out, _ = _check(config, capsys, f"data.dir={moved}")                  # the same data elsewhere: fine
    assert code == 0, out
    code, _, err = _check(config, capsys, "data.dir=/nowhere")
    assert code == 2 and "data.dir" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("change,key", [
    ("model.hidden_size=32", "model.hidden_size: 64 in checkpoint"),
    ("run.seed=8", "run.seed: 7 in checkpoint"),
    ("zero.stage=0", "zero.stage: 2 in checkpoint"),
    ("train.objective=rtd", "train.objective: 'mlm' in checkpoint"),
    ("other data", "data.dir: the data of checkpoint"),
])
def test_check_refuses_what_a_resume_may_not_change(finished, capsys, sample_data, tmp_path_factory, change, key):
    _, config = finished
    if change == "other data":
        change = f"data.dir={prepare_data(tmp_path_factory.getbasetemp(), sample_data, pack_documents=False)}"
    code, out, err = _check(config, capsys, change)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"distaff pretrain: {key}") and "checkpoint.resume=none" in err, err


def test_a_run_resumed_with_another_seed_is_refused_before_its_engine(finished, tmp_path):
    """Every rank refuses together, exit 2, one line each, before DeepSpeed is started."""
    run, config = finished
    copy = shutil.copytree(run, tmp_path / "run")
    codes = wait_all(spawn_ranks(config, tmp_path, f"run.out_dir={copy}", "run.seed=9", "train.max_steps=4"), 120)
    logs = rank_logs(tmp_path)
    assert codes == [2, 2], logs[-3000:]
    for rank in (0, 1):
        log = (tmp_path / f"rank{rank}.log").read_text()
        assert "run.seed: 7 in checkpoint" in log and "Traceback" not in log, log[-2000:]
        assert "DeepSpeed" not in log and "resuming from" not in log, log[-2000:]
