"""`distaff finetune` end to end on 2 gloo ranks (ZeRO-2) on the bundled movie snippets: dev metrics, the best
checkpoint, exact resume after a preemption, and `distaff export-hf` of the result into transformers."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from finetune_fixtures import MAX_LEN, tiny_model, write_ft_config
from pretrain_fixtures import PYTHON, metrics, rank_env, spawn_ranks, torchrun, wait_all, run_log

from distaff.train.run.checkpoint import META
from distaff.train.run.weights import fp32_state_dict, model_from_meta

pytestmark = pytest.mark.integration

FT_MODULE = "distaff.train.finetune"
# warmup 0.25 of 8 steps = 2 steps, then linear decay to 0 at step 8
FULL_RUN_OPTIM = {"lr": 1e-3, "warmup_steps": 0, "warmup_ratio": 0.25, "layer_decay": 0.8}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.getbasetemp() / "finetune-model")


@pytest.fixture(scope="module")
def full_run(model_dir, tmp_path_factory) -> Path:
    """8 steps on 2 ranks, dev evaluated at steps 4 and 8, layer-wise lr decay on."""
    tmp = tmp_path_factory.mktemp("ft-full")
    config = write_ft_config(tmp / "ft.yaml", model_dir, tmp / "run", optim=FULL_RUN_OPTIM,
                             data={"label_names": {0: "negative", 1: "positive"}})
    proc = torchrun(config, tmp, module=FT_MODULE)
    assert proc.returncode == 0, run_log(proc)
    return tmp / "run"


def eval_records(run_dir: Path) -> list[dict]:
    return [r for r in metrics(run_dir) if "eval_accuracy" in r]


def test_run_reports_dev_metrics_and_keeps_the_best_checkpoint(full_run):
    summary = json.loads((full_run / "summary.json").read_text())
    evals = eval_records(full_run)
    assert [r["step"] for r in evals] == [4, 8]
    for record in evals:
        for key in ("eval_loss", "eval_accuracy", "eval_f1", "eval_mcc"):
            assert math.isfinite(record[key]), (key, record)
    assert summary["dev_examples"] == 300 and summary["train_examples"] == 2700
    assert summary["labels"] == ["0", "1"]
    # the best checkpoint is the first evaluation with the highest accuracy
    best = max(evals, key=lambda r: (r["eval_accuracy"], -r["step"]))
    assert summary["best_step"] == best["step"] and summary["best_metric"] == best["eval_accuracy"]
    assert Path(summary["best_checkpoint"]).name == f"step-{best['step']:08d}"
    assert (full_run / "checkpoints" / "step-00000008" / META).is_file()
    assert (full_run / "metrics.png").stat().st_size > 0
    assert any((full_run / "wandb").glob("offline-run-*"))


def test_schedule_is_warmup_then_linear_decay(full_run):
    """The logged lr of step s (1-based) is the one step s-1 ran with: s/2 x lr while warming up over 2 steps,
    then lr x (1 - (s - 3) / 6)."""
    logged = {r["step"]: r["lr"] for r in metrics(full_run) if "lr" in r}
    expected = {s: 1e-3 * (s / 2 if s <= 2 else 1 - (s - 3) / 6) for s in range(1, 9)}
    assert logged == pytest.approx(expected)


def test_resume_after_preemption_is_exact(full_run, model_dir, tmp_path):
    """Stopped at step 3 (checkpoint, exit 75) and resumed: the same losses, dev metrics and final weights."""
    config = write_ft_config(tmp_path / "ft.yaml", model_dir, tmp_path / "run", optim=FULL_RUN_OPTIM)
    probe = (str(Path(__file__).with_name("finetune_probe.py")),)
    first = spawn_ranks(config, tmp_path, program=probe, env={"PROBE_STOP_AT": "3"})
    assert wait_all(first, timeout=300) == [75, 75], (tmp_path / "rank0.log").read_text()[-3000:]
    stopped = (tmp_path / "rank0.log").read_text()       # a clean summary: no best yet, and no "n/a at step 0"
    assert "  best dev accuracy: none yet (stopped before the first dev evaluation, due at step 4)\n" in stopped
    resumed = spawn_ranks(config, tmp_path, program=probe)
    assert wait_all(resumed, timeout=300) == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    assert "resuming from" in (tmp_path / "rank0.log").read_text()
    expected = {r["step"]: r.get("loss", r.get("eval_accuracy")) for r in metrics(full_run)}
    got = {r["step"]: r.get("loss", r.get("eval_accuracy")) for r in metrics(tmp_path / "run")}
    assert got == expected
    final = [fp32_state_dict(run / "checkpoints" / "step-00000008") for run in (full_run, tmp_path / "run")]
    for name, tensor in final[0].items():
        torch.testing.assert_close(final[1][name], tensor, rtol=0, atol=0, msg=name)


def classifier_from_checkpoint(folder: Path):
    meta = json.loads((folder / META).read_text())
    model = model_from_meta(meta, str(folder))
    model.load_state_dict(fp32_state_dict(folder))
    return model.eval(), meta


def test_export_loads_in_transformers_with_the_same_logits(full_run, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    out = tmp_path / "hf"
    proc = subprocess.run([PYTHON, "-m", "distaff.launch.cli", "export-hf", str(full_run), str(out)],
                          env=rank_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, run_log(proc)
    summary = json.loads((full_run / "summary.json").read_text())
    ours, meta = classifier_from_checkpoint(Path(summary["best_checkpoint"]))
    theirs = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert theirs.config.id2label == {0: "negative", 1: "positive"}          # data.label_names
    assert theirs.config.label2id == {"negative": 0, "positive": 1}
    assert theirs.config.problem_type == "single_label_classification"
    tokenizer = AutoTokenizer.from_pretrained(out)
    texts = ["A gorgeous, funny film.", "Dull and far too long; I left early.", "It is a movie."]
    batch = tokenizer(texts, padding=True, truncation=True, max_length=MAX_LEN, return_tensors="pt")
    with torch.no_grad():
        expected = ours(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got = theirs(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    classify = pipeline("text-classification", model=str(out), tokenizer=str(out))
    results = classify(texts)
    assert [r["label"] for r in results] == [meta["label_names"][i] for i in expected.argmax(-1).tolist()]
    for result, probabilities in zip(results, expected.softmax(-1)):
        assert result["score"] == pytest.approx(float(probabilities.max()), rel=1e-4)


def test_export_latest_takes_the_last_checkpoint(full_run, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "hf-latest"
    proc = subprocess.run([PYTHON, "-m", "distaff.launch.cli", "export-hf", "--latest", str(full_run), str(out)],
                          env=rank_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, run_log(proc)
    last = fp32_state_dict(full_run / "checkpoints" / "step-00000008")
    written = load_file(out / "model.safetensors")
    for name, tensor in last.items():
        torch.testing.assert_close(written[name], tensor, rtol=0, atol=0, msg=name)


def test_zero3_bf16_with_sift_runs_and_exports(model_dir, tmp_path):
    """ZeRO-3 (partitioned weights: SiFT's extra forwards and the dev evaluation gather them on every rank) in
    bf16; the export reassembles the fp32 master weights and transformers computes distaff's logits."""
    from transformers import AutoModelForSequenceClassification

    config = write_ft_config(tmp_path / "ft.yaml", model_dir, tmp_path / "run", train={"max_steps": 4,
                                                                                       "precision": "bf16"},
                             eval={"every": 2}, zero={"stage": 3}, sift={"enabled": True})
    proc = torchrun(config, tmp_path, module=FT_MODULE)
    assert proc.returncode == 0, run_log(proc)
    evals = eval_records(tmp_path / "run")
    assert [r["step"] for r in evals] == [2, 4] and all(math.isfinite(r["eval_loss"]) for r in evals)
    out = tmp_path / "hf"
    proc = subprocess.run([PYTHON, "-m", "distaff.launch.cli", "export-hf", "--latest", str(tmp_path / "run"),
                           str(out)], env=rank_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, run_log(proc)
    ours, _ = classifier_from_checkpoint(tmp_path / "run" / "checkpoints" / "step-00000004")
    theirs = AutoModelForSequenceClassification.from_pretrained(out).eval()
    ids = torch.tensor([[1, 30, 31, 32, 2, 0, 0], [1, 60, 61, 62, 63, 64, 2]])
    mask = (ids != 0).long()
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=ids, attention_mask=mask).logits,
                                   ours(ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-5)


def _examples(path: Path) -> list[int]:
    return [i for line in path.read_text().splitlines() for i in json.loads(line)]


@pytest.mark.timeout(600)
def test_a_two_rank_checkpoint_resumes_on_one_rank_with_the_epoch_re_dealt(model_dir, tmp_path):
    """The red-team repro (2 ranks stopped at step 3, resumed on 1 rank) runs to the end: the ZeRO-2 state
    goes through the universal checkpoint and the epoch's unread examples are re-dealt, none read twice or
    skipped. Resuming with a changed data.batch_size is refused, naming the key, before any engine is built."""
    config = write_ft_config(tmp_path / "ft.yaml", model_dir, tmp_path / "run", optim=FULL_RUN_OPTIM)
    probe, record = (str(Path(__file__).with_name("finetune_probe.py")),), tmp_path / "record"
    for part in ("first", "refused", "resumed"):
        (record / part).mkdir(parents=True)
    first = spawn_ranks(config, tmp_path, program=probe, env={"PROBE_STOP_AT": "3", "PROBE_RECORD": str(record / "first")})
    log = lambda: (tmp_path / "rank0.log").read_text()   # noqa: E731
    assert wait_all(first, timeout=300) == [75, 75], log()[-3000:]

    resumed = spawn_ranks(config, tmp_path, world_size=1, program=probe, env={"PROBE_RECORD": str(record / "resumed")})
    assert wait_all(resumed, timeout=300) == [0], log()[-3000:]
    assert "to a universal checkpoint" in log() and "resuming a 2-rank checkpoint on 1 rank(s)" in log()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["finished"] is True and summary["world_size"] == 1
    before = [_examples(record / "first" / f"examples-rank{r}.jsonl") for r in (0, 1)]
    after = _examples(record / "resumed" / "examples-rank0.jsonl")
    epoch = np.random.default_rng([3, 0]).permutation(summary["train_examples"])   # run.seed 3, epoch 0
    assert sorted(before[0] + before[1]) == sorted(epoch[:3 * 2 * 8])            # 3 steps x 2 ranks x 8
    assert after == epoch[3 * 2 * 8:3 * 2 * 8 + 5 * 8].tolist()                   # then steps 4-8 x 1 rank x 8

    refused = spawn_ranks(config, tmp_path, "data.batch_size=16", world_size=1, program=probe,
                          env={"PROBE_RECORD": str(record / "refused")})
    assert wait_all(refused, timeout=120) == [2], log()[-3000:]
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000008"
    assert log().strip().splitlines()[-1] == (
        f"finetune_probe: data.batch_size: batch_size 8 in checkpoint {checkpoint}, 16 in this run; a fine-tuning "
        "run resumes only with the settings it started with: restore data.batch_size, or start over with "
        "checkpoint.resume=none (or another run.out_dir)")
    assert not list((record / "refused").iterdir())                       # no engine was built


@pytest.mark.timeout(600)
def test_an_epoch_run_resumed_on_fewer_ranks_keeps_its_epochs_and_schedule(model_dir, tmp_path):
    """The red-team repro: 2 ranks by epochs, stopped at step 3, resumed on 1 rank. The run reads train.epochs
    epochs of data in all (not k steps more), the epoch counter never goes back and the learning rate continues
    its decay (no dip, no second warmup)."""
    import gzip

    from finetune_fixtures import MOVIES

    with gzip.open(MOVIES, "rt") as handle:
        rows = handle.read().splitlines()[:100]
    small = tmp_path / "small.tsv"
    small.write_text("\n".join(rows) + "\n")
    config = write_ft_config(tmp_path / "ft.yaml", model_dir, tmp_path / "run", optim=FULL_RUN_OPTIM,
                             train={"max_steps": 0, "epochs": 2}, logging={"every": 1}, eval={"every": 0},
                             data={"train": str(small)})
    probe, record = (str(Path(__file__).with_name("finetune_probe.py")),), tmp_path / "record"
    for part in ("first", "resumed"):
        (record / part).mkdir(parents=True)
    log = lambda: (tmp_path / "rank0.log").read_text()   # noqa: E731
    first = spawn_ranks(config, tmp_path, program=probe, env={"PROBE_STOP_AT": "3", "PROBE_RECORD": str(record / "first")})
    assert wait_all(first, timeout=300) == [75, 75], log()[-3000:]
    resumed = spawn_ranks(config, tmp_path, world_size=1, program=probe, env={"PROBE_RECORD": str(record / "resumed")})
    assert wait_all(resumed, timeout=300) == [0], log()[-3000:]

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    train_examples = summary["train_examples"]                      # 90: 5 steps of 2 x 8 per epoch, 11 of 8
    read = sum(len(_examples(record / "first" / f"examples-rank{r}.jsonl")) for r in (0, 1))
    read += len(_examples(record / "resumed" / "examples-rank0.jsonl"))
    per_epoch_2, per_epoch_1 = train_examples // 16, train_examples // 8
    assert summary["steps"] == 3 + round((2 - 3 / per_epoch_2) * per_epoch_1), summary
    assert abs(read - 2 * train_examples) < 16 and summary["epochs"] == pytest.approx(2.0, abs=0.1), (read, summary)
    records = [r for r in metrics(tmp_path / "run") if "loss" in r]
    epochs, lrs = [r["epoch"] for r in records], [r["lr"] for r in records]
    assert [r["step"] for r in records] == list(range(1, summary["steps"] + 1))
    assert epochs == sorted(epochs) and epochs[2] == pytest.approx(3 / per_epoch_2)
    peak = lrs.index(max(lrs))
    assert peak < 3 and all(a >= b for a, b in zip(lrs[peak:], lrs[peak + 1:])), lrs   # one warmup, then decay


def test_finetune_check_and_print_config_start_nothing(model_dir, tmp_path, capsys):
    from distaff.train.finetune.config import finetune_config_to_dict, load_finetune_config
    from distaff.train.finetune.trainer import main

    import yaml

    config = write_ft_config(tmp_path / "ft.yaml", model_dir, tmp_path / "run")
    assert main(["--config", str(config), "--print-config", "optim.lr=0.25"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == finetune_config_to_dict(load_finetune_config(str(config), ["optim.lr=0.25"]))
    assert main(["--config", str(config), "--check"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("distaff finetune: OK: ") and f"a new run in {tmp_path / 'run'}" in out, out
    assert "8 steps" in out and not (tmp_path / "run").exists()
    assert main(["--config", str(config), "--check", "data.train=/nowhere.tsv"]) == 2
    first, summary = capsys.readouterr().err.strip().splitlines()     # the missing file, then what went unchecked
    assert first == "distaff finetune: --check: data.train: /nowhere.tsv does not exist", first
    assert "not checked without it: " in summary and summary.endswith("(exit 2)"), summary
