"""An exclusive lock on an output directory, naming its holder.

Two live runs writing one directory corrupt each other's checkpoints and metrics. The lock is an
``fcntl.flock`` on ``<dir>/.distaff.lock``, held by one process for its life; the file holds a JSON
description of the holder (host, pid, Slurm job id and attempt, start time) for the refusal message.
The kernel drops a flock when its holder dies however it dies, so a stale lock never blocks a
requeued job: the next holder just takes it over and rewrites the description.

A holder that never dies is a hung node's (a process stopped on a host that no longer answers, or a
lock a network filesystem keeps for a client that crashed). When it is an earlier attempt of the
same Slurm job, Slurm has already ended that attempt (it requeues a job only then), so the new
attempt replaces the lock file with a fresh one, which it locks, and says so; any other holder is
refused.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import sys
from pathlib import Path

from distaff.train.core.errors import ConfigError, env_int

__all__ = ["LOCK_FILE", "DirLock", "DirectoryBusy"]

LOCK_FILE = ".distaff.lock"


class DirectoryBusy(ConfigError):
    """Another live process holds the directory's lock."""


def _holder() -> dict[str, object]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart": env_int(os.environ, "SLURM_RESTART_COUNT", 0),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _earlier_attempt_of_this_job(text: str) -> bool:
    """Whether the holder described by ``text`` ran this Slurm job before it was requeued."""
    job = os.environ.get("SLURM_JOB_ID")
    try:
        holder = json.loads(text)
        return bool(job) and holder["slurm_job_id"] == job and \
            int(holder["slurm_restart"]) < env_int(os.environ, "SLURM_RESTART_COUNT", 0)
    except (ValueError, KeyError, TypeError):
        return False


def _describe(text: str) -> str:
    try:
        h = json.loads(text)
        job = f", Slurm job {h['slurm_job_id']}" if h.get("slurm_job_id") else ""
        return f"pid {h['pid']} on {h['host']}{job}, started {h['started']}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not described itself yet"


class DirLock:
    """``DirLock(folder, what)`` holds ``folder``'s lock while the object lives (a run's
    life), or for a ``with`` block."""

    def __init__(self, folder: Path, what: str):
        self.path = folder / LOCK_FILE
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:   # read-only, not ours, a file where a folder should be: the user's to choose again
            at = f" at {err.filename}" if err.filename and Path(err.filename) not in (folder, self.path) else ""
            raise ConfigError(f"{what}: {folder} cannot be written ({(err.strerror or str(err)).lower()}{at}); "
                              "choose a folder this user can write") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(self._fd, 4096, 0).decode(errors="replace")
            os.close(self._fd)
            if not _earlier_attempt_of_this_job(text):
                raise DirectoryBusy(f"{what}: {folder} is in use by {_describe(text)} (lock file {self.path}); "
                                    f"wait for it to finish or choose another directory") from None
            print(f"distaff: {what}: {folder} is still locked by {_describe(text)}, an earlier attempt of this "
                  "job that Slurm has ended (its node failed or hangs): taking the lock over", file=sys.stderr,
                  flush=True)
            self._fd = self._fresh_lock_file()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (json.dumps(_holder()) + "\n").encode(), 0)

    def _fresh_lock_file(self) -> int:
        """A new, locked lock file renamed over the old one (whose lock stays with the dead holder)."""
        fresh = self.path.with_name(f"{LOCK_FILE}.{os.getpid()}")
        fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.replace(fresh, self.path)
        return fd

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)
