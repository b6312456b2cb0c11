"""``--check`` is the run's own validation (issue 41): every bad input the fourth red-team pass found ``--check``
passing and the run then failing on is refused by both, with the same one line, and the run refuses before it
builds an engine. The real runs are single-rank processes started together (each fails in seconds); ``--check``
runs in this process, and so do the manifest's other readers (``distaff plan``, ``distaff data verify``). Also:
``--check`` never runs a ``pipe:`` data dir's command, and an override may follow ``--check``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from finetune_fixtures import tiny_model, write_ft_config
from pretrain_fixtures import PYTHON, prepare_data, rank_env, wait_all, write_config

from distaff.launch import cli
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
    model = tiny_model(tmp_path_factory.getbasetemp() / "finetune-model")
    ft_config = write_ft_config(tmp_path / "ft.yaml", model, tmp_path / "ft",
                                data={"label_names": {"0": "negative", "7": "unheard-of"}})
    runs = {name: _spawn("distaff.train.pretrain", config, tmp_path, name,
                         [*overrides, f"run.out_dir={tmp_path / name}"]) for name, (overrides, _) in cases.items()}
    runs["label_names"] = _spawn("distaff.train.finetune", ft_config, tmp_path, "label_names", [])
    cases["label_names"] = ([], r"data.label_names: ['7'] is not a label of the data")
    for name, (overrides, message) in cases.items():       # --check, here, while the runs start
        main = finetune_main if name == "label_names" else pretrain_main
        assert main(["--config", str(ft_config if name == "label_names" else config), "--check", *overrides]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and message in err, (name, err)
    for name, (overrides, message) in list(cases.items())[:3]:     # the manifest's other readers: plan, data verify
        assert cli.main(["plan", "--config", str(config), "--gpus", "1xA100-80GB", *overrides]) == 2
        assert message in capsys.readouterr().err, name
        assert cli.main(["data", "verify", overrides[0].split("=", 1)[1]]) == 1
        assert message in capsys.readouterr().out, name
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
    # the run reads through the command (here it then refuses a model too short for the data, before its engine)
    too_short = ["model.emd=true", "model.max_position_embeddings=32"]
    assert pretrain_main(["--config", str(config), f"data.dir={pipe}", "--check", *too_short]) == 0
    assert not marker.exists()
    run = subprocess.run([PYTHON, "-m", "distaff.train.pretrain", "--config", str(config), f"data.dir={pipe}",
                          *too_short], env=rank_env(tmp_path), cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2 and "model.max_position_embeddings: 32 is shorter than" in run.stderr, run.stderr
    assert marker.exists()


def test_an_override_may_follow_check_in_pretrain_and_finetune(sample_data, tmp_path_factory, tmp_path, capsys):
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    config = write_config(tmp_path / "run.yaml", data, tmp_path / "run", train={"max_steps": 2})
    ft_config = write_ft_config(tmp_path / "ft.yaml", tiny_model(tmp_path_factory.getbasetemp() / "finetune-model"),
                                tmp_path / "ft")
    for main, path, prog in ((pretrain_main, config, "pretrain"), (finetune_main, ft_config, "finetune")):
        assert main(["--config", str(path), "run.seed=5", "--check", "train.max_steps=3"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"distaff {prog}: OK: ") and re.search(r"; 3 steps", out), out
        assert main(["--config", str(path), "--check", "optim.lr=-1"]) == 2
        assert "optim.lr" in capsys.readouterr().err
