"""`distaff export-hf`: ZeRO-0 and ZeRO-3 checkpoints to Hugging Face folders that transformers loads,
with the same MLM logits as our model (EMD off)."""

from __future__ import annotations

import json

import pytest
import torch

from test_pretrain_zero import zero_run

from distaff.train.run.weights import fp32_state_dict

from distaff.train.model.config import ModelConfig
from distaff.train.model.deberta import DebertaForMaskedLM
from distaff.train.tools.export import main as export_main

pytestmark = pytest.mark.integration

TEXT = ["Shall I compare thee to a summer's day? Thou art more lovely and more temperate.",
        "Now is the winter of our discontent made glorious summer by this sun of York."]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [0, 3])
def test_export_loads_in_transformers_with_identical_logits(stage, sample_data, tmp_path_factory, tmp_path):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    run = zero_run(tmp_path_factory.getbasetemp(), sample_data, stage)
    out = tmp_path / "hf"
    assert export_main([str(run), str(out)]) == 0              # a run dir resolves to its latest checkpoint

    hf_model = AutoModelForMaskedLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    batch = tokenizer(TEXT, padding=True, return_tensors="pt")
    assert batch["input_ids"].shape[1] > 10 and (batch["input_ids"] != tokenizer.unk_token_id).float().mean() > 0.9

    checkpoint = run / "checkpoints" / "step-00000016"
    meta = json.loads((checkpoint / "distaff" / "meta.json").read_text())
    assert meta["model_config"]["emd"], "pretraining runs with the Enhanced Mask Decoder"
    ours = DebertaForMaskedLM(ModelConfig.from_dict(meta["model_config"]).replace(emd=False))
    ours.load_state_dict({k: v for k, v in fp32_state_dict(checkpoint).items() if not k.startswith("emd.")})
    ours.eval()
    with torch.no_grad():
        expected = ours(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got = hf_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    keep = batch["attention_mask"].bool()
    torch.testing.assert_close(got[keep], expected[keep], rtol=1e-4, atol=1e-4)
    # a trained model, not the initialisation: predictions are far from uniform
    assert expected[keep].softmax(-1).max(-1).values.mean() > 2.0 / meta["model_config"]["vocab_size"]


def test_export_names_a_missing_checkpoint(tmp_path, capsys):
    assert export_main([str(tmp_path), str(tmp_path / "out")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
