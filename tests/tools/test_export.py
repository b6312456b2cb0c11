"""`distaff export-hf`: ZeRO-0 and ZeRO-3 checkpoints to Hugging Face folders that transformers loads,
with the same MLM logits as our model (EMD off)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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
    (tmp_path / "run").mkdir()
    assert export_main([str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


def _two_checkpoints(run: Path, copy: Path) -> tuple[Path, Path]:
    """A copy of ``run`` whose step 16 is also saved as step 8 (sound, same weights): something to fall back to."""
    shutil.copytree(run, copy)
    newest = copy / "checkpoints" / "step-00000016"
    older = copy / "checkpoints" / "step-00000008"
    for kept in (older, copy / "checkpoints" / "step-00000012"):    # the run's own older ones (keep=3)
        shutil.rmtree(kept)
    shutil.copytree(newest, older)
    return newest, older


def _flip_bits(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("damage", ["flipped bit", "truncated"])
def test_a_damaged_checkpoint_is_never_exported(damage, sample_data, tmp_path_factory, tmp_path, capsys):
    """Resume's verification, for every reader: a run directory falls back to its newest sound checkpoint with a
    notice; a damaged checkpoint named explicitly is refused in one line (export-hf and grow alike)."""
    from distaff.train.tools.grow import main as grow_main

    run = zero_run(tmp_path_factory.getbasetemp(), sample_data, 3)
    newest, older = _two_checkpoints(run, tmp_path / "run")
    optimizer = sorted(newest.rglob("*optim_states.pt"))[0]
    if damage == "truncated":
        optimizer.write_bytes(optimizer.read_bytes()[:1000])
    else:
        _flip_bits(optimizer)
    expected = fp32_state_dict(run / "checkpoints" / "step-00000016")

    assert export_main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    err = capsys.readouterr().err
    assert f"skipping checkpoint {newest}" in err and optimizer.name in err
    from transformers import AutoModelForMaskedLM
    exported = AutoModelForMaskedLM.from_pretrained(tmp_path / "hf").state_dict()
    torch.testing.assert_close(exported["deberta.embeddings.word_embeddings.weight"],
                               expected["deberta.embeddings.word_embeddings.weight"])
    capsys.readouterr()     # transformers' progress bars
    assert export_main([str(newest), str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{newest}: damaged checkpoint: " in err and optimizer.name in err
    assert not (tmp_path / "hf2").exists()

    assert grow_main([str(newest), str(tmp_path / "grown")]) == 2
    assert "damaged checkpoint" in capsys.readouterr().err
    assert grow_main([str(tmp_path / "run"), str(tmp_path / "grown")]) == 0
    assert f"skipping checkpoint {newest}" in capsys.readouterr().err
    shutil.rmtree(older)
    assert export_main([str(tmp_path / "run"), str(tmp_path / "hf3")]) == 2
    assert "every checkpoint here is damaged" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_export_overwrite_replaces_the_whole_folder(sample_data, tmp_path_factory, tmp_path, capsys):
    """A stale added_tokens.json would give the new tokenizer one token more than the model's embedding table."""
    from transformers import AutoTokenizer

    run = zero_run(tmp_path_factory.getbasetemp(), sample_data, 3)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "added_tokens.json").write_text(json.dumps({"<stale>": 1000}))
    assert export_main([str(run), str(out)]) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert export_main([str(run), str(out), "--overwrite"]) == 0
    assert not (out / "added_tokens.json").exists()
    assert len(AutoTokenizer.from_pretrained(out)) == json.loads((out / "config.json").read_text())["vocab_size"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
