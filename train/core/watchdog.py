"""A per-rank watchdog: a rank that makes no step progress for too long dumps its stacks and exits.

The process-group timeout bounds our own collectives, but not every wait: a stalled (SIGSTOPped,
swapping, deadlocked) peer leaves the others blocked inside DeepSpeed's gloo calls for far longer.
A daemon thread notices that the loop has not been fed for ``timeout_s``, writes every Python
thread's stack to ``<out_dir>/stacks-rank<N>.txt`` and ends the process with ``EXIT_FAILURE``
(``os._exit``: the main thread is stuck and would never reach a clean exit). A Slurm requeue then
resumes from the last checkpoint.
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

from distaff.train.core.exit_codes import EXIT_FAILURE

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
        with open(self.path, "w") as handle:
            handle.write(f"rank {self.rank} (pid {os.getpid()}): no step progress for {self.timeout_s} s\n")
            handle.flush()
            faulthandler.dump_traceback(file=handle, all_threads=True)
        print(f"distaff pretrain: rank {self.rank}: failed: no step progress for {self.timeout_s} s "
              f"(a peer rank is probably stalled or dead); stacks written to {self.path}; exiting with "
              f"{EXIT_FAILURE}", file=sys.stderr, flush=True)
        os._exit(EXIT_FAILURE)
