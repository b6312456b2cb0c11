"""Atomic file writes (readers see the old content or the new, never a torn file, even after a crash)
and file checksums."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator


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
