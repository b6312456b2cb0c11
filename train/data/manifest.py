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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

import webdataset as wds

from distaff.train.core.files import atomic_write_text, file_sha256
from distaff.train.data.errors import DataError
from distaff.train.data.tokenizer import METADATA_FILE, MODEL_FILE, TokenizerInfo, load_tokenizer_info

MANIFEST_FILE = "manifest.json"
TOKENIZER_DIR = "tokenizer"
FORMAT = "distaff-shards/1"
SPLITS = ("train", "heldout")
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
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


def _shard_info(entry: dict, where: str) -> ShardInfo:
    info = ShardInfo(**entry)
    check_relpath(info.path, where)
    return info


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
        if data.get("format") != FORMAT:
            raise DataError(f"{where}: format {data.get('format')!r} is not {FORMAT!r}")
        try:
            splits = {name: SplitInfo(shards=[_shard_info(s, where) for s in split["shards"]],
                                      top_tokens=[(int(i), int(c)) for i, c in split["top_tokens"]],
                                      non_special_tokens=int(split["non_special_tokens"]))
                      for name, split in data["splits"].items()}
            return cls(seq_len=int(data["seq_len"]), dtype=data["dtype"], vocab_size=int(data["vocab_size"]),
                       tokenizer_fingerprint=data["tokenizer_fingerprint"], special_ids=dict(data["special_ids"]),
                       pack_documents=bool(data["pack_documents"]), sources=list(data["sources"]), splits=splits,
                       skipped=dict(data.get("skipped", {})))
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(f"{where}: malformed manifest ({err!r})") from err


def is_remote(data_dir: str | Path) -> bool:
    text = str(data_dir)
    return "{path}" in text or text.startswith("pipe:") or "://" in text


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
    return wds.gopen(url, "rb")


def read_manifest(data_dir: str | Path) -> Manifest:
    where = data_url(data_dir, MANIFEST_FILE)
    try:
        with open_data_file(data_dir, MANIFEST_FILE) as f:
            data = json.loads(f.read())
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(f"{where}: cannot read manifest ({err})") from err
    return Manifest.from_json(data, where)


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
    return info
