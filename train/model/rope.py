"""Rotary position embedding (RoFormer, Su et al. 2021) for the attention's queries and keys.

Each head's vector is split into ``d/2`` planes, pairing coordinate ``i`` with ``i + d/2`` (the
"rotate half" layout; the paper pairs neighbours, which is the same function up to a fixed
permutation of the projection weights). The plane ``i`` of the vector at position ``m`` is rotated
by the angle ``m * theta^(-2i/d)``. Rotating both ``q`` at ``m`` and ``k`` at ``n`` makes their
dot product depend on ``m - n`` only, so the attention op needs no change: it runs its content-only
mode, or adds DeBERTa's c2p/p2c terms on top when relative attention is also on.
"""

from __future__ import annotations

import torch


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of the rotation angles, ``[..., N, d/2]`` for integer ``positions [..., N]``.

    Computed in float32 (bf16 angles lose whole radians at positions in the hundreds)."""
    inv_freq = theta ** (-torch.arange(0, head_dim // 2, device=positions.device, dtype=torch.float32)
                         / (head_dim // 2))
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [..., d]`` with each ``(x_i, x_{i+d/2})`` plane rotated by the angles whose ``cos``/``sin``
    broadcast against ``x`` with its last dim halved: ``[N, d/2]`` for padded ``[B, H, N, d]``,
    ``[T, 1, d/2]`` for packed ``[T, H, d]``."""
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)
    return rotated.to(x.dtype)
