"""How every ``distaff`` command reports a failure: one mechanism, one style.

Bad input is one line on stderr, ``distaff <command>: <what>, <where>; <what to do>``, and exit status
:data:`EXIT_BAD_INPUT` (2), without a traceback. Bad input is a :class:`UserError` (``ConfigError`` and
``DataError`` are its subclasses: raise those, with a message that names the file, line, key or value
and says what to do; ``ConfigError`` is also importable from ``model_config``) or a path the user named
that cannot be used (missing, not a folder, not writable). A :class:`RunFailure` (a full disk during a save, say) is one line and exit 1. Anything
else is a bug or a broken machine: its traceback, then one line naming the exception, exit 1.
``--debug`` anywhere on a command line (or ``DISTAFF_DEBUG=1``, which ``--debug`` sets for the
processes a command starts) prints the traceback of every error.

Numbers a user gives (command-line values, launcher variables, fields of the files distaff reads) are parsed
here too, by :func:`finite_float`, :func:`whole_number` and :func:`env_int`, so every one is range-checked and its
error names where it came from; every number option of every command is parsed by :func:`int_arg` or
:func:`float_arg` (never argparse's bare ``int``/``float``: they take nan, inf and numbers too large for what
uses them), and :func:`document_ranges` writes each one's range into its ``--help`` line.

Imports nothing heavy: launchers use it without importing torch.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import math
import os
import re
import reprlib
import sys
import traceback
from typing import Any, Callable, Iterable, Mapping

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


class OptionError(Exception):
    """A command-line option's value is bad (the message names the option, the value and the range). Not a
    ValueError, so that argparse passes it up to :func:`command_main` (one line, exit 2) instead of printing its
    usage and a message that leaves the range out."""


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


_DIGITS = re.compile(r"[0-9]+")     # ASCII digits only: str.isdigit() also takes '²', which int() refuses


def _number(value: float) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def _bounds(low: float | None, high: float | None, low_open: bool, high_open: bool = False) -> str:
    parts = [f"{'>' if low_open else '>='} {_number(low)}" if low is not None else "",
             f"{'<' if high_open else '<='} {_number(high)}" if high is not None else ""]
    return " and ".join(part for part in parts if part)


def finite_float(value: Any, what: str, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False, error: type[UserError] = ConfigError) -> float:
    """``value`` (text or a number) as a finite float within the bounds; else ``error`` naming ``what``. nan and
    inf are refused: they pass every comparison a range check makes, and turn a plan or a run into NaN."""
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            pass
    bounds = _bounds(low, high, low_open, high_open)
    below = low is not None and number is not None and (number <= low if low_open else number < low)
    above = high is not None and number is not None and (number >= high if high_open else number > high)
    if number is None or not math.isfinite(number) or below or above:
        raise error(f"{what}: expected a finite number{' ' + bounds if bounds else ''}, got {shown(value)}")
    return number


def whole_number(value: Any, what: str, *, low: int | None = 0, high: int | None = None,
                 error: type[UserError] = ConfigError) -> int:
    """``value`` (an int, or text of ASCII digits) as an int within the bounds; else ``error`` naming ``what``."""
    number = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and _DIGITS.fullmatch(value.strip().removeprefix("-")):
        number = int(value.strip())
    if number is None or (low is not None and number < low) or (high is not None and number > high):
        bounds = _bounds(low, high, False)
        raise error(f"{what}: expected a whole number{' ' + bounds if bounds else ''}, got {shown(value)}")
    return number


def env_int(env: Mapping[str, str], name: str, default: int | None = None, *, low: int = 0,
            high: int | None = None) -> int | None:
    """The launcher variable ``name`` of ``env`` as a whole number (``default`` when unset); a bad value is a
    :class:`ConfigError` naming the variable."""
    if name not in env:
        return default
    return whole_number(env[name], f"environment variable {name}", low=low, high=high)


# bounds of command-line numbers that have no natural one: far above any real use, far below what breaks arithmetic
MAX_SEED = 2**32 - 1        # numpy's largest seed; torch and Python take it too
MAX_COUNT = 10**9           # steps, sentences, samples, batches
MAX_NODES = 100_000         # the largest machines have some 10,000 nodes
MAX_PROCESSES = 4096        # worker processes or threads on one machine
MAX_PORT = 65535


class NumberArg:
    """An argparse ``type`` for a number option: finite (no nan, inf), within the bounds, whole when ``whole``; a bad
    value is an :class:`OptionError` naming the option, the value and the range. :func:`document_ranges` adds the
    range to the option's ``--help`` line."""

    def __init__(self, what: str, whole: bool, **bounds: Any):
        self.what, self.whole, self.bounds = what, whole, bounds

    @property
    def range(self) -> str:
        bounds = {"low": 0, **self.bounds} if self.whole else self.bounds
        text = _bounds(bounds.get("low"), bounds.get("high"), bounds.get("low_open", False),
                       bounds.get("high_open", False))
        return ("a whole number" if self.whole else "a finite number") + (f" {text}" if text else "")

    def __call__(self, text: str) -> float | int:
        try:
            if self.whole:
                return whole_number(text, self.what, **self.bounds)
            return finite_float(text, self.what, **self.bounds)
        except ConfigError as err:
            raise OptionError(str(err)) from None


