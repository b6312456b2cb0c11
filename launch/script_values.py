"""The one gate for values that the launchers write into generated files or commands.

Everything that reaches an sbatch script, a deepspeed hostfile, a ``.deepspeed_env`` or the command line
that deepspeed's pdsh runner pastes into a remote shell passes :func:`plain_text` first: no control
character (a newline would end a ``#SBATCH`` line and start a shell command, a NUL would cut a C string),
no leading or trailing whitespace (several readers strip it). Then, per reader:

- ``#SBATCH`` lines (:func:`sbatch_option`): sbatch splits an option line at whitespace, drops everything
  after an unquoted ``#`` and reads ``"..."`` (and, since 19.05, ``'...'``) as one word with ``\\`` escaping
  the next character; a value that needs it is written ``"..."`` with ``\\`` and ``"`` escaped, which
  every Slurm version reads back unchanged. Paths in ``--output`` have ``%`` doubled (Slurm's file-name
  patterns).
- shell text (the sbatch script's body): ``shlex.quote``, in ``slurm.py``.
- host names (:func:`host_name`): letters, digits, ``_``, ``.``, ``-``, not starting with ``-``; they reach
  pdsh's ``-w`` list and the remote ``--master_addr`` unquoted.
- arguments deepspeed's pdsh runner sends to the other nodes (:func:`remote_argument`): it joins them into
  one remote shell command, wrapping an argument in ``"..."`` only when it holds a space, so ``"``, ``$``,
  `````, ``\\`` and ``!`` are refused everywhere, and other shell characters unless the space makes
  deepspeed quote them.
- Slurm time limits (:func:`slurm_time`) and memory sizes (:func:`slurm_memory`): the formats sbatch accepts.
- words a site adds to the job (:func:`site_word`: a container image, its mounts, a ``--gres`` request): no
  shell metacharacter at all, so what the dry run shows is what runs, quoted or not.
- set-up lines (:func:`setup_line`): shell code by design, written verbatim into the per-node script; one line
  each (no newline or other control character but a tab), and never the line that ends that script.
"""

from __future__ import annotations

import re
import unicodedata

from distaff.train.core.errors import ConfigError, shown

_SBATCH_PLAIN = re.compile(r"[A-Za-z0-9_@%+=:,./\-\[\]]+")  # read by sbatch as they are: no quoting needed
_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
MAX_HOST_CHARS = 253                                         # a DNS name's limit
_SLURM_MEMORY = re.compile(r"\d+[KMGTkmgt]?")                # a number of MB, or with a K/M/G/T suffix
_SLURM_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|infinite|unlimited", re.I)
_UNQUOTED_SAFE = re.compile(r"[\w@%+=:,./\-]+")              # what a shell reads as one literal word
_NEVER_REMOTE = '"$`\\!'                                     # special even inside deepspeed's "..."
_SBATCH_OPTION = re.compile(r"(--?[A-Za-z][A-Za-z0-9\-]*)(?:=(.*))?", re.S)
_SITE_WORD = re.compile(r"[A-Za-z0-9_@%+=:,./#\-]+")            # image names (pyxis: nvcr.io#nvidia/x:24.01), paths
NODE_SCRIPT_END = "DISTAFF_NODE_SCRIPT_END"                  # the heredoc delimiter of the per-node script


_NAMES = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\0": "a NUL byte"}


def _char_name(char: str) -> str:
    name = _NAMES.get(char) or unicodedata.name(char, "").lower()
    return f"U+{ord(char):04X}" + (f", {name}" if name else "")


