"""Model presets and the errors a bad model config or checkpoint gives."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from distaff.train.model.config import ConfigError, ModelConfig, load_model_config, preset_names
from distaff.train.model.deberta import DebertaForMaskedLM
from distaff.train.model.hf import from_hf, to_hf

pytestmark = pytest.mark.unit

V3 = {"deberta-v3-xsmall": (12, 384, 6, 1536), "deberta-v3-small": (6, 768, 12, 3072),
      "deberta-v3-base": (12, 768, 12, 3072), "deberta-v3-large": (24, 1024, 16, 4096)}


@pytest.mark.parametrize("name", V3)
def test_v3_presets(name):
    cfg = load_model_config(name)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size) == V3[name]
    assert cfg.head_dim == 64 and cfg.vocab_size == 128100 and cfg.max_position_embeddings == 512
    assert cfg.position_buckets == 256 and cfg.share_att_key and cfg.norm_rel_ebd == "layer_norm"
    assert sorted(cfg.pos_att_type) == ["c2p", "p2c"] and not cfg.position_biased_input
    assert cfg.hidden_dropout_prob == cfg.attention_probs_dropout_prob == 0.1 and cfg.layer_norm_eps == 1e-7


def test_tiny_preset_builds_and_runs():
    assert "tiny" in preset_names()
    model = DebertaForMaskedLM(load_model_config("tiny", vocab_size=100, emd=True))
    ids = torch.randint(5, 100, (2, 16))
    out = model(ids, labels=torch.where(torch.rand(2, 16) < 0.3, ids, -100))
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("change,message", [
    (dict(hidden_size=100, num_attention_heads=12), "must be divisible by num_attention_heads"),
    (dict(pos_att_type=["c2p", "p2p"]), "pos_att_type: unsupported"),
    (dict(pos_att_type="c2p|x2y"), "pos_att_type: unsupported"),
    (dict(hidden_act="relu"), "hidden_act"),
    (dict(norm_rel_ebd="rms"), "norm_rel_ebd"),
    (dict(attention_impl="cuda"), "attention_impl"),
    (dict(num_hidden_layers="12"), "num_hidden_layers must be of type int"),
    (dict(hidden_dropout_prob=1.5), "hidden_dropout_prob"),
])
def test_inconsistent_config_names_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**change)


def test_unknown_preset_and_field():
    with pytest.raises(ConfigError, match="unknown model preset 'deberta-v9'"):
        load_model_config("deberta-v9")
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['hiden_size'\]"):
        load_model_config("tiny", hiden_size=3)
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        load_model_config("/nowhere/missing.yaml")


@pytest.fixture
def exported(tmp_path):
    cfg = ModelConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=16, position_buckets=4)
    return to_hf(DebertaForMaskedLM(cfg), tmp_path / "model")


def test_unsupported_hf_field_is_named(exported):
    config = json.loads((exported / "config.json").read_text())
    (exported / "config.json").write_text(json.dumps({**config, "conv_kernel_size": 3}))
    with pytest.raises(ConfigError, match="conv_kernel_size=3"):
        from_hf(exported)


def test_mismatched_checkpoint_shapes_are_named(exported):
    config = json.loads((exported / "config.json").read_text())
    (exported / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(ValueError, match=r"layer.0.intermediate.dense.\w+ has shape \(32.*\) in the checkpoint but \(48"):
        from_hf(exported)


def test_weights_of_another_architecture_are_named(exported):
    config = json.loads((exported / "config.json").read_text())
    (exported / "config.json").write_text(json.dumps({**config, "share_att_key": False}))
    with pytest.raises(ValueError, match="missing weights .*pos_key_proj"):
        from_hf(exported)
    state = load_file(exported / "model.safetensors")
    state["deberta.encoder.layer.7.output.dense.weight"] = torch.zeros(1)
    save_file(state, exported / "model.safetensors")
    (exported / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not used by a model of this config.*layer.7"):
        from_hf(exported)


def test_missing_files_are_named(exported, tmp_path):
    (exported / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights in .*model"):
        from_hf(exported)
    with pytest.raises(FileNotFoundError, match="no config.json in .*elsewhere"):
        from_hf(tmp_path / "elsewhere")
