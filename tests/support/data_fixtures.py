"""Shared, cached test inputs for the data tests: slices of the bundled real text, a tokenizer, a data dir.

Built once per test session (cached on the session's base temp dir) and treated as read-only;
tests that damage data work on copies.
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

from distaff.train.data.prepare import PrepareConfig, prepare
from distaff.train.data.tokenizer import train_tokenizer

SEQ_LEN = 128
# corpus name -> (bundled file in data/, characters taken). Slices of different sizes (and one tiny
# file) give deliberately uneven shards.
SLICES = {"austen": ("austen-emma-pride.txt.gz", 600_000), "python-docs": ("python-docs.txt.gz", 400_000),
          "shakespeare": ("shakespeare.txt.gz", 250_000), "linux-docs": ("linux-docs.txt.gz", 3_000)}
_built: dict[str, Path] = {}


def read_sample(path: Path, nchars: int | None = None, start: int = 0) -> str:
    """Characters ``start`` to ``start + nchars`` (or to the end) of a bundled ``.gz`` text file."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        text = f.read(None if nchars is None else start + nchars)
    return text[start:]


def corpus_slice(sample: Path, nchars: int, out: Path) -> Path:
    """The first ``nchars`` characters of a bundled sample, cut at a paragraph boundary, as a .txt file."""
    text = read_sample(sample, nchars)
    out.write_text(text[:text.rfind("\n\n")] + "\n", encoding="utf-8")
    return out


def _once(key: str, build) -> Path:
    if key not in _built:
        _built[key] = build()
    return _built[key]


@pytest.fixture(scope="session")
def corpus_files(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    def build() -> Path:
        root = tmp_path_factory.mktemp("corpus")
        for name, (sample, nchars) in SLICES.items():
            corpus_slice(sample_data / sample, nchars, root / f"{name}.txt")
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


@pytest.fixture(scope="session")
def small_model_dir(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small model with random weights (seed 0, EMD on) and the real tokenizer, saved as a distaff model folder."""
    import torch

    from distaff.train.data.tokenizer import load_tokenizer_info
    from distaff.train.model.config import ModelConfig
    from distaff.train.model.deberta import DebertaForMaskedLM
    from distaff.train.run.model_folder import save_model_folder

    tokenizer = load_tokenizer_info(tokenizer_dir)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_id, hidden_size=32,
                      num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                      position_buckets=16, emd=True)
    return save_model_folder(DebertaForMaskedLM(cfg), tmp_path_factory.mktemp("model"), tokenizer_dir)
