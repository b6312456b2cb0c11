"""``distaff embed``: pooling against a direct computation, whitening's defining property on its
fitting sample, the saved transform reproducing it on new runs, and bad input named."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from data_fixtures import read_sample
from helpers import CreatesMarker

from distaff.train.data.tokenizer import load_tokenizer_info
from distaff.train.tools.embed import fit_whitening, main

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def sentences(sample_data, tmp_path_factory):
    """120 lines of real prose (bundled Austen), blank lines dropped."""
    lines = [line for line in read_sample(sample_data / "austen-emma-pride.txt.gz", 60_000).splitlines()
             if len(line.split()) > 3][:120]
    path = tmp_path_factory.mktemp("text") / "lines.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_mean_and_cls_pooling_equal_a_direct_encoder_pass(small_model_dir, sentences, tmp_path):
    from distaff.train.run.model_folder import load_model

    for pooling in ("mean", "cls"):
        assert main(["--model", str(small_model_dir), "--input", str(sentences), "--out", str(tmp_path / pooling),
                     "--pooling", pooling, "--batch-size", "7"]) == 0
    model, tokenizer_dir = load_model(small_model_dir)
    tokenizer = load_tokenizer_info(tokenizer_dir)
    text = sentences.read_text().splitlines()[10]
    ids = torch.tensor([[tokenizer.cls_id, *tokenizer.processor().encode(text)[:30], tokenizer.sep_id]])
    with torch.no_grad():
        hidden = model.eval().deberta(ids)[0]   # alone, unpadded; in the file it shares a padded batch
    np.testing.assert_allclose(np.load(tmp_path / "mean" / "embeddings.npy")[10], hidden.mean(0).numpy(), atol=1e-5)
    np.testing.assert_allclose(np.load(tmp_path / "cls" / "embeddings.npy")[10], hidden[0].numpy(), atol=1e-5)


def test_whitened_sample_has_zero_mean_and_identity_covariance(small_model_dir, sentences, tmp_path):
    out = tmp_path / "fit"
    assert main(["--model", str(small_model_dir), "--input", str(sentences), "--out", str(out), "--whiten", "8",
                 "--fit-sample", "80"]) == 0
    x, rows = np.load(out / "embeddings.npy").astype(np.float64), np.load(out / "fit_rows.npy")
    assert x.shape == (120, 8) and len(rows) == 80 and len(set(rows.tolist())) == 80
    sample = x[rows]
    np.testing.assert_allclose(sample.mean(0), 0.0, atol=1e-5)
    np.testing.assert_allclose(np.cov(sample.T, bias=True), np.eye(8), atol=1e-4)
    meta = json.loads((out / "whitening.json").read_text())
    assert meta["k"] == 8 and meta["fit_rows"] == 80 and meta["pooling"] == "mean"
    # the saved transform, applied to the same text by a new run, gives the same rows
    again = tmp_path / "apply"
    assert main(["--model", str(small_model_dir), "--input", str(sentences), "--out", str(again),
                 "--transform", str(out)]) == 0
    np.testing.assert_array_equal(np.load(again / "embeddings.npy"), np.load(out / "embeddings.npy"))
    assert not (again / "whitening.safetensors").exists()


def test_fit_whitening_matches_the_definition():
    x = np.random.default_rng(0).normal(size=(500, 6)) @ np.random.default_rng(1).normal(size=(6, 6)) + 3.0
    mean, w = fit_whitening(x, 4)
    y = (x - mean) @ w
    np.testing.assert_allclose(y.T @ y / len(y), np.eye(4), atol=1e-10)
    variances = np.linalg.eigvalsh(np.cov(x.T, bias=True))[::-1]
    np.testing.assert_allclose(np.linalg.norm(w, axis=0), 1 / np.sqrt(variances[:4]), rtol=1e-8)


@pytest.mark.parametrize("args,message", [
    (["--whiten", "33"], "--whiten 33: must be between 1 and the embedding size 32"),
    (["--whiten", "20", "--fit-sample", "10"], "--whiten 20: the fitting sample \\(10 texts\\) spans only"),
    (["--transform", "{tmp}/none"], "--transform: .*none/whitening.safetensors not found"),
])
def test_bad_requests_are_named(small_model_dir, sentences, tmp_path, capsys, args, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(["--model", str(small_model_dir), "--input", str(sentences), "--out", str(tmp_path / "o"), *args]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_bad_input_files_are_named(small_model_dir, tmp_path, capsys):
    blank = tmp_path / "blank.txt"
    blank.write_text("one line\n\nthird line\n")
    assert main(["--model", str(small_model_dir), "--input", str(blank), "--out", str(tmp_path / "o")]) == 2
    assert f"{blank}:2: blank line" in capsys.readouterr().err
    assert main(["--model", str(small_model_dir), "--input", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")]) == 2
    assert "--input: file not found" in capsys.readouterr().err
    blank.write_text("one line\n")
    assert main(["--model", str(tmp_path / "nomodel"), "--input", str(blank), "--out", str(tmp_path / "o")]) == 2
    assert "--model: " + str(tmp_path / "nomodel") + " does not exist" in capsys.readouterr().err


def test_a_bare_hugging_face_encoder_folder_embeds_like_its_source(small_model_dir, sentences, tmp_path):
    """Public DeBERTa-v3 checkpoints and distaff's RTD export are ``DebertaV2Model`` folders, with no MLM head."""
    from transformers import DebertaV2Model

    from distaff.train.model.hf import to_hf
    from distaff.train.run.model_folder import load_model

    model, tokenizer_dir = load_model(small_model_dir)
    bare = to_hf(model, tmp_path / "hf", tokenizer_dir)
    DebertaV2Model.from_pretrained(bare).save_pretrained(bare)   # the encoder alone replaces the MLM folder's weights
    for name, source in (("source", small_model_dir), ("bare", bare)):
        assert main(["--model", str(source), "--input", str(sentences), "--out", str(tmp_path / name)]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "bare" / "embeddings.npy"),
                               np.load(tmp_path / "source" / "embeddings.npy"), atol=1e-5)