def float_arg(what: str, **bounds: Any) -> NumberArg:
    """An argparse ``type`` for a float option ``what``: :func:`finite_float` with ``bounds``."""
    return NumberArg(what, False, **bounds)


def int_arg(what: str, **bounds: Any) -> NumberArg:
    """An argparse ``type`` for a whole-number option ``what``: :func:`whole_number` with ``bounds`` (low 0 unless
    given)."""
    return NumberArg(what, True, **bounds)


def document_ranges(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` (and its subcommands') with each number option's range at the end of its ``--help`` line."""
    for action in parser._actions:
        shown_range = isinstance(action.type, NumberArg) and action.type.range in (action.help or "")
        if isinstance(action.type, NumberArg) and action.help != argparse.SUPPRESS and not shown_range:
            action.help = f"{action.help}; {action.type.range}" if action.help else action.type.range
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                document_ranges(sub)
    return parser


def is_bad_input(err: BaseException) -> bool:
    return (isinstance(err, (UserError, OptionError, *_PATH_ERRORS))
            or (isinstance(err, OSError) and err.errno in _PATH_ERRNOS))


# a write refused for want of room: a full disk or quota, or the process's file-size limit (RLIMIT_FSIZE)
_NO_ROOM_ERRNOS = {errno.ENOSPC: "no space left", errno.EDQUOT: "the disk quota is used up",
                   errno.EFBIG: "a file reached the file-size limit (`ulimit -f`; raise it, e.g. ulimit -f unlimited)"}


def is_run_failure(err: BaseException) -> bool:
    """A failure outside the input and the code (one line, exit 1, no traceback): a :class:`RunFailure`, or a write
    refused for want of room."""
    return isinstance(err, RunFailure) or (isinstance(err, OSError) and err.errno in _NO_ROOM_ERRNOS)


def describe(err: BaseException) -> str:
    """The one-line message of ``err`` (an ``OSError`` as ``path: reason``), at most MAX_MESSAGE_CHARS long."""
    if isinstance(err, OSError) and err.errno in _NO_ROOM_ERRNOS:
        message = f"{err.filename or 'a write'}: {_NO_ROOM_ERRNOS[err.errno]}"
    elif isinstance(err, OSError) and err.strerror and err.filename is not None:
        message = f"{err.filename}: {err.strerror.lower()}"
    else:
        message = str(err) or type(err).__name__
    if is_bad_input(err):
        message = " ".join(line.strip() for line in message.splitlines())
    elif not is_run_failure(err):
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
    if debug_enabled() or not (bad or is_run_failure(err)):
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
