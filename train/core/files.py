"""Atomic file writes (readers see the old content or the new, never a torn file, even after a crash),
file checksums, and text read strictly: every text file distaff reads (configs, hostfiles, manifests, JSON
metadata, labelled files, corpora) is decoded by :func:`decode_text`, whose error names the file, line and byte."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator

from distaff.train.core.errors import UserError


def fsync_dir(path: Path) -> None:
    """Make renames inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_open(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """A handle on a temporary file beside ``path`` that replaces ``path`` when the block exits
    without an error (flushed and fsynced first); on an error the temporary file is removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, mode) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def chmod_default(path: str | Path) -> None:
    """Give ``path`` the mode a new file normally gets (0666 less the umask); some writers leave 0600."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_open(path, "w") as handle:
        handle.write(text)


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextmanager
def replaced_folder(out: str | Path) -> Iterator[Path]:
    """A fresh folder beside ``out`` to write into; when the block succeeds it takes ``out``'s place whole (none of
    the old folder's files survive: a stale ``added_tokens.json`` would change the tokenizer), else it is removed
    and ``out`` stays as it was."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fresh = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(fresh, 0o777 & ~mask)      # mkdtemp makes it 0700
    try:
        yield fresh
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    old = fresh.with_name(fresh.name.replace(".partial-", ".old-"))
    if out.exists():
        os.replace(out, old)
    os.replace(fresh, out)
    fsync_dir(out.parent)
    shutil.rmtree(old, ignore_errors=True)


def byte_position(raw: bytes, index: int, first_line: int = 1) -> str:
    """``line L, byte B`` of ``raw[index]`` (both 1-based; ``first_line``: the line ``raw`` starts on)."""
    line, line_start = first_line + raw.count(b"\n", 0, index), raw.rfind(b"\n", 0, index) + 1
    return f"line {line}, byte {index - line_start + 1}"


def decode_text(raw: bytes, source: str, *, first_line: int = 1, error: type[UserError] = UserError,
                nul_ok: bool = False) -> str:
    """``raw`` decoded as UTF-8; else ``error`` (one line) naming ``source``, the line and byte of the first byte
    that is not UTF-8, or (unless ``nul_ok``: corpora may hold one) of a NUL byte, which no text file holds."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{source}, {byte_position(raw, err.start, first_line)}: byte 0x{raw[err.start]:02x} is not "
                    "UTF-8 (a Latin-1 or binary file?); save the file as UTF-8 text") from None
    if not nul_ok and "\x00" in text:
        raise error(f"{source}, {byte_position(raw, raw.index(0), first_line)}: a NUL byte, which no text file "
                    "holds (a binary or damaged file?); give a UTF-8 text file") from None
    return text


def read_text(path: str | Path, *, error: type[UserError] = UserError, what: str = "") -> str:
    """The UTF-8 text of the file ``path`` (``what`` prefixes its name in errors: ``--hostfile``)."""
    source = f"{what} {path}" if what else str(path)
    return decode_text(Path(path).read_bytes(), source, error=error)


def parse_json(text: str | bytes, source: str, *, error: type[UserError] = UserError) -> Any:
    """The JSON value of ``text`` (bytes are decoded by :func:`decode_text`); else ``error`` naming ``source``,
    the line and the column."""
    if isinstance(text, bytes):
        text = decode_text(text, source, error=error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"{source}, line {err.lineno}, column {err.colno}: not valid JSON ({err.msg})") from None
    except RecursionError:
        raise error(f"{source}: JSON nested too deeply to read") from None


def read_json(path: str | Path, *, error: type[UserError] = UserError) -> Any:
    """The JSON value of the file ``path``, read strictly (see :func:`parse_json`)."""
    return parse_json(Path(path).read_bytes(), str(path), error=error)
