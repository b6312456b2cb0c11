"""Which probing sentences a model was pretrained on: exact matches of a sentence's tokens in the training text.

The pretraining text of a distaff run is the ``train`` split of its data directory (the shards ``distaff data
prepare`` wrote; the ``heldout`` documents were never trained on). With the data directory's own tokenizer, a
sentence *overlaps* when its whole token sequence occurs contiguously in that split: the shards' sequences
are read in order with the packer's ``[CLS]``/``[SEP]`` dropped, which puts each document's tokens back end to end
(a document longer than a sequence is split across consecutive ones). SentencePiece writes the same pieces
for a sentence inside a paragraph as for the sentence alone (a line break or a double space is one ``▁``), so
a sentence found anywhere in a training document is caught. Matching is by a 64-bit rolling hash of every
window of each sentence's length, and every hash hit is confirmed token by token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from distaff.train.core.config_yaml import load_yaml
from distaff.train.core.errors import ConfigError
from distaff.train.core.files import read_text
from distaff.train.data import manifest as mf
from distaff.train.data.shards import read_shard
from distaff.train.data.tokenizer import TokenizerInfo

BASE = np.uint64(0x9E3779B97F4A7C15)   # odd, so it has an inverse modulo 2^64
BASE_INVERSE = np.uint64(pow(int(BASE), -1, 1 << 64))


def run_data_dir(model: str | Path) -> Path | None:
    """The data directory a distaff run (or one of its checkpoints) trained on, from its saved
    ``config.yaml``; None for a folder that is not a run (an HF folder, a model folder)."""
    folder = Path(model)
    for run_dir in (folder, folder.parent, folder.parent.parent):   # the run, checkpoints/, step-N
        config = run_dir / "config.yaml"
        if config.is_file():
            values = load_yaml(read_text(config, error=ConfigError), str(config))
            data_dir = (values.get("data") or {}).get("dir") if isinstance(values, dict) else None
            return Path(data_dir) if data_dir else None
    return None


def training_tokens(data_dir: str | Path) -> tuple[np.ndarray, TokenizerInfo]:
    """The ``train`` split's tokens, ``[CLS]`` and ``[SEP]`` dropped, in shard order; and the data dir's tokenizer."""
    manifest = mf.read_manifest(data_dir)
    tokenizer = mf.load_data_tokenizer(data_dir, manifest)
    dtype = np.dtype(manifest.dtype)
    special = np.array([tokenizer.cls_id, tokenizer.sep_id], dtype=np.int64)   # what the packer adds ([UNK] is text)
    pieces = []
    for shard in manifest.splits["train"].shards:
        with mf.open_data_file(data_dir, shard.path) as stream:
            samples = read_shard(stream, mf.data_url(data_dir, shard.path), dtype, shard.samples)
        pieces.extend(sample[~np.isin(sample, special)] for sample in samples)
    tokens = np.concatenate(pieces).astype(np.uint64) if pieces else np.zeros(0, dtype=np.uint64)
    return tokens, tokenizer


def _prefix_hashes(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``H[i] = sum_{j<i} (t_j + 1) * BASE^j`` and ``BASE^-i`` (mod 2^64), for every prefix length ``i``."""
    powers = np.empty(len(tokens) + 1, dtype=np.uint64)
    powers[0] = 1
    inverse = np.empty_like(powers)
    inverse[0] = 1
    with np.errstate(over="ignore"):
        powers[1:] = BASE
        inverse[1:] = BASE_INVERSE
        powers = np.cumprod(powers, dtype=np.uint64)
        inverse = np.cumprod(inverse, dtype=np.uint64)
        prefix = np.zeros(len(tokens) + 1, dtype=np.uint64)
        prefix[1:] = np.cumsum((tokens.astype(np.uint64) + np.uint64(1)) * powers[:-1], dtype=np.uint64)
    return prefix, inverse


def _window_hashes(prefix: np.ndarray, inverse: np.ndarray, length: int) -> np.ndarray:
    """The hash of every window of ``length`` tokens, as if it started at position 0."""
    with np.errstate(over="ignore"):
        return (prefix[length:] - prefix[:-length]) * inverse[: len(prefix) - length]


def _hash(ids: Sequence[int]) -> np.uint64:
    return _prefix_hashes(np.asarray(ids, dtype=np.uint64))[0][-1]


def find_in_tokens(sequences: Sequence[Sequence[int]], tokens: np.ndarray) -> list[bool]:
    """For each token sequence, whether it occurs contiguously in ``tokens`` (empty ones never do)."""
    found = [False] * len(sequences)
    if len(tokens) == 0:
        return found
    prefix, inverse = _prefix_hashes(tokens)
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(sequences):
        if 0 < len(ids) <= len(tokens):
            by_length.setdefault(len(ids), []).append(i)
    for length, members in by_length.items():
        windows = _window_hashes(prefix, inverse, length)
        wanted = np.array([_hash(sequences[i]) for i in members], dtype=np.uint64)
        order = np.argsort(wanted, kind="stable")
        ranked = wanted[order]
        slots = np.clip(np.searchsorted(ranked, windows), 0, len(members) - 1)
        for start in np.flatnonzero(ranked[slots] == windows):
            # a hash hit is confirmed token by token, for every sentence of that hash
            for k in range(slots[start], np.searchsorted(ranked, windows[start], side="right")):
                j = members[order[k]]
                if not found[j]:
                    found[j] = np.array_equal(tokens[start:start + length], np.asarray(sequences[j], np.uint64))
    return found


def pretrained_on(sentences: Sequence[str], data_dir: str | Path) -> list[bool]:
    """For each sentence, whether its tokens occur in ``data_dir``'s training split (see the module doc)."""
    tokens, tokenizer = training_tokens(data_dir)
    return find_in_tokens(tokenizer.processor().encode(list(sentences)), tokens)
