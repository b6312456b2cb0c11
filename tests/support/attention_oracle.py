"""A deliberately naive disentangled attention (explicit per-pair position rows, plain autograd).

Independent of ``distaff.kernels.reference``'s row-block formulation: tests run both in float64
and compare values and gradients. The whole ``[B, H, N, N]`` score matrix is built explicitly,
with ``-inf`` on every pair that is not visible (padding, and the diagonal under ``mask_diagonal``).
"""

from __future__ import annotations

import torch

from distaff.kernels.relative_position import relative_position_index


def naive_scores(q, k, pos_key, pos_query, *, position_buckets, max_relative_positions, softmax_scale=None):
    """The pre-softmax scores ``[B, H, N, N]``, every pair (visible or not)."""
    batch, n, d = q.shape[0], q.shape[2], q.shape[3]
    terms = 1 + (pos_key is not None) + (pos_query is not None)
    scale = softmax_scale if softmax_scale is not None else (d * terms) ** -0.5
    if isinstance(scale, torch.Tensor):  # one scale per sequence
        scale = scale.to(q.dtype).view(batch, 1, 1, 1)
    idx = relative_position_index(n, n, position_buckets, max_relative_positions, q.device)
    scores = torch.einsum("bhid,bhjd->bhij", q, k)
    if pos_key is not None:  # c2p: Q_i . Kr[idx(i, j)]
        scores = scores + torch.einsum("bhid,hijd->bhij", q, pos_key[:, idx])
    if pos_query is not None:  # p2c: K_j . Qr[idx(i, j)]
        scores = scores + torch.einsum("bhjd,hijd->bhij", k, pos_query[:, idx])
    return scores * scale


def masked_softmax_attention(scores, v, *, attention_mask=None, mask_diagonal=False):
    """``softmax(scores) v`` over the visible pairs; a row with none outputs zeros."""
    batch, n = scores.shape[0], scores.shape[-1]
    m = torch.ones(batch, n, dtype=torch.bool, device=v.device) if attention_mask is None else attention_mask.bool()
    visible = (m[:, None, :, None] & m[:, None, None, :])
    if mask_diagonal:
        visible = visible & ~torch.eye(n, dtype=torch.bool, device=v.device)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    probs = torch.where(visible.any(-1, keepdim=True), probs, torch.zeros_like(probs))
    return probs @ v


def naive_attention(q, k, v, pos_key, pos_query, *, position_buckets, max_relative_positions,
                    attention_mask=None, softmax_scale=None, mask_diagonal=False):
    scores = naive_scores(q, k, pos_key, pos_query, position_buckets=position_buckets,
                          max_relative_positions=max_relative_positions, softmax_scale=softmax_scale)
    return masked_softmax_attention(scores, v, attention_mask=attention_mask, mask_diagonal=mask_diagonal)
