"""``distaff grow``: wider, deeper and both give the same logits (fp32) for every position scheme;
the copies can drift apart in training; a grown folder starts a real run through ``model.init_from``."""

from __future__ import annotations

import subprocess

import pytest
import torch
import yaml
from pretrain_fixtures import PYTHON, prepare_data, rank_env, run_log, write_config

from distaff.train.model.config import ModelConfig
from distaff.train.model.deberta import DebertaForMaskedLM
from distaff.train.run.config import ConfigError, load_config
from distaff.train.run.model_folder import load_model
from distaff.train.tools.grow import grow_model, main

BASE = dict(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
            max_position_embeddings=24, position_buckets=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
SCHEMES = {"relative+emd": dict(emd=True),
           "absolute": dict(relative_attention=False, pos_att_type=[], position_biased_input=True, norm_rel_ebd="none"),
           "rope+emd": dict(rope=True, emd=True),
           "factorised-embeddings": dict(embedding_size=16, share_att_key=False, type_vocab_size=2)}
SHAPES = {"deeper": (32, 5, None), "wider": (64, 2, None), "both": (96, 4, 200)}


def trained_looking(extra: dict, layers: int = 2) -> DebertaForMaskedLM:
    """Random weights far from the initialisation (LayerNorm gains and biases too), so nothing is trivially 0/1."""
    torch.manual_seed(0)
    model = DebertaForMaskedLM(ModelConfig(**{**BASE, "num_hidden_layers": layers}, **extra))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.15))
    return model.eval()


def _inputs():
    ids = torch.randint(5, 60, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 14:] = 0
    return ids, mask


@pytest.mark.unit
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_grown_model_gives_the_same_logits_and_loss(scheme, shape):
    small = trained_looking(SCHEMES[scheme])
    grown = grow_model(small, *SHAPES[shape], seed=3).eval()
    hidden, layers, _ = SHAPES[shape]
    assert (grown.config.hidden_size, grown.config.num_hidden_layers) == (hidden, layers)
    assert grown.config.head_dim == small.config.head_dim
    ids, mask = _inputs()
    with torch.no_grad():
        before, after = small(ids, mask).logits, grown(ids, mask).logits
        assert before[mask.bool()].abs().max() > 1.0  # logits large enough for the tolerance to mean something
        torch.testing.assert_close(after[mask.bool()], before[mask.bool()], atol=2e-5, rtol=1e-5)
        labels = torch.where(mask.bool() & (torch.arange(20) % 4 == 0), ids, -100)
        torch.testing.assert_close(grown(ids, mask, labels=labels).loss, small(ids, mask, labels=labels).loss,
                                   atol=2e-6, rtol=1e-6)


@pytest.mark.unit
def test_single_layer_model_grows_from_the_embeddings():
    small = trained_looking(SCHEMES["relative+emd"], layers=1)
    grown = grow_model(small, 64, 3).eval()
    ids, mask = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(grown(ids, mask).logits[mask.bool()], small(ids, mask).logits[mask.bool()],
                                   atol=2e-5, rtol=1e-5)


@pytest.mark.unit
def test_copies_drift_apart_after_a_training_step():
    """Uneven weight shares: two copies of a hidden unit get different gradients (even shares would not)."""
    grown = grow_model(trained_looking(SCHEMES["relative+emd"]), 64, 2).train()
    ids, mask = _inputs()
    labels = torch.where(torch.arange(20) % 3 == 0, ids, -100)
    grown(ids, mask, labels=labels).loss.backward()
    query_proj = grown.deberta.encoder.layer[0].attention.self.query_proj
    with torch.no_grad():
        queries = query_proj(torch.randn(3, 32).repeat(1, 2))  # a hidden state is two copies of a small one
    torch.testing.assert_close(queries[:, 5], queries[:, 37])                 # unit 5 and its copy 32 + 5 ...
    assert (query_proj.weight.grad[5] - query_proj.weight.grad[37]).abs().max() > 1e-6  # ... learn differently


