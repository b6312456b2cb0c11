"""``distaff average`` on real 2-rank checkpoints of ZeRO 0, 2 and 3: the averaged checkpoint's fp32 weights are the
weighted mean of its sources' (read back through DeepSpeed's own zero_to_fp32, independently of how the average
was written), it verifies like any checkpoint and names its sources, it resumes (the engine starts from the
averaged weights and the newest source's Adam moments), fine-tunes and exports; checkpoints of other shapes,
partitionings or tokenizers are refused with one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pretrain_fixtures import prepare_data, run_probe, write_config
from test_pretrain_zero import zero_run

from distaff.train.finetune.classifier_init import load_encoder
from distaff.train.run.checkpoint_files import META, checkpoint_problem, write_file_list
from distaff.train.run.weights import fp32_state_dict
from distaff.train.core.safe_load import safe_load
from distaff.train.tools.average import average, average_weights, main as average_main, weight_containers, weighted
from distaff.train.tools.checkpoint_eval import heldout_metrics
from distaff.train.tools.export import main as export_main

STEPS = (8, 12, 16)


def checkpoint(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def expected_average(sources: list[Path], weights: list[float]) -> dict[str, torch.Tensor]:
    states = [fp32_state_dict(source) for source in sources]
    return {k: sum(w * s[k].double() for w, s in zip(weights, states)).float() for k in states[-1]}


def without_weights(state):
    """A DeepSpeed file's contents with every copy of the weights left out (what averaging must not change)."""
    for _, container, keys in weight_containers(state):
        for key in keys:
            container[key] = None
    return state


def assert_same_values(a, b, where: str = "") -> None:
    if torch.is_tensor(a):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_values(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_values(x, y, f"{where}[{i}]")
    else:
        assert str(a) == str(b), where


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]


