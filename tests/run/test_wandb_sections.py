"""W&B's run page as a dashboard: metrics in sections (train/, eval/, rtd/, optim/, perf/, progress/), charted
against the optimizer step, the final held-out numbers in the run summary; read back from the offline run's
``.wandb`` file. metrics.jsonl keeps the flat names. TensorBoard (``logging.tensorboard: true``) holds the same
sections and values, read back from its event files."""

from __future__ import annotations

import json
import subprocess

import pytest

from distaff.train.run.metrics import WANDB_CHARTED, wandb_key, wandb_summary
from pretrain_fixtures import (PYTHON, metrics, prepare_data, rank_env, read_wandb_records, run_log, tensorboard_scalars,
                               wandb_runs, write_config)


@pytest.mark.unit
@pytest.mark.parametrize("flat, sectioned", [
    ("loss", "train/loss"), ("accuracy", "train/accuracy"), ("eval_loss", "eval/loss"),
    ("eval_rtd_auc", "eval/rtd_auc"), ("rtd_auc", "rtd/auc"), ("gen_loss", "rtd/gen_loss"),
    ("replaced_rate", "rtd/replaced_rate"), ("weight_rtd", "rtd/weight_rtd"), ("lr", "optim/lr"),
    ("grad_norm", "optim/grad_norm"), ("tokens_per_s", "perf/tokens_per_s"), ("mfu", "perf/mfu"),
    ("peak_mem_gb", "perf/peak_mem_gb"), ("forward_s", "perf/forward_s"), ("data_wait_s", "perf/data_wait_s"),
    ("grad_comm_s", "perf/grad_comm_s"), ("step", "progress/step"), ("tokens_seen", "progress/tokens_seen"),
    ("epoch", "progress/epoch"), ("f1", "train/f1"),
])
def test_every_logged_key_has_a_section(flat, sectioned):
    assert wandb_key(flat) == sectioned


@pytest.mark.unit
def test_the_run_summary_puts_final_held_out_numbers_under_eval():
    summary = {"steps": 10, "eval_loss": 4.5, "eval_accuracy": 0.3, "unigram_baseline_accuracy": 0.04,
               "best_metric": 0.7, "plot": None}
    assert wandb_summary(summary) == {"run/steps": 10, "eval/loss": 4.5, "eval/accuracy": 0.3,
                                      "eval/unigram_baseline_accuracy": 0.04, "eval/best_metric": 0.7}


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_offline_run_files_hold_sections_step_axis_and_final_summary(sample_data, tmp_path_factory, tmp_path):
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    out = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", data, out, train={"max_steps": 6}, eval={"every": 3, "batches": 2},
                          logging={"every": 2, "progress_bar": False, "tensorboard": True})
    proc = subprocess.run([PYTHON, "-m", "distaff.train.pretrain", "--config", str(config)], env=rank_env(tmp_path),
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, run_log(proc)

    (_, history), = wandb_runs(out)
    flat = metrics(out)
    train = {r["step"]: r for r in flat if "loss" in r}
    evals = {r["step"]: r for r in flat if "eval_loss" in r}
    assert sorted(train) == [2, 4, 6] and sorted(evals) == [3, 6]          # metrics.jsonl: flat keys, as before
    assert sorted(history) == [2, 3, 4, 6]
    for step, row in history.items():
        assert all(key.startswith("_") or key.split("/")[0] in (*WANDB_CHARTED, "progress") for key in row), row
        assert row["progress/step"] == step
    assert history[4]["train/loss"] == train[4]["loss"] and history[4]["optim/lr"] == train[4]["lr"]
    assert history[4]["perf/tokens_per_s"] == train[4]["tokens_per_s"]
    # where the step's time went, beside step_time_s; and the one line comparing it with the plan
    assert history[4]["perf/forward_s"] == train[4]["forward_s"] > 0 and train[4]["backward_s"] > 0
    assert "perf/data_wait_s" in history[4] and "perf/optimizer_s" in history[4]
    assert [line for line in proc.stdout.splitlines() if line.startswith("distaff: plan check: step ")] != []
    assert history[4]["progress/tokens_seen"] == train[4]["tokens_seen"]
    assert history[3]["eval/loss"] == evals[3]["eval_loss"]
    assert history[3]["progress/tokens_seen"] == evals[3]["tokens_seen"] > 0

    records = read_wandb_records(next((out / "wandb").glob("offline-run-*/*.wandb")))
    axes = {r.metric.glob_name or r.metric.name: r.metric.step_metric for r in records
            if r.WhichOneof("record_type") == "metric"}
    assert axes == {"progress/step": "", "progress/tokens_seen": "progress/step",
                    **{f"{section}/*": "progress/step" for section in WANDB_CHARTED}}
    summary = {}
    for record in records:
        if record.WhichOneof("record_type") == "summary":
            summary.update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.summary.update})
    final = json.loads((out / "summary.json").read_text())
    assert summary["eval/loss"] == final["eval_loss"] == evals[6]["eval_loss"]
    assert summary["eval/accuracy"] == final["eval_accuracy"]
    assert summary["eval/unigram_baseline_accuracy"] == final["unigram_baseline_accuracy"]
    assert summary["run/steps"] == 6 and summary["run/tokens"] == final["tokens"]

    scalars = tensorboard_scalars(out / "tensorboard")
    for step, row in history.items():
        for key, value in row.items():
            if not key.startswith("_") and key != "progress/step" and value is not None:
                assert scalars[key][step] == pytest.approx(value, rel=1e-6), (key, step)
    assert scalars["eval/unigram_baseline_accuracy"][6] == pytest.approx(final["unigram_baseline_accuracy"])
    assert scalars["run/tokens"][6] == final["tokens"]

