"""A checkpoint's file list: every file's size and sha256, written when it is saved and checked before it is
resumed from, so a truncated, deleted or altered file makes ``resume=auto`` fall back instead of failing
deep inside DeepSpeed (``PytorchStreamReader failed`` or an empty ``AssertionError``)."""

from __future__ import annotations

import json
from pathlib import Path

from distaff.train.core.files import atomic_write_text, file_sha256

FILES = Path("distaff") / "files.json"
META = Path("distaff") / "meta.json"
FIRST_FORMAT_WITH_FILES = 3  # checkpoints written before have no file list and are trusted as they are


def tag_for_step(step: int) -> str:
    """The folder name of step ``step``'s checkpoint."""
    return f"step-{step:08d}"


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` is a finished checkpoint (``meta.json`` is written last)."""
    return (folder / META).is_file()


def write_file_list(folder: Path) -> None:
    """Record every file under ``folder`` but the list itself and ``meta.json`` (written after it)."""
    files = {path.relative_to(folder).as_posix(): {"size": path.stat().st_size, "sha256": file_sha256(path)}
             for path in sorted(folder.rglob("*")) if path.is_file() and path.relative_to(folder) not in (FILES, META)}
    atomic_write_text(folder / FILES, json.dumps(files, indent=1))


def _file_problem(folder: Path, relpath: str, expected: dict) -> str | None:
    path = folder / relpath
    if not path.is_file():
        return f"{relpath} is missing"
    size = path.stat().st_size
    if size != expected["size"]:
        return f"{relpath} is {size} bytes, {expected['size']} when saved (truncated?)"
    if file_sha256(path) != expected["sha256"]:
        return f"{relpath} has changed since it was saved (sha256 differs)"
    return None


def checkpoint_problem(folder: Path) -> str | None:
    """What makes the checkpoint ``folder`` unusable (an unreadable meta, a missing, truncated or altered file),
    or None when every file matches its record."""
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError) as err:
        return f"{META} is unreadable ({err})"
    if meta.get("format", 0) < FIRST_FORMAT_WITH_FILES:
        return None
    try:
        files = json.loads((folder / FILES).read_text())
    except (OSError, ValueError) as err:
        return f"{FILES} is unreadable ({err})"
    for relpath, expected in files.items():
        problem = _file_problem(folder, relpath, expected)
        if problem:
            return problem
    return None
