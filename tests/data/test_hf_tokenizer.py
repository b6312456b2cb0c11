"""A Hugging Face DeBERTa-v3 folder's own tokenizer (``spm.model`` + ``added_tokens.json``, no distaff metadata),
as the public checkpoints ship it: ids and special tokens against ``transformers``' ``DebertaV2Tokenizer`` on real
sentences, and fine-tuning's encoder loading finding it beside the weights."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from distaff.train.data.tokenizer import load_tokenizer_info
from distaff.train.finetune.classifier_init import load_encoder, resolve_tokenizer
from distaff.train.finetune.labelled import Example, tokenize

pytestmark = pytest.mark.unit

PIECES = 600


def _sentences(sample_data: Path, count: int) -> list[str]:
    with gzip.open(sample_data / "movie-snippets.tsv.gz", "rt", encoding="utf-8") as f:
        return [line.rstrip("\n").split("\t", 1)[1] for _, line in zip(range(count), f)]


@pytest.fixture(scope="module")
def v3_folder(sample_data: Path, tmp_path_factory) -> Path:
    """DeBERTa-v3's layout: [PAD] [CLS] [SEP] [UNK] at 0-3 inside the model, [MASK] appended after its last piece."""
    folder = tmp_path_factory.mktemp("hf-v3-tokenizer")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_sentences(sample_data, 3000)), model_prefix=str(folder / "spm"),
        vocab_size=PIECES, model_type="unigram", pad_id=0, pad_piece="[PAD]", bos_id=1, bos_piece="[CLS]",
        eos_id=2, eos_piece="[SEP]", unk_id=3, unk_piece="[UNK]", minloglevel=2)
    (folder / "spm.vocab").unlink()
    (folder / "added_tokens.json").write_text(json.dumps({"[MASK]": PIECES}))
    # microsoft/deberta-v3-base's tokenizer_config.json, with the class named (it has a config.json instead)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "DebertaV2Tokenizer",
                                                              "do_lower_case": False, "vocab_type": "spm"}))
    return folder


def _hf_tokenizer(folder: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def test_special_ids_come_from_the_model_and_the_added_tokens(v3_folder: Path):
    info = load_tokenizer_info(v3_folder)
    hf = _hf_tokenizer(v3_folder)
    assert (info.pad_id, info.cls_id, info.sep_id, info.unk_id) == (0, 1, 2, 3)
    assert (info.pad_id, info.cls_id, info.sep_id, info.unk_id, info.mask_id) == (
        hf.pad_token_id, hf.cls_token_id, hf.sep_token_id, hf.unk_token_id, hf.mask_token_id)
    assert info.mask_id == PIECES and info.vocab_size == PIECES + 1


def test_fine_tuning_ids_equal_transformers_on_real_sentences_and_pairs(v3_folder: Path, sample_data: Path):
    hf = _hf_tokenizer(v3_folder)
    texts = _sentences(sample_data, 400)[200:]            # sentences the tokenizer was trained on, and others
    info, labels = load_tokenizer_info(v3_folder), np.zeros(len(texts), dtype=np.int64)
    singles = tokenize([Example(t, None, "0", f"line {i}") for i, t in enumerate(texts)], labels, info, max_len=512)
    pairs = tokenize([Example(a, b, "0", f"line {i}") for i, (a, b) in enumerate(zip(texts, texts[1:]))],
                     labels[1:], info, max_len=512)
    for text, ids in zip(texts, singles.input_ids):
        assert ids.tolist() == hf(text)["input_ids"], text
    for (a, b), ids, types in zip(zip(texts, texts[1:]), pairs.input_ids, pairs.token_type_ids):
        expected = hf(a, b)
        assert ids.tolist() == expected["input_ids"] and types.tolist() == expected["token_type_ids"], (a, b)


def test_a_missing_mask_id_is_an_error_naming_the_folder(v3_folder: Path, tmp_path: Path):
    (tmp_path / "spm.model").write_bytes((v3_folder / "spm.model").read_bytes())
    with pytest.raises(ValueError, match=rf"{tmp_path}.*\[MASK\].*added_tokens.json"):
        load_tokenizer_info(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {str(PIECES): {"content": "[MASK]", "special": True}}}))
    assert load_tokenizer_info(tmp_path).mask_id == PIECES


def test_fine_tuning_finds_the_tokenizer_beside_hf_weights(v3_folder: Path, tmp_path: Path):
    transformers = pytest.importorskip("transformers")
    config = transformers.DebertaV2Config(vocab_size=PIECES + 100, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                                          relative_attention=True, position_buckets=16, pos_att_type=["p2c", "c2p"],
                                          norm_rel_ebd="layer_norm", share_att_key=True, position_biased_input=False)
    transformers.DebertaV2ForSequenceClassification(config).save_pretrained(tmp_path)
    for name in ("spm.model", "added_tokens.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((v3_folder / name).read_bytes())
    source = load_encoder(tmp_path, {})
    info = resolve_tokenizer(source, "", str(tmp_path))
    assert source.tokenizer_dir == tmp_path and info.mask_id == PIECES