@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_the_average_is_the_weighted_mean_and_a_sound_checkpoint(stage, sample_data, tmp_path_factory, tmp_path):
    run = zero_run(tmp_path_factory.getbasetemp(), sample_data, stage)
    out = tmp_path / "avg"
    assert average_main([str(run), "--out", str(out)]) == 0          # a run dir: all its checkpoints
    sources = [checkpoint(run, s) for s in STEPS]
    assert_same_weights(fp32_state_dict(out), expected_average(sources, [1 / 3] * 3))
    assert checkpoint_problem(out) is None
    meta, newest = json.loads((out / META).read_text()), json.loads((sources[-1] / META).read_text())
    assert [(s["step"], s["weight"]) for s in meta["averaged_from"]] == [(s, 1 / 3) for s in STEPS]
    assert meta["averaging"] == "uniform" and meta["step"] == 16 and meta["train_state"]["wandb_run_id"] is None
    assert meta["model_config"] == newest["model_config"] and meta["config"] == newest["config"]
    for rank in (0, 1):        # the data position and random states: the newest source's
        rank_file = Path("distaff") / f"rank-{rank:05d}.json"
        assert (out / rank_file).read_text() == (sources[-1] / rank_file).read_text()
    files = sorted(p.name for p in sources[-1].glob("*.pt"))
    assert files and sorted(p.name for p in out.glob("*.pt")) == files
    for name in files:         # Adam moments, step counts, loss scaler, DeepSpeed's config: the newest source's
        assert_same_values(without_weights(safe_load(out / name)), without_weights(safe_load(sources[-1] / name)), name)

    ema = tmp_path / "ema"
    assert average_main([str(checkpoint(run, 12)), str(checkpoint(run, 16)), str(checkpoint(run, 8)), "--last", "2",
                         "--ema", "0.5", "--out", str(ema)]) == 0
    assert_same_weights(fp32_state_dict(ema), expected_average(sources[1:], [1 / 3, 2 / 3]))
    assert [s["step"] for s in json.loads((ema / META).read_text())["averaged_from"]] == [12, 16]


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_the_average_resumes_fine_tunes_exports_and_evaluates(sample_data, tmp_path_factory, tmp_path):
    base = tmp_path_factory.getbasetemp()
    run = zero_run(base, sample_data, 3)
    out = average([str(run)], tmp_path / "avg", last=2)
    weights = fp32_state_dict(out)

    probe = tmp_path / "probe"
    config = write_config(tmp_path / "resume.yaml", prepare_data(base, sample_data), tmp_path / "continued",
                          zero={"stage": 3}, train={"max_steps": 18})
    codes, logs = run_probe(config, tmp_path, 2, probe, f"checkpoint.resume={out}")
    assert codes == [0, 0], logs
    start = torch.load(probe / "start-rank0.pt", weights_only=True)
    assert start["train_state"]["step"] == 16 and start["train_state"]["wandb_run_id"] is not None
    assert all(torch.equal(start["tensors"][f"fp32/{k}"], v) for k, v in weights.items())
    assert json.loads((tmp_path / "continued" / "summary.json").read_text())["steps"] == 18

    encoder = load_encoder(out, {})                               # fine-tuning's model.init_from
    assert torch.equal(encoder.weights["deberta.embeddings.word_embeddings.weight"],
                       weights["deberta.embeddings.word_embeddings.weight"])
    assert export_main([str(out), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()

    alone = average([str(checkpoint(run, 16))], tmp_path / "one")  # an average of one: the checkpoint itself
    assert_same_weights(fp32_state_dict(alone), fp32_state_dict(checkpoint(run, 16)))
    figures = heldout_metrics(out)
    assert figures["eval_loss"] < 6.9 and figures["eval_tokens"] > 500           # below ln(1000): it learned
    assert heldout_metrics(alone) == heldout_metrics(checkpoint(run, 16))


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_checkpoints_of_other_partitionings_shapes_or_tokenizers_are_refused_in_one_line(
        sample_data, tmp_path_factory, tmp_path, capsys):
    base = tmp_path_factory.getbasetemp()
    zero2, zero3 = zero_run(base, sample_data, 2), zero_run(base, sample_data, 3)
    assert average_main([str(checkpoint(zero2, 16)), str(checkpoint(zero3, 16)), "--out", str(tmp_path / "x")]) == 2
    assert "zero.stage 2, but 3 in" in capsys.readouterr().err

    other = tmp_path / "other-tokenizer"
    shutil.copytree(checkpoint(zero3, 12), other)
    piece = next(p for p in sorted((other / "tokenizer").iterdir()) if p.suffix == ".json")
    piece.write_text(piece.read_text().replace("}", ', "edited": true}', 1))
    write_file_list(other)                                   # sound, but of another tokenizer
    assert average_main([str(other), str(checkpoint(zero3, 16)), "--out", str(tmp_path / "y")]) == 2
    assert "its tokenizer differs" in capsys.readouterr().err

    wider = tmp_path / "wider"
    shutil.copytree(checkpoint(zero3, 12), wider)
    meta = json.loads((wider / META).read_text())
    meta["model_config"]["hidden_size"] = 128
    (wider / META).write_text(json.dumps(meta))
    write_file_list(wider)                                   # sound (meta.json is listed), but of another shape
    assert average_main([str(wider), str(checkpoint(zero3, 16)), "--out", str(tmp_path / "z")]) == 2
    err = capsys.readouterr().err
    assert "model.hidden_size 128, but 64" in err and err.count("\n") == 1
    assert average_main([str(zero3), str(checkpoint(zero3, 16)), "--out", str(tmp_path / "w")]) == 2
    assert "named twice" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in "xyzw")   # nothing written by a refusal


@pytest.mark.unit
def test_the_weights_and_the_tensor_sums_refuse_mismatched_shapes():
    assert average_weights(3) == [1 / 3] * 3
    assert average_weights(3, 0.5) == pytest.approx([1 / 7, 2 / 7, 4 / 7])
    halves = weighted([torch.ones(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16)], [0.5, 0.5], "w")
    assert halves.dtype == torch.bfloat16 and torch.equal(halves, torch.full((3,), 0.5, dtype=torch.bfloat16))
    assert weighted([torch.tensor(3), torch.tensor(5)], [0.5, 0.5], "step") == 5     # counts: the newest's
    from distaff.train.run.config import ConfigError

    with pytest.raises(ConfigError, match=r"^w\[1\]: shapes \[\(2,\), \(3,\)\] differ"):
        weighted([[torch.ones(2), torch.ones(2)], [torch.ones(2), torch.ones(3)]], [0.5, 0.5], "w")
