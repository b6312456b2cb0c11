"""The data pipeline's error and the checks that several of its readers share."""

from __future__ import annotations

from distaff.train.core.errors import UserError


class DataError(UserError):
    """Bad input data; the message names the file (and line or member)."""


def length_problem(tokens: int, seq_len: int) -> str | None:
    """What is wrong with a sample of ``tokens`` tokens for sequences of ``seq_len``, if anything."""
    return f"{tokens} tokens, more than seq_len {seq_len}" if tokens > seq_len else None
