"""Webdataset tar shards of token arrays: one ``<key>.npy`` member per sample.

Writing is atomic (temporary file, fsync, then rename) so an interrupted prepare never leaves a shard that
looks finished. Reading streams the tar (``r|``), so a shard can come from any URL webdataset opens,
and every problem is a :class:`DataError` naming the shard and member.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import BinaryIO, Iterator, Sequence

import numpy as np

from distaff.train.core.files import atomic_open
from distaff.train.data.errors import DataError

SAMPLE_SUFFIX = ".npy"


TOKEN_DTYPES = ("uint16", "int32")      # what token_dtype gives: the manifest's dtype is one of these


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def write_shard(path: Path, samples: Sequence[np.ndarray]) -> None:
    """Write ``samples`` as members ``00000000.npy, 00000001.npy, ...`` of a tar at ``path`` (atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "wb") as handle, tarfile.open(fileobj=handle, mode="w",
                                                          format=tarfile.USTAR_FORMAT) as tar:
        for index, sample in enumerate(samples):
            data = _npy_bytes(sample)
            info = tarfile.TarInfo(f"{index:08d}{SAMPLE_SUFFIX}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _parse_npy(data: bytes, where: str, dtype: np.dtype) -> np.ndarray:
    try:
        array = np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)
    except (ValueError, EOFError, OSError) as err:
        raise DataError(f"{where}: not a valid .npy array ({err})") from err
    if array.dtype != dtype:
        raise DataError(f"{where}: dtype {array.dtype} but the manifest says {dtype}")
    if array.ndim != 1:
        raise DataError(f"{where}: shape {array.shape} but token arrays are 1-D")
    return array


class _Tail:
    """A read-only stream that keeps its last :data:`TAIL_BYTES` bytes: tarfile ends a streamed archive at the first
    header it cannot parse, silently, so the block it stopped at is read back to tell a garbled header (corrupt)
    from the end of the archive (zeros) or of the file (truncated)."""

    def __init__(self, raw: BinaryIO):
        self.raw, self.total, self.tail = raw, 0, b""

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.total += len(data)
        self.tail = (self.tail + data)[-TAIL_BYTES:]
        return data

    def block(self, offset: int) -> bytes | None:
        """The 512 bytes at ``offset`` of the stream (fewer at its end), or None when no longer held."""
        start = offset - (self.total - len(self.tail))
        return self.tail[start:start + tarfile.BLOCKSIZE] if start >= 0 else None


TAIL_BYTES = 4 * tarfile.RECORDSIZE     # tarfile reads a record at a time: the header it stopped at is in here


def _check_archive_end(tar: tarfile.TarFile, tail: _Tail, where: str, last_member: str) -> None:
    """A DataError when the archive stopped at a header that is neither the end-of-archive zeros nor past the
    file's end: a garbled header, and the shard is corrupt (not truncated)."""
    header = tail.block(tar.offset)
    if header and len(header) == tarfile.BLOCKSIZE and any(header):
        raise DataError(f"{where}: corrupt tar header at byte {tar.offset:,} (after member {last_member}): the shard is "
                        "damaged, not truncated; prepare the data again or restore the shard (distaff data verify "
                        "lists every damaged one)")


def iter_shard(stream: BinaryIO, where: str, dtype: np.dtype) -> Iterator[tuple[str, np.ndarray]]:
    """(member name, token array) for each sample of a tar stream, in file order; a garbled header is a
    DataError saying the shard is corrupt."""
    member_name = "<start of archive>"
    tail = _Tail(stream)
    try:
        with tarfile.open(fileobj=tail, mode="r|") as tar:
            for member in tar:
                member_name = member.name
                if not member.isfile():
                    continue
                if not member.name.endswith(SAMPLE_SUFFIX):
                    raise DataError(f"{where}: member {member.name}: no {SAMPLE_SUFFIX} token array in this sample")
                handle = tar.extractfile(member)
                data = handle.read() if handle is not None else b""
                if len(data) != member.size:
                    raise DataError(f"{where}: member {member.name}: truncated ({len(data)} of {member.size} bytes)")
                yield member.name, _parse_npy(data, f"{where}: member {member.name}", dtype)
            _check_archive_end(tar, tail, where, member_name)
    except (tarfile.TarError, EOFError, OSError) as err:
        raise DataError(f"{where}: unreadable tar after member {member_name} ({err})") from err


def count_problem(where: str, samples: int, expected: int, last_member: str | None) -> str | None:
    """The message for a shard whose sample count differs from the manifest's (truncated or empty), if it does."""
    if samples == expected:
        return None
    if samples == 0:
        return f"{where}: 0 samples but the manifest says {expected} (empty shard)"
    return f"{where}: ends after member {last_member}: {samples} samples but the manifest says {expected} (truncated?)"


def read_shard(stream: BinaryIO, where: str, dtype: np.dtype, expected_samples: int) -> list[np.ndarray]:
    """All samples of one shard, checked against the manifest's sample count."""
    names, samples = [], []
    for name, array in iter_shard(stream, where, dtype):
        names.append(name)
        samples.append(array)
    problem = count_problem(where, len(samples), expected_samples, names[-1] if names else None)
    if problem:
        raise DataError(problem)
    return samples
