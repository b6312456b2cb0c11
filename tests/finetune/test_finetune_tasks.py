"""Fine-tuning runs (1 rank, real DeepSpeed engine) for each kind of task and stop: early stopping with the best
checkpoint kept, regression from a derived file (packed batches, dev file given, HF export), sentence pairs
with SiFT, and bad input refused with the file and line named."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from finetune_fixtures import MOVIES, tiny_model, write_ft_config
from pretrain_fixtures import PYTHON, metrics, rank_env, run_log, spawn_ranks, wait_all

from distaff.train.run.checkpoint import META
from distaff.train.run.weights import fp32_state_dict, model_from_meta

pytestmark = pytest.mark.integration

FINETUNE = ("-m", "distaff.train.finetune")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.getbasetemp() / "finetune-model")


def movie_rows(count: int) -> list[tuple[int, str]]:
    with gzip.open(MOVIES, "rt") as handle:
        rows = [line.rstrip("\n").split("\t", 1) for line in handle][:count]
    return [(int(label), text) for label, text in rows]


def finetune(config: Path, tmp: Path, *overrides: str) -> tuple[int, str]:
    """One rank of ``distaff.train.finetune``; the exit code and its log."""
    (code,) = wait_all(spawn_ranks(config, tmp, *overrides, world_size=1, program=FINETUNE), timeout=300)
    return code, (tmp / "rank0.log").read_text()


def test_early_stopping_keeps_the_best_checkpoint(model_dir, tmp_path):
    """An lr too small to change a prediction: the first evaluation is the best, the next two are no better,
    so patience 2 stops the run at step 3 of 40."""
    config = write_ft_config(tmp_path / "ft.yaml", model_dir, tmp_path / "run", train={"max_steps": 40},
                             optim={"lr": 1e-12, "warmup_steps": 0}, eval={"every": 1, "patience": 2})
    code, log = finetune(config, tmp_path)
    assert code == 0, log[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_early"] and summary["steps"] == 3
    assert summary["best_step"] == 1 and Path(summary["best_checkpoint"]).name == "step-00000001"
    accuracies = [r["eval_accuracy"] for r in metrics(tmp_path / "run") if "eval_accuracy" in r]
    assert len(accuracies) == 3 and accuracies[1] <= accuracies[0] and accuracies[2] <= accuracies[0]
    assert (tmp_path / "run" / "checkpoints" / "step-00000003" / META).is_file()
    assert "early stop at step 3" in log


def write_regression_files(folder: Path) -> tuple[Path, Path]:
    """A header TSV with a numeric target (the label plus a length term) and a separate dev file."""
    rows = [(f"{label + len(text.split()) / 50:.3f}", text) for label, text in movie_rows(480)]
    files = []
    for name, part in (("train.tsv", rows[:400]), ("dev.tsv", rows[400:])):
        path = folder / name
        path.write_text("score\tsentence\n" + "".join(f"{score}\t{text}\n" for score, text in part))
        files.append(path)
    return files[0], files[1]


def test_regression_with_packed_batches_exports_with_the_same_outputs(model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    train, dev = write_regression_files(tmp_path)
    config = write_ft_config(tmp_path / "ft.yaml", model_dir, tmp_path / "run",
                             data={"train": str(train), "dev": str(dev), "dev_fraction": 0.0, "columns": [],
                                   "text_column": "sentence", "label_column": "score", "task": "regression",
                                   "packing": "varlen"})
    code, log = finetune(config, tmp_path)
    assert code == 0, log[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["metric"] == "pearson" and summary["dev_examples"] == 80 and summary["labels"] is None
    for key in ("eval_pearson", "eval_spearman", "eval_mse", "eval_loss"):
        assert math.isfinite(summary[key]), key
    out = tmp_path / "hf"
    proc = subprocess.run([PYTHON, "-m", "distaff.launch.cli", "export-hf", str(tmp_path / "run"), str(out)],
                          env=rank_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, run_log(proc)
    folder = Path(summary["best_checkpoint"])
    ours = model_from_meta(json.loads((folder / META).read_text()), str(folder))
    ours.load_state_dict(fp32_state_dict(folder))
    theirs = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert theirs.config.problem_type == "regression" and theirs.config.num_labels == 1
    ids = torch.tensor([[1, 40, 41, 42, 2, 0], [1, 50, 51, 52, 53, 2]])
    mask = (ids != 0).long()
    with torch.no_grad():
        expected = ours.eval()(ids, attention_mask=mask).logits
        got = theirs(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_sentence_pairs_with_sift(model_dir, tmp_path):
    rows = movie_rows(402)
    pairs = tmp_path / "pairs.jsonl"
    with pairs.open("w") as handle:
        for (label_a, a), (label_b, b) in zip(rows[::2], rows[1::2]):
            handle.write(json.dumps({"premise": a, "hypothesis": b,
                                     "label": "same" if label_a == label_b else "different"}) + "\n")
    config = write_ft_config(tmp_path / "ft.yaml", model_dir, tmp_path / "run", train={"max_steps": 4},
                             data={"train": str(pairs), "columns": [], "text_column": "premise",
                                   "text_pair_column": "hypothesis"},
                             eval={"every": 2},
                             # strong enough to show: at the defaults, on this barely trained model (logits near 0),
                             # the runs with and without SiFT logged identical float32 losses
                             sift={"enabled": True, "perturbation_size": 0.5, "step_size": 0.1, "loss_weight": 100.0})
    code, log = finetune(config, tmp_path)
    assert code == 0, log[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["labels"] == ["different", "same"] and summary["train_examples"] + summary["dev_examples"] == 201
    losses = [r["loss"] for r in metrics(tmp_path / "run") if "loss" in r]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    # without SiFT (no dropout: the runs differ only by the adversarial term) the first step's task loss is the
    # same and the later ones are not: SiFT's gradient reached the weights
    code, log = finetune(config, tmp_path, "sift.enabled=false", f"run.out_dir={tmp_path / 'plain'}")
    assert code == 0, log[-3000:]
    plain = [r["loss"] for r in metrics(tmp_path / "plain") if "loss" in r]
    assert plain[0] == losses[0] and plain[1:] != losses[1:]


@pytest.mark.parametrize("case", ["unknown_label", "dev_class_missing_from_train"])
def test_bad_labels_name_the_file_and_line(model_dir, tmp_path, case):
    if case == "unknown_label":
        data, expected = {"labels": ["neg", "pos"]}, f"{MOVIES}:1: unknown label '1'"
    else:
        dev = tmp_path / "dev.tsv"
        dev.write_text("0\tfine\n7\tanother class\n")
        data, expected = {"dev": str(dev), "dev_fraction": 0.0}, f"{dev}:2: class '7' does not occur in the train set"
    config = write_ft_config(tmp_path / "ft.yaml", model_dir, tmp_path / "run", data=data)
    code, log = finetune(config, tmp_path)
    assert code == 2, log[-3000:]
    assert expected in log
