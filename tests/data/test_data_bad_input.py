"""Bad input: every case is an error naming the file (and member), or a counted, logged skip. Never a hang."""

from __future__ import annotations

import gzip
import io
import json
import multiprocessing
import re
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
from data_fixtures import SEQ_LEN, copy_data_dir

from distaff.launch.cli import main as distaff_main
from distaff.train.data.collator import MaskingConfig
from distaff.train.data.loader import build_train_loader
from distaff.train.data.manifest import check_relpath, data_url, read_manifest
from distaff.train.data.prepare import PrepareConfig, prepare
from distaff.train.data.sources import DataError, ReadOptions
from distaff.train.data.verify import verify

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _prepare(inputs: list[Path], tokenizer_dir: Path, out: Path, **read) -> None:
    prepare(PrepareConfig(inputs=tuple(map(str, inputs)), tokenizer_dir=str(tokenizer_dir), seq_len=SEQ_LEN,
                          out_dir=str(out), read=ReadOptions(**read), heldout_every=0, workers=0, progress=False))


def _damaged(data_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the data dir and the path of its largest train shard (to damage)."""
    copy = copy_data_dir(data_dir, tmp_path / "data")
    shards = read_manifest(copy).splits["train"].shards
    return copy, copy / max(shards, key=lambda s: s.samples).path


def _verify(copy: Path, capsys: pytest.CaptureFixture) -> str:
    assert distaff_main(["data", "verify", str(copy)]) == 1
    return capsys.readouterr().out


def _read_epoch(copy: Path, num_workers: int = 0) -> None:
    loader = build_train_loader(copy, batch_size=64, rank=0, world_size=1, num_workers=num_workers, seed=0,
                                masking=MaskingConfig())
    batches = iter(loader)
    for _ in range(loader.batches_per_epoch):
        next(batches)


def _rewrite_member(shard: Path, member_index: int, name: str, data: bytes) -> str:
    """Replace one member of a tar shard; returns the replaced member's original name."""
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    original = members[member_index][0].name
    info = tarfile.TarInfo(name)
    info.size = len(data)
    members[member_index] = (info, data)
    with tarfile.open(shard, "w") as tar:
        for member, payload in members:
            tar.addfile(member, io.BytesIO(payload))
    return original


def test_truncated_tar(data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    copy, shard = _damaged(data_dir, tmp_path)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2 + 100])
    assert re.search(rf"{shard}: (ends after member \d+\.npy|unreadable tar after member)", _verify(copy, capsys))
    with pytest.raises(DataError, match=rf"{shard.name}: (ends after member|unreadable tar after member)") as error:
        _read_epoch(copy, num_workers=2)  # an error in a DataLoader worker reaches the caller
    # ... and the workers are stopped at once, although the traceback (kept alive by `error`) still
    # references the loader: leaked workers would keep the process from exiting.
    assert error.traceback and not multiprocessing.active_children()


