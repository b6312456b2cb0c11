"""What a new user meets on a first run: a bad ``data.dir`` is one line before anything is created; re-running a
finished run says how to continue instead of evaluating again; a small held-out split is named with its
count; the corpus commands report progress in a log."""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from distaff.launch.cli import main as distaff_main
from distaff.train.core import threads
from distaff.train.core.progress import ProgressLines
from distaff.train.pretrain.trainer import load_run_config
from distaff.train.run.config import ConfigError
from pretrain_fixtures import PYTHON, metrics, prepare_data, rank_env, spawn_ranks, wait_all, rank_logs, write_config

DISTAFF = str(Path(PYTHON).with_name("distaff"))


@pytest.mark.unit
def test_a_missing_data_dir_or_manifest_is_a_config_error_naming_the_key_and_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"^data.dir: {tmp_path}/nosuch does not exist; set data.dir to a folder "
                                          r"written by `distaff data prepare"):
        load_run_config("tiny-cpu", ["data.dir=nosuch"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=rf"^data.dir: {tmp_path}/empty holds no manifest.json;"):
        load_run_config("tiny-cpu", ["data.dir=empty"])


@pytest.mark.unit
@pytest.mark.parametrize("command, preset", [("pretrain", "tiny-cpu"), ("finetune", "sentiment-cpu")])
def test_print_config_with_check_prints_then_checks(tmp_path, monkeypatch, capsys, command, preset):
    """Issue 48: given both, --check was skipped silently (exit 0 with the config alone); now the config is printed,
    then checked, and the exit status is the check's."""
    monkeypatch.chdir(tmp_path)
    assert distaff_main([command, "--config", preset, "--print-config", "--check"]) == 2
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["run"]["name"] and "note:" not in err
    assert err.splitlines()[-1].startswith(f"distaff {command}: --check: the config is valid; not checked without")
    assert not list(tmp_path.iterdir())                # nothing written


@pytest.mark.unit
def test_a_preset_reads_before_its_data_exists_and_inspecting_says_nothing_of_the_load(tmp_path, monkeypatch, capsys):
    """--print-config prints a preset whose inputs are not there yet and notes each (exit 0); --check names them and
    the checks that could not run (exit 2: the run would stop on the same line). On a busy machine, where a
    trainer says how many threads it leaves the others, neither says a word about it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "busy_cores", lambda *_: 1.9)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    before = torch.get_num_threads()
    try:
        threads.configure_threads({})                      # what a trainer would say here
        assert "other processes keep 1.9 of the 2 cores busy" in capsys.readouterr().err
        data = f"data.dir: {tmp_path}/data/deberta-v3-large does not exist; set data.dir to a folder written by " \
               "`distaff data prepare ... --out DIR`"
        assert distaff_main(["pretrain", "--config", "deberta-v3-large", "--print-config"]) == 0
        out, err = capsys.readouterr()
        assert yaml.safe_load(out)["model"] == {"preset": "deberta-v3-large", "emd": True}
        assert err == f"distaff pretrain: note: {data}\n"
        assert distaff_main(["pretrain", "--config", "deberta-v3-large", "--check"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.splitlines() == [
            f"distaff pretrain: --check: {data}",
            "distaff pretrain: --check: the config is valid; not checked without it: the data (manifest, tokenizer, "
            "shards), the model against the data, the schedule's sources and phases, a checkpoint to resume; a run "
            "would stop on the same line (exit 2)"]
        assert distaff_main(["finetune", "--config", "sentiment-cpu", "--print-config"]) == 0
        out, err = capsys.readouterr()
        assert yaml.safe_load(out)["model"]["init_from"] == "runs/demo/run"
        assert err.splitlines() == [
            f"distaff finetune: note: model.init_from: {tmp_path}/runs/demo/run does not exist; set it to a "
            "pretraining run's folder (scripts/demo.sh writes runs/demo/run), one of its checkpoints or a Hugging "
            "Face model folder",
            f"distaff finetune: note: data.train: {tmp_path}/data/movie-snippets.tsv.gz does not exist"]
        assert distaff_main(["finetune", "--config", "sentiment-cpu", "--check"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 3 and "not checked without them: the encoder" in err
        assert not list(tmp_path.iterdir())                # nothing written
    finally:
        torch.set_num_threads(before)


@pytest.mark.integration
def test_the_installed_command_runs_a_preset_from_any_folder_and_names_a_bad_data_dir(tmp_path):
    """`distaff pretrain --config tiny-cpu` from a folder that is not the repository: the preset is found, its
    data.dir is not, and that is one line, exit 2, before a run folder (and its lock file) exists."""
    proc = subprocess.run([DISTAFF, "pretrain", "--config", "tiny-cpu"], env=rank_env(tmp_path), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"distaff pretrain: data.dir: {tmp_path}/runs/data/austen does not exist; set data.dir to a "
        f"folder written by `distaff data prepare ... --out DIR`"]
    assert list(tmp_path.iterdir()) == []             # no runs/tiny-cpu/ holding only a lock file


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_rerunning_a_finished_run_says_how_to_continue_without_evaluating_again(sample_data, tmp_path_factory,
                                                                                  tmp_path):
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    out = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", data, out, train={"max_steps": 6}, eval={"every": 3, "batches": 2})
    assert wait_all(spawn_ranks(config, tmp_path), timeout=240) == [0, 0], rank_logs(tmp_path)
    first = (tmp_path / "rank0.log").read_text()
    # a few hundred held-out tokens per evaluation: said once, by rank 0, with the count
    assert first.count("distaff: warning: the held-out evaluation scored only") == 1
    assert "scored only" not in (tmp_path / "rank1.log").read_text()
    records, summary = metrics(out), (out / "summary.json").read_text()

    assert wait_all(spawn_ranks(config, tmp_path), timeout=240) == [0, 0], rank_logs(tmp_path)
    again = (tmp_path / "rank0.log").read_text()
    assert (f"distaff: {out} is finished: its latest checkpoint is at step 6, train.max_steps=6; raise "
            f"train.max_steps to continue it") in again
    assert "eval step" not in again and "starting" not in again and "resuming" not in again
    assert metrics(out) == records and (out / "summary.json").read_text() == summary
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1    # no W&B run opened for nothing
    assert "changed since that run finished" not in again

    # a changed learning rate is not silently ignored: the rerun names it and what to do instead
    changed = write_config(tmp_path / "run.yaml", data, out, train={"max_steps": 6}, eval={"every": 3, "batches": 2},
                           optim={"lr": 1e-3, "warmup_steps": 2})
    assert wait_all(spawn_ranks(changed, tmp_path), timeout=240) == [0, 0], rank_logs(tmp_path)
    third = (tmp_path / "rank0.log").read_text()
    assert ("distaff: warning: changed since that run finished, and applied to nothing (it trains no further step): "
            "optim.lr: 0.003 -> 0.001. To train with them, start a new run (another run.out_dir)") in third, third
    assert metrics(out) == records and (out / "summary.json").read_text() == summary


@pytest.mark.integration
def test_prepare_names_a_small_held_out_split_and_reports_progress_in_a_log(corpus_files, tokenizer_dir, tmp_path,
                                                                           capsys):
    out = tmp_path / "data"
    assert distaff_main(["data", "prepare", "--input", str(corpus_files[2]), "--tokenizer", str(tokenizer_dir),
                         "--seq-len", "64", "--out", str(out), "--heldout-fraction", "0.01", "--workers", "1",
                         "--shard-mb", "0.1"]) == 0
    heldout = json.loads((out / "manifest.json").read_text())["splits"]["heldout"]
    err = capsys.readouterr().err       # not a terminal: lines, not a bar
    assert "distaff data prepare: tokenized: 0.2 MB of text, 3 blocks in" in err
    assert (f"distaff data prepare: warning: the held-out split has only {heldout['tokens']:,} tokens "
            f"({heldout['samples']} sequences), too few for steady held-out loss and accuracy; raise "
            f"--heldout-fraction to hold out 20,000 tokens or more") in err


@pytest.mark.integration
def test_tokenizer_training_reports_what_it_read(corpus_files, tmp_path, capsys):
    assert distaff_main(["tokenizer", "train", "--input", str(corpus_files[2]), "--vocab-size", "500", "--out",
                         str(tmp_path / "tok")]) == 0
    lines = sum(1 for line in corpus_files[2].read_text().splitlines() if line.strip())
    assert f"read; training the unigram model: 0.2 MB of text, {lines:,} lines in" in capsys.readouterr().err


@pytest.mark.unit
def test_progress_lines_come_every_interval_and_at_the_end():
    now = [0.0]
    stream = io.StringIO()
    progress = ProgressLines("distaff x", "blocks", every_s=30, stream=stream, clock=lambda: now[0])
    for _ in range(10):                 # 10 blocks of 1 MB, 10 s apart: a line at 30 s and at 60 s
        now[0] += 10
        progress.add(1_000_000)
    progress.done()
    assert stream.getvalue().splitlines() == [
        "distaff x: so far: 3.0 MB of text, 3 blocks in 30 s (0.10 MB/s)",
        "distaff x: so far: 6.0 MB of text, 6 blocks in 60 s (0.10 MB/s)",
        "distaff x: so far: 9.0 MB of text, 9 blocks in 90 s (0.10 MB/s)",
        "distaff x: done: 10.0 MB of text, 10 blocks in 100 s (0.10 MB/s)"]
