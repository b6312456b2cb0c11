"""RTD discriminators and Hugging Face folders: the RTD head (``mask_predictions.*``) is kept when
reading a v3-style checkpoint, a bare ``DebertaV2Model`` folder loads with a fresh head, and
``rtd.init_discriminator`` starts an RTD run from such a folder under each embedding-sharing mode."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from distaff.train.model import rtd
from distaff.train.model.hf import discriminator_from_hf, discriminator_to_hf
from distaff.train.pretrain.objectives import objective_for
from distaff.train.run.config import ConfigError, config_from_dict

pytestmark = pytest.mark.unit

MODEL = {"preset": "tiny", "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
         "num_hidden_layers": 2, "position_buckets": 8, "max_position_embeddings": 64, "vocab_size": 120,
         "attention_impl": "reference", "kernel_impl": "reference"}


def run_config(**rtd_section):
    return config_from_dict({"data": {"dir": "x"}, "model": MODEL, "train": {"objective": "rtd"}, "rtd": rtd_section})


def trained_discriminator(seed: int = 0) -> rtd.Discriminator:
    """A discriminator with non-trivial weights everywhere (the head included)."""
    torch.manual_seed(seed)
    cfg = run_config()
    model = rtd.Discriminator(objective_for(cfg, cfg.model_config()).model_cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def v3_style_folder(tmp_path, model: rtd.Discriminator):
    """Like the public v3 checkpoints: ``deberta.*``, ``mask_predictions.*``, plus an unused MLM head
    and absolute position table."""
    folder = discriminator_to_hf(model, tmp_path / "v3")
    state = load_file(folder / "model.safetensors")
    hidden = model.config.hidden_size
    state["lm_predictions.lm_head.dense.weight"] = torch.randn(hidden, hidden)
    state["lm_predictions.lm_head.bias"] = torch.randn(model.config.vocab_size)
    state["deberta.embeddings.position_embeddings.weight"] = torch.randn(64, hidden)
    save_file(state, folder / "model.safetensors")
    return folder


def ids_and_mask():
    ids = torch.randint(5, 120, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    return ids, mask


def test_reading_a_v3_checkpoint_keeps_the_rtd_head(tmp_path):
    ours = trained_discriminator()
    loaded, has_head = discriminator_from_hf(v3_style_folder(tmp_path, ours))
    assert has_head
    ids, mask = ids_and_mask()
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(ids, mask), ours(ids, mask))
    assert torch.equal(loaded.mask_predictions.classifier.weight, ours.mask_predictions.classifier.weight)


def test_a_bare_transformers_model_loads_with_a_fresh_head(tmp_path):
    from transformers import DebertaV2Model

    ours = trained_discriminator()
    hf = DebertaV2Model.from_pretrained(discriminator_to_hf(ours, tmp_path / "export")).eval()
    hf.save_pretrained(tmp_path / "bare")
    assert not any(k.startswith("mask_predictions.") for k in load_file(tmp_path / "bare" / "model.safetensors"))
    loaded, has_head = discriminator_from_hf(tmp_path / "bare")
    loaded.eval()
    assert not has_head
    ids, mask = ids_and_mask()
    keep = mask.bool()
    with torch.no_grad():
        torch.testing.assert_close(loaded.deberta(ids, mask)[keep], hf(input_ids=ids, attention_mask=mask)
                                   .last_hidden_state[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sharing", ["gdes", "es", "none"])
def test_init_discriminator_starts_rtd_from_an_hf_checkpoint(sharing, tmp_path):
    source = trained_discriminator(seed=1)
    folder = v3_style_folder(tmp_path, source)
    cfg = run_config(init_discriminator=str(folder), embedding_sharing=sharing)
    model = objective_for(cfg, cfg.model_config()).build(rank=0).eval()
    table = source.deberta.embeddings.word_embeddings.weight
    assert torch.equal(model.discriminator_word_embeddings(), table)
    if sharing == "gdes":
        assert torch.equal(model.generator.word_embeddings.weight, table)
        assert not model.discriminator.deberta.embeddings.word_embeddings.weight.any()
    ids, mask = ids_and_mask()
    offset = model.generator.word_embeddings(ids) if sharing == "gdes" else None
    with torch.no_grad():
        torch.testing.assert_close(model.discriminator(ids, mask, word_offset=offset), source(ids, mask))


def test_init_discriminator_refuses_another_architecture(tmp_path):
    folder = v3_style_folder(tmp_path, trained_discriminator())
    cfg = config_from_dict({"data": {"dir": "x"}, "model": {**MODEL, "num_hidden_layers": 3},
                            "train": {"objective": "rtd"}, "rtd": {"init_discriminator": str(folder)}})
    with pytest.raises(ConfigError, match="rtd.init_discriminator: .*num_hidden_layers: 2 there, 3 here"):
        objective_for(cfg, cfg.model_config()).build(rank=0)
    cfg = run_config(init_discriminator=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="rtd.init_discriminator: no config.json"):
        objective_for(cfg, cfg.model_config()).build(rank=0)
