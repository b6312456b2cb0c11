"""The files a data dir holds, read strictly (issue 41): every numeric field range-checked where it is read (cause 4:
a manifest ``seq_len`` of -64 gave a plan with negative tokens/s, 0 a ZeroDivisionError), every text file decoded
with an error naming the file, line and byte (cause 5), and the weak cases: SentencePiece's silently dropped long
lines, a garbled tar header reported as a truncated shard.
"""

from __future__ import annotations

import copy
import gzip
import io
import json
import logging
import tarfile
from pathlib import Path

import numpy as np
import pytest

from distaff.train.core.files import decode_text
from distaff.train.data.errors import DataError
from distaff.train.data.manifest import Manifest
from distaff.train.data.shards import iter_shard, write_shard
from distaff.train.data.tokenizer import _pieces, load_tokenizer_info, train_tokenizer
from distaff.train.finetune.labelled import InputFormat, read_examples

pytestmark = pytest.mark.unit

GOOD = {"format": "distaff-shards/1", "seq_len": 64, "dtype": "uint16", "vocab_size": 1000,
        "tokenizer_fingerprint": "ab" * 32, "special_ids": {"pad": 0, "cls": 1, "sep": 2, "unk": 3, "mask": 4},
        "pack_documents": True, "sources": [], "skipped": {},
        "splits": {"train": {"shards": [{"path": "train/shard-000000.tar", "samples": 3, "tokens": 90, "sha256": ""}],
                             "top_tokens": [[5, 10]], "non_special_tokens": 80}}}


def _with(path: str, value) -> dict:
    data = copy.deepcopy(GOOD)
    *keys, last = path.split(".")
    node = data
    for key in keys:
        node = node[int(key)] if key.isdigit() else node[key]
    node[last] = value
    return data


@pytest.mark.parametrize("field, value, message", [
    ("seq_len", 0, "seq_len: expected a whole number >= 3"), ("seq_len", -64, "seq_len: expected a whole number >= 3"),
    ("seq_len", 1 << 40, "seq_len: expected a whole number >= 3 and <= 16,777,216"),
    ("seq_len", 64.5, "seq_len: expected a whole number"), ("seq_len", True, "seq_len: expected a whole number"),
    ("seq_len", None, "seq_len: expected a whole number"),
    ("dtype", "object", "dtype 'object' is not a token dtype (uint16, int32)"),
    ("dtype", "float32", "dtype 'float32' is not a token dtype"),
    ("vocab_size", 0, "vocab_size: expected a whole number >= 5"),
    ("vocab_size", 70000, "dtype uint16 cannot hold the ids of a vocabulary of 70000"),
    ("special_ids.mask", 1000, "special_ids.mask: expected a whole number >= 0 and <= 999, got 1000"),
    ("special_ids.pad", -1, "special_ids.pad: expected a whole number >= 0"),
    ("special_ids", {"pad": 0}, "special_ids must name ['pad', 'cls', 'sep', 'unk', 'mask']"),
    ("splits.train.shards.0.samples", -3, "shard train/shard-000000.tar samples: expected a whole number >= 1"),
    ("splits.train.shards.0.tokens", 2, "shard train/shard-000000.tar tokens: expected a whole number >= 3"),
    ("splits.train.top_tokens", [[1000, 3]], "top_tokens id: expected a whole number >= 0 and <= 999"),
    ("splits.train.non_special_tokens", -1, "non_special_tokens: expected a whole number >= 0"),
])
def test_every_manifest_number_is_range_checked_where_it_is_read(field, value, message):
    Manifest.from_json(GOOD, "m.json")                                  # the good one reads
    with pytest.raises(DataError, match=rf"^m\.json: .*{_escaped(message)}"):
        Manifest.from_json(_with(field, value), "m.json")


def _escaped(message: str) -> str:
    import re

    return re.escape(message)


def test_tokenizer_metadata_ids_lie_inside_the_vocabulary(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "spm.model").write_bytes(b"model")
    from distaff.train.core.files import file_sha256

    meta = {"vocab_size": 300, "fingerprint": file_sha256(folder / "spm.model"),
            "special_ids": {"pad": 0, "cls": 1, "sep": 2, "unk": 3, "mask": 300}}
    for edit, message in (({}, "special_ids.mask: expected a whole number >= 0 and <= 299, got 300"),
                          ({"vocab_size": 2.5}, "vocab_size: expected a whole number >= 5, got 2.5"),
                          ({"special_ids": {"pad": 0}}, "special_ids must name")):
        (folder / "distaff_tokenizer.json").write_text(json.dumps({**meta, **edit}))
        with pytest.raises(DataError, match=_escaped(message)):
            load_tokenizer_info(folder)
    (folder / "distaff_tokenizer.json").write_bytes(b'{"vocab_size": 3\xff00}')
    with pytest.raises(DataError, match=r"distaff_tokenizer.json, line 1, byte 17: byte 0xff is not UTF-8"):
        load_tokenizer_info(folder)


