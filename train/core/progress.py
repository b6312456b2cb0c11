"""Progress of a long command as log lines: one every ``every_s`` seconds and one at the end.

For output that is not a terminal (a job log, a pipe), where a progress bar draws nothing useful: the
commands that read a corpus (``distaff tokenizer train``, ``distaff data prepare``) report how much they
have read and how fast, so a log shows they are alive.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

EVERY_S = 30.0


class ProgressLines:
    """``add(nbytes, items)`` as work is done; a line at most every ``every_s`` seconds, ``done()`` at the end."""

    def __init__(self, prog: str, unit: str, *, every_s: float = EVERY_S, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.prog, self.unit, self.every_s = prog, unit, every_s
        self.stream, self.clock = stream or sys.stderr, clock
        self.started = self.last = clock()
        self.nbytes = self.items = 0

    def add(self, nbytes: int, items: int = 1) -> None:
        self.nbytes += nbytes
        self.items += items
        if self.clock() - self.last >= self.every_s:
            self._line("so far")

    def done(self, what: str = "done") -> None:
        self._line(what)

    def _line(self, what: str) -> None:
        now = self.clock()
        self.last = now
        elapsed = max(now - self.started, 1e-9)
        print(f"{self.prog}: {what}: {self.nbytes / 1e6:,.1f} MB of text, {self.items:,} {self.unit} in "
              f"{elapsed:.0f} s ({self.nbytes / 1e6 / elapsed:.2f} MB/s)", file=self.stream, flush=True)