def plain_text(what: str, value: str) -> str:
    """``value``, refused (ConfigError naming ``what``) if it holds a control or line-separator character or
    starts or ends with whitespace."""
    value = str(value)
    bad = next((c for c in value if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")), None)
    if bad is not None:
        raise ConfigError(f"{what} {shown(value)}: contains a control character ({_char_name(bad)}), which would "
                          "break the script or file it is written into; remove it")
    if value != value.strip():
        raise ConfigError(f"{what} {shown(value)}: starts or ends with whitespace; remove it")
    return value


def sbatch_word(what: str, value: str) -> str:
    """``value`` as sbatch reads it back from an ``#SBATCH`` line: as it is, or in double quotes."""
    plain_text(what, value)
    if _SBATCH_PLAIN.fullmatch(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def sbatch_option(name: str, value: str | int | None = None, *, what: str | None = None) -> str:
    """``--name=value`` for an ``#SBATCH`` line, the value checked and quoted (``what`` names it in errors)."""
    if value is None:
        return f"--{name}"
    return f"--{name}={sbatch_word(what or f'--{name}', str(value))}"


def sbatch_extra(line: str) -> str:
    """A user's extra ``--sbatch`` option (``--qos=high``): one option, its value quoted for sbatch."""
    plain_text("--sbatch", line)
    match = _SBATCH_OPTION.fullmatch(line)
    if not match:
        raise ConfigError(f"--sbatch {shown(line)}: expected one sbatch option such as --qos=high (one option per "
                          "--sbatch, its value after '=' and unquoted)")
    option, value = match.groups()
    return option if value is None else f"{option}={sbatch_word(f'--sbatch {option}', value)}"


def slurm_path_pattern(path: str) -> str:
    """A literal path for ``--output``: Slurm expands ``%x``-style patterns, ``%%`` is a ``%``."""
    return path.replace("%", "%%")


def host_name(value: str, where: str = "host") -> str:
    """A host name as the launchers pass it to pdsh and deepspeed (unquoted): refused unless plain."""
    plain_text(where, value)
    if not _HOST.fullmatch(value) or len(value) > MAX_HOST_CHARS:
        raise ConfigError(f"{where} {shown(value)}: not a host name (letters, digits, '_', '.', '-', not starting "
                          f"with '-', at most {MAX_HOST_CHARS} characters); give the node's name or address")
    return value


def remote_argument(what: str, value: str) -> str:
    """``value``, if deepspeed's pdsh runner can paste it into the remote shell command unchanged."""
    plain_text(what, value)
    bad = sorted({c for c in value if c in _NEVER_REMOTE})
    if not bad and (" " in value or _UNQUOTED_SAFE.fullmatch(value)):
        return value
    bad = bad or sorted({c for c in value if not _UNQUOTED_SAFE.fullmatch(c)})
    problem = f"contains {bad}, which" if bad else "is empty, which"
    raise ConfigError(f"{what} {shown(value)}: {problem} deepspeed's multi-node (pdsh) launcher would hand to the "
                      "other nodes' shell unquoted; put the value in the config file, or use `distaff slurm submit`, "
                      "which quotes it")


def slurm_time(value: str) -> str:
    """A ``--time`` limit in one of Slurm's formats (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, infinite)."""
    plain_text("--time", value)
    if not _SLURM_TIME.fullmatch(value):
        raise ConfigError(f"--time {shown(value)}: not a Slurm time limit; give minutes (90), MM:SS, HH:MM:SS, "
                          "D-HH, D-HH:MM, D-HH:MM:SS (1-12:00:00) or infinite")
    return value


def slurm_memory(what: str, value: str) -> str:
    """A memory size as ``--mem``/``--mem-per-cpu`` take it: a number of MB, or with a K/M/G/T suffix."""
    if not _SLURM_MEMORY.fullmatch(value):
        raise ConfigError(f"{what} {value!r}: expected a Slurm size such as 64G, 4000M or 4000 (MB)")
    return value


def site_word(what: str, value: str) -> str:
    """A value a site adds to the job script (an image, mounts, a ``--gres`` request): letters, digits and
    ``_@%+=:,./#-`` only, not starting with ``-``; anything else (a space, ``;``, ``$``, quotes...) is refused."""
    plain_text(what, value)
    if not _SITE_WORD.fullmatch(value) or value.startswith("-"):
        bad = sorted({c for c in value if not _SITE_WORD.fullmatch(c)}) or ["a leading '-'"]
        raise ConfigError(f"{what} {shown(value)}: contains {', '.join(map(repr, bad))}; give a plain name or path "
                          "(letters, digits and _@%+=:,./#-, not starting with '-')")
    return value


def setup_line(what: str, line: str) -> str:
    """A set-up line (shell code, run verbatim on every node): refused if it holds a control character other than a
    tab (a newline or carriage return would make it more than the one line the dry run shows) or is the line that
    ends the per-node script."""
    bad = next((c for c in line if c != "\t" and unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")), None)
    if bad is not None:
        hint = " (a file with Windows line ends: convert it with dos2unix)" if bad == "\r" else ""
        raise ConfigError(f"{what}: {shown(line)} contains a control character ({_char_name(bad)}){hint}; give "
                          "one line per --setup, or one per line of --setup-file")
    if line.strip() == NODE_SCRIPT_END:
        raise ConfigError(f"{what}: {shown(line)} would end the per-node script early; remove it")
    return line
