"""The data directory's ``manifest.json`` and how its files are opened (local paths or webdataset URLs).

A data directory is self-contained::

    manifest.json                  this schema (see docs/data.md)
    tokenizer/                     copy of the tokenizer folder (spm.model, HF files, distaff_tokenizer.json)
    train/shard-000000.tar ...     webdataset shards, one ``<key>.npy`` token array per sample
    heldout/shard-000000.tar ...

``data_dir`` may be a local folder, a URL prefix webdataset opens (``http://host/dir``), or a template
with ``{path}`` (``pipe:aws s3 cp s3://bucket/dir/{path} -``) into which relative paths are substituted.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

import numpy as np

from distaff.train.core.errors import shown, whole_number
from distaff.train.core.files import atomic_write_text, file_sha256, is_remote, parse_json
from distaff.train.data.errors import DataError
from distaff.train.data.shards import TOKEN_DTYPES
from distaff.train.data.tokenizer import (METADATA_FILE, MODEL_FILE, SPECIAL_TOKENS, TokenizerInfo,
                                          load_tokenizer_info)

MANIFEST_FILE = "manifest.json"
TOKENIZER_DIR = "tokenizer"
FORMAT = "distaff-shards/1"
SPLITS = ("train", "heldout")
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SPECIAL_NAMES = tuple(SPECIAL_TOKENS)       # pad, cls, sep, unk, mask
MIN_SEQ_LEN = 3             # [CLS], a token, [SEP]
MAX_SEQ_LEN = 1 << 24       # far above any encoder's context; a larger value is a damaged manifest
MAX_VOCAB = 2**31 - 1       # int32 ids
# Manifest paths end up in shell commands (``pipe:`` URLs): only plain relative names are allowed.
_SAFE_PATH = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*")


@dataclass(frozen=True)
class ShardInfo:
    path: str  # relative to the data dir
    samples: int
    tokens: int
    sha256: str = ""  # of the shard file; empty in manifests written before checksums were recorded


def check_relpath(path: object, where: str) -> str:
    """``path`` if it is a plain relative path inside the data dir, else a DataError naming it."""
    if not isinstance(path, str) or not _SAFE_PATH.fullmatch(path) or ".." in path.split("/"):
        raise DataError(f"{where}: unsafe shard path {path!r} (must be relative, inside the data dir, "
                        "of the characters A-Z a-z 0-9 . _ - /)")
    return path


def _count(value: object, what: str, low: int = 0, high: int | None = None) -> int:
    return whole_number(value, what, low=low, high=high, error=DataError)


def _shard_info(entry: dict, where: str) -> ShardInfo:
    if not isinstance(entry, dict):
        raise DataError(f"{where}: a shard entry is {shown(entry)}, not a mapping")
    info = ShardInfo(**entry)
    check_relpath(info.path, where)
    samples = _count(info.samples, f"{where}: shard {info.path} samples", low=1)
    tokens = _count(info.tokens, f"{where}: shard {info.path} tokens", low=samples)
    if not isinstance(info.sha256, str):
        raise DataError(f"{where}: shard {info.path} sha256: expected text, got {shown(info.sha256)}")
    return replace(info, samples=samples, tokens=tokens)


@dataclass
class SplitInfo:
    shards: list[ShardInfo]
    # Label-free unigram statistics for a frequency baseline: the 20 most frequent non-special ids.
    top_tokens: list[tuple[int, int]] = field(default_factory=list)  # (id, count)
    non_special_tokens: int = 0

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)


@dataclass
class Manifest:
    seq_len: int
    dtype: str  # numpy dtype name of the token arrays
    vocab_size: int
    tokenizer_fingerprint: str
    special_ids: dict[str, int]
    pack_documents: bool
    sources: list[dict]  # {"path", "bytes"} per input file
    splits: dict[str, SplitInfo]
    skipped: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        out = asdict(self)
        for name, split in self.splits.items():
            out["splits"][name].update(samples=split.samples, tokens=split.tokens)
        return {"format": FORMAT, **out}

    @classmethod
    def from_json(cls, data: dict, where: str) -> "Manifest":
        """The manifest of the JSON value ``data``; every field checked where it is read (a seq_len of 0 or a token
        dtype that cannot hold the vocabulary would otherwise fail deep inside a run, or pass ``--check``)."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise DataError(f"{where}: format {data.get('format') if isinstance(data, dict) else data!r} is not "
                            f"{FORMAT!r}")
        try:
            vocab_size = _count(data["vocab_size"], f"{where}: vocab_size", low=len(SPECIAL_NAMES), high=MAX_VOCAB)
            splits = {name: _split_info(split, f"{where}: splits.{name}", vocab_size)
                      for name, split in data["splits"].items()}
            return cls(seq_len=_count(data["seq_len"], f"{where}: seq_len", low=MIN_SEQ_LEN, high=MAX_SEQ_LEN),
                       dtype=_token_dtype(data["dtype"], vocab_size, where), vocab_size=vocab_size,
                       tokenizer_fingerprint=str(data["tokenizer_fingerprint"]),
                       special_ids=_special_ids(data["special_ids"], vocab_size, where),
                       pack_documents=bool(data["pack_documents"]), sources=list(data["sources"]), splits=splits,
                       skipped=dict(data.get("skipped", {})))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            if isinstance(err, DataError):
                raise
            raise DataError(f"{where}: malformed manifest ({err!r})") from err


