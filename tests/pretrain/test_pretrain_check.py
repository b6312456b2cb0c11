"""What a resumed run may not change, refused before any engine is built (train/run/resume_check.py), and the
commands that look at a run without training it: ``distaff pretrain --check`` and ``--print-config``."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from pretrain_fixtures import prepare_data, rank_logs, spawn_ranks, torchrun, run_log, wait_all, write_config

from distaff.train.pretrain.trainer import load_run_config, main
from distaff.train.run.checkpoint_files import FILES, META, write_file_list
from distaff.train.tools.export import main as export_main
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
    first, summary = err.splitlines()     # the missing folder on one line, then what went unchecked (exit 2)
    assert code == 2 and first.startswith("distaff pretrain: --check: data.dir: /nowhere does not exist"), err
    assert "not checked without it: " in summary and summary.endswith("(exit 2)"), summary


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


def test_a_checkpoints_meta_json_is_verified_and_a_missing_field_differs(finished, tmp_path, capsys, monkeypatch):
    """Issue 41: editing meta.json's format number turned verification off, so export wrote altered weights with
    exit 0; a model field missing from it was never compared, so --check said OK for a changed layer count and the
    resume failed with a traceback. Now both are refused, by export, --check and the run alike."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run, config = finished
    copy = shutil.copytree(run, tmp_path / "run")
    step = copy / "checkpoints" / "step-00000002"
    assert META.as_posix() in json.loads((step / FILES).read_text())
    text = (step / META).read_text()
    (step / META).write_text(text.replace('"format": 4', '"format": 2'))          # "turns verification off"
    assert export_main([str(step), str(tmp_path / "hf")]) == 2
    assert "distaff/meta.json has changed since it was saved" in capsys.readouterr().err
    code, out, _ = _check(config, capsys, f"run.out_dir={copy}")
    assert code == 0 and f"skipping checkpoint {step}: distaff/meta.json has changed" in out and "a new run" in out
    # a checkpoint whose meta.json lacks num_hidden_layers (recorded in its file list): a difference
    meta = json.loads(text)
    del meta["model_config"]["num_hidden_layers"]
    (step / META).write_text(json.dumps(meta))
    write_file_list(step)
    overrides = [f"run.out_dir={copy}", "model.num_hidden_layers=1", "train.max_steps=4"]
    code, _, err = _check(config, capsys, *overrides)
    assert code == 2 and re.search(r"model.num_hidden_layers: missing \(default \d+\) in checkpoint .*, 1 in this run",
                                   err), err
    codes = wait_all(spawn_ranks(config, tmp_path, *overrides), 120)
    log = (tmp_path / "rank0.log").read_text()
    assert codes == [2, 2] and "model.num_hidden_layers: missing (default" in log, log[-2000:]
    assert "Traceback" not in log and "resuming from" not in log, log[-2000:]
