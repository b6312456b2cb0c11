"""``distaff data prepare``: real text -> tar shards -> the same tokens; formats, packing, resume."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_fixtures import SEQ_LEN, read_sample

import distaff.train.data.prepare as prepare_module
from distaff.launch.cli import main as distaff_main
from distaff.train.data.manifest import read_manifest
from distaff.train.data.prepare import PrepareConfig, prepare
from distaff.train.data.shards import iter_shard
from distaff.train.data.sources import ReadOptions, iter_documents
from distaff.train.data.tokenizer import load_tokenizer_info

pytestmark = pytest.mark.integration


def _read_split(out: Path, split: str) -> list[np.ndarray]:
    manifest = read_manifest(out)
    samples = []
    for shard in manifest.splits[split].shards:
        with open(out / shard.path, "rb") as f:
            samples += [a for _, a in iter_shard(f, shard.path, np.dtype(manifest.dtype))]
    return samples


def _contents(sequences: list[np.ndarray], sep_id: int) -> list[int]:
    """Token ids without the [CLS] ... [SEP] framing, in order."""
    return [int(t) for seq in sequences for t in seq[1:] if t != sep_id]


def _prepare(tmp_path: Path, tokenizer_dir: Path, inputs: list[Path], **options) -> Path:
    out = tmp_path / "out"
    settings = dict(seq_len=SEQ_LEN, shard_mb=0.05, heldout_every=0, workers=0, progress=False) | options
    prepare(PrepareConfig(inputs=tuple(map(str, inputs)), tokenizer_dir=str(tokenizer_dir), out_dir=str(out),
                          **settings))
    return out


def test_round_trip_text_to_shards_to_tokens(data_dir: Path, corpus_files: list[Path], tokenizer_dir: Path) -> None:
    info = load_tokenizer_info(tokenizer_dir)
    docs = [d.text for d in iter_documents(corpus_files, ReadOptions())]
    encoded = info.processor().encode(docs)
    heldout_docs = [ids for i, ids in enumerate(encoded, start=1) if i % 20 == 0]
    train_docs = [ids for i, ids in enumerate(encoded, start=1) if i % 20 != 0]
    train, heldout = _read_split(data_dir, "train"), _read_split(data_dir, "heldout")
    assert _contents(train, info.sep_id) == [t for ids in train_docs for t in ids]
    assert _contents(heldout, info.sep_id) == [t for ids in heldout_docs for t in ids]
    assert all(len(s) <= SEQ_LEN and s[0] == info.cls_id and s[-1] == info.sep_id for s in train + heldout)
    # Without --pack-documents a sequence never spans two documents.
    assert len(train) >= len(train_docs)
    assert info.processor().decode(train[0][1:-1].tolist()) == info.processor().decode(train_docs[0][:SEQ_LEN - 2])


def test_manifest_describes_the_shards(data_dir: Path, tokenizer_dir: Path) -> None:
    manifest = read_manifest(data_dir)
    info = load_tokenizer_info(tokenizer_dir)
    assert manifest.dtype == "uint16" and manifest.seq_len == SEQ_LEN
    assert manifest.tokenizer_fingerprint == info.fingerprint
    assert len(manifest.sources) == 4
    for name in ("train", "heldout"):
        split = manifest.splits[name]
        samples = _read_split(data_dir, name)
        assert split.samples == len(samples) and split.tokens == sum(len(s) for s in samples)
        counts = np.bincount(np.concatenate(samples), minlength=info.vocab_size)
        counts[list(info.special_ids)] = 0
        assert split.non_special_tokens == counts.sum()
        assert split.top_tokens == [(int(i), int(counts[i])) for i in np.argsort(-counts, kind="stable")[:20]]
    raw = json.loads((data_dir / "manifest.json").read_text())
    assert raw["splits"]["train"]["samples"] == manifest.splits["train"].samples
    assert (data_dir / "tokenizer" / "spm.model").is_file() and (data_dir / "tokenizer" / "tokenizer.json").is_file()


def test_long_document_is_split_not_dropped(tmp_path: Path, sample_data: Path, tokenizer_dir: Path) -> None:
    # One paragraph, far longer than SEQ_LEN tokens.
    book = " ".join(read_sample(sample_data / "austen-emma-pride.txt.gz", 60_000).split())
    src = tmp_path / "book.txt"
    src.write_text(book)
    info = load_tokenizer_info(tokenizer_dir)
    out = _prepare(tmp_path, tokenizer_dir, [src])
    train = _read_split(out, "train")
    expected = info.processor().encode(book)
    assert len(expected) > 20 * SEQ_LEN
    assert _contents(train, info.sep_id) == expected
    assert [len(s) for s in train[:-1]] == [SEQ_LEN] * (len(train) - 1)


def test_jsonl_gz_and_parquet_give_the_same_tokens_as_txt(tmp_path: Path, corpus_files: list[Path],
                                                          tokenizer_dir: Path) -> None:
    texts = [d.text for d in iter_documents([corpus_files[2]], ReadOptions())][:300]
    txt = tmp_path / "docs.txt"
    txt.write_text("\n\n".join(texts) + "\n")
    jsonl = tmp_path / "docs.jsonl.gz"
    with gzip.open(jsonl, "wt") as f:
        f.writelines(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(texts))
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": texts}), parquet, row_group_size=64)
    results = []
    for name, src in (("txt", txt), ("jsonl", jsonl), ("parquet", parquet)):
        out = _prepare(tmp_path / name, tokenizer_dir, [src], read=ReadOptions(text_field="body"))
        results.append([s.tolist() for s in _read_split(out, "train")])
    assert results[0] == results[1] == results[2] and len(results[0]) >= 300


def test_doc_per_file(tmp_path: Path, corpus_files: list[Path], tokenizer_dir: Path) -> None:
    out = _prepare(tmp_path, tokenizer_dir, [corpus_files[3]], read=ReadOptions(doc_per_file=True))
    info = load_tokenizer_info(tokenizer_dir)
    expected = info.processor().encode(corpus_files[3].read_text().strip("\n"))
    assert _contents(_read_split(out, "train"), info.sep_id) == expected


def test_pack_documents_fills_sequences(tmp_path: Path, corpus_files: list[Path], tokenizer_dir: Path) -> None:
    info = load_tokenizer_info(tokenizer_dir)
    out = _prepare(tmp_path, tokenizer_dir, [corpus_files[0]], pack_documents=True)
    train = _read_split(out, "train")
    docs = info.processor().encode([d.text for d in iter_documents([corpus_files[0]], ReadOptions())])
    assert _contents(train, info.sep_id) == [t for ids in docs for t in ids]
    lengths = np.array([len(s) for s in train])
    assert lengths.max() <= SEQ_LEN and lengths[:-1].mean() > 0.95 * SEQ_LEN
    assert (np.array([int((s == info.sep_id).sum()) for s in train]) > 1).mean() > 0.5  # documents share rows


def test_interrupted_prepare_resumes_without_redoing_finished_shards(
        tmp_path: Path, corpus_files: list[Path], tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = _prepare(tmp_path / "ref", tokenizer_dir, corpus_files[:3], heldout_every=10)
    real = prepare_module._process_block
    processed: list[int] = []

    def crash_after_three(block, config, tokenizer):
        if len(processed) == 3:
            raise KeyboardInterrupt("simulated interruption")
        processed.append(block.index)
        return real(block, config, tokenizer)

    monkeypatch.setattr(prepare_module, "_process_block", crash_after_three)
    with pytest.raises(KeyboardInterrupt):
        _prepare(tmp_path / "run", tokenizer_dir, corpus_files[:3], heldout_every=10)
    out = tmp_path / "run" / "out"
    first = sorted(out.glob("*/shard-*.tar"))
    stamps = {p: p.stat().st_mtime_ns for p in first}
    assert len(first) >= 3 and not (out / "manifest.json").exists()

    processed.clear()
    monkeypatch.setattr(prepare_module, "_process_block", lambda b, c, t: processed.append(b.index) or real(b, c, t))
    _prepare(tmp_path / "run", tokenizer_dir, corpus_files[:3], heldout_every=10)
    assert {p: p.stat().st_mtime_ns for p in first} == stamps  # finished shards untouched
    assert processed and min(processed) == 3  # tokenization restarted at the first unfinished block
    shards = sorted(p.relative_to(out) for p in out.glob("*/shard-*.tar"))
    assert shards == sorted(p.relative_to(reference) for p in reference.glob("*/shard-*.tar"))
    assert all((out / s).read_bytes() == (reference / s).read_bytes() for s in shards)
    assert read_manifest(out).to_json()["splits"] == read_manifest(reference).to_json()["splits"]


def test_cli_prepare_then_verify(tmp_path: Path, corpus_files: list[Path], tokenizer_dir: Path,
                                 capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    code = distaff_main(["data", "prepare", "--input", str(corpus_files[2]), "--tokenizer", str(tokenizer_dir),
                         "--seq-len", "64", "--out", str(out), "--shard-mb", "0.1", "--workers", "2",
                         "--heldout-fraction", "0.05", "--no-progress"])
    assert code == 0
    assert "train:" in capsys.readouterr().out
    assert distaff_main(["data", "verify", str(out)]) == 0
    assert capsys.readouterr().out.strip().endswith(": ok")


def test_tsv_and_csv_give_the_same_tokens_as_txt_and_a_missing_column_is_one_line(
        tmp_path: Path, corpus_files: list[Path], tokenizer_dir: Path, capsys: pytest.CaptureFixture) -> None:
    texts = [d.text for d in iter_documents([corpus_files[2]], ReadOptions())][:200]
    txt = tmp_path / "docs.txt"
    tables = {"tsv": tmp_path / "docs.tsv", "csv": tmp_path / "docs.csv.gz"}
    with gzip.open(tables["csv"], "wt", newline="") as f:      # quoted fields: the paragraphs' newlines and commas
        csv.writer(f).writerows([["body", "id"], *([t, i] for i, t in enumerate(texts))])
    assert any("\n" in t for t in texts) and any("," in t for t in texts)
    tables["tsv"].write_text("id\tbody\n" + "".join(f"{i}\t{t.replace(chr(10), ' ')}\n" for i, t in enumerate(texts)))
    txt.write_text("\n\n".join(t.replace("\n", " ") for t in texts) + "\n")  # TSV has no quoting: one line a row
    flat = _read_split(_prepare(tmp_path / "txt", tokenizer_dir, [txt]), "train")
    tsv = _read_split(_prepare(tmp_path / "tsv", tokenizer_dir, [tables["tsv"]], read=ReadOptions(text_field="body")),
                      "train")
    assert [s.tolist() for s in tsv] == [s.tolist() for s in flat] and len(flat) >= 200
    csv_docs = [d.text for d in iter_documents([tables["csv"]], ReadOptions(text_field="body"))]
    assert csv_docs == texts                                   # newlines and commas inside quotes kept
    code = distaff_main(["data", "prepare", "--input", str(tables["tsv"]), "--tokenizer", str(tokenizer_dir),
                         "--seq-len", "64", "--out", str(tmp_path / "cli"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err == (f"distaff data prepare: {tables['tsv']}: no column 'text' in its header row "
                                 "(columns: ['id', 'body']); name the text column with --text-field\n")


def test_prepare_warns_in_one_line_when_batches_would_be_mostly_padding(
        tmp_path: Path, corpus_files: list[Path], tokenizer_dir: Path, capsys: pytest.CaptureFixture) -> None:
    short = tmp_path / "short.txt"       # one short paragraph each: a few tokens of 256
    short.write_text("\n\n".join(f"A short line, number {i}." for i in range(400)) + "\n")
    argv = ["data", "prepare", "--input", str(short), "--tokenizer", str(tokenizer_dir), "--seq-len", "256",
            "--heldout-fraction", "0", "--no-progress"]
    assert distaff_main([*argv, "--out", str(tmp_path / "padded")]) == 0
    warning = [line for line in capsys.readouterr().err.splitlines() if "padding" in line]
    assert len(warning) == 1 and warning[0].startswith("distaff data prepare: warning: the sequences hold ")
    filled = read_manifest(tmp_path / "padded").splits["train"]
    assert f"about {1 - filled.tokens / (filled.samples * 256):.0%} of every batch would be padding; " \
           "--pack-documents fills each sequence" in warning[0] and "data.packing=varlen" in warning[0]
    assert distaff_main([*argv, "--out", str(tmp_path / "packed"), "--pack-documents"]) == 0
    assert "padding" not in capsys.readouterr().err
