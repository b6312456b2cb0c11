"""What a run leaves to read: ``metrics.png`` with loss, accuracy beside the unigram baseline, learning rate,
gradient norm and tokens/s; TensorBoard event files in W&B's sections, or one line naming the extra to install."""

from __future__ import annotations

import importlib.util
import json

import pytest

from distaff.train.core.errors import ConfigError
from distaff.train.run import metrics
from distaff.train.run.config import load_config
from pretrain_fixtures import tensorboard_scalars

pytestmark = pytest.mark.unit

RECORDS = [{"step": 2, "loss": 7.5, "accuracy": 0.05, "lr": 1e-4, "grad_norm": 2.0, "tokens_per_s": 900.0},
           {"step": 4, "loss": 6.5, "accuracy": 0.09, "lr": 2e-4, "grad_norm": 1.5, "tokens_per_s": 1000.0},
           {"step": 4, "eval_loss": 6.7, "eval_accuracy": 0.08, "eval_perplexity": 812.0},
           {"step": 6, "loss": 6.0, "accuracy": 0.12, "lr": 1e-4, "grad_norm": 1.2, "tokens_per_s": 1100.0}]


def _write(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def _drawn(monkeypatch, tmp_path, baseline):
    figures = []
    monkeypatch.setattr(metrics, "save_figure", lambda fig, path: figures.append(fig) or path)
    assert metrics.plot_metrics(_write(tmp_path), tmp_path / "m.png", baseline) == tmp_path / "m.png"
    return {ax.get_title(): ax for ax in figures[0].axes if ax.get_title()}


def _series(ax) -> dict[str, list]:
    return {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}


def test_the_plot_has_a_panel_per_quantity_with_the_logged_values(monkeypatch, tmp_path):
    panels = _drawn(monkeypatch, tmp_path, baseline=0.041)
    assert list(panels) == ["loss", "accuracy", "learning rate", "gradient norm", "tokens/s (all ranks)"]
    assert _series(panels["loss"]) == {"loss": [7.5, 6.5, 6.0], "held-out loss": [6.7]}
    assert _series(panels["learning rate"]) == {"lr": [1e-4, 2e-4, 1e-4]}
    assert _series(panels["gradient norm"]) == {"grad_norm": [2.0, 1.5, 1.2]}
    assert _series(panels["tokens/s (all ranks)"]) == {"tokens_per_s": [900.0, 1000.0, 1100.0]}
    accuracy = _series(panels["accuracy"])
    assert accuracy["accuracy"] == [0.05, 0.09, 0.12] and accuracy["unigram baseline 0.041"] == [0.041, 0.041]


def test_without_a_baseline_the_accuracy_panel_has_no_line_for_it(monkeypatch, tmp_path):
    panels = _drawn(monkeypatch, tmp_path, baseline=None)
    assert not any("baseline" in label for label in _series(panels["accuracy"]))


def test_the_plot_is_a_png_file(tmp_path):
    png = metrics.plot_metrics(_write(tmp_path), tmp_path / "metrics.png", 0.04)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_tensorboard_sink_writes_w_and_b_sections_read_back_by_tensorboard(tmp_path):
    sink = metrics.TensorBoardSink(tmp_path)
    for record in RECORDS:
        sink.log(record, record["step"])
    sink.summary({"steps": 6, "tokens": 12_000, "eval_loss": 6.4, "unigram_baseline_accuracy": 0.041})
    sink.finish(0)
    scalars = tensorboard_scalars(tmp_path / metrics.TENSORBOARD_DIR)
    assert scalars["train/loss"] == {2: 7.5, 4: 6.5, 6: 6.0}
    assert scalars["eval/loss"] == pytest.approx({4: 6.7})                      # the summary adds no second point
    assert scalars["optim/lr"] == pytest.approx({2: 1e-4, 4: 2e-4, 6: 1e-4})
    assert scalars["perf/tokens_per_s"] == {2: 900.0, 4: 1000.0, 6: 1100.0}
    assert scalars["eval/unigram_baseline_accuracy"] == pytest.approx({6: 0.041})
    assert scalars["run/tokens"] == {6: 12_000.0}
    assert "progress/step" not in scalars and all(tag.split("/")[0] in (*metrics.WANDB_CHARTED, "progress", "run")
                                                  for tag in scalars)


@pytest.mark.parametrize("load", [lambda o: load_config("tiny-cpu", o),
                                  lambda o: __import__("distaff.train.finetune.config", fromlist=["x"])
                                  .load_finetune_config("sentiment-cpu", o)])
def test_tensorboard_without_the_package_is_one_line_naming_the_extra(load, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert load(["logging.tensorboard=false"]) is not None
    with pytest.raises(ConfigError) as info:
        load(["logging.tensorboard=true"])
    assert str(info.value) == ("logging.tensorboard: the tensorboard package is not installed; pip install "
                               "'distaff[tensorboard]' (the tensorboard extra), or set logging.tensorboard=false")


def test_a_pause_between_steps_is_not_counted_as_training():
    """Issue 48: the step line after an (inline or held-out) evaluation spread the pause over the window's steps,
    tokens/s and ETA some 150x off. 10 s since the last report, 9 of them an evaluation, 5 steps of 100 tokens."""
    import time

    throughput = metrics.Throughput(world_size=2, flops_per_token=0.0, peak_flops=None)
    for _ in range(5):
        throughput.add(100, 4, 128)
    throughput.t0 = time.perf_counter() - 10.0
    throughput.exclude(9.0)
    report = throughput.report(steps_left=50)
    assert report["step_time_s"] == pytest.approx(0.2, abs=0.02)
    assert report["tokens_per_s"] == pytest.approx(500, rel=0.1) and report["eta_s"] == pytest.approx(10, rel=0.1)
    with throughput.paused():                     # the window after a report starts without a pause
        pass
    assert 0 <= throughput.paused_s < 1
    assert throughput.report(0)["eta_s"] == 0
