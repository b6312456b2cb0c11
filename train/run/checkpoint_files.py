"""A checkpoint's file list: every file's size and sha256, written when it is saved and checked before it is
resumed from or exported, so a truncated, deleted or altered file makes ``resume=auto`` fall back instead of
failing deep inside DeepSpeed (``PytorchStreamReader failed`` or an empty ``AssertionError``), and export refuses.

``meta.json`` is in the list (from format 4 on: it is written before the list), so nothing in it can be edited
unnoticed, its format number included: whether a checkpoint is verified never depends on what it says about
itself. A checkpoint without a list cannot be verified and is refused. Format 3 wrote ``meta.json`` after the
list (its other files are verified, ``meta.json`` is not).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from distaff.train.core.errors import UserError, whole_number
from distaff.train.core.files import atomic_write_text, check_apart, file_sha256, read_json
from distaff.train.data.errors import DataError

FILES = Path("distaff") / "files.json"
META = Path("distaff") / "meta.json"
OLDEST_FORMAT = 3           # the first with a file list; older checkpoints cannot be verified
FORMAT_WITH_META_LISTED = 4  # meta.json is written before the list and recorded in it


def tag_for_step(step: int) -> str:
    """The folder name of step ``step``'s checkpoint."""
    return f"step-{step:08d}"


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` is a finished checkpoint (``meta.json`` is written last)."""
    return (folder / META).is_file()


def check_apart_from_checkpoints(out: tuple[str, str | Path], named: list[tuple[str, str | Path]],
                                 error: type[UserError] = UserError) -> None:
    """Refuse an output folder ``out`` (option, path) over the checkpoints a command reads through the paths
    ``named`` (option, path: a checkpoint, a run's ``checkpoints`` folder, a run directory or a model folder):
    it may lie inside a run directory (``runs/x/avg``, where ``distaff evals`` finds averages) but not be it,
    contain it, or touch the run's ``checkpoints`` (or fine-tuning ``best``) folder, which the run rotates and
    resumes from (see :func:`distaff.train.core.files.check_apart`)."""
    inputs, holders = [], []
    for name, path in named:
        run = Path(path)
        if not is_complete(run) and (run / "checkpoints").is_dir():
            holders.append((name, run))
            inputs += [(f"{name}'s {sub} folder", run / sub) for sub in ("checkpoints", "best") if (run / sub).is_dir()]
        else:
            inputs.append((name, run))
    check_apart(out, inputs, holders, error)


def write_file_list(folder: Path) -> None:
    """Record every file under ``folder`` (``meta.json`` included) but the list itself."""
    files = {path.relative_to(folder).as_posix(): {"size": path.stat().st_size, "sha256": file_sha256(path)}
             for path in sorted(folder.rglob("*")) if path.is_file() and path.relative_to(folder) != FILES}
    atomic_write_text(folder / FILES, json.dumps(files, indent=1))


def read_meta(folder: Path) -> dict[str, Any]:
    """A checkpoint's ``meta.json``, its numbers range-checked (a DataError naming the file and field)."""
    path = folder / META
    meta = read_json(path, error=DataError)
    if not isinstance(meta, dict):
        raise DataError(f"{path}: expected a JSON object")
    for name, low in (("format", 0), ("step", 0), ("world_size", 1)):
        whole_number(meta.get(name), f"{path}: {name}", low=low, error=DataError)
    return meta


def _file_problem(folder: Path, relpath: str, expected: Any) -> str | None:
    path = folder / relpath
    if not isinstance(expected, dict) or not isinstance(expected.get("size"), int):
        return f"{FILES} has no size and sha256 for {relpath}"
    if not path.is_file():
        return f"{relpath} is missing"
    size = path.stat().st_size
    if size != expected["size"]:
        return f"{relpath} is {size} bytes, {expected['size']} when saved (truncated?)"
    if file_sha256(path) != expected.get("sha256"):
        return f"{relpath} has changed since it was saved (sha256 differs)"
    return None


def checkpoint_problem(folder: Path) -> str | None:
    """What makes the checkpoint ``folder`` unusable (no file list, an unreadable meta, a missing, truncated or
    altered file, ``meta.json`` among them), or None when every file matches its record."""
    try:
        files = read_json(folder / FILES, error=DataError)
    except FileNotFoundError:
        return (f"{FILES} is missing: without its file list the checkpoint cannot be verified (written before "
                f"format {OLDEST_FORMAT}, or damaged)")
    except (OSError, UserError) as err:
        return f"{FILES} is unreadable ({err})"
    if not isinstance(files, dict):
        return f"{FILES} is not a list of files"
    for relpath, expected in files.items():
        problem = _file_problem(folder, relpath, expected)
        if problem:
            return problem
    try:
        meta = read_meta(folder)
    except (OSError, UserError) as err:
        return f"{META} is unreadable ({err})"
    if META.as_posix() not in files and meta["format"] >= FORMAT_WITH_META_LISTED:
        return f"{META} is not in {FILES} (every checkpoint of format {FORMAT_WITH_META_LISTED} on lists it)"
    return None
