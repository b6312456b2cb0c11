"""Slurm hostlist expressions: ``gpu[01-03,07]`` -> ``gpu01 gpu02 gpu03 gpu07``.

Follows ``scontrol show hostnames``: comma-separated host expressions, each with any number of
bracketed ranges (their cartesian product, leftmost varying slowest); a range keeps the zero
padding of its lower bound (``[08-10]`` -> ``08 09 10``). Duplicates are kept, in order.
"""

from __future__ import annotations

import itertools
import re

from distaff.train.core.errors import UserError

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


class HostlistError(UserError):
    """A malformed hostlist expression; the message quotes it."""


def _split_top_level(spec: str) -> list[str]:
    """Split on commas that are outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(spec):
        if char == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"hostlist {spec!r}: nested '['")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"hostlist {spec!r}: ']' without '['")
        elif char == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    if depth:
        raise HostlistError(f"hostlist {spec!r}: '[' without ']'")
    parts.append(spec[start:])
    return parts


def _expand_ranges(body: str, spec: str) -> list[str]:
    """``01-03,07`` -> ``['01', '02', '03', '07']``."""
    values = []
    for item in body.split(","):
        match = _RANGE.fullmatch(item.strip())
        if not match:
            raise HostlistError(f"hostlist {spec!r}: bad range {item!r} (expected N or N-M)")
        low_text, high_text = match.group(1), match.group(2) or match.group(1)
        low, high = int(low_text), int(high_text)
        if high < low:
            raise HostlistError(f"hostlist {spec!r}: range {item!r} runs backwards")
        width = len(low_text)
        values += [str(n).zfill(width) for n in range(low, high + 1)]
    return values


def _expand_host(expr: str, spec: str) -> list[str]:
    # Alternate literal text and bracket bodies: "a[1-2]b[3]" -> ["a", "1-2", "b", "3", ""].
    pieces = re.split(r"\[([^\]]*)\]", expr)
    choices = [[text] if i % 2 == 0 else _expand_ranges(text, spec) for i, text in enumerate(pieces)]
    return ["".join(combo) for combo in itertools.product(*choices)]


def expand_hostlist(spec: str) -> list[str]:
    """All host names of a Slurm hostlist expression, in Slurm's order."""
    hosts = []
    for expr in _split_top_level(spec.strip()):
        expr = expr.strip()
        if not expr:
            raise HostlistError(f"hostlist {spec!r}: empty host name")
        hosts += _expand_host(expr, spec)
    return hosts
