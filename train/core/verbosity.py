"""How much of the libraries' own output a command shows: by default none of their INFO lines, progress bars
or repeated warnings (DeepSpeed's launcher and checkpoint conversion, torch's FutureWarnings from DeepSpeed's
collectives); ``--verbose`` anywhere on a command line (or ``DISTAFF_VERBOSE=1``, which ``--verbose`` sets for
the processes a command starts) shows them all."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings
from collections.abc import Iterator

VERBOSE_FLAG = "--verbose"
VERBOSE_ENV = "DISTAFF_VERBOSE"


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def take_verbose_flag(argv: list[str]) -> list[str]:
    """``argv`` without ``--verbose``; when it was there, ``DISTAFF_VERBOSE=1`` for this process and its children."""
    if VERBOSE_FLAG in argv:
        os.environ[VERBOSE_ENV] = "1"
    return [arg for arg in argv if arg != VERBOSE_FLAG]


def quiet_torch_warnings() -> None:
    """Unless verbose: no FutureWarnings from inside torch.distributed (DeepSpeed calls deprecated collectives
    at every step; the user can do nothing about them)."""
    if not verbose():
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")


@contextlib.contextmanager
def library_chatter_hidden() -> Iterator[None]:
    """Unless verbose: what a library prints and its progress bars, while the block runs, are kept back; shown
    after all if the block raises (they may say why)."""
    if verbose():
        yield
        return
    kept = io.StringIO()
    try:
        with contextlib.redirect_stdout(kept), contextlib.redirect_stderr(kept):
            yield
    except BaseException:
        sys.stderr.write(kept.getvalue())
        raise
