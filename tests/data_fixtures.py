"""Shared, cached test inputs for the data tests: slices of the real corpora, a tokenizer, a data dir.

Built once per test session (cached on the session's base temp dir) and treated as read-only;
tests that damage data work on copies.
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

from distaff.train.data.prepare import PrepareConfig, prepare
from distaff.train.tokenizer import train_tokenizer

SEQ_LEN = 128
# Slices of different sizes (and one tiny file) give deliberately uneven shards.
SLICES = {"austen": 600_000, "python-docs": 400_000, "shakespeare": 250_000, "linux-docs": 3_000}
_built: dict[str, Path] = {}


def corpus_slice(shared_data: Path, name: str, nbytes: int, out_dir: Path) -> Path:
    """The first ``nbytes`` characters of a corpus, cut at a paragraph boundary, as a .txt file."""
    with gzip.open(shared_data / "corpus" / f"{name}.txt.gz", "rt", encoding="utf-8") as f:
        text = f.read(nbytes)
    text = text[:text.rfind("\n\n")] + "\n"
    out = out_dir / f"{name}.txt"
    out.write_text(text, encoding="utf-8")
    return out


def _once(key: str, build) -> Path:
    if key not in _built:
        _built[key] = build()
    return _built[key]


@pytest.fixture(scope="session")
def corpus_files(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    def build() -> Path:
        root = tmp_path_factory.mktemp("corpus")
        for name, nbytes in SLICES.items():
            corpus_slice(shared_data, name, nbytes, root)
        return root

    root = _once("corpus", build)
    return [root / f"{name}.txt" for name in SLICES]


@pytest.fixture(scope="session")
def tokenizer_dir(corpus_files: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Prose and technical text together, ~1 MB: a realistic vocabulary in about two seconds.
    return _once("tokenizer", lambda: train_tokenizer(corpus_files[:2], 4000, tmp_path_factory.mktemp("tok")).path)


@pytest.fixture(scope="session")
def data_dir(corpus_files: list[Path], tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    def build() -> Path:
        out = tmp_path_factory.mktemp("data")
        prepare(PrepareConfig(inputs=tuple(map(str, corpus_files)), tokenizer_dir=str(tokenizer_dir),
                              seq_len=SEQ_LEN, out_dir=str(out), shard_mb=0.12, heldout_every=20, workers=2,
                              progress=False))
        return out

    return _once("data", build)


def copy_data_dir(data_dir: Path, target: Path) -> Path:
    shutil.copytree(data_dir, target)
    return target
