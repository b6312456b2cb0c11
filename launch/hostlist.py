"""Slurm hostlist expressions: ``gpu[01-03,07]`` -> ``gpu01 gpu02 gpu03 gpu07``.

Follows ``scontrol show hostnames``: comma-separated host expressions, each with any number of
bracketed ranges (their cartesian product, leftmost varying slowest); a range keeps the zero
padding of its lower bound (``[08-10]`` -> ``08 09 10``). Duplicates are kept, in order.

Every host name is checked (:func:`distaff.launch.script_values.host_name`: it reaches pdsh and a remote
shell unquoted), and an expression that names more than :data:`MAX_HOSTS` hosts is refused before any
is expanded (``n[0-99999999]`` would take minutes and gigabytes).
"""

from __future__ import annotations

import itertools
import re

from distaff.launch.script_values import host_name
from distaff.train.core.errors import UserError, shown

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
MAX_HOSTS = 10_000         # far above any deepspeed/pdsh launch; a typo like n[0-99999999] stops here


class HostlistError(UserError):
    """A malformed hostlist expression; the message quotes it."""


def _split_top_level(spec: str) -> list[str]:
    """Split on commas that are outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(spec):
        if char == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"hostlist {shown(spec)}: nested '['")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"hostlist {shown(spec)}: ']' without '['")
        elif char == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    if depth:
        raise HostlistError(f"hostlist {shown(spec)}: '[' without ']'")
    parts.append(spec[start:])
    return parts


def _ranges(body: str, spec: str) -> list[tuple[int, int, int]]:
    """``01-03,07`` -> ``[(1, 3, 2), (7, 7, 2)]``: (low, high, zero-padded width) of each range."""
    ranges = []
    for item in body.split(","):
        match = _RANGE.fullmatch(item.strip())
        if not match:
            raise HostlistError(f"hostlist {shown(spec)}: bad range {item!r} (expected N or N-M)")
        low_text, high_text = match.group(1), match.group(2) or match.group(1)
        low, high = int(low_text), int(high_text)
        if high < low:
            raise HostlistError(f"hostlist {shown(spec)}: range {item!r} runs backwards")
        ranges.append((low, high, len(low_text)))
    return ranges


def _pieces(expr: str, spec: str) -> list[str | list[tuple[int, int, int]]]:
    """Literal text and bracket ranges alternating: "a[1-2]b[3]" -> ["a", [(1, 2, 1)], "b", [(3, 3, 1)], ""]."""
    return [text if i % 2 == 0 else _ranges(text, spec) for i, text in enumerate(re.split(r"\[([^\]]*)\]", expr))]


def _count(pieces: list) -> int:
    count = 1
    for piece in pieces[1::2]:
        count *= sum(high - low + 1 for low, high, _ in piece)
    return count


def _expand(pieces: list) -> list[str]:
    choices = [[piece] if i % 2 == 0 else [str(n).zfill(width) for low, high, width in piece
                                             for n in range(low, high + 1)] for i, piece in enumerate(pieces)]
    return ["".join(combo) for combo in itertools.product(*choices)]


def expand_hostlist(spec: str) -> list[str]:
    """All host names of a Slurm hostlist expression, in Slurm's order; each a valid host name, at most
    :data:`MAX_HOSTS` of them."""
    parsed, total = [], 0
    for expr in _split_top_level(spec.strip()):
        expr = expr.strip()
        if not expr:
            raise HostlistError(f"hostlist {shown(spec)}: empty host name")
        parsed.append(_pieces(expr, spec))
        total += _count(parsed[-1])
        if total > MAX_HOSTS:
            raise HostlistError(f"hostlist {shown(spec)}: names more than {MAX_HOSTS:,} hosts; check the ranges")
    return [host_name(host, f"hostlist {shown(spec)}: host") for pieces in parsed for host in _expand(pieces)]