@pytest.mark.parametrize("raw, where", [
    (b"caf\xe9", "line 1, byte 4: byte 0xe9"), (b"a\nb\nc\xff\xfed\n", "line 3, byte 2: byte 0xff"),
    (b"ok\n\xc3", "line 2, byte 1: byte 0xc3"), (b"x: 1\ny: a\x00b\n", "line 2, byte 5: a NUL byte"),
])
def test_the_decoder_names_the_line_and_byte(raw, where):
    with pytest.raises(DataError, match=_escaped(f"f.txt, {where}")):
        decode_text(raw, "f.txt", error=DataError)


def test_labelled_files_that_are_not_utf8_name_the_line_and_byte(tmp_path):
    tsv, jsonl = tmp_path / "train.tsv", tmp_path / "train.jsonl"
    tsv.write_bytes(b"label\ttext\n1\tgood\n0\tbad caf\xe9\n")
    jsonl.write_bytes(b'{"label": 1, "text": "good"}\n{"label": 0, "text": "caf\xe9"}\n')
    fmt = InputFormat(text_column="text", label_column="label")
    with pytest.raises(DataError, match=_escaped(f"{tsv}, line 3, byte 10: byte 0xe9 is not UTF-8")):
        read_examples(tsv, fmt, regression=False)
    with pytest.raises(DataError, match=_escaped(f"{jsonl}, line 2, byte 26: byte 0xe9 is not UTF-8")):
        read_examples(jsonl, fmt, regression=False)


# ---------------------------------------------------------------- weak: long lines, garbled tar headers


def test_a_long_line_is_cut_at_spaces_and_none_of_it_is_lost():
    line = "é" * 10_000 + " ab " + "x" * 20_000 + " end"
    pieces = list(_pieces(line, 16_384))
    assert "".join(pieces) == line and all(len(p.encode()) <= 16_384 for p in pieces) and len(pieces) == 4
    assert list(_pieces("short line", 16_384)) == ["short line"]


def test_tokenizer_training_on_long_lines_trains_on_them_and_says_so(sample_data, tmp_path, caplog):
    """SentencePiece drops a line over 16,384 bytes without a word: a corpus of one long line found "no text"."""
    with gzip.open(sample_data / "shakespeare.txt.gz", "rt") as handle:
        words = handle.read(60_000).split()
    corpus = tmp_path / "one-line.txt"
    corpus.write_text(" ".join(words) + "\n")
    with caplog.at_level(logging.WARNING):
        info = train_tokenizer([corpus], 300, tmp_path / "tok", num_threads=1)
    assert info.vocab_size == 300
    assert "1 line(s) longer than 16,384 bytes were cut at spaces" in caplog.text


def _shard(tmp_path: Path) -> tuple[Path, int]:
    path = tmp_path / "shard.tar"
    write_shard(path, [np.array([1, 5, 6, 2], dtype=np.uint16) for _ in range(12)])
    with tarfile.open(path) as tar:
        return path, tar.getmembers()[5].offset


def _read_all(raw: bytes) -> list:
    return [name for name, _ in iter_shard(io.BytesIO(raw), "s.tar", np.dtype(np.uint16))]


def test_a_garbled_tar_header_is_corrupt_and_a_cut_shard_truncated(tmp_path):
    path, offset = _shard(tmp_path)
    raw = path.read_bytes()
    assert len(_read_all(raw)) == 12
    garbled = raw[:offset] + b"\xff" * 100 + raw[offset + 100:]
    with pytest.raises(DataError, match=_escaped(f"s.tar: corrupt tar header at byte {offset:,} (after member "
                                                 "00000004.npy): the shard is damaged, not truncated")):
        _read_all(garbled)
    assert len(_read_all(raw[:offset])) == 5                # cut at a header: the count check calls it truncated


def test_a_manifest_that_is_not_utf8_json_names_the_line_and_byte(tmp_path):
    from distaff.train.data.manifest import read_manifest

    (tmp_path / "manifest.json").write_bytes(json.dumps(GOOD, indent=1).replace('"pack_documents"', '"pack_d\xe9"')
                                             .encode("latin-1"))
    with pytest.raises(DataError, match=r"manifest.json, line 14, byte 9: byte 0xe9 is not UTF-8"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": "distaff-shards/1",\n "seq_len": }')
    with pytest.raises(DataError, match=r"manifest.json, line 2, column 13: not valid JSON"):
        read_manifest(tmp_path)


@pytest.mark.parametrize("field, value", [("layer_norm_eps", float("nan")), ("rope_theta", float("inf")),
                                          ("initializer_range", float("-inf"))])
def test_a_model_configs_float_fields_are_finite_where_read(tmp_path, field, value):
    """A model's config.json (a Hugging Face folder, a distaff model folder) may say NaN or Infinity: refused."""
    from distaff.train.model.config import ConfigError
    from distaff.train.run.model_folder import MODEL_CONFIG_FILE, read_model_config

    (tmp_path / MODEL_CONFIG_FILE).write_text(json.dumps({"hidden_size": 32, field: value}))
    with pytest.raises(ConfigError, match=f"{field} must be a finite number, got {value}"):
        read_model_config(tmp_path)
