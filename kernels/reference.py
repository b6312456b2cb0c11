"""Plain PyTorch references of every distaff kernel: the CPU path and the test oracle.

Each function has the same signature as its fused counterpart in ``distaff.kernels``.

The attention reference is written as an explicit autograd function that walks the queries in
row blocks, keeping only the log-sum-exp between forward and backward, so it never holds more
than one ``[B, H, N, N]``-sized tensor (a block of rows of it, for long sequences). The exact
function is documented in ``docs/attention.md``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from .contract import (IGNORE_INDEX, AttentionCall, MaskedLMLoss, attention_op, check_masked_lm_inputs,
                       check_targets, dropout_seed, varlen_attention_op)
from .relative_position import relative_position_index

# Upper bound on the elements of one [B, H, rows, N] score block (64 Mi fp32 = 256 MiB).
_BLOCK_ELEMENTS = 1 << 26


# --------------------------------------------------------------------------- attention


def _rows_per_block(batch: int, heads: int, n: int) -> int:
    return max(1, min(n, _BLOCK_ELEMENTS // max(1, batch * heads * n)))


def _dropout_keep(shape: torch.Size, p: float, seed: int, block: int, device: torch.device) -> torch.Tensor:
    """Keep-mask of one row block, regenerated identically in backward from (seed, block)."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed + 0x9E3779B97F4A7C15 * (block + 1)) % (1 << 63))
    return torch.rand(shape, generator=gen, device=device) >= p


class _BlockScores:
    """Scores of one block of query rows: ``(Q K^T + c2p + p2c) * scale``, masked.

    ``scale``: a float or a ``[B, 1, 1, 1]`` tensor (one per sequence); ``mask_diagonal`` hides the
    pairs ``(i, i)``.
    """

    def __init__(self, q, k, pos_key, pos_query, index, mask, scale, mask_diagonal):
        self.q, self.k, self.pos_key, self.index, self.mask, self.scale = q, k, pos_key, index, mask, scale
        self.mask_diagonal = mask_diagonal
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
        if self.mask_diagonal:
            rows = torch.arange(r0, r1, device=scores.device)[:, None]
            scores.masked_fill_(rows == torch.arange(scores.shape[-1], device=scores.device), float("-inf"))
        return scores


class _ReferenceAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pos_key, pos_query, index, mask, scale, mask_diagonal, dropout_p, seed):
        scores_of = _BlockScores(q, k, pos_key, pos_query, index, mask, scale, mask_diagonal)
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
            # Rows with no visible key (padding; a one-token sequence without its diagonal) have row_sum 0: their probabilities (and output) are 0, and an
            # lse of +inf makes exp(score - lse) = 0 again in backward.
            lse[:, :, r0:r1] = torch.where(row_sum > 0, row_max + row_sum.log(), float("inf")).squeeze(-1)
            probs.div_(row_sum.clamp_min(torch.finfo(probs.dtype).tiny))
            if dropout_p > 0:
                probs.mul_(_dropout_keep(probs.shape, dropout_p, seed, blk, q.device)).div_(1 - dropout_p)
            out[:, :, r0:r1] = probs @ v
        ctx.save_for_backward(q, k, v, pos_key, pos_query, index, mask, out, lse)
        ctx.scale, ctx.mask_diagonal, ctx.dropout_p, ctx.seed, ctx.rows = scale, mask_diagonal, dropout_p, seed, rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, pos_key, pos_query, index, mask, out, lse = ctx.saved_tensors
        scale, dropout_p = ctx.scale, ctx.dropout_p
        scores_of = _BlockScores(q, k, pos_key, pos_query, index, mask, scale, ctx.mask_diagonal)
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
        return dq, dk, dv, d_pos_key, d_pos_query, None, None, None, None, None, None


