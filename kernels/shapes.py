"""The contract's torch-free part: implementation names, constants and the position span, which a model's config
reads (``distaff plan`` plans a model from its config without importing torch; ``contract`` re-exports them)."""

from __future__ import annotations

IMPLS = ("auto", "triton", "reference")
IGNORE_INDEX = -100  # label of positions without an MLM target (PyTorch's cross-entropy default)
TRITON_HEAD_DIMS = (16, 32, 64, 128)  # head sizes the fused attention kernels are built for


def attention_span(position_buckets: int, max_relative_positions: int) -> int:
    """Half the number of rows of the position tables (``att_span`` in DeBERTa)."""
    if max_relative_positions < 1:
        raise ValueError(f"max_relative_positions must be >= 1, got {max_relative_positions}")
    return position_buckets if position_buckets > 0 else max_relative_positions
