"""Atomic file writes (readers see the old content or the new, never a torn file, even after a crash), output
folders written whole and kept apart from what a command reads (:func:`check_apart`), file checksums, and text
read strictly: every text file distaff reads (configs, hostfiles, manifests, JSON metadata, labelled files,
corpora) is decoded by :func:`decode_text`, whose error names the file, line and byte. The JSONL record files
distaff writes (``metrics.jsonl``, ``evals.jsonl``) are appended whole lines at a time by :func:`append_record`
and read by :func:`read_records`, which passes over and counts a line that is not a record."""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterable, Iterator

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


# ---------------------------------------------------------------- output folders

def check_out_dir(out: Path, overwrite: bool, what: str = "", overwriting: str = "replace it") -> None:
    """Refuse to write into a folder that already holds files (the user's config.json, say) unless told to
    (``overwriting``: what ``--overwrite`` then does)."""
    name = f"{what} {out}" if what else str(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{name}: exists and is not a folder; name a folder to write")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{name}: exists and is not an empty folder; pass --overwrite to {overwriting}")


def is_remote(data_dir: str | Path) -> bool:
    """Whether a data dir is read through a URL or a ``pipe:`` command, not a local folder."""
    text = str(data_dir)
    return "{path}" in text or text.startswith("pipe:") or "://" in text


def place(path: str | Path) -> str:
    """Where ``path`` is: absolute, with every symlink and ``..`` resolved (as far as it exists), so that two
    spellings of one folder compare equal; a remote data dir, or a path no file can have (a NUL byte: refused
    where it is used), as written."""
    if is_remote(path) or "\x00" in str(path):
        return str(path)
    return os.path.realpath(Path(path).expanduser())


def _named(name: str, path: str | Path) -> str:
    """``NAME PATH``, and where it really is when that reads otherwise (a symlink, ``..``, a relative path)."""
    real = place(path)
    return f"{name} {path}" + (f" ({real})" if real != str(path) else "")


def _overlap(out: Path, source: Path) -> str:
    """How the resolved ``out`` overlaps the resolved ``source`` ("" when apart)."""
    if out == source:
        return "is"
    if source in out.parents:
        return "lies inside"
    if out in source.parents:
        return "contains"
    return ""


def check_apart(out: tuple[str, str | Path], inputs: Iterable[tuple[str, str | Path | None]],
                holders: Iterable[tuple[str, str | Path]] = (), error: type[UserError] = UserError) -> None:
    """Refuse an output folder or file ``out`` (its option's name, its path) that is, lies inside or contains one of
    ``inputs`` (name, path; None or "" skipped, as are remote data dirs), or that is or contains one of
    ``holders`` (folders it may lie inside: a run directory holding its branches). Paths are compared with their
    symlinks and ``..`` resolved. Called before anything is written or deleted, with or without ``--overwrite``:
    replacing the output would delete what the command reads."""
    real_out = Path(place(out[1]))
    places = [(name, path, True) for name, path in holders] + [(name, path, False) for name, path in inputs]
    for name, path, may_hold in places:
        if not path or is_remote(path):
            continue
        relation = _overlap(real_out, Path(place(path)))
        if relation and not (may_hold and relation == "lies inside"):
            raise error(f"{_named(*out)}: {relation} the {_named(name, path)}, which this command reads (writing "
                        "there could overwrite or delete it); name an output apart from its inputs")


def _stale_siblings(out: Path) -> Iterator[Path]:
    """What an earlier write of ``out`` killed mid-way left beside it (a partial copy, or the old folder)."""
    for kind in ("partial", "old"):
        yield from out.parent.glob(f".{glob.escape(out.name)}.{kind}-*")


def _host() -> str:
    """This host's name as a write's temporary folder names it (no ``-`` or ``.``, which separate its parts)."""
    return socket.gethostname().replace(".", "_").replace("-", "_")


def _owner_alive(folder: Path) -> bool:
    """Whether the process that made ``folder`` (``.NAME.KIND-HOST-PID-XXXX``) is alive on this host."""
    try:
        host, pid = folder.name.rsplit(".", 1)[1].split("-", 1)[1].rsplit("-", 2)[:2]
        os.kill(int(pid), 0)
    except (ValueError, IndexError):
        return False            # no owner in the name: a write of an older distaff
    except ProcessLookupError:
        return host != _host()      # another host's process: not ours to judge
    except PermissionError:
        pass                    # alive, another user's
    return True