def _split_info(split: dict, where: str, vocab_size: int) -> SplitInfo:
    top = [(_count(i, f"{where}.top_tokens id", high=vocab_size - 1), _count(c, f"{where}.top_tokens count"))
           for i, c in split["top_tokens"]]
    return SplitInfo(shards=[_shard_info(s, where) for s in split["shards"]], top_tokens=top,
                     non_special_tokens=_count(split["non_special_tokens"], f"{where}.non_special_tokens"))


def _token_dtype(name: object, vocab_size: int, where: str) -> str:
    """The token arrays' dtype: one prepare writes, wide enough for every id of the vocabulary."""
    if name not in TOKEN_DTYPES:
        raise DataError(f"{where}: dtype {shown(name)} is not a token dtype ({', '.join(TOKEN_DTYPES)}); the data dir "
                        "was not written by `distaff data prepare`, or its manifest was edited")
    if np.iinfo(np.dtype(name)).max < vocab_size - 1:
        raise DataError(f"{where}: dtype {name} cannot hold the ids of a vocabulary of {vocab_size}")
    return name


def _special_ids(ids: dict, vocab_size: int, where: str) -> dict[str, int]:
    """Every special token's id, inside the vocabulary (a [MASK] id outside it fails the first step's lookup)."""
    if not isinstance(ids, dict) or set(SPECIAL_NAMES) - set(ids):
        raise DataError(f"{where}: special_ids must name {list(SPECIAL_NAMES)}, got {shown(ids)}")
    return {name: _count(value, f"{where}: special_ids.{name}", high=vocab_size - 1) for name, value in ids.items()}


def data_url(data_dir: str | Path, relpath: str) -> str:
    text = str(data_dir)
    if text.startswith("pipe:"):
        relpath = shlex.quote(relpath)  # webdataset runs pipe: URLs with shell=True
    if "{path}" in text:
        return text.replace("{path}", relpath)
    return f"{text.rstrip('/')}/{relpath}"


def open_data_file(data_dir: str | Path, relpath: str) -> BinaryIO:
    """Open a file of the data dir through webdataset's URL openers (local, ``pipe:``, http...)."""
    url = data_url(data_dir, relpath)
    if not is_remote(data_dir) and not Path(url).is_file():
        raise DataError(f"{url}: file not found")
    import webdataset as wds  # here, not at the top: the planner reads manifests without torch (webdataset imports it)

    return wds.gopen(url, "rb")


def read_manifest(data_dir: str | Path) -> Manifest:
    where = data_url(data_dir, MANIFEST_FILE)
    try:
        with open_data_file(data_dir, MANIFEST_FILE) as f:
            raw = f.read()
    except OSError as err:
        raise DataError(f"{where}: cannot read manifest ({err})") from err
    return Manifest.from_json(parse_json(raw, where, error=DataError), where)


def write_manifest(data_dir: str | Path, manifest: Manifest) -> None:
    atomic_write_text(Path(data_dir) / MANIFEST_FILE, json.dumps(manifest.to_json(), indent=1) + "\n")


def copy_tokenizer(tokenizer: TokenizerInfo, data_dir: Path) -> None:
    target = data_dir / TOKENIZER_DIR
    target.mkdir(parents=True, exist_ok=True)
    for name in (MODEL_FILE, METADATA_FILE) + HF_TOKENIZER_FILES:
        if (tokenizer.path / name).is_file():
            shutil.copyfile(tokenizer.path / name, target / name)


def load_data_tokenizer(data_dir: str | Path, manifest: Manifest, cache_dir: str | Path | None = None) -> TokenizerInfo:
    """The data dir's own tokenizer, checked against the manifest's fingerprint.

    A remote data dir's tokenizer is fetched into ``cache_dir`` (default ``~/.cache/distaff/tokenizers``).
    """
    if is_remote(data_dir):
        local = Path(cache_dir or Path.home() / ".cache" / "distaff" / "tokenizers") / manifest.tokenizer_fingerprint
        local.mkdir(parents=True, exist_ok=True)
        for name in (MODEL_FILE, METADATA_FILE):
            with open_data_file(data_dir, f"{TOKENIZER_DIR}/{name}") as f:
                (local / name).write_bytes(f.read())
    else:
        local = Path(data_dir) / TOKENIZER_DIR
    model = local / MODEL_FILE
    if not model.is_file():
        raise DataError(f"{model}: tokenizer model missing from the data dir")
    fingerprint = file_sha256(model)
    if fingerprint != manifest.tokenizer_fingerprint:
        raise DataError(f"{model}: tokenizer fingerprint {fingerprint[:16]}... does not match the manifest's "
                        f"{manifest.tokenizer_fingerprint[:16]}... ({data_url(data_dir, MANIFEST_FILE)})")
    info = load_tokenizer_info(local)
    if info.vocab_size != manifest.vocab_size:
        raise DataError(f"{local}: vocab size {info.vocab_size} does not match the manifest's {manifest.vocab_size}")
    ids = dict(zip(SPECIAL_NAMES, info.special_ids))
    if ids != {name: manifest.special_ids[name] for name in SPECIAL_NAMES}:
        raise DataError(f"{local}: special ids {ids} differ from the manifest's {manifest.special_ids} "
                        f"({data_url(data_dir, MANIFEST_FILE)}); the shards were framed with the manifest's")
    return info