def test_transform_with_other_pooling_is_refused(small_model_dir, sentences, tmp_path, capsys):
    assert main(["--model", str(small_model_dir), "--input", str(sentences), "--out", str(tmp_path / "t"), "--whiten", "4",
                 "--pooling", "cls"]) == 0
    assert main(["--model", str(small_model_dir), "--input", str(sentences), "--out", str(tmp_path / "u"),
                 "--transform", str(tmp_path / "t"), "--pooling", "mean"]) == 2
    assert "fitted on 'cls' pooling" in capsys.readouterr().err


def test_an_hf_folder_with_only_a_pickled_bin_is_refused_naming_the_file(small_model_dir, sentences, tmp_path, capsys):
    """An HF folder whose weights are a pytorch_model.bin holding more than tensors: nothing runs, and the error
    names the file and the folder and says what to do."""
    from distaff.train.finetune.classifier_init import load_encoder
    from distaff.train.model.config import ConfigError
    from distaff.train.model.hf import to_hf
    from distaff.train.run.model_folder import load_model

    model, tokenizer_dir = load_model(small_model_dir)
    folder = to_hf(model, tmp_path / "hf", tokenizer_dir)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "code-ran"
    torch.save({"deberta.embeddings.word_embeddings.weight": CreatesMarker(marker)}, folder / "pytorch_model.bin")
    assert main(["--model", str(folder), "--input", str(sentences), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"{folder / 'pytorch_model.bin'}: refusing to load, the file holds objects that are not plain weights" in err
    assert f"{folder} has no model.safetensors: where you trust the file, convert it" in err
    with pytest.raises(ConfigError, match=re.escape(f"model.init_from: {folder / 'pytorch_model.bin'}: refusing")):
        load_encoder(folder, {})
    assert not marker.exists()


def test_out_holding_files_needs_overwrite(small_model_dir, sentences, tmp_path, capsys):
    out = tmp_path / "used"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = ["--model", str(small_model_dir), "--input", str(sentences), "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not an empty folder; pass --overwrite" in err
    assert main([*args, "--overwrite"]) == 0 and (out / "embeddings.npy").is_file()


@pytest.mark.parametrize("meta", ['{"pooling": "me', "null", '{"k": 2}'])
def test_a_damaged_transform_is_one_line_naming_its_file(tmp_path, meta):
    """Issue 48: a transform's whitening.json that is torn or not a transform's was a traceback."""
    from safetensors.torch import save_file

    from distaff.train.core.errors import UserError
    from distaff.train.tools.embed import TRANSFORM_META, TRANSFORM_WEIGHTS, load_transform

    save_file({"mean": torch.zeros(4), "W": torch.eye(4)}, str(tmp_path / TRANSFORM_WEIGHTS))
    (tmp_path / TRANSFORM_META).write_text(meta)
    with pytest.raises(UserError, match=re.escape(str(tmp_path / TRANSFORM_META))) as err:
        load_transform(tmp_path)
    assert "\n" not in str(err.value)