def test_empty_shard(data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    copy, shard = _damaged(data_dir, tmp_path)
    with tarfile.open(shard, "w"):
        pass
    assert f"{shard}: 0 samples but the manifest says" in _verify(copy, capsys)
    with pytest.raises(DataError, match=f"{shard.name}: 0 samples .* \\(empty shard\\)"):
        _read_epoch(copy)


def test_member_without_array(data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    copy, shard = _damaged(data_dir, tmp_path)
    _rewrite_member(shard, 5, "00000005.txt", b"hello")
    assert f"{shard}: member 00000005.txt: no .npy token array" in _verify(copy, capsys)
    with pytest.raises(DataError, match="00000005.txt"):
        _read_epoch(copy)


def test_member_with_wrong_dtype(data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    copy, shard = _damaged(data_dir, tmp_path)
    buffer = io.BytesIO()
    np.save(buffer, np.array([1, 50, 60, 2], dtype=np.int64))
    name = _rewrite_member(shard, 7, "00000007.npy", buffer.getvalue())
    assert f"{shard}: member {name}: dtype int64 but the manifest says uint16" in _verify(copy, capsys)
    with pytest.raises(DataError, match=f"member {name}: dtype int64"):
        _read_epoch(copy)


def test_pickled_member_is_never_unpickled(data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    copy, shard = _damaged(data_dir, tmp_path)
    buffer = io.BytesIO()
    np.save(buffer, np.array([object()], dtype=object), allow_pickle=True)
    _rewrite_member(shard, 2, "00000002.npy", buffer.getvalue())
    assert "member 00000002.npy: not a valid .npy array" in _verify(copy, capsys)


def test_fingerprint_mismatch(data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    copy = copy_data_dir(data_dir, tmp_path / "data")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["tokenizer_fingerprint"] = "0" * 64
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert "spm.model: tokenizer fingerprint" in _verify(copy, capsys)
    with pytest.raises(DataError, match=r"tokenizer/spm.model: tokenizer fingerprint .* does not match"):
        build_train_loader(copy, batch_size=8, rank=0, world_size=1, num_workers=0, seed=0, masking=MaskingConfig())


def test_corrupt_gzip(corpus_files: list[Path], tokenizer_dir: Path, tmp_path: Path) -> None:
    raw = gzip.compress(corpus_files[0].read_bytes())
    bad = tmp_path / "bad.txt.gz"
    bad.write_bytes(raw[: len(raw) // 2] + bytes(200) + raw[len(raw) // 2 + 200:])
    with pytest.raises(DataError, match=rf"{bad}: after line \d+: corrupt compressed stream"):
        _prepare([bad], tokenizer_dir, tmp_path / "a")
    _prepare([bad, corpus_files[3]], tokenizer_dir, tmp_path / "b", skip_bad=True)
    manifest = read_manifest(tmp_path / "b")
    assert manifest.skipped["corrupt_file"] == 1 and manifest.splits["train"].samples > 0


def test_invalid_utf8(tokenizer_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = tmp_path / "mixed.txt"
    src.write_bytes(b"A first good paragraph.\n\nA bad \xff\xfe paragraph\non two lines.\n\nThe last good one.\n")
    with pytest.raises(DataError, match=rf"{src}, line 3, byte 7: byte 0xff is not UTF-8"):
        _prepare([src], tokenizer_dir, tmp_path / "a")
    _prepare([src], tokenizer_dir, tmp_path / "b", skip_bad=True)
    manifest = read_manifest(tmp_path / "b")
    assert manifest.skipped == {"invalid_utf8": 1} and manifest.splits["train"].samples == 2
    assert f"{src}:3" in caplog.text


def test_empty_documents_are_counted(tokenizer_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "docs.jsonl"
    records = [{"text": "Some real words here."}, {"text": ""}, {"text": None}, {"text": "   \n "},
               {"text": "More words."}]
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    _prepare([src], tokenizer_dir, tmp_path / "out")
    manifest = read_manifest(tmp_path / "out")
    assert manifest.skipped == {"empty_document": 3} and manifest.splits["train"].samples == 2


def test_jsonl_missing_field(tokenizer_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "docs.jsonl"
    src.write_text('{"text": "fine"}\n{"body": "wrong field"}\n')
    with pytest.raises(DataError, match=rf"{src}:2: no string field 'text'"):
        _prepare([src], tokenizer_dir, tmp_path / "out")


def test_missing_input_file(tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "absent.jsonl.gz"
    code = distaff_main(["data", "prepare", "--input", str(missing), "--tokenizer", str(tokenizer_dir),
                         "--seq-len", "64", "--out", str(tmp_path / "out"), "--no-progress"])
    assert code == 2
    assert f"{missing}: input file not found" in capsys.readouterr().err


def test_manifest_path_cannot_inject_shell(data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # A pipe: data dir runs its URLs with shell=True: a manifest path must never reach the shell as code.
    copy = copy_data_dir(data_dir, tmp_path / "data")
    marker = tmp_path / "injected"
    manifest = json.loads((copy / "manifest.json").read_text())
    bad = f"heldout/shard-000000.tar; touch {marker}; #"
    manifest["splits"]["heldout"]["shards"][0]["path"] = bad
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert distaff_main(["data", "verify", f"pipe:cat {copy}/{{path}}"]) == 1
    out = capsys.readouterr().out
    assert "manifest.json" in out and f"unsafe shard path {bad!r}" in out
    assert not marker.exists()


@pytest.mark.parametrize("bad", ["/etc/passwd", "../outside.tar", "train/../../x.tar", "train/$(id).tar", ""])
def test_manifest_paths_must_stay_inside(bad: str) -> None:
    with pytest.raises(DataError, match="unsafe shard path"):
        check_relpath(bad, "manifest.json")


def test_pipe_urls_quote_paths(data_dir: Path) -> None:
    assert data_url("pipe:cat /d/{path}", "a b;touch x") == "pipe:cat /d/'a b;touch x'"
    assert data_url("pipe:cat /d", "train/s.tar") == "pipe:cat /d/train/s.tar"
    assert verify(f"pipe:cat {data_dir}/{{path}}") == []  # quoting keeps ordinary pipe: data dirs working


def test_in_vocabulary_byte_flip_is_caught(data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    copy, shard = _damaged(data_dir, tmp_path)
    raw = bytearray(shard.read_bytes())
    # first member's data starts after its 512-byte tar header and the 128-byte .npy header; token 5's low
    # byte flipped by one stays inside the vocabulary, keeps the framing and the token count
    raw[512 + 128 + 2 * 5] ^= 1
    shard.write_bytes(bytes(raw))
    out = _verify(copy, capsys)
    assert f"{shard}: sha256" in out and "does not match the manifest's" in out


def _prepare_cli(inputs: list[Path], tokenizer_dir: Path, out: Path, seq_len: int = 64) -> int:
    return distaff_main(["data", "prepare", "--input", *map(str, inputs), "--tokenizer", str(tokenizer_dir),
                         "--seq-len", str(seq_len), "--out", str(out), "--workers", "0", "--no-progress"])


def test_bad_prepare_arguments_are_clear_errors(corpus_files: list[Path], tokenizer_dir: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "texts"
    folder.mkdir()
    assert _prepare_cli([folder], tokenizer_dir, tmp_path / "a") == 2           # a directory, not a file
    assert f"{folder}: is a directory; pass the input files in it" in capsys.readouterr().err
    assert _prepare_cli(corpus_files[3:], tokenizer_dir, tmp_path / "b", seq_len=2) == 2
    assert "distaff data prepare: --seq-len: expected a whole number >= 3" in capsys.readouterr().err
    mismatched = shutil.copytree(tokenizer_dir, tmp_path / "tok")
    (mismatched / "spm.model").write_bytes((mismatched / "spm.model").read_bytes() + b"\0")
    assert _prepare_cli(corpus_files[3:], mismatched, tmp_path / "c") == 2
    assert f"{mismatched / 'spm.model'}: sha256" in capsys.readouterr().err
