"""RealFormer's residual attention (He et al., Findings of ACL 2021) without an ``N x N`` score tensor.

Layer ``l`` attends with the sum of its own pre-softmax scores and those of every earlier layer. Every
layer's score is ``scale * (q_i . k_j + q_i . Kr[idx(i, j)] + k_j . Qr[idx(i, j)])`` with one scale
for all layers (the head size and the position terms are the same in every layer), so the running sum
over layers ``1..l`` is that same expression for the queries, keys and position tables of those layers
concatenated along the head dimension: a dot product of concatenations is the sum of the blocks' dot
products. The fused kernel therefore runs it unchanged, at a head size of ``l * d``; a width the
kernel is not built for is zero-padded up to the next one it is (zeros add nothing to a dot product),
and past the largest (``TRITON_HEAD_DIMS``) the reference path runs it. Values stay the layer's own
(zero-padded to the width of the queries, which the op requires, and cut back after).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from distaff import kernels


class ScoreHistory(NamedTuple):
    """Queries, keys and position tables of layers ``1..l``, concatenated along the head dimension.

    A NamedTuple so activation checkpointing and ZeRO-3 see its tensors."""

    q: torch.Tensor                 # [B, H, N, l*d] padded, [T, H, l*d] packed
    k: torch.Tensor
    pos_key: torch.Tensor | None    # [H, 2*span, l*d] (c2p), or None
    pos_query: torch.Tensor | None  # [H, 2*span, l*d] (p2c), or None


def _joined(old: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor | None:
    return new if old is None or new is None else torch.cat([old, new], -1)


def extend(history: ScoreHistory | None, q: torch.Tensor, k: torch.Tensor, pos_key: torch.Tensor | None,
           pos_query: torch.Tensor | None) -> ScoreHistory:
    """The history after one more layer with these queries, keys and position tables."""
    if history is None:
        return ScoreHistory(q, k, pos_key, pos_query)
    return ScoreHistory(_joined(history.q, q), _joined(history.k, k), _joined(history.pos_key, pos_key),
                        _joined(history.pos_query, pos_query))


def kernel_width(width: int, impl: str, device: torch.device) -> tuple[str, int]:
    """The implementation that runs a concatenated head size ``width`` and the width it runs at:
    Triton at the smallest supported head size that holds it, else the reference at ``width``."""
    if kernels.resolve_impl(impl, device) == "triton" and width <= max(kernels.TRITON_HEAD_DIMS):
        return "triton", next(d for d in kernels.TRITON_HEAD_DIMS if d >= width)
    return "reference", width


def residual_attention(history: ScoreHistory, v: torch.Tensor, op: Callable[..., torch.Tensor], impl: str,
                       **options) -> torch.Tensor:
    """``softmax(sum of the history's scores) V`` through the attention ``op`` (padded or packed, its
    layout arguments bound); ``options`` are the op's keywords and must include the layers' common
    ``softmax_scale`` (the op's default would follow the concatenated head size)."""
    if options.get("softmax_scale") is None:
        raise ValueError("residual_attention needs the layers' softmax_scale")
    chosen, width = kernel_width(history.q.shape[-1], impl, v.device)

    def widened(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else F.pad(t, (0, width - t.shape[-1]))

    out = op(*(widened(t) for t in (history.q, history.k, v, history.pos_key, history.pos_query)),
             impl=chosen, **options)
    return out[..., : v.shape[-1]]