@attention_op
def disentangled_attention(call: AttentionCall) -> torch.Tensor:
    """DeBERTa disentangled attention, ``softmax(QK^T + c2p + p2c) V`` with padding and dropout.

    ``q, k, v``: ``[B, H, N, d]``; ``pos_key`` (Kr) and ``pos_query`` (Qr): ``[H, 2*span, d]`` or
    None to drop the c2p / p2c term; ``attention_mask``: ``[B, N]``, nonzero = token;
    ``softmax_scale``: a float or a float32 ``[B]`` tensor (one scale per sequence);
    ``mask_diagonal``: query ``i`` never attends key ``i``. Rows with no visible key (padded queries,
    a one-token sequence under ``mask_diagonal``) output zeros. Half-precision inputs are computed in
    float32. ``keep_scores`` is the Triton path's (its forward's dense position scores kept for its backward
    instead of recomputed: the same gradients, memory for time); the reference ignores it.
    """
    q = call.q
    index = relative_position_index(q.shape[2], q.shape[2], call.position_buckets, call.max_relative_positions,
                                    q.device)
    mask = None if call.attention_mask is None else call.attention_mask.ne(0)
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    cast = [None if t is None else t.to(compute) for t in (q, call.k, call.v, call.pos_key, call.pos_query)]
    scale = call.softmax_scale
    if call.per_sequence_scale:
        scale = scale.to(compute).view(-1, 1, 1, 1)
    seed = dropout_seed(call.dropout_p) if call.seed is None else call.seed
    out = _ReferenceAttention.apply(*cast, index, mask, scale, call.mask_diagonal, call.dropout_p, seed)
    return out.to(q.dtype)


@varlen_attention_op
def disentangled_attention_varlen(call: AttentionCall) -> torch.Tensor:
    """Packed form: ``q, k, v`` are ``[total_tokens, H, d]``; sequence ``s`` spans tokens
    ``cu_seqlens[s]:cu_seqlens[s+1]`` and relative positions restart in every sequence;
    ``softmax_scale`` may be a float32 ``[S]`` tensor, one scale per sequence."""
    outs = []
    bounds = call.bounds or tuple(call.cu_seqlens.tolist())  # the reference slices on the host (one sync)
    for s, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        seq = [t[start:end].transpose(0, 1).unsqueeze(0) for t in (call.q, call.k, call.v)]
        scale = call.softmax_scale[s:s + 1] if call.per_sequence_scale else call.softmax_scale
        one = replace(call, q=seq[0], k=seq[1], v=seq[2], softmax_scale=scale, cu_seqlens=None, max_seqlen=0,
                      bounds=(), seed=None if call.seed is None else (call.seed + s) % (1 << 62))
        out = disentangled_attention.__wrapped__(one)  # validated above
        outs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outs, 0)


# --------------------------------------------------------------------------- training ops


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """``LayerNorm(x + residual)`` over the last dimension (post-LN residual block)."""
    if residual is not None:
        x = x + residual
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu(x + bias)`` with the exact (erf) GELU of the DeBERTa feed-forward."""
    return F.gelu(x + bias)


def masked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   labels: torch.Tensor, ignore_index: int | None = IGNORE_INDEX) -> MaskedLMLoss:
    """MLM loss of ``hidden @ weight.T + bias`` on the positions whose label is not ignored.

    ``hidden``: ``[..., E]``; ``weight``: ``[V, E]`` (tied word embeddings); ``labels``: ``[...]``;
    ``ignore_index=None`` when every position is labelled. Only labelled rows are projected onto
    the vocabulary.
    """
    check_masked_lm_inputs(hidden, weight, bias, labels)
    flat = labels.reshape(-1)
    labelled = torch.ones_like(flat, dtype=torch.bool) if ignore_index is None else flat != ignore_index
    rows = hidden.reshape(-1, hidden.shape[-1])[labelled]
    targets = labels.reshape(-1)[labelled]
    check_targets(targets, weight.shape[0], ignore_index)
    logits = F.linear(rows, weight, bias)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    num = targets.numel()
    loss = F.cross_entropy(logits, targets, reduction="sum") / max(num, 1)
    correct = (logits.argmax(-1) == targets).sum() if num else torch.zeros((), dtype=torch.long, device=hidden.device)
    return MaskedLMLoss(loss, torch.tensor(num, device=hidden.device), correct)
