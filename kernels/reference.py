"""Plain PyTorch references of every distaff kernel: the CPU path and the test oracle.

Each function has the same signature as its fused counterpart in ``distaff.kernels``.

The attention reference is written as an explicit autograd function that walks the queries in
row blocks, keeping only the log-sum-exp between forward and backward, so it never holds more
than one ``[B, H, N, N]``-sized tensor (a block of rows of it, for long sequences). The exact
function is documented in ``docs/attention.md``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .relative_position import attention_span, relative_position_index

# Upper bound on the elements of one [B, H, rows, N] score block (64 Mi fp32 = 256 MiB).
_BLOCK_ELEMENTS = 1 << 26


# --------------------------------------------------------------------------- attention


def default_softmax_scale(head_dim: int, pos_key: torch.Tensor | None, pos_query: torch.Tensor | None) -> float:
    """``1 / sqrt(d * (1 + number of position terms))``, DeBERTa's scaling."""
    factor = 1 + (pos_key is not None) + (pos_query is not None)
    return 1.0 / math.sqrt(head_dim * factor)


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           pos_key: torch.Tensor | None, pos_query: torch.Tensor | None,
                           span: int, attention_mask: torch.Tensor | None, dropout_p: float) -> None:
    """Validate shapes of the padded contract; errors name the offending argument."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, H, N, d], got shape {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(t.shape)}")
    _, heads, _, head_dim = q.shape
    for name, t in (("pos_key", pos_key), ("pos_query", pos_query)):
        if t is not None and tuple(t.shape) != (heads, 2 * span, head_dim):
            raise ValueError(f"{name} must be [H, 2*span, d] = {(heads, 2 * span, head_dim)}, got {tuple(t.shape)}")
    if attention_mask is not None and tuple(attention_mask.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(f"attention_mask must be [B, N] = {(q.shape[0], q.shape[2])}, got {tuple(attention_mask.shape)}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")


def _rows_per_block(batch: int, heads: int, n: int) -> int:
    return max(1, min(n, _BLOCK_ELEMENTS // max(1, batch * heads * n)))


def _dropout_keep(shape: torch.Size, p: float, seed: int, block: int, device: torch.device) -> torch.Tensor:
    """Keep-mask of one row block, regenerated identically in backward from (seed, block)."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed + 0x9E3779B97F4A7C15 * (block + 1)) % (1 << 63))
    return torch.rand(shape, generator=gen, device=device) >= p


class _BlockScores:
    """Scores of one block of query rows: ``(Q K^T + c2p + p2c) * scale``, masked."""

    def __init__(self, q, k, pos_key, pos_query, index, mask, scale):
        self.q, self.k, self.pos_key, self.index, self.mask, self.scale = q, k, pos_key, index, mask, scale
        # p2c reads K_j . Qr[idx(i, j)]: one [B, H, 2*span, N] product shared by all row blocks.
        self.key_posq = None if pos_query is None else pos_query @ k.transpose(-1, -2)

    def __call__(self, r0: int, r1: int) -> torch.Tensor:
        q_blk = self.q[:, :, r0:r1]
        scores = q_blk @ self.k.transpose(-1, -2)
        idx = self.index[r0:r1].expand(scores.shape)
        if self.pos_key is not None:
            scores += torch.gather(q_blk @ self.pos_key.transpose(-1, -2), -1, idx)
        if self.key_posq is not None:
            scores += torch.gather(self.key_posq, -2, idx)
        scores *= self.scale
        if self.mask is not None:
            visible = self.mask[:, None, r0:r1, None] & self.mask[:, None, None, :]
            scores.masked_fill_(~visible, float("-inf"))
        return scores


