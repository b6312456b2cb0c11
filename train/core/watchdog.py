"""A per-rank watchdog: a rank that makes no step progress for too long dumps its stacks and exits.

The process-group timeout bounds our own collectives, but not every wait: a stalled (SIGSTOPped,
swapping, deadlocked) peer leaves the others blocked inside DeepSpeed's gloo calls for far longer.
A daemon thread notices that the loop has not been fed for ``timeout_s``, appends every Python
thread's stack to ``<out_dir>/stacks-rank<N>.txt`` (under a line with the time and the Slurm job and attempt,
so a requeued job keeps each attempt's dumps) and ends the process with ``EXIT_STALLED`` through
``exit_codes.leave_now`` (its DataLoader workers first: the main thread is stuck and would never reach a clean
exit). The Slurm script requeues on that status (up to ``--max-requeues``) and the next attempt resumes from the
last checkpoint.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from distaff.train.core.exit_codes import EXIT_STALLED, claim_exit, leave_now

__all__ = ["Watchdog", "stack_file"]


def stack_file(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / f"stacks-rank{rank}.txt"


class Watchdog:
    """``feed()`` after every step; ``with paused():`` around work that is allowed to take longer
    (checkpoint saves, evaluation: their collectives are bounded by the process-group timeout)."""

    def __init__(self, timeout_s: float, out_dir: Path, rank: int):
        self.timeout_s, self.path, self.rank = timeout_s, stack_file(out_dir, rank), rank
        self._fed = time.monotonic()
        self._paused = 0
        self._stopped = False
        self._thread = threading.Thread(target=self._watch, name="distaff-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """After the loop: closing (saving, evaluating, W&B) is not step progress."""
        self._stopped = True

    def feed(self) -> None:
        self._fed = time.monotonic()

    @contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.feed()

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self._stopped:
            time.sleep(poll)
            if not self._paused and not self._stopped and time.monotonic() - self._fed > self.timeout_s:
                self._fire()

    def _fire(self) -> None:
        claim_exit()    # from here the stall is the rank's story: its main thread, woken by the exit, stays quiet
        try:
            stacks = self._append_stacks()
        except OSError as err:  # a full or read-only disk must not keep a stalled rank (holding the exit) alive
            stacks = f"its stacks could not be appended to {self.path} ({err})"
        print(f"distaff: rank {self.rank}: stalled: no step progress for {self.timeout_s} s (a slow filesystem, "
              f"or a peer rank stalled or dead); {stacks}; exiting with {EXIT_STALLED} "
              "(run again to resume from the latest checkpoint)", file=sys.stderr, flush=True)
        leave_now(EXIT_STALLED)

    def _append_stacks(self) -> str:
        job = os.environ.get("SLURM_JOB_ID")
        attempt = f", Slurm job {job} attempt {os.environ.get('SLURM_RESTART_COUNT', '0')}" if job else ""
        with open(self.path, "a") as handle:
            handle.write(f"=== {time.strftime('%Y-%m-%dT%H:%M:%S%z')} rank {self.rank} (pid {os.getpid()}{attempt}): "
                         f"no step progress for {self.timeout_s} s\n")
            handle.flush()
            faulthandler.dump_traceback(file=handle, all_threads=True)
        return f"stacks appended to {self.path}"