@pytest.mark.unit
@pytest.mark.parametrize("args,message", [
    ((48, 2, None, None), "--hidden-size 48: must be a multiple of the model's hidden_size 32"),
    ((64, 2, None, 2), "--heads 2: widening by 2 keeps the head size 16, so the model gets 4 heads"),
    ((32, 1, None, None), "--num-layers 1: fewer than the model's 2 layers"),
    ((32, 2, 20, None), "--intermediate-size 20: smaller than the model's 48"),
])
def test_impossible_growth_is_named(args, message):
    with pytest.raises(ConfigError, match=message):
        grow_model(trained_looking({}), *args)


@pytest.mark.integration
def test_grow_a_checkpoint_and_continue_pretraining(sample_data, tmp_path_factory, tmp_path):
    data_dir = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    config = write_config(tmp_path / "small.yaml", data_dir, tmp_path / "small", train={"max_steps": 6})
    env = rank_env(tmp_path)
    small_run = subprocess.run([PYTHON, "-m", "distaff.train.pretrain", "--config", str(config)], env=env,
                               capture_output=True, text=True, timeout=240)
    assert small_run.returncode == 0, run_log(small_run)
    assert main([str(tmp_path / "small"), str(tmp_path / "grown"), "--hidden-size", "128", "--num-layers", "3"]) == 0
    small, _ = load_model(tmp_path / "small")
    grown, tokenizer = load_model(tmp_path / "grown")
    assert tokenizer == tmp_path / "grown" / "tokenizer" and grown.config.num_hidden_layers == 3
    ids = torch.randint(5, 1000, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(grown.eval()(ids).logits, small.eval()(ids).logits, atol=2e-5, rtol=1e-5)
    # a run from the grown weights (lr ~0, so the weights it trains are still the grown ones); its model
    # section names the folder only: the architecture comes from there
    values = yaml.safe_load(config.read_text())
    values["model"] = {"init_from": str(tmp_path / "grown"), "hidden_dropout_prob": 0.0}
    big = tmp_path / "big.yaml"
    big.write_text(yaml.safe_dump(values))
    overrides = ["optim.lr=1e-12", "train.max_steps=2", f"run.out_dir={tmp_path / 'big'}"]
    big_run = subprocess.run([PYTHON, "-m", "distaff.train.pretrain", "--config", str(big), *overrides], env=env,
                             capture_output=True, text=True, timeout=240)
    assert big_run.returncode == 0, run_log(big_run)
    continued, _ = load_model(tmp_path / "big")
    assert continued.config.hidden_size == 128 and continued.config.num_hidden_layers == 3
    with torch.no_grad():
        torch.testing.assert_close(continued.eval()(ids).logits, small(ids).logits, atol=1e-4, rtol=1e-4)
    with pytest.raises(ConfigError, match=r"model.init_from: .* has hidden_size=128 but model.hidden_size asks for 64"):
        load_config(config, [f"model.init_from={tmp_path / 'grown'}"])  # the small config sets model.hidden_size: 64


@pytest.mark.integration
def test_grow_cli_names_a_bad_model(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "out"), "--num-layers", "4"]) == 2
    assert "nowhere: not a model" in capsys.readouterr().err


@pytest.mark.integration
def test_grow_cli_refuses_a_zero_size_instead_of_copying(small_model_dir, tmp_path, capsys):
    assert main([str(small_model_dir), str(tmp_path / "out"), "--hidden-size", "0"]) == 2
    assert "distaff grow: --hidden-size: expected a whole number >= 1" in capsys.readouterr().err
    assert main([str(small_model_dir), str(tmp_path / "out"), "--hidden-size", "48"]) == 2
    assert "--hidden-size 48: must be a multiple" in capsys.readouterr().err
    assert main([str(small_model_dir), str(tmp_path / "out"), "--num-layers", "1"]) == 2
    assert "--num-layers 1: fewer than" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.integration
def test_grow_overwrite_leaves_no_old_file_behind(small_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier model")
    assert main([str(small_model_dir), str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err and (out / "stale.txt").exists()
    assert main([str(small_model_dir), str(out), "--overwrite"]) == 0
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]      # no temporary folder left beside it