class _ReferenceAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pos_key, pos_query, index, mask, scale, dropout_p, seed):
        scores_of = _BlockScores(q, k, pos_key, pos_query, index, mask, scale)
        batch, heads, n, _ = q.shape
        rows = _rows_per_block(batch, heads, n)
        out = torch.empty_like(q)
        lse = torch.empty(batch, heads, n, dtype=q.dtype, device=q.device)
        for blk, r0 in enumerate(range(0, n, rows)):
            r1 = min(n, r0 + rows)
            probs = scores_of(r0, r1)
            row_max = probs.amax(-1, keepdim=True)
            row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
            probs.sub_(row_max).exp_()
            row_sum = probs.sum(-1, keepdim=True)
            # Fully masked rows have row_sum 0: their probabilities (and output) are 0, and an
            # lse of +inf makes exp(score - lse) = 0 again in backward.
            lse[:, :, r0:r1] = torch.where(row_sum > 0, row_max + row_sum.log(), float("inf")).squeeze(-1)
            probs.div_(row_sum.clamp_min(torch.finfo(probs.dtype).tiny))
            if dropout_p > 0:
                probs.mul_(_dropout_keep(probs.shape, dropout_p, seed, blk, q.device)).div_(1 - dropout_p)
            out[:, :, r0:r1] = probs @ v
        ctx.save_for_backward(q, k, v, pos_key, pos_query, index, mask, out, lse)
        ctx.scale, ctx.dropout_p, ctx.seed, ctx.rows = scale, dropout_p, seed, rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, pos_key, pos_query, index, mask, out, lse = ctx.saved_tensors
        scale, dropout_p = ctx.scale, ctx.dropout_p
        scores_of = _BlockScores(q, k, pos_key, pos_query, index, mask, scale)
        n = q.shape[2]
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        # Score gradients summed per position-table row: c2p per query row, p2c per key column.
        c2p_rows = None if pos_key is None else torch.zeros(*q.shape[:3], pos_key.shape[1], dtype=q.dtype, device=q.device)
        p2c_cols = None if pos_query is None else torch.zeros(*q.shape[:2], pos_query.shape[1], n, dtype=q.dtype, device=q.device)
        delta = (grad_out * out).sum(-1, keepdim=True)  # rowsum(dO * O) = rowsum(P * dP)
        for blk, r0 in enumerate(range(0, n, ctx.rows)):
            r1 = min(n, r0 + ctx.rows)
            probs = scores_of(r0, r1).sub_(lse[:, :, r0:r1, None]).exp_()
            d_probs = grad_out[:, :, r0:r1] @ v.transpose(-1, -2)
            if dropout_p > 0:
                keep = _dropout_keep(probs.shape, dropout_p, ctx.seed, blk, q.device)
                dv += (probs * keep / (1 - dropout_p)).transpose(-1, -2) @ grad_out[:, :, r0:r1]
                d_probs.mul_(keep).div_(1 - dropout_p)
            else:
                dv += probs.transpose(-1, -2) @ grad_out[:, :, r0:r1]
            d_scores = probs.mul_(d_probs.sub_(delta[:, :, r0:r1])).mul_(scale)
            dq[:, :, r0:r1] = d_scores @ k
            dk += d_scores.transpose(-1, -2) @ q[:, :, r0:r1]
            idx = index[r0:r1].expand(d_scores.shape)
            if c2p_rows is not None:
                c2p_rows[:, :, r0:r1].scatter_add_(-1, idx, d_scores)
            if p2c_cols is not None:
                p2c_cols.scatter_add_(-2, idx, d_scores)
        d_pos_key = d_pos_query = None
        if c2p_rows is not None:
            dq += c2p_rows @ pos_key
            d_pos_key = (c2p_rows.transpose(-1, -2) @ q).sum(0)
        if p2c_cols is not None:
            dk += p2c_cols.transpose(-1, -2) @ pos_query
            d_pos_query = (p2c_cols @ k).sum(0)
        return dq, dk, dv, d_pos_key, d_pos_query, None, None, None, None, None


def dropout_seed(dropout_p: float) -> int:
    # Drawn from torch's global generator, so torch.manual_seed makes dropout reproducible.
    return int(torch.randint(0, 1 << 62, (1,)).item()) if dropout_p > 0 else 0


