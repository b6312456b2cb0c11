"""``distaff data verify``: read every shard of a data dir against its manifest and list every problem.

Checks: the tokenizer copy matches the manifest's fingerprint; each shard opens and reads to the end;
each member is a 1-D ``.npy`` of the manifest's dtype, at most ``seq_len`` long, framed ``[CLS] ... [SEP]``,
with ids below the vocabulary size; the sample and token counts and the file's sha256 match the manifest
(the checksum catches damage that still parses, such as a flipped byte inside a token id).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import BinaryIO

import numpy as np

from distaff.train.data.errors import DataError, length_problem
from distaff.train.data.manifest import (Manifest, ShardInfo, data_url, load_data_tokenizer, open_data_file,
                                         read_manifest)
from distaff.train.data.shards import count_problem, iter_shard


def _sample_problems(array: np.ndarray, manifest: Manifest) -> list[str]:
    problems = [length_problem(len(array), manifest.seq_len)]
    if len(array) < 3 or array[0] != manifest.special_ids["cls"] or array[-1] != manifest.special_ids["sep"]:
        problems.append("not framed as [CLS] ... [SEP]")
    if len(array) and int(array.max()) >= manifest.vocab_size:
        problems.append(f"token id {int(array.max())} outside the vocabulary of {manifest.vocab_size}")
    return [problem for problem in problems if problem]


class _HashingReader:
    """A read-only stream that hashes every byte read through it."""

    def __init__(self, raw: BinaryIO):
        self.raw, self.digest = raw, hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.digest.update(data)
        return data

    def hexdigest_to_end(self) -> str:
        """The digest of the whole file (tar readers stop before the end-of-archive padding)."""
        while self.read(1 << 20):
            pass
        return self.digest.hexdigest()


def _checksum_problem(where: str, actual: str, expected: str) -> str | None:
    if not expected or actual == expected:
        return None
    return f"{where}: sha256 {actual[:16]}... does not match the manifest's {expected[:16]}... (corrupted file)"


def verify_shard(data_dir: str | Path, manifest: Manifest, shard: ShardInfo) -> list[str]:
    where = data_url(data_dir, shard.path)
    problems, seen_samples, seen_tokens, last_member = [], 0, 0, None
    try:
        with open_data_file(data_dir, shard.path) as raw:
            stream = _HashingReader(raw)
            for last_member, array in iter_shard(stream, where, np.dtype(manifest.dtype)):
                seen_samples += 1
                seen_tokens += len(array)
                problems += [f"{where}: member {last_member}: {p}" for p in _sample_problems(array, manifest)]
            checksum = _checksum_problem(where, stream.hexdigest_to_end(), shard.sha256)
    except DataError as err:
        return problems + [str(err)]
    problems += [checksum] if checksum else []
    samples, tokens = shard.samples, shard.tokens
    count = count_problem(where, seen_samples, samples, last_member)
    if count:
        problems.append(count)
    elif seen_tokens != tokens:
        problems.append(f"{where}: {seen_tokens} tokens but the manifest says {tokens}")
    return problems


def check_first_samples(data_dir: str | Path, manifest: Manifest) -> None:
    """The first sample of each split's first shard, read and checked as ``verify`` checks every sample (the
    manifest's dtype, length and framing): a DataError naming the shard and member if it is wrong. What a run's
    first batches would find, found before it starts (``--check``); ``distaff data verify`` reads everything."""
    for split in manifest.splits.values():
        if not split.shards:
            continue
        shard = split.shards[0]
        where = data_url(data_dir, shard.path)
        with open_data_file(data_dir, shard.path) as raw:
            for member, array in iter_shard(raw, where, np.dtype(manifest.dtype)):
                problems = _sample_problems(array, manifest)
                if problems:
                    raise DataError(f"{where}: member {member}: {problems[0]}; run `distaff data verify {data_dir}`")
                break


def verify(data_dir: str | Path) -> list[str]:
    """Every problem found, one line each naming the file (and member); empty when the data dir is sound."""
    try:
        manifest = read_manifest(data_dir)
    except DataError as err:
        return [str(err)]
    problems = []
    try:
        load_data_tokenizer(data_dir, manifest)
    except (DataError, OSError, ValueError) as err:
        problems.append(str(err))
    for split in manifest.splits.values():
        for shard in split.shards:
            problems += verify_shard(data_dir, manifest, shard)
    return problems
