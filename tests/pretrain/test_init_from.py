"""``model.init_from``: a run's model built from an HF folder or a distaff model folder, with the
folder's architecture and weights; conflicting run settings named."""

from __future__ import annotations

import pytest
import torch

from distaff.train.model.config import ModelConfig
from distaff.train.model.deberta import DebertaForMaskedLM
from distaff.train.model.hf import from_hf, to_hf
from distaff.train.run.config import ConfigError, load_config
from distaff.train.run.model_folder import load_initial_weights, save_model_folder

pytestmark = pytest.mark.unit

SMALL = dict(vocab_size=80, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=32, position_buckets=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _run_model(folder, *overrides):
    cfg = load_config(None, ["data.dir=x", f"model.init_from={folder}", *overrides])
    model = DebertaForMaskedLM(cfg.model_config(vocab_size=80, pad_token_id=0))
    load_initial_weights(model, folder)
    return model.eval()


def test_run_starts_from_an_hf_folder_with_emd_added(tmp_path):
    torch.manual_seed(0)
    to_hf(DebertaForMaskedLM(ModelConfig(**SMALL)), tmp_path / "hf")
    model = _run_model(tmp_path / "hf", "model.attention_probs_dropout_prob=0.1")
    assert model.config.emd and model.config.hidden_size == 32   # the pretraining default; preset `tiny` unused
    reference = from_hf(tmp_path / "hf").eval()
    ids = torch.randint(5, 80, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model.deberta(ids), reference.deberta(ids))


def test_run_starts_from_a_distaff_folder_keeping_rope_and_emd(tmp_path):
    torch.manual_seed(0)
    source = DebertaForMaskedLM(ModelConfig(**SMALL, rope=True, emd=True)).eval()
    save_model_folder(source, tmp_path / "m", tokenizer=None)
    model = _run_model(tmp_path / "m")
    assert model.config.rope and model.config.emd
    ids = torch.randint(5, 80, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source(ids).logits)
    without_emd = _run_model(tmp_path / "m", "model.emd=false")   # EMD may be switched off
    assert without_emd.emd is None


def test_conflicts_with_the_folder_are_named(tmp_path):
    save_model_folder(DebertaForMaskedLM(ModelConfig(**SMALL)), tmp_path / "m", tokenizer=None)
    with pytest.raises(ConfigError, match=r"model.init_from: .*m has rope=False but model.rope asks for True"):
        load_config(None, ["data.dir=x", f"model.init_from={tmp_path / 'm'}", "model.rope=true"])
    cfg = load_config(None, ["data.dir=x", f"model.init_from={tmp_path / 'm'}"])
    with pytest.raises(ConfigError, match="has vocab_size=80 but the data's tokenizer asks for 1000"):
        cfg.model_config(vocab_size=1000, pad_token_id=0)
    with pytest.raises(ConfigError, match="is not a model folder .*; for a run directory or checkpoint, make one "
                                          "first: `distaff grow RUN OUT`"):
        load_config(None, ["data.dir=x", f"model.init_from={tmp_path}"])
