"""How every ``distaff`` command reports a failure: one mechanism, one style.

Bad input is one line on stderr, ``distaff <command>: <what>, <where>; <what to do>``, and exit status
:data:`EXIT_BAD_INPUT` (2), without a traceback. Bad input is a :class:`UserError` (``ConfigError`` and
``DataError`` are its subclasses: raise those, with a message that names the file, line, key or value
and says what to do; ``ConfigError`` is also importable from ``model_config``) or a path the user named
that cannot be used (missing, not a folder, not writable). A :class:`RunFailure` (a full disk during a save, say) is one line and exit 1. Anything
else is a bug or a broken machine: its traceback, then one line naming the exception, exit 1.
``--debug`` anywhere on a command line (or ``DISTAFF_DEBUG=1``, which ``--debug`` sets for the
processes a command starts) prints the traceback of every error.

Imports nothing heavy: launchers use it without importing torch.
"""

from __future__ import annotations

import difflib
import errno
import os
import reprlib
import sys
import traceback
from typing import Any, Callable, Iterable

from distaff.train.core.exit_codes import EXIT_BAD_CONFIG, EXIT_FAILURE
from distaff.train.core.verbosity import take_verbose_flag

EXIT_BAD_INPUT = EXIT_BAD_CONFIG
DEBUG_FLAG = "--debug"
DEBUG_ENV = "DISTAFF_DEBUG"
MAX_MESSAGE_CHARS = 2000        # a message longer than this is cut in the middle (a value can be huge)
# a path the user named that cannot be used as asked (by class, or by errno for a plain OSError): bad input
_PATH_ERRORS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)
_PATH_ERRNOS = {errno.ENOENT, errno.EEXIST, errno.EISDIR, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS,
                errno.ENAMETOOLONG}

_repr = reprlib.Repr()
_repr.maxstring, _repr.maxother, _repr.maxlevel = 80, 80, 3
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 8


class UserError(ValueError):
    """Bad input the user can fix; the message names where it is and what to do."""


class ConfigError(UserError):
    """A configuration value is invalid; the message names the field (or key) and what to do."""


class RunFailure(RuntimeError):
    """The run cannot go on for a reason outside the input (a full disk, say); the message says what survived."""


def shown(value: Any) -> str:
    """``repr(value)`` cut short: an error message never formats a huge value (a YAML alias bomb, a 30 MB text)."""
    return _repr.repr(value)


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice most like ``word`` (a typo's intended key or name), or None when none is close."""
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


def reject_unknown_keys(values: Iterable[str], known: Iterable[str], what: str, prefix: str = "",
                        hint: str = "") -> None:
    """A :class:`ConfigError` ``"<what> [<prefix>key, ...]<hint>; did you mean <prefix>known?"`` if ``values``
    holds keys not in ``known``; the question names the closest known key of each unknown one that has one."""
    known = list(known)
    unknown = sorted(set(values) - set(known))
    if not unknown:
        return
    guesses = {key: closest(key, known) for key in unknown}
    meant = [f"{prefix}{guess!s}" + (f" for {prefix}{key}" if len(unknown) > 1 else "")
             for key, guess in guesses.items() if guess is not None]
    question = f"; did you mean {', '.join(meant)}?" if meant else ""
    raise ConfigError(f"{what} {[prefix + key for key in unknown]}{hint}{question}")


def is_bad_input(err: BaseException) -> bool:
    return isinstance(err, (UserError, *_PATH_ERRORS)) or (isinstance(err, OSError) and err.errno in _PATH_ERRNOS)


def describe(err: BaseException) -> str:
    """The one-line message of ``err`` (an ``OSError`` as ``path: reason``), at most MAX_MESSAGE_CHARS long."""
    if isinstance(err, OSError) and err.strerror and err.filename is not None:
        message = f"{err.filename}: {err.strerror.lower()}"
    else:
        message = str(err) or type(err).__name__
    if is_bad_input(err):
        message = " ".join(line.strip() for line in message.splitlines())
    elif not isinstance(err, RunFailure):
        message = f"failed: {type(err).__name__}: {message}"
    if len(message) > MAX_MESSAGE_CHARS:
        half = MAX_MESSAGE_CHARS // 2
        message = f"{message[:half]} [... {len(message) - 2 * half:,} characters ...] {message[-half:]}"
    return message


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def take_debug_flag(argv: list[str]) -> list[str]:
    """``argv`` without ``--debug``; when it was there, ``DISTAFF_DEBUG=1`` for this process and its children."""
    if DEBUG_FLAG in argv:
        os.environ[DEBUG_ENV] = "1"
    return [arg for arg in argv if arg != DEBUG_FLAG]


def report(prog: str, err: BaseException, where: str = "", hint: str = "") -> int:
    """Print ``err`` for the command ``prog`` (``where``, e.g. ``"rank 1: "``, after its name; ``hint`` in
    parentheses after the message); the exit status."""
    bad = is_bad_input(err)
    if debug_enabled() or not (bad or isinstance(err, RunFailure)):
        traceback.print_exception(err)
    print(f"{prog}: {where}{describe(err)}{f' ({hint})' if hint else ''}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT if bad else EXIT_FAILURE


def command_main(prog: str, body: Callable[[list[str]], int], argv: list[str] | None) -> int:
    """Run ``body(argv)`` (``argv`` without ``--debug`` and ``--verbose``) and report what it raises; the exit
    status."""
    argv = take_verbose_flag(take_debug_flag(sys.argv[1:] if argv is None else list(argv)))
    try:
        code = int(body(argv) or 0)
        sys.stdout.flush()          # here, where a closed pipe can still be caught, not at the interpreter's exit
        return code
    except BrokenPipeError:
        # the reader stopped early (`distaff plan ... | head -1`): nothing is wrong, and nobody reads the rest
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as err:  # noqa: BLE001 - every failure is reported in the one style
        return report(prog, err)
