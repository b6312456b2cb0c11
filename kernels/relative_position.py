"""DeBERTa's relative-position index: one table shared by the reference and the kernels.

For query position ``i`` and key position ``j`` the score reads row ``idx(i, j)`` of the
position tables ``Kr`` / ``Qr``::

    idx(i, j) = clamp(bucket(i - j) + span, 0, 2 * span - 1)

``bucket`` is the identity for ``|r| <= span // 2`` and logarithmic beyond, saturating at
``max_relative_positions``. It is computed here exactly as Hugging Face ``transformers`` does
(``make_log_bucket_position``); kernels must read this table (or an exact copy of it), never
re-derive it with an approximate in-kernel log.
"""

from __future__ import annotations

import math

import torch

from .shapes import attention_span


def log_bucket_position(relative_pos: torch.Tensor, bucket_size: int, max_position: int) -> torch.Tensor:
    """Map signed distances onto log-spaced buckets (odd function of the distance).

    Matches ``transformers``' ``make_log_bucket_position`` for every distance; float64 is used
    for the log so no distance sits on a rounding edge (tests compare the two tables).
    """
    mid = bucket_size // 2
    rel = relative_pos.to(torch.float64)
    abs_pos = rel.abs()
    # Distances inside (-mid, mid) are the identity; give them a harmless log argument.
    log_arg = torch.where(abs_pos < mid, torch.full_like(abs_pos, mid - 1), abs_pos)
    log_pos = torch.ceil(torch.log(log_arg / mid) / math.log((max_position - 1) / mid) * (mid - 1)) + mid
    bucket = torch.where(log_arg <= mid, rel, log_pos * torch.sign(rel))
    return bucket.to(torch.long)


def relative_bucket(distance: torch.Tensor, position_buckets: int, max_relative_positions: int) -> torch.Tensor:
    """``bucket(i - j)``: log buckets when ``position_buckets > 0``, plain distances otherwise."""
    if position_buckets > 0:
        return log_bucket_position(distance, position_buckets, max_relative_positions)
    return distance.to(torch.long)


def relative_position_index(
    query_len: int,
    key_len: int,
    position_buckets: int,
    max_relative_positions: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``[query_len, key_len]`` long tensor of rows into the ``[2 * span, d]`` position tables."""
    span = attention_span(position_buckets, max_relative_positions)
    q_pos = torch.arange(query_len, device=device)
    k_pos = torch.arange(key_len, device=device)
    bucket = relative_bucket(q_pos[:, None] - k_pos[None, :], position_buckets, max_relative_positions)
    return (bucket + span).clamp_(0, 2 * span - 1)


def bucket_table(max_distance: int, position_buckets: int, max_relative_positions: int,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """``idx`` as a function of the distance ``r = i - j`` for ``r`` in ``[-max_distance, max_distance]``.

    Entry ``r + max_distance`` holds ``clamp(bucket(r) + span, 0, 2*span - 1)``: the O(N) form of
    the index that kernels load instead of an ``N x N`` table.
    """
    span = attention_span(position_buckets, max_relative_positions)
    distance = torch.arange(-max_distance, max_distance + 1, device=device)
    bucket = relative_bucket(distance, position_buckets, max_relative_positions)
    return (bucket + span).clamp_(0, 2 * span - 1).to(torch.int32)
