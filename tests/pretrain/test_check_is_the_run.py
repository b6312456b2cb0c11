"""``--check`` is the run's own validation (issue 41): every bad input the fourth red-team pass found ``--check``
passing and the run then failing on is refused by both, with the same one line, and the run refuses before it
builds an engine. The real runs are single-rank processes started together (each fails in seconds); ``--check``
runs in this process. Also: ``--check`` never runs a ``pipe:`` data dir's command, and an override may follow
``--check``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from finetune_fixtures import tiny_model, write_ft_config
from pretrain_fixtures import PYTHON, prepare_data, rank_env, wait_all, write_config

from distaff.train.finetune.trainer import main as finetune_main
from distaff.train.pretrain.trainer import main as pretrain_main

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _threads_chosen(monkeypatch):
    """--check runs in this process: the thread share chosen, so no "other processes keep N cores busy" line."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _edited_data(data: Path, target: Path, file: str, old: str, new: str) -> Path:
    copy = shutil.copytree(data, target)
    path = copy / file
    text = path.read_text()
    assert old in text, (file, old)
    path.write_text(text.replace(old, new, 1))
    return copy


# name -> (the file of the data dir edited, the text replaced, its replacement, the message both must give)
DATA_EDITS = {
    "dtype object": ("manifest.json", '"uint16"', '"object"', "dtype 'object' is not a token dtype"),
    "seq_len 0": ("manifest.json", '"seq_len": 64', '"seq_len": 0', "seq_len: expected a whole number >= 3"),
    "seq_len -64": ("manifest.json", '"seq_len": 64', '"seq_len": -64', "seq_len: expected a whole number >= 3"),
    "mask id outside the vocabulary": ("tokenizer/distaff_tokenizer.json", '"mask": 4', '"mask": 5000',
                                       "special_ids.mask: expected a whole number >= 0 and <= 999, got 5000"),
    "shards of another dtype": ("manifest.json", '"uint16"', '"int32"', "dtype uint16 but the manifest says int32"),
}