def disentangled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos_key: torch.Tensor | None = None,
    pos_query: torch.Tensor | None = None,
    *,
    position_buckets: int,
    max_relative_positions: int,
    attention_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    impl: str = "reference",
) -> torch.Tensor:
    """DeBERTa disentangled attention, ``softmax(QK^T + c2p + p2c) V`` with padding and dropout.

    ``q, k, v``: ``[B, H, N, d]``; ``pos_key`` (Kr) and ``pos_query`` (Qr): ``[H, 2*span, d]`` or
    None to drop the c2p / p2c term; ``attention_mask``: ``[B, N]``, nonzero = token. Rows of
    padded queries output zeros. Half-precision inputs are computed in float32.
    """
    del impl  # the reference is its own implementation
    span = attention_span(position_buckets, max_relative_positions)
    check_attention_inputs(q, k, v, pos_key, pos_query, span, attention_mask, dropout_p)
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(q.shape[-1], pos_key, pos_query)
    index = relative_position_index(q.shape[2], k.shape[2], position_buckets, max_relative_positions, q.device)
    mask = None if attention_mask is None else attention_mask.ne(0)
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    cast = [None if t is None else t.to(compute) for t in (q, k, v, pos_key, pos_query)]
    out = _ReferenceAttention.apply(*cast, index, mask, float(softmax_scale), float(dropout_p), dropout_seed(dropout_p))
    return out.to(q.dtype)


def check_varlen_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                        max_seqlen: int) -> list[int]:
    """Validate the packed form; returns the sequence offsets (one host sync)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [total_tokens, H, d], got shape {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(t.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor of >= 2 offsets, got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    total, bounds = q.shape[0], cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to total_tokens={total}, got {bounds}")
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    if longest > max_seqlen:
        raise ValueError(f"a sequence in cu_seqlens has {longest} tokens, more than max_seqlen={max_seqlen}")
    return bounds


def disentangled_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos_key: torch.Tensor | None = None,
    pos_query: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    position_buckets: int,
    max_relative_positions: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    impl: str = "reference",
) -> torch.Tensor:
    """Packed form: ``q, k, v`` are ``[total_tokens, H, d]``; sequence ``s`` spans tokens
    ``cu_seqlens[s]:cu_seqlens[s+1]`` and relative positions restart in every sequence."""
    del impl
    bounds = check_varlen_inputs(q, k, v, cu_seqlens, max_seqlen)
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        seq = [t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        out = disentangled_attention(*seq, pos_key, pos_query, position_buckets=position_buckets,
                                     max_relative_positions=max_relative_positions,
                                     dropout_p=dropout_p, softmax_scale=softmax_scale)
        outs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outs, 0)


# --------------------------------------------------------------------------- training ops


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               residual: torch.Tensor | None = None, impl: str = "reference") -> torch.Tensor:
    """``LayerNorm(x + residual)`` over the last dimension (post-LN residual block)."""
    del impl
    if residual is not None:
        x = x + residual
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, impl: str = "reference") -> torch.Tensor:
    """``gelu(x + bias)`` with the exact (erf) GELU of the DeBERTa feed-forward."""
    del impl
    return F.gelu(x + bias)


class MaskedLMLoss(NamedTuple):
    """Mean cross-entropy over labelled tokens, with the counts a trainer logs."""

    loss: torch.Tensor          # scalar; 0 (with zero gradients) when nothing is labelled
    num_labelled: torch.Tensor  # int64 scalar
    num_correct: torch.Tensor   # int64 scalar: labelled tokens whose argmax is the label

    @property
    def accuracy(self) -> torch.Tensor:
        return self.num_correct.float() / self.num_labelled.clamp_min(1).float()


def masked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   labels: torch.Tensor, ignore_index: int = -100, impl: str = "reference") -> MaskedLMLoss:
    """MLM loss of ``hidden @ weight.T + bias`` on the positions whose label is not ignored.

    ``hidden``: ``[..., E]``; ``weight``: ``[V, E]`` (tied word embeddings); ``labels``: ``[...]``.
    Only labelled rows are projected onto the vocabulary.
    """
    del impl
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match hidden {tuple(hidden.shape[:-1])}")
    labelled = labels.reshape(-1) != ignore_index
    rows = hidden.reshape(-1, hidden.shape[-1])[labelled]
    targets = labels.reshape(-1)[labelled]
    logits = F.linear(rows, weight, bias)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    num = targets.numel()
    loss = F.cross_entropy(logits, targets, reduction="sum") / max(num, 1)
    correct = (logits.argmax(-1) == targets).sum() if num else torch.zeros((), dtype=torch.long, device=hidden.device)
    return MaskedLMLoss(loss, torch.tensor(num, device=hidden.device), correct)