def clean_stale_writes(out: Path) -> None:
    """Remove what a killed write of ``out`` left beside it; when it was killed between moving the old ``out``
    aside and moving the new one in, put the old one back (the user's folder is never lost)."""
    for stale in sorted(_stale_siblings(out)):
        if _owner_alive(stale):
            continue
        if ".old-" in stale.name and not out.exists():
            os.replace(stale, out)
        else:
            shutil.rmtree(stale, ignore_errors=True)


@contextmanager
def replaced_folder(out: str | Path) -> Iterator[Path]:
    """A fresh folder beside ``out`` to write into; when the block succeeds it takes ``out``'s place whole (none of
    the old folder's files survive: a stale ``added_tokens.json`` would change the tokenizer), else it is removed
    and ``out`` stays as it was. What a killed earlier write left beside ``out`` is cleaned first."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_writes(out)
    owner = f"{_host()}-{os.getpid()}-"
    fresh = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{owner}", dir=out.parent))
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(fresh, 0o777 & ~mask)      # mkdtemp makes it 0700
    try:
        yield fresh
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    old = fresh.with_name(f".{out.name}.old-" + fresh.name.removeprefix(f".{out.name}.partial-"))
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


# ---- JSONL record files distaff writes (metrics.jsonl, evals.jsonl, evals/failures.jsonl)

# a field's expected JSON kind: a name is text, a step or seed a whole number, a value any number (NaN included:
# json writes a diverged figure as NaN, and it is a result to show)
NAME, WHOLE, NUMBER = (str,), (int,), (int, float)
_REPORTED: set[tuple[str, tuple[int, ...]]] = set()      # (file, bad lines) already reported by this process
_SHOWN_LINES = 10       # line numbers a report names before "and N more"


def append_record(path: str | Path, record: dict[str, Any], *, durable: bool = True) -> None:
    """``record`` as one whole line at the end of ``path``, under an exclusive lock (several processes append to
    one file): after a newline when a writer that died left a torn line. A write that fails (a full disk) is cut
    back off, so the file ends as it was, and the error names ``path``. ``durable``: fsynced before returning."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record) + "\n"
    with open(path, "a+b", buffering=0) as handle:     # unbuffered: what a write returns is in the file
        fcntl.flock(handle, fcntl.LOCK_EX)
        size = handle.seek(0, os.SEEK_END)
        torn = size > 0 and (handle.seek(size - 1), handle.read(1))[1] != b"\n"
        data = (("\n" if torn else "") + line).encode()
        try:
            written = 0
            while written < len(data):          # a short write (the disk filling up) is followed by the error
                written += handle.write(data[written:])
            if durable:
                os.fsync(handle.fileno())
        except OSError as err:
            handle.truncate(size)       # whole line or nothing: a reader never meets half a record
            raise OSError(err.errno, err.strerror, str(path)) from None


def read_records(path: str | Path, fields: dict[str, tuple[type, ...]], what: str) -> list[dict[str, Any]]:
    """The records of the JSONL file ``path`` (none when it does not exist): JSON objects holding ``fields``, each of
    its kind (NAME, WHOLE, NUMBER). A line that is not one (a torn last line, null, a string, a list where a name
    belongs) is passed over and counted, its line number reported once (``what``: whose records they are). A
    ``path`` that exists but is not a file is a :class:`UserError`."""
    path = Path(path)
    if not path.exists():
        return []
    if not path.is_file():
        raise UserError(f"{path}: not a file ({what} are kept in this file); move it out of the way")
    found, bad = [], []
    raw = path.read_bytes()
    for number, line in enumerate(raw.splitlines(), 1):
        record = _record(line, fields)
        if record is not None:
            found.append(record)
        elif line.strip():
            bad.append(number)
    _report_bad_lines(path, bad, what, torn=bool(raw) and not raw.endswith(b"\n") and raw.count(b"\n") + 1 in bad)
    return found


def _record(line: bytes, fields: dict[str, tuple[type, ...]]) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict):
        return None
    for field, kinds in fields.items():
        value = record.get(field)
        if isinstance(value, bool) or not isinstance(value, kinds):
            return None
    return record


def _report_bad_lines(path: Path, bad: list[int], what: str, torn: bool) -> None:
    if not bad or (str(path), tuple(bad)) in _REPORTED:
        return
    _REPORTED.add((str(path), tuple(bad)))
    shown_lines = ", ".join(map(str, bad[:_SHOWN_LINES])) + (f" and {len(bad) - _SHOWN_LINES} more"
                                                              if len(bad) > _SHOWN_LINES else "")
    cause = " (the last one torn: a writer stopped mid-line)" if torn else ""
    print(f"distaff: warning: {path}: {len(bad)} line(s) are not {what} and were passed over{cause}: "
          f"line {shown_lines}", file=sys.stderr, flush=True)