def _pretrain_cases(data: Path, tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (overrides, the message both must give)."""
    cases = {}
    for name, (file, old, new, message) in DATA_EDITS.items():
        edited = _edited_data(data, tmp / name.replace(" ", "-"), file, old, new)
        cases[name] = ([f"data.dir={edited}"], message)
    return cases


def _spawn(module: str, config: Path, tmp: Path, name: str, overrides: list[str]) -> subprocess.Popen:
    log = open(tmp / f"{name.replace(' ', '-')}.log", "w")
    return subprocess.Popen([PYTHON, "-m", module, "--config", str(config), *overrides], env=rank_env(tmp),
                            stdout=log, stderr=subprocess.STDOUT, cwd=tmp)


def test_check_refuses_what_the_run_refuses(sample_data, tmp_path_factory, tmp_path, capsys):
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    config = write_config(tmp_path / "run.yaml", data, tmp_path / "run", train={"max_steps": 2})
    cases = _pretrain_cases(data, tmp_path)
    ft_config = write_ft_config(tmp_path / "ft.yaml", tiny_model(tmp_path_factory.getbasetemp()), tmp_path / "ft",
                                data={"label_names": {"0": "negative", "7": "unheard-of"}})
    runs = {name: _spawn("distaff.train.pretrain", config, tmp_path, name, [*overrides, f"run.out_dir={tmp_path / name}"])
            for name, (overrides, _) in cases.items()}
    runs["label_names"] = _spawn("distaff.train.finetune", ft_config, tmp_path, "label_names", [])
    cases["label_names"] = ([], r"data.label_names: ['7'] is not a label of the data")
    for name, (overrides, message) in cases.items():       # --check, here, while the runs start
        main = finetune_main if name == "label_names" else pretrain_main
        assert main(["--config", str(ft_config if name == "label_names" else config), "--check", *overrides]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and message in err, (name, err)
    codes = dict(zip(runs, wait_all(list(runs.values()), timeout=300)))
    for name, (_, message) in cases.items():
        log = (tmp_path / f"{name.replace(' ', '-')}.log").read_text()
        assert codes[name] == 2 and message in log and "Traceback" not in log, (name, log[-2000:])
        assert "starting a new run" not in log and "DeepSpeed" not in log, (name, log[-2000:])   # before the engine


def test_check_runs_no_pipe_command_and_says_so(sample_data, tmp_path_factory, tmp_path, capsys):
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    marker = tmp_path / "the-command-ran"
    pipe = f"pipe:touch {marker} && cat {data}/{{path}}"
    config = write_config(tmp_path / "run.yaml", data, tmp_path / "run", train={"max_steps": 2})
    assert pretrain_main(["--config", str(config), f"data.dir={pipe}", "--check"]) == 0
    out = capsys.readouterr().out
    assert "is remote and was not read (--check runs no command and fetches nothing)" in out, out
    assert not marker.exists()
    # the run itself reads through the command: the same data, remote
    run = subprocess.run([PYTHON, "-m", "distaff.train.pretrain", "--config", str(config), f"data.dir={pipe}",
                          "train.max_steps=1", "checkpoint.every=0"], env=rank_env(tmp_path), cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert marker.exists()


def test_an_override_may_follow_check_in_pretrain_and_finetune(sample_data, tmp_path_factory, tmp_path, capsys):
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    config = write_config(tmp_path / "run.yaml", data, tmp_path / "run", train={"max_steps": 2})
    ft_config = write_ft_config(tmp_path / "ft.yaml", tiny_model(tmp_path_factory.getbasetemp()), tmp_path / "ft")
    for main, path, prog in ((pretrain_main, config, "pretrain"), (finetune_main, ft_config, "finetune")):
        assert main(["--config", str(path), "run.seed=5", "--check", "train.max_steps=3"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"distaff {prog}: OK: ") and re.search(r"; 3 steps", out), out
        assert main(["--config", str(path), "--check", "optim.lr=-1"]) == 2
        assert "optim.lr" in capsys.readouterr().err


def test_a_checkpoints_meta_json_is_verified_and_a_missing_field_differs(sample_data, tmp_path_factory, tmp_path,
                                                                          capsys):
    """The red-team cases: editing meta.json's format number turned verification off, so export wrote altered
    weights with exit 0; a model field missing from it was never compared, so --check said OK for 4 -> 2 layers."""
    from distaff.train.run.checkpoint_files import FILES, META, write_file_list
    from distaff.train.tools.export import main as export_main

    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    config = write_config(tmp_path / "run.yaml", data, tmp_path / "run", train={"max_steps": 1},
                          zero={"stage": 0})
    run = subprocess.run([PYTHON, "-m", "distaff.train.pretrain", "--config", str(config)], env=rank_env(tmp_path),
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    step = tmp_path / "run" / "checkpoints" / "step-00000001"
    assert META.as_posix() in json.loads((step / FILES).read_text())
    text = (step / META).read_text()
    meta = json.loads(text)
    (step / META).write_text(text.replace('"format": 4', '"format": 2'))          # "turns verification off"
    assert export_main([str(step), str(tmp_path / "hf")]) == 2
    assert "distaff/meta.json has changed since it was saved" in capsys.readouterr().err
    assert pretrain_main(["--config", str(config), "--check", "train.max_steps=2"]) == 0
    out = capsys.readouterr().out
    assert f"skipping checkpoint {step}: distaff/meta.json has changed" in out and "a new run in" in out, out
    # a checkpoint whose meta.json lacks num_hidden_layers (listed as saved): a difference, for --check and the run
    del meta["model_config"]["num_hidden_layers"]
    (step / META).write_text(json.dumps(meta))
    write_file_list(step)
    overrides = ["model.num_hidden_layers=1", "train.max_steps=2"]
    assert pretrain_main(["--config", str(config), "--check", *overrides]) == 2
    err = capsys.readouterr().err
    assert re.search(r"model.num_hidden_layers: missing \(default \d+\) in checkpoint .*, 1 in this run", err), err
    resumed = subprocess.run([PYTHON, "-m", "distaff.train.pretrain", "--config", str(config), *overrides],
                             env=rank_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 2 and "model.num_hidden_layers: missing (default" in resumed.stderr, resumed.stderr
    assert "Traceback" not in resumed.stderr and "DeepSpeed" not in resumed.stdout + resumed.stderr
