"""RTD loss weighting (``rtd.loss_weighting``): ``fixed`` bit-identical to the plain sum, ``initial``
and ``uncertainty`` against hand computations and closed-form gradients, ``initial``'s recorded
values through a checkpoint's JSON, the config errors, and a 2-rank ZeRO-2 run learning the weights."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_rtd import batch, configs, run_config

from distaff.train.model import rtd
from distaff.train.model.loss_weighting import LossWeighting
from distaff.train.pretrain.objectives import objective_for
from distaff.train.run.config import ConfigError, config_from_dict
from distaff.train.run.engine import parameter_groups


def rtd_model(loss_weighting: str) -> rtd.ReplacedTokenDetection:
    torch.manual_seed(0)
    return rtd.ReplacedTokenDetection(*configs(), weight=50.0, loss_weighting=loss_weighting)


def losses(*values: float) -> list[torch.Tensor]:
    return [torch.tensor(v, requires_grad=True) for v in values]


@pytest.mark.unit
def test_fixed_is_bit_identical_to_mlm_plus_weight_times_rtd():
    ids, mask, labels = batch()
    ours = rtd_model("fixed")
    out = ours(ids, mask, labels=labels)
    ours.zero_grad()
    out.loss.backward()
    plain = rtd_model("fixed")
    ref = plain(ids, mask, labels=labels)
    plain.zero_grad()
    (ref.generator_loss + 50.0 * ref.rtd_loss).backward()       # the loss before loss weighting existed
    assert torch.equal(out.loss, ref.generator_loss + 50.0 * ref.rtd_loss)
    for (name, a), b in zip(ours.named_parameters(), plain.parameters()):
        assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad)), name
    assert list(dict(ours.named_parameters())) == list(dict(plain.named_parameters()))   # nothing new to train


@pytest.mark.unit
def test_fixed_and_initial_against_hand_computed_sums():
    total, weights = LossWeighting("fixed", (1.0, 50.0))(losses(2.0, 0.5))
    assert total.item() == 27.0 and weights.tolist() == [1.0, 50.0]

    initial = LossWeighting("initial", (1.0, 50.0))
    first = losses(4.0, 0.25)
    total, weights = initial(first)
    total.backward()
    # before anything is recorded each loss is divided by its own value: 1 + 50, gradients w_i / L_i
    assert total.item() == pytest.approx(51.0) and weights.tolist() == [0.25, 200.0]
    assert [t.grad.item() for t in first] == [0.25, 200.0]
    initial.record([4.0, 0.25])
    initial.record([8.0, 1.0])                  # only the first step's values are kept
    total, weights = initial(losses(2.0, 0.5))
    assert total.item() == pytest.approx(2.0 / 4.0 + 50.0 * 0.5 / 0.25) and weights.tolist() == [0.25, 200.0]


@pytest.mark.unit
def test_uncertainty_loss_and_gradient_match_the_closed_form():
    weighting = LossWeighting("uncertainty", (1.0, 50.0))
    assert weighting.log_variance.tolist() == pytest.approx([0.0, -math.log(50.0)])   # starts at the fixed weights
    with torch.no_grad():
        weighting.log_variance.copy_(torch.tensor([0.3, -1.2]))
    values = [2.0, 0.5]
    inputs = losses(*values)
    total, weights = weighting(inputs)
    total.backward()
    s = [0.3, -1.2]
    assert total.item() == pytest.approx(sum(math.exp(-si) * li + si for si, li in zip(s, values)), rel=1e-6)
    assert weights.tolist() == pytest.approx([math.exp(-si) for si in s], rel=1e-6)
    # d/ds (exp(-s) L + s) = 1 - exp(-s) L; d/dL = exp(-s)
    assert weighting.log_variance.grad.tolist() == pytest.approx([1 - math.exp(-si) * li for si, li in zip(s, values)],
                                                                 rel=1e-6)
    assert [t.grad.item() for t in inputs] == pytest.approx([math.exp(-si) for si in s], rel=1e-6)


@pytest.mark.unit
def test_uncertainty_log_variances_live_in_the_model_without_weight_decay():
    model = rtd_model("uncertainty")
    log_variance = model.weighting.log_variance
    assert "weighting.log_variance" in model.state_dict()
    decay, no_decay = parameter_groups(model, 0.01)
    assert any(p is log_variance for p in no_decay["params"])
    assert not any(p is log_variance for p in decay["params"])
    ids, mask, labels = batch()
    out = model(ids, mask, labels=labels)
    out.loss.backward()
    expected = 1 - torch.exp(-log_variance.detach()) * torch.stack([out.generator_loss, out.rtd_loss]).detach()
    torch.testing.assert_close(log_variance.grad, expected)


@pytest.mark.unit
def test_initial_records_the_global_means_and_resumes_from_checkpoint_json_exactly():
    cfg = run_config(loss_weighting="initial")
    objective = objective_for(cfg, cfg.model_config(vocab_size=97, hidden_size=32, num_attention_heads=2,
                                                    intermediate_size=64, num_hidden_layers=2,
                                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    ids, mask, labels = batch()
    torch.manual_seed(0)
    model = objective.build(rank=0)
    first = model(ids, mask, labels=labels)
    # two ranks' sums, as the step's all-reduce adds them
    second = model(*batch(seed=2)[:2], labels=batch(seed=2)[2])
    sums = (first.sums + second.sums).tolist()
    objective.after_step(model, sums)
    recorded = model.weighting.initial.values
    masked = [(labels != -100).sum().item(), (batch(seed=2)[2] != -100).sum().item()]
    real = [mask.sum().item(), batch(seed=2)[1].sum().item()]
    expected_gen = (first.generator_loss.item() * masked[0] + second.generator_loss.item() * masked[1]) / sum(masked)
    expected_rtd = (first.rtd_loss.item() * real[0] + second.rtd_loss.item() * real[1]) / sum(real)
    assert recorded == pytest.approx([expected_gen, expected_rtd], rel=1e-6)

    saved = json.loads(json.dumps({name: part.state_dict() for name, part in objective.per_rank_state(model).items()}))
    assert saved["initial_losses"]["values"] == recorded
    torch.manual_seed(0)
    resumed = objective.build(rank=0)
    for name, part in objective.per_rank_state(resumed).items():
        part.load_state_dict(saved[name])
    after, again = model(ids, mask, labels=labels), resumed(ids, mask, labels=labels)
    assert torch.equal(after.loss, again.loss)
    assert after.loss.item() == pytest.approx(after.generator_loss.item() / expected_gen
                                              + 50.0 * after.rtd_loss.item() / expected_rtd, rel=1e-6)


@pytest.mark.unit
def test_export_rebuilds_an_uncertainty_run_with_its_log_variances():
    from distaff.train.run.config import config_to_dict
    from distaff.train.run.weights import model_from_meta

    cfg = run_config(loss_weighting="uncertainty")
    objective = objective_for(cfg, cfg.model_config(vocab_size=97))
    trained = objective.build(rank=0)
    meta = {"config": config_to_dict(cfg), "model_config": objective.model_cfg.to_dict(), **objective.meta()}
    rebuilt = model_from_meta(json.loads(json.dumps(meta)), "meta.json")
    rebuilt.load_state_dict(trained.state_dict(), strict=True)        # weighting.log_variance included
    assert torch.equal(rebuilt.weighting.log_variance, trained.weighting.log_variance)


@pytest.mark.unit
def test_only_initial_adds_checkpoint_state():
    for method, extra in (("fixed", set()), ("uncertainty", set()), ("initial", {"initial_losses"})):
        cfg = run_config(loss_weighting=method)
        objective = objective_for(cfg, cfg.model_config(vocab_size=97))
        assert set(objective.per_rank_state(objective.build(rank=0))) == {"sampler"} | extra


@pytest.mark.unit
def test_loss_weighting_config_errors_name_the_keys():
    assert run_config().rtd.loss_weighting == "fixed"
    with pytest.raises(ConfigError, match=r"rtd\.loss_weighting: must be one of .*'softmax'"):
        run_config(loss_weighting="softmax")
    with pytest.raises(ConfigError, match=r"rtd\.loss_weighting=initial with train\.objective=mlm"):
        config_from_dict({"data": {"dir": "x"}, "rtd": {"loss_weighting": "initial"}})
    assert config_from_dict({"data": {"dir": "x"}, "rtd": {"loss_weighting": "fixed"}}).train.objective == "mlm"


def weighted_run(tmp, sample_data, name: str, method: str, steps: int, every: int, *overrides: str):
    """A 2-rank ZeRO-2 RTD run with ``rtd.loss_weighting=method``; its run directory."""
    from pretrain_fixtures import prepare_data, rank_logs, spawn_ranks, wait_all, write_config

    folder, out = tmp / name, tmp / name / "run"
    folder.mkdir()
    config = write_config(folder / "run.yaml", prepare_data(tmp.parent, sample_data), out,
                          train={"max_steps": steps, "objective": "rtd"}, rtd={"loss_weighting": method},
                          zero={"stage": 2}, checkpoint={"every": every, "keep": 3}, eval={"every": 0, "batches": 2})
    assert wait_all(spawn_ranks(config, folder, *overrides), timeout=240) == [0, 0], rank_logs(folder)
    return out


def train_records(run_dir) -> dict[int, dict]:
    from pretrain_fixtures import metrics

    return {r["step"]: r for r in metrics(run_dir) if "loss" in r}


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_zero2_uncertainty_run_learns_and_logs_the_weights(sample_data, tmp_path):
    from distaff.train.run.weights import fp32_state_dict

    run = weighted_run(tmp_path, sample_data, "uncertainty", "uncertainty", 4, 3)
    records = train_records(run)
    assert sorted(records) == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["weight_gen"]) for r in records.values())
    assert [records[1]["weight_gen"], records[1]["weight_rtd"]] == pytest.approx([1.0, 50.0], rel=1e-6)
    # step 4's forward used the log-variances the step-3 checkpoint holds (fp32 master weights)
    log_variance = fp32_state_dict(run / "checkpoints" / "step-00000003")["weighting.log_variance"]
    assert [records[4]["weight_gen"], records[4]["weight_rtd"]] == pytest.approx(torch.exp(-log_variance).tolist(),
                                                                                 rel=1e-5)
    assert records[4]["weight_rtd"] != pytest.approx(50.0, rel=1e-6)       # learned: it moved
    summary = json.loads((run / "summary.json").read_text())
    assert math.isfinite(summary["eval_loss"]) and "eval_weight_rtd" not in summary


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_zero2_initial_weighting_resumes_exactly(sample_data, tmp_path):
    full = weighted_run(tmp_path, sample_data, "initial", "initial", 4, 2)
    records = train_records(full)
    ranks = [json.loads((full / "checkpoints" / "step-00000002" / "distaff" / f"rank-0000{r}.json").read_text())
             for r in (0, 1)]
    recorded = ranks[0]["initial_losses"]["values"]
    assert ranks[1]["initial_losses"]["values"] == recorded                  # every rank recorded the same
    assert recorded == pytest.approx([records[1]["gen_loss"], records[1]["rtd_loss"]], rel=1e-9)
    # from step 2 on each loss is divided by step 1's global mean
    assert [records[3]["weight_gen"], records[3]["weight_rtd"]] == pytest.approx(
        [1.0 / recorded[0], 50.0 / recorded[1]], rel=1e-9)
    resumed = weighted_run(tmp_path, sample_data, "initial-resumed", "initial", 4, 2,
                           f"checkpoint.resume={full / 'checkpoints' / 'step-00000002'}")
    again = train_records(resumed)
    assert sorted(again) == [3, 4]
    assert {step: [again[step][k] for k in TRACKED] for step in (3, 4)} == \
        {step: [records[step][k] for k in TRACKED] for step in (3, 4)}              # bit for bit


TRACKED = ("loss", "gen_loss", "rtd_loss", "gen_accuracy", "rtd_accuracy", "rtd_auc", "weight_gen", "weight_rtd")
