"""Fused DeBERTa disentangled attention in Triton: flash-style forward, deterministic backward.

Scores of a ``[BLOCK_M, BLOCK_N]`` tile (query rows ``i0..``, key columns ``j0..``) are
``(Q K^T + c2p + p2c) * scale`` with ``c2p[a, b] = Q_a . Kr[idx(i0+a, j0+b)]`` and
``p2c[a, b] = K_b . Qr[idx(i0+a, j0+b)]``. The distances ``i - j`` of a tile form one contiguous
*window* of ``BLOCK_M + BLOCK_N - 1`` values (window column ``c = a - b + BLOCK_N - 1``), and the
bucket table is monotone with steps of 0 or 1, so the tile reads one contiguous *slab* of ``SLAB``
(the window width rounded up to a power of two) rows of ``Kr`` / ``Qr`` starting at bucket
``t_lo``. The kernels compute ``Q @ slab(Kr)^T`` and ``K @ slab(Qr)^T`` with ``tl.dot`` and gather
each score's column in registers (``loc = idx - t_lo``); no ``[B, H, N, 2*span]`` tensor and no
``N x N`` tensor is ever written.

Backward (no atomics, deterministic):

* ``_attn_bwd_delta``: ``rowsum(dO * O)`` in float32.
* ``_attn_bwd_dkdv``: a program walks a run of (sequence, key block) items of one head; each block
  loops over query blocks -> ``dK``, ``dV``, and the run adds into one partial ``dQr`` of that head
  over all ``2*span`` buckets (read-modify-write of rows only this program touches).
* ``_attn_bwd_dq``: the same over query blocks -> ``dQ`` and a partial ``dKr``.
* Runs are sized so the partials fit a budget (the bytes of ``dq + dk + dv``); ``torch.sum`` adds
  them in a fixed order into ``dKr`` / ``dQr``.

A tile's score gradient ``dS`` is moved to window (distance) coordinates by a pure skew (a
register gather), then to bucket coordinates by a one-hot ``tl.dot`` that merges distances sharing
a bucket; tiles whose window maps one-to-one onto buckets (near the diagonal) skip the merge.

Saturated tiles (every distance in one bucket ``t``: far from the diagonal, most tiles at long N)
take a rank-1 path, chosen per tile by a scalar branch: c2p is ``Q Kr[t]`` per row, p2c ``K Qr[t]``
per column, and their gradients are row / column sums of ``dS`` times one table row, with one
partial row updated; no slab, gather or merge (``_score_tile``, ``_position_grads``).
``tile_paths`` counts the tiles on each path on the host.

Optional features are ``tl.constexpr`` specialisations, so kernels without them are unchanged:
``SCALE_PER_SEQ`` loads the sequence's softmax scale from a float32 ``[num_seqs]`` tensor (forward
and both backward kernels, where it scales ``dS``); ``MASK_DIAGONAL`` hides ``i == j`` on the tiles
that meet the diagonal. A row left without keys gets ``lse = +inf`` and output 0, hence ``P = 0``
and ``dS = 0`` in backward.

Dropout keeps ``(i, j)`` iff ``tl.rand(seed + b*H + h, i * n_ctx + j) >= p``: regenerated in
backward, no mask in memory. Tile sizes per kernel and head dim are chosen so that every
configuration compiles for sm_80/sm_90/sm_100 without register spills (``compile_check``);
design notes, costs and the per-target figures: ``docs/kernels.md``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .contract import TRITON_HEAD_DIMS, AttentionCall, attention_op, dropout_seed, varlen_attention_op
from .relative_position import attention_span, bucket_table

# Largest value a 32-bit in-kernel offset may take (see check_offsets_fit_int32).
INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------- tile helpers


@triton.jit
def _locate(CU, seq, head, n_ctx, stride_b, stride_h, stride_n, stride_lb, stride_lh,
            TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, VARLEN: tl.constexpr):
    """Where (sequence ``seq``, head ``head``) lives: its length, the int64 offset of its first
    token in q/k/v/o (``base``), the offset of the head's ``[2*span, d]`` position table and the
    int64 offset of its first row statistic (lse / delta). Offsets inside one sequence stay 32-bit
    (the host checks they fit)."""
    start = tl.zeros([], tl.int64)
    seq_len = n_ctx
    if VARLEN:
        start = tl.load(CU + seq).to(tl.int64)
        seq_len = tl.load(CU + seq + 1) - tl.load(CU + seq)
    base = seq.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h + start * stride_n
    rel_off = head * TWO_SPAN * HEAD_DIM
    stat_off = seq.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + start
    return seq_len, base, rel_off, stat_off


@triton.jit
def _load_rows(ptr, row0, offs_r, offs_d, stride_n, seq_len):
    """``[len(offs_r), d]`` rows ``row0 + offs_r`` of one sequence, zero past its end."""
    rows = row0 + offs_r
    ok = rows < seq_len
    return tl.load(ptr + rows[:, None] * stride_n + offs_d[None, :], mask=ok[:, None], other=0.0)


@triton.jit
def _store_rows(ptr, row0, offs_r, offs_d, stride_n, seq_len, value):
    """Store ``value`` as rows ``row0 + offs_r`` of one sequence (rows past its end are dropped)."""
    rows = row0 + offs_r
    tl.store(ptr + rows[:, None] * stride_n + offs_d[None, :], value.to(ptr.dtype.element_ty),
             mask=(rows < seq_len)[:, None])


@triton.jit
def _bucket_range(table_ptr, i0, j0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Bucket range ``[t_lo, t_hi]`` of the tile's distance window; ``t_lo == t_hi``: saturated tile.

    ``table_ptr`` points at distance 0; window column ``c`` is distance ``i0 - j0 - BLOCK_N + 1 + c``.
    """
    r0 = i0 - j0 - (BLOCK_N - 1)
    return tl.load(table_ptr + r0), tl.load(table_ptr + r0 + BLOCK_M + BLOCK_N - 2)


@triton.jit
def _load_slab(rel_ptr, t_lo, offs_w, offs_d, SLAB: tl.constexpr, TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rows ``t_lo .. t_lo + SLAB - 1`` of one head's ``[2*span, d]`` position table (zeros past its end)."""
    rows = t_lo + offs_w
    return tl.load(rel_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=(rows < TWO_SPAN)[:, None],
                   other=0.0)


@triton.jit
def _visible(mask_ptr, i0, j0, offs_m, offs_n, seq_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             HAS_MASK: tl.constexpr, MASK_DIAGONAL: tl.constexpr):
    """Visible pairs of a tile: both tokens real; under ``MASK_DIAGONAL`` also ``i != j``, tested only on
    the tiles whose rectangle meets the diagonal (a uniform scalar branch: the others skip it)."""
    rows = i0 + offs_m
    cols = j0 + offs_n
    row_ok = rows < seq_len
    col_ok = cols < seq_len
    if HAS_MASK:
        row_ok &= tl.load(mask_ptr + rows, mask=row_ok, other=0) != 0
        col_ok &= tl.load(mask_ptr + cols, mask=col_ok, other=0) != 0
    visible = row_ok[:, None] & col_ok[None, :]
    if MASK_DIAGONAL:
        if (i0 < j0 + BLOCK_N) & (j0 < i0 + BLOCK_M):
            visible = visible & (rows[:, None] != cols[None, :])
    return visible


@triton.jit
def _sequence_scale(SCALES, seq, scale, SCALE_PER_SEQ: tl.constexpr):
    """The softmax scale of sequence ``seq``: its entry of ``SCALES`` (float32 [num_seqs]) or the one float."""
    seq_scale = scale
    if SCALE_PER_SEQ:
        seq_scale = tl.load(SCALES + seq)
    return seq_scale


@triton.jit
def _add_slab_bias(s, q, k, kr_ptr, qr_ptr, table_ptr, i0, j0, t_lo, offs_m, offs_n, offs_w, offs_d,
                   TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, SLAB: tl.constexpr, HAS_C2P: tl.constexpr,
                   HAS_P2C: tl.constexpr, PRECISION: tl.constexpr):
    """``s`` + c2p + p2c of a general tile: ``Q @ slab(Kr)^T`` and ``K @ slab(Qr)^T``, then each score
    picks its bucket's column (``loc = idx - t_lo``) with a register gather."""
    loc = tl.load(table_ptr + (i0 - j0) + offs_m[:, None] - offs_n[None, :]) - t_lo
    if HAS_C2P:
        krs = _load_slab(kr_ptr, t_lo, offs_w, offs_d, SLAB, TWO_SPAN, HEAD_DIM)
        s += tl.gather(tl.dot(q, tl.trans(krs), input_precision=PRECISION), loc, 1)
    if HAS_P2C:
        qrs = _load_slab(qr_ptr, t_lo, offs_w, offs_d, SLAB, TWO_SPAN, HEAD_DIM)
        s += tl.trans(tl.gather(tl.dot(k, tl.trans(qrs), input_precision=PRECISION), tl.trans(loc), 1))
    return s


@triton.jit
def _dot_row(x, row_ptr, offs_d):
    """``x @ row`` for one table row (``[len(x)]``, float32): a rank-1 term on the CUDA cores."""
    return tl.sum(x.to(tl.float32) * tl.load(row_ptr + offs_d).to(tl.float32)[None, :], 1)


@triton.jit
def _score_tile(q, k, kr_ptr, qr_ptr, table_ptr, mask_ptr, i0, j0, seq_len, scale, offs_m, offs_n, offs_w, offs_d,
                TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                SLAB: tl.constexpr, HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_MASK: tl.constexpr,
                MASK_DIAGONAL: tl.constexpr, PRECISION: tl.constexpr):
    """Scaled scores of tile ``(i0, j0)`` (``-inf`` where the pair is not visible) and its bucket range.

    A saturated tile (every distance in one bucket ``t``) has a rank-1 position bias: c2p is one value
    per query row (``q_a . Kr[t]``), p2c one per key column (``k_b . Qr[t]``); no slab, no gather.
    """
    t_lo, t_hi = _bucket_range(table_ptr, i0, j0, BLOCK_M, BLOCK_N)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if t_lo == t_hi:
        if HAS_C2P:
            s += _dot_row(q, kr_ptr + t_lo * HEAD_DIM, offs_d)[:, None]
        if HAS_P2C:
            s += _dot_row(k, qr_ptr + t_lo * HEAD_DIM, offs_d)[None, :]
    else:
        s = _add_slab_bias(s, q, k, kr_ptr, qr_ptr, table_ptr, i0, j0, t_lo, offs_m, offs_n, offs_w, offs_d,
                           TWO_SPAN, HEAD_DIM, SLAB, HAS_C2P, HAS_P2C, PRECISION)
    visible = _visible(mask_ptr, i0, j0, offs_m, offs_n, seq_len, BLOCK_M, BLOCK_N, HAS_MASK, MASK_DIAGONAL)
    return tl.where(visible, s * scale, float("-inf")), t_lo, t_hi


@triton.jit
def _tile_offsets(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLAB: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Row, column, slab-row and head-dim offsets of a tile."""
    return tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, SLAB), tl.arange(0, HEAD_DIM)


@triton.jit
def _row_stats(LSE, DELTA, stat_off, i0, offs_m, seq_len):
    """Log-sum-exp (``+inf`` past the end: probabilities 0) and ``delta`` of rows ``i0 + offs_m``."""
    row_ok = (i0 + offs_m) < seq_len
    lse = tl.load(LSE + stat_off + i0 + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + stat_off + i0 + offs_m, mask=row_ok, other=0.0)
    return lse, delta


@triton.jit
def _dropout_keep(seed, i0, j0, offs_m, offs_n, n_ctx):
    """Counter-based keep draw: one Philox value per (sequence, head, i, j), never stored."""
    offsets = (i0 + offs_m)[:, None] * n_ctx + (j0 + offs_n)[None, :]
    return tl.rand(seed, offsets)


@triton.jit
def _to_buckets(d_dist, table_ptr, i0, j0, t_lo, t_hi, offs_w, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """Sum the window columns (distances) of ``d_dist`` that share a bucket: column ``u`` = bucket ``t_lo + u``.

    Returned in ``DTYPE``, the operand type of the products that consume it.
    """
    if t_hi - t_lo != BLOCK_M + BLOCK_N - 2:  # not one-to-one (log buckets, partly saturated): merge
        bucket_of = tl.load(table_ptr + i0 - j0 - (BLOCK_N - 1) + offs_w) - t_lo
        one_hot = (bucket_of[:, None] == offs_w[None, :]).to(DTYPE)
        d_bucket = tl.dot(d_dist.to(DTYPE), one_hot, input_precision=PRECISION).to(DTYPE)
    else:  # (casting before the branch trips a dominance error in triton 3.7's passes)
        d_bucket = d_dist.to(DTYPE)
    return d_bucket


@triton.jit
def _accumulate_rows(part_ptr, t_lo, t_hi, offs_w, offs_d, rows_grad, HEAD_DIM: tl.constexpr):
    """``part[t_lo + u] += rows_grad[u]`` for the tile's buckets ``t_lo..t_hi``, in this program's own
    partial buffer.

    The next tile's window overlaps these rows and another thread of this program may read them:
    the barrier (``bar.sync``) makes this store visible to every warp of the block before those loads.
    """
    rows = t_lo + offs_w
    ptrs = part_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :]
    ok = (rows <= t_hi)[:, None]
    tl.store(ptrs, tl.load(ptrs, mask=ok, other=0.0) + rows_grad, mask=ok)
    tl.debug_barrier()


@triton.jit
def _accumulate_row(row_ptr, offs_d, row_grad):
    """``part[t] += row_grad`` for a saturated tile's one bucket (same barrier as ``_accumulate_rows``;
    the compiler stores each element from one thread, the one that loaded it)."""
    tl.store(row_ptr + offs_d, tl.load(row_ptr + offs_d) + row_grad)
    tl.debug_barrier()


@triton.jit
def _position_grads(acc, own, ds_own, skew, skew_ok, rel_ptr, part_ptr, table_ptr, i0, j0, t_lo, t_hi, offs_w, offs_d,
                    TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    SLAB: tl.constexpr, PRECISION: tl.constexpr):
    """One position term's gradients from a tile, seen from the program's own side (``own`` = q with
    ``ds_own = dS`` for c2p, k with ``dS^T`` for p2c): ``acc[a] += sum_b ds_own[a, b] * rel[idx]``
    and ``part[t] += sum_{idx = t} ds_own[a, b] * own[a]``.

    Saturated tile (one bucket ``t``): ``acc += rowsum(ds_own) rel[t]^T`` and
    ``part[t] += rowsum(ds_own) @ own``, rank-1 on the CUDA cores. Otherwise ``ds_own`` is skewed to
    distances, merged to buckets and multiplied with the slab.
    """
    if t_lo == t_hi:
        ds_sum = tl.sum(ds_own, 1)
        acc += ds_sum[:, None] * tl.load(rel_ptr + t_lo * HEAD_DIM + offs_d).to(tl.float32)[None, :]
        _accumulate_row(part_ptr + t_lo * HEAD_DIM, offs_d, tl.sum(ds_sum[:, None] * own.to(tl.float32), 0))
    else:
        ds_dist = tl.where(skew_ok, tl.gather(ds_own, skew, 1), 0.0)
        ds_bucket = _to_buckets(ds_dist, table_ptr, i0, j0, t_lo, t_hi, offs_w, BLOCK_M, BLOCK_N, own.dtype,
                                PRECISION)
        slab = _load_slab(rel_ptr, t_lo, offs_w, offs_d, SLAB, TWO_SPAN, HEAD_DIM)
        acc += tl.dot(ds_bucket, slab, input_precision=PRECISION)
        _accumulate_rows(part_ptr, t_lo, t_hi, offs_w, offs_d,
                         tl.dot(tl.trans(ds_bucket), own, input_precision=PRECISION), HEAD_DIM)
    return acc


@triton.jit
def _probs_and_dscores(s, lse, delta, dp, seed, i0, j0, offs_m, offs_n, n_ctx, dropout_p, scale,
                       DROPOUT: tl.constexpr):
    """Recomputed (dropped) probabilities and the score gradient ``dS`` (scale included) from
    the scores ``s`` and ``dP = dO V^T``."""
    p = tl.exp(s - lse[:, None])
    p_dropped = p
    if DROPOUT:
        keep = _dropout_keep(seed, i0, j0, offs_m, offs_n, n_ctx) >= dropout_p
        p_dropped = tl.where(keep, p / (1.0 - dropout_p), 0.0)
        dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
    ds = p * (dp - delta[:, None]) * scale
    return p_dropped, ds


# --------------------------------------------------------------------------- kernels


@triton.jit
def _attn_fwd(Q, K, V, KR, QR, TABLE, MASK, CU, SCALES, O, LSE,
              seed, scale, dropout_p, n_ctx, n_heads,
              stride_b, stride_h, stride_n, stride_lb, stride_lh,
              TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              SLAB: tl.constexpr, HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_MASK: tl.constexpr,
              VARLEN: tl.constexpr, DROPOUT: tl.constexpr, SCALE_PER_SEQ: tl.constexpr,
              MASK_DIAGONAL: tl.constexpr, PRECISION: tl.constexpr):
    bh = tl.program_id(1)
    seq = bh // n_heads
    seq_len, base, rel_off, stat_off = _locate(CU, seq, bh % n_heads, n_ctx, stride_b, stride_h, stride_n,
                                               stride_lb, stride_lh, TWO_SPAN, HEAD_DIM, VARLEN)
    i0 = tl.program_id(0) * BLOCK_M
    if i0 >= seq_len:
        return
    offs_m, offs_n, offs_w, offs_d = _tile_offsets(BLOCK_M, BLOCK_N, SLAB, HEAD_DIM)
    q = _load_rows(Q + base, i0, offs_m, offs_d, stride_n, seq_len)
    seq_scale = _sequence_scale(SCALES, seq, scale, SCALE_PER_SEQ)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    m_safe = tl.zeros([BLOCK_M], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for j0 in range(0, seq_len, BLOCK_N):
        k = _load_rows(K + base, j0, offs_n, offs_d, stride_n, seq_len)
        v = _load_rows(V + base, j0, offs_n, offs_d, stride_n, seq_len)
        s, _, _ = _score_tile(q, k, KR + rel_off, QR + rel_off, TABLE, MASK + seq * n_ctx, i0, j0,
                              seq_len, seq_scale, offs_m, offs_n, offs_w, offs_d, TWO_SPAN, HEAD_DIM,
                              BLOCK_M, BLOCK_N, SLAB, HAS_C2P, HAS_P2C, HAS_MASK, MASK_DIAGONAL, PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with nothing visible yet keep m = -inf; subtract 0 so exp gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(_dropout_keep(seed + bh, i0, j0, offs_m, offs_n, n_ctx) >= dropout_p, p, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    has_any = l_i > 0.0
    out = acc / tl.where(has_any, l_i, 1.0)[:, None]
    if DROPOUT:
        out = out / (1.0 - dropout_p)
    _store_rows(O + base, i0, offs_m, offs_d, stride_n, seq_len, out)
    # Fully masked rows get lse = +inf so that backward's exp(s - lse) is 0 there.
    lse = tl.where(has_any, m_safe + tl.log(tl.where(has_any, l_i, 1.0)), float("inf"))
    tl.store(LSE + stat_off + i0 + offs_m, lse, mask=(i0 + offs_m) < seq_len)


@triton.jit
def _dkdv_block(Q, K, V, KR, QR, TABLE, mask_ptr, DO, LSE, DELTA, DK, DV, part_ptr, j0,
                seed, scale, dropout_p, n_ctx, seq_len, base, rel_off, stat_off, stride_n,
                TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                SLAB: tl.constexpr, HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_MASK: tl.constexpr,
                MASK_DIAGONAL: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr):
    """dK, dV of key block ``j0`` (all query blocks), and its p2c gradient added to the partial dQr."""
    offs_m, offs_n, offs_w, offs_d = _tile_offsets(BLOCK_M, BLOCK_N, SLAB, HEAD_DIM)
    k = _load_rows(K + base, j0, offs_n, offs_d, stride_n, seq_len)
    v = _load_rows(V + base, j0, offs_n, offs_d, stride_n, seq_len)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    # Window column c of key b holds query row a = c + b - (BLOCK_N - 1) (the same distance skew).
    skew_rows = offs_w[None, :] + offs_n[:, None] - (BLOCK_N - 1)
    skew_ok = (skew_rows >= 0) & (skew_rows < BLOCK_M)
    skew_rows = tl.where(skew_ok, skew_rows, 0)
    for i0 in range(0, seq_len, BLOCK_M):
        q = _load_rows(Q + base, i0, offs_m, offs_d, stride_n, seq_len)
        do = _load_rows(DO + base, i0, offs_m, offs_d, stride_n, seq_len)
        lse, delta = _row_stats(LSE, DELTA, stat_off, i0, offs_m, seq_len)
        s, t_lo, t_hi = _score_tile(q, k, KR + rel_off, QR + rel_off, TABLE, mask_ptr, i0, j0, seq_len, scale,
                                    offs_m, offs_n, offs_w, offs_d, TWO_SPAN, HEAD_DIM, BLOCK_M, BLOCK_N, SLAB,
                                    HAS_C2P, HAS_P2C, HAS_MASK, MASK_DIAGONAL, PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        p_dropped, ds = _probs_and_dscores(s, lse, delta, dp, seed, i0, j0, offs_m, offs_n, n_ctx,
                                           dropout_p, scale, DROPOUT)
        dv += tl.dot(tl.trans(p_dropped).to(do.dtype), do, input_precision=PRECISION)
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
        if HAS_P2C:  # dK_b += sum_a dS[a,b] Qr[idx];  dQr[t] += sum_{idx=t} dS[a,b] K_b
            dk = _position_grads(dk, k, tl.trans(ds), skew_rows, skew_ok, QR + rel_off, part_ptr, TABLE, i0, j0,
                                 t_lo, t_hi, offs_w, offs_d, TWO_SPAN, HEAD_DIM, BLOCK_M, BLOCK_N, SLAB, PRECISION)
    _store_rows(DK + base, j0, offs_n, offs_d, stride_n, seq_len, dk)
    _store_rows(DV + base, j0, offs_n, offs_d, stride_n, seq_len, dv)


@triton.jit
def _attn_bwd_dkdv(Q, K, V, KR, QR, TABLE, MASK, CU, SCALES, DO, LSE, DELTA, DK, DV, DQR_PART,
                   seed, scale, dropout_p, n_ctx, n_heads, num_seqs, items_per_program,
                   stride_b, stride_h, stride_n, stride_lb, stride_lh,
                   TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   SLAB: tl.constexpr, HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_MASK: tl.constexpr,
                   VARLEN: tl.constexpr, DROPOUT: tl.constexpr, SCALE_PER_SEQ: tl.constexpr,
                   MASK_DIAGONAL: tl.constexpr, PRECISION: tl.constexpr):
    """Program (p, head) walks ``items_per_program`` (sequence, key block) items of one head, in
    sequence-major order, adding their p2c gradients into one partial dQr of that head."""
    pid, head = tl.program_id(0), tl.program_id(1)
    part_ptr = DQR_PART + (head * tl.num_programs(0) + pid).to(tl.int64) * TWO_SPAN * HEAD_DIM
    blocks = tl.cdiv(n_ctx, BLOCK_N)
    first = pid * items_per_program
    for item in range(first, tl.minimum(first + items_per_program, num_seqs * blocks)):
        seq = item // blocks
        seq_len, base, rel_off, stat_off = _locate(CU, seq, head, n_ctx, stride_b, stride_h, stride_n,
                                                   stride_lb, stride_lh, TWO_SPAN, HEAD_DIM, VARLEN)
        j0 = (item % blocks) * BLOCK_N
        if j0 < seq_len:
            _dkdv_block(Q, K, V, KR, QR, TABLE, MASK + seq * n_ctx, DO, LSE, DELTA, DK, DV, part_ptr, j0,
                        seed + seq * n_heads + head, _sequence_scale(SCALES, seq, scale, SCALE_PER_SEQ), dropout_p,
                        n_ctx, seq_len, base, rel_off, stat_off, stride_n, TWO_SPAN, HEAD_DIM, BLOCK_M, BLOCK_N,
                        SLAB, HAS_C2P, HAS_P2C, HAS_MASK, MASK_DIAGONAL, DROPOUT, PRECISION)


@triton.jit
def _dq_block(Q, K, V, KR, QR, TABLE, mask_ptr, DO, LSE, DELTA, DQ, part_ptr, i0,
              seed, scale, dropout_p, n_ctx, seq_len, base, rel_off, stat_off, stride_n,
              TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              SLAB: tl.constexpr, HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_MASK: tl.constexpr,
              MASK_DIAGONAL: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr):
    """dQ of query block ``i0`` (all key blocks), and its c2p gradient added to the partial dKr."""
    offs_m, offs_n, offs_w, offs_d = _tile_offsets(BLOCK_M, BLOCK_N, SLAB, HEAD_DIM)
    q = _load_rows(Q + base, i0, offs_m, offs_d, stride_n, seq_len)
    do = _load_rows(DO + base, i0, offs_m, offs_d, stride_n, seq_len)
    lse, delta = _row_stats(LSE, DELTA, stat_off, i0, offs_m, seq_len)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Window column c of query a holds key column b = a + BLOCK_N - 1 - c.
    skew_cols = offs_m[:, None] + (BLOCK_N - 1) - offs_w[None, :]
    skew_ok = (skew_cols >= 0) & (skew_cols < BLOCK_N)
    skew_cols = tl.where(skew_ok, skew_cols, 0)
    for j0 in range(0, seq_len, BLOCK_N):
        k = _load_rows(K + base, j0, offs_n, offs_d, stride_n, seq_len)
        v = _load_rows(V + base, j0, offs_n, offs_d, stride_n, seq_len)
        s, t_lo, t_hi = _score_tile(q, k, KR + rel_off, QR + rel_off, TABLE, mask_ptr, i0, j0, seq_len, scale,
                                    offs_m, offs_n, offs_w, offs_d, TWO_SPAN, HEAD_DIM, BLOCK_M, BLOCK_N, SLAB,
                                    HAS_C2P, HAS_P2C, HAS_MASK, MASK_DIAGONAL, PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        _, ds = _probs_and_dscores(s, lse, delta, dp, seed, i0, j0, offs_m, offs_n, n_ctx, dropout_p, scale, DROPOUT)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        if HAS_C2P:  # dQ_a += sum_b dS[a,b] Kr[idx];  dKr[t] += sum_{idx=t} dS[a,b] Q_a
            dq = _position_grads(dq, q, ds, skew_cols, skew_ok, KR + rel_off, part_ptr, TABLE, i0, j0, t_lo, t_hi,
                                 offs_w, offs_d, TWO_SPAN, HEAD_DIM, BLOCK_M, BLOCK_N, SLAB, PRECISION)
    _store_rows(DQ + base, i0, offs_m, offs_d, stride_n, seq_len, dq)


@triton.jit
def _attn_bwd_dq(Q, K, V, KR, QR, TABLE, MASK, CU, SCALES, DO, LSE, DELTA, DQ, DKR_PART,
                 seed, scale, dropout_p, n_ctx, n_heads, num_seqs, items_per_program,
                 stride_b, stride_h, stride_n, stride_lb, stride_lh,
                 TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 SLAB: tl.constexpr, HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_MASK: tl.constexpr,
                 VARLEN: tl.constexpr, DROPOUT: tl.constexpr, SCALE_PER_SEQ: tl.constexpr,
                 MASK_DIAGONAL: tl.constexpr, PRECISION: tl.constexpr):
    """Program (p, head) walks (sequence, query block) items of one head into one partial dKr."""
    pid, head = tl.program_id(0), tl.program_id(1)
    part_ptr = DKR_PART + (head * tl.num_programs(0) + pid).to(tl.int64) * TWO_SPAN * HEAD_DIM
    blocks = tl.cdiv(n_ctx, BLOCK_M)
    first = pid * items_per_program
    for item in range(first, tl.minimum(first + items_per_program, num_seqs * blocks)):
        seq = item // blocks
        seq_len, base, rel_off, stat_off = _locate(CU, seq, head, n_ctx, stride_b, stride_h, stride_n,
                                                   stride_lb, stride_lh, TWO_SPAN, HEAD_DIM, VARLEN)
        i0 = (item % blocks) * BLOCK_M
        if i0 < seq_len:
            _dq_block(Q, K, V, KR, QR, TABLE, MASK + seq * n_ctx, DO, LSE, DELTA, DQ, part_ptr, i0,
                      seed + seq * n_heads + head, _sequence_scale(SCALES, seq, scale, SCALE_PER_SEQ), dropout_p,
                      n_ctx, seq_len, base, rel_off, stat_off, stride_n, TWO_SPAN, HEAD_DIM, BLOCK_M, BLOCK_N,
                      SLAB, HAS_C2P, HAS_P2C, HAS_MASK, MASK_DIAGONAL, DROPOUT, PRECISION)


@triton.jit
def _attn_bwd_delta(O, DO, CU, DELTA, n_ctx, n_heads, stride_b, stride_h, stride_n, stride_lb, stride_lh,
                    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, VARLEN: tl.constexpr):
    """``delta = rowsum(dO * O)`` in float32, straight into the lse layout (no float32 copies)."""
    bh = tl.program_id(1)
    seq_len, base, _, stat_off = _locate(CU, bh // n_heads, bh % n_heads, n_ctx, stride_b, stride_h, stride_n,
                                         stride_lb, stride_lh, 1, HEAD_DIM, VARLEN)
    i0 = tl.program_id(0) * BLOCK
    offs_r, offs_d = tl.arange(0, BLOCK), tl.arange(0, HEAD_DIM)
    o = _load_rows(O + base, i0, offs_r, offs_d, stride_n, seq_len).to(tl.float32)
    do = _load_rows(DO + base, i0, offs_r, offs_d, stride_n, seq_len).to(tl.float32)
    tl.store(DELTA + stat_off + i0 + offs_r, tl.sum(o * do, 1), mask=(i0 + offs_r) < seq_len)


# --------------------------------------------------------------------------- tiling


@dataclass(frozen=True)
class Tiles:
    """One kernel's launch shape: query rows x key columns per tile, warps and pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    @property
    def slab(self) -> int:
        """Rows of the position-table slab a tile reads: its window width, rounded to a power of two."""
        return triton.next_power_of_2(self.block_m + self.block_n - 1)


# (kernel, head dim) -> tiles on a GPU. Each entry is the largest tile found that compiles for sm_80,
# sm_90 and sm_100 with no register spills (`python -m distaff.kernels.compile_check`); the
# alternatives tried and what they spilled are in docs/kernels.md. The backward holds the most
# state per tile (slabs, skewed and bucketed dS, a partial-gradient window), hence 16 x 16.
GPU_TILES = {
    **{("fwd", d): Tiles(32, 32, 4, 1) for d in (16, 32, 64)}, ("fwd", 128): Tiles(16, 16, 4, 1),
    **{(kernel, d): Tiles(16, 16, 8, 1) for kernel in ("dkdv", "dq") for d in (16, 32, 64, 128)},
}
# float32 inputs (TF32 products, fp32 operands take twice the registers): 16 x 16 everywhere.
GPU_TILES_FP32 = {key: Tiles(16, 16, tiles.num_warps, 1) for key, tiles in GPU_TILES.items()}
# A backward kernel without its own position gradient (dq without c2p, dk/dv without p2c) holds far
# less; at d = 128 ptxas then settles at 128 registers with 8 warps and spills, so it gets 4.
LIGHT_TILES = {("dq", 128): Tiles(16, 16, 4, 1), ("dkdv", 128): Tiles(16, 16, 4, 1)}
# The interpreter runs programs one after another: few, larger tiles are fastest.
INTERPRETER_TILES = Tiles(32, 32, 4, 1)
KERNELS = ("fwd", "dkdv", "dq")
# The backward's partial position gradients (one float32 [2*span, d] per program) and delta may
# take at most this fraction of the bytes of dq + dk + dv; it sets the programs per head.
PARTIAL_BUDGET = 1.0
DELTA_ELEMENTS = 2048  # elements of dO and O per program of the delta kernel (rows = this / d)


def tiles_for(kernel: str, head_dim: int, dtype: torch.dtype, own_term: bool = True) -> Tiles:
    """The launch shape of ``kernel`` ("fwd", "dkdv" or "dq") for inputs of ``head_dim`` and ``dtype``;
    ``own_term``: whether a backward kernel computes its position gradient (c2p for dq, p2c for dk/dv)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return INTERPRETER_TILES
    if not own_term and dtype != torch.float32 and (kernel, head_dim) in LIGHT_TILES:
        return LIGHT_TILES[(kernel, head_dim)]
    table = GPU_TILES_FP32 if dtype == torch.float32 else GPU_TILES
    return table[(kernel, head_dim)]


def tile_bucket_widths(n: int, tiles: Tiles, position_buckets: int, max_relative_positions: int) -> torch.Tensor:
    """``t_hi - t_lo`` of every tile of one length-``n`` sequence, as the kernels compute it (rows:
    query blocks, columns: key blocks): 0 for a saturated tile, ``BLOCK_M + BLOCK_N - 2`` for a tile
    whose distances map one-to-one onto buckets."""
    bm, bn = tiles.block_m, tiles.block_n
    reach = n + bm + bn  # every distance a tile's window covers, its overhang past n included
    table = bucket_table(reach, position_buckets, max_relative_positions).long()
    first = torch.arange(0, n, bm)[:, None] - torch.arange(0, n, bn)[None, :] - (bn - 1) + reach
    return table[first + bm + bn - 2] - table[first]


@dataclass(frozen=True)
class TilePaths:
    """How many tiles of one sequence take each path of a kernel."""

    saturated: int  # one bucket: rank-1 position terms, no slab, no merge
    identity: int   # near the diagonal, one bucket per distance: slab products; the backward skips the merge
    merged: int     # the rest (log buckets, partly saturated): slab products; the backward merges buckets

    @property
    def total(self) -> int:
        return self.saturated + self.identity + self.merged


def tile_paths(n: int, tiles: Tiles, position_buckets: int, max_relative_positions: int) -> TilePaths:
    """The path counts of a kernel with ``tiles`` over one sequence of ``n`` tokens (a kernel selects
    the path per tile from its bucket range, as ``tile_bucket_widths`` computes it)."""
    widths = tile_bucket_widths(n, tiles, position_buckets, max_relative_positions)
    saturated = int((widths == 0).sum())
    identity = int((widths == tiles.block_m + tiles.block_n - 2).sum())
    return TilePaths(saturated, identity, widths.numel() - saturated - identity)


@functools.lru_cache(maxsize=64)
def _distance_table(max_distance: int, position_buckets: int, max_relative_positions: int,
                    device: torch.device) -> torch.Tensor:
    """The reference bucket table, checked to rise by at most one per unit of distance.

    That property bounds a tile's buckets by its window of distances (the slab width).
    """
    table = bucket_table(max_distance, position_buckets, max_relative_positions, device)
    step = int((table[1:] - table[:-1]).max().item()) if table.numel() > 1 else 0
    if step > 1:
        raise NotImplementedError(
            f"position_buckets={position_buckets}, max_relative_positions={max_relative_positions}: the bucket "
            f"index jumps by {step} between neighbouring distances; the Triton kernel needs steps <= 1 "
            "(max_relative_positions >= about 2.7 * position_buckets / 2); use impl='reference'")
    return table


@dataclass(frozen=True)
class _Problem:
    """Everything but the five differentiable tensors: geometry, index table, masks and RNG."""

    num_seqs: int
    n_heads: int
    n_ctx: int              # padded length, or max_seqlen of the packed form
    strides: tuple          # (batch, head, token) strides of q/k/v/o (head dim contiguous)
    stat_shape: tuple       # per-row statistics (lse, delta): [B, H, N] (padded) or [H, total_tokens] (packed)
    stat_strides: tuple     # (sequence, head) strides into them; the token stride is 1
    table: torch.Tensor     # int32 bucket index of every distance from -max_distance to +max_distance
    max_distance: int
    mask: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    two_span: int
    scale: float                 # the one scale, or 1.0 (unused) when ``scales`` is given
    scales: torch.Tensor | None  # float32 [num_seqs]: one softmax scale per sequence
    mask_diagonal: bool
    dropout_p: float
    seed: int

    def launch(self, kernel, tiles: Tiles, grid: tuple, q: torch.Tensor, has_c2p: bool, has_p2c: bool,
               **args) -> None:
        """Launch one of the three attention kernels on ``grid``."""
        kernel[grid](
            TABLE=self.table[self.max_distance:],  # element 0 is distance 0
            MASK=q if self.mask is None else self.mask,  # q stands in for absent optional tensors
            CU=q if self.cu_seqlens is None else self.cu_seqlens,
            SCALES=q if self.scales is None else self.scales,
            seed=self.seed, scale=self.scale, dropout_p=self.dropout_p, n_ctx=self.n_ctx, n_heads=self.n_heads,
            stride_b=self.strides[0], stride_h=self.strides[1], stride_n=self.strides[2],
            stride_lb=self.stat_strides[0], stride_lh=self.stat_strides[1],
            TWO_SPAN=self.two_span, HEAD_DIM=q.shape[-1], BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
            SLAB=tiles.slab, HAS_C2P=has_c2p, HAS_P2C=has_p2c, HAS_MASK=self.mask is not None,
            VARLEN=self.cu_seqlens is not None, DROPOUT=self.dropout_p > 0,
            SCALE_PER_SEQ=self.scales is not None, MASK_DIAGONAL=self.mask_diagonal,
            PRECISION="tf32",  # fp32 inputs use TF32 tensor cores (docs/kernels.md); half inputs ignore it
            num_warps=tiles.num_warps, num_stages=tiles.num_stages, **args)

    def row_delta(self, out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
        """``rowsum(dO * O)`` (= ``rowsum(P * dP)``) in float32, laid out like the lse."""
        delta = torch.empty(self.stat_shape, dtype=torch.float32, device=out.device)
        rows = DELTA_ELEMENTS // out.shape[-1]
        _attn_bwd_delta[(triton.cdiv(self.n_ctx, rows), self.num_seqs * self.n_heads)](
            O=out, DO=grad_out, CU=out if self.cu_seqlens is None else self.cu_seqlens, DELTA=delta,
            n_ctx=self.n_ctx, n_heads=self.n_heads, stride_b=self.strides[0], stride_h=self.strides[1],
            stride_n=self.strides[2], stride_lb=self.stat_strides[0], stride_lh=self.stat_strides[1],
            HEAD_DIM=out.shape[-1], BLOCK=rows, VARLEN=self.cu_seqlens is not None, num_warps=4)
        return delta


def attention_forward(q, k, v, pos_key, pos_query, problem: _Problem):
    """Output and row log-sum-exp of the fused forward."""
    out = torch.empty_like(q)
    lse = torch.empty(problem.stat_shape, dtype=torch.float32, device=q.device)
    tiles = tiles_for("fwd", q.shape[-1], q.dtype)
    problem.launch(_attn_fwd, tiles, (triton.cdiv(problem.n_ctx, tiles.block_m), problem.num_seqs * problem.n_heads),
                   q, pos_key is not None, pos_query is not None,
                   Q=q, K=k, V=v, KR=q if pos_key is None else pos_key, QR=q if pos_query is None else pos_query,
                   O=out, LSE=lse)
    return out, lse


def programs_per_head(items: int, has_partial: bool, budget_bytes: int, partial_bytes: int, n_heads: int) -> int:
    """How many programs share a head's ``items`` (sequence, block) pairs in a backward kernel.

    Each program holds one float32 ``[2*span, d]`` partial (``partial_bytes``), so the partials of
    all heads fit ``budget_bytes``; without a position term there is no partial and every item gets
    its own program.
    """
    if not has_partial:
        return items
    return max(1, min(items, budget_bytes // (n_heads * partial_bytes)))


def attention_backward(grad_out, q, k, v, pos_key, pos_query, out, lse, problem: _Problem):
    """``dq, dk, dv, d_pos_key, d_pos_query`` (None for absent position terms).

    Extra memory beyond the gradients: ``delta`` and one kernel's partials at a time, together at
    most ``PARTIAL_BUDGET`` x the bytes of ``dq + dk + dv``.
    """
    grad_out = grad_out.contiguous()
    delta = problem.row_delta(out, grad_out)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    has_c2p, has_p2c = pos_key is not None, pos_query is not None
    partial_bytes = problem.two_span * q.shape[-1] * 4
    # What else is alive beside the partials: delta, and a head's summed partials before their cast.
    others = delta.numel() * delta.element_size() + 2 * problem.n_heads * partial_bytes
    budget = int(PARTIAL_BUDGET * 3 * q.numel() * q.element_size()) - others
    common = dict(Q=q, K=k, V=v, KR=q if pos_key is None else pos_key, QR=q if pos_query is None else pos_query,
                  DO=grad_out, LSE=lse, DELTA=delta)

    def run(kernel, tiles: Tiles, rows: int, has_term: bool, part_name: str, **outputs) -> torch.Tensor | None:
        """Launch a backward kernel over (sequence, ``rows``-row block) items; its summed partials."""
        items = problem.num_seqs * triton.cdiv(problem.n_ctx, rows)
        programs = programs_per_head(items, has_term, budget, partial_bytes, problem.n_heads)
        shape = (problem.n_heads, programs, problem.two_span, q.shape[-1]) if has_term else (1,)
        partial = torch.zeros(shape, dtype=torch.float32, device=q.device)
        problem.launch(kernel, tiles, (programs, problem.n_heads), q, has_c2p, has_p2c, num_seqs=problem.num_seqs,
                       items_per_program=triton.cdiv(items, programs), **{part_name: partial}, **outputs, **common)
        return partial.sum(1) if has_term else None  # fixed order: deterministic

    dkdv_tiles = tiles_for("dkdv", q.shape[-1], q.dtype, own_term=has_p2c)
    dq_tiles = tiles_for("dq", q.shape[-1], q.dtype, own_term=has_c2p)
    d_pos_query = run(_attn_bwd_dkdv, dkdv_tiles, dkdv_tiles.block_n, has_p2c, "DQR_PART", DK=dk, DV=dv)
    d_pos_key = run(_attn_bwd_dq, dq_tiles, dq_tiles.block_m, has_c2p, "DKR_PART", DQ=dq)
    return (dq, dk, dv, None if d_pos_key is None else d_pos_key.to(pos_key.dtype),
            None if d_pos_query is None else d_pos_query.to(pos_query.dtype))


class _DisentangledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pos_key, pos_query, problem: _Problem):
        out, lse = attention_forward(q, k, v, pos_key, pos_query, problem)
        ctx.save_for_backward(q, k, v, pos_key, pos_query, out, lse)
        ctx.problem = problem
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return (*attention_backward(grad_out, *ctx.saved_tensors, ctx.problem), None)


def _check_kernel_inputs(q: torch.Tensor, tensors: dict) -> None:
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q must be float16, bfloat16 or float32 for the Triton kernel, got {q.dtype}")
    head_dim = q.shape[-1]
    if head_dim not in TRITON_HEAD_DIMS:
        raise ValueError(f"head dim d must be one of {TRITON_HEAD_DIMS} for the Triton kernel, got {head_dim}")
    for name, t in tensors.items():
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        if name in ("k", "v") and t.dtype != q.dtype:
            raise TypeError(f"q, k, v must share a dtype, got q {q.dtype} and {name} {t.dtype}")
    if q.numel() == 0:
        raise ValueError(f"q must hold at least one token, got shape {tuple(q.shape)}")


def check_offsets_fit_int32(num_seqs: int, n_heads: int, n_ctx: int, token_stride: int, table_elements: int,
                            dropout: bool) -> None:
    """Reject shapes whose 32-bit in-kernel offsets could overflow.

    Offsets across sequences and heads are int64 in the kernels (``_locate``); what stays
    32-bit is a token's offset inside one sequence (at most ``(n_ctx + 256) * token_stride`` with
    the last tile's overhang), the mask offset (``num_seqs * n_ctx``), a head's offset into the
    position tables (``n_heads * 2*span * d``) and, with dropout, the Philox counter ``i * n_ctx + j``.
    """
    checks = [("(max_seqlen + 256) x token stride", (n_ctx + 256) * token_stride),
              ("sequences x max_seqlen (mask offsets)", num_seqs * n_ctx),
              ("heads x 2*span x d (position-table offsets)", n_heads * table_elements)]
    if dropout:
        checks.append(("max_seqlen**2 (dropout counters)", n_ctx * n_ctx))
    for what, value in checks:
        if value > INT32_MAX:
            raise ValueError(f"{what} = {value} exceeds the kernels' 32-bit offset range (2**31 - 1); "
                             "split the batch")


def _make_problem(call: AttentionCall, *, num_seqs: int, n_ctx: int, strides: tuple, stat_shape: tuple,
                  stat_strides: tuple, mask, cu_seqlens) -> _Problem:
    q = call.q
    heads = q.shape[1]  # [B, H, N, d] and [total, H, d] alike
    two_span = 2 * attention_span(call.position_buckets, call.max_relative_positions)
    check_offsets_fit_int32(num_seqs, heads, n_ctx, strides[2], two_span * q.shape[-1], call.dropout_p > 0)
    # Tiles read the table from distance -(n_ctx + BLOCK_N) up to n_ctx + SLAB - BLOCK_N.
    tiles = [tiles_for(kernel, q.shape[-1], q.dtype) for kernel in KERNELS]
    max_distance = n_ctx + max(t.slab + t.block_n for t in tiles)
    table = _distance_table(max_distance, call.position_buckets, call.max_relative_positions, q.device)
    return _Problem(num_seqs=num_seqs, n_heads=heads, n_ctx=n_ctx,
                    strides=strides, stat_shape=stat_shape, stat_strides=stat_strides, table=table,
                    max_distance=max_distance, mask=mask, cu_seqlens=cu_seqlens, two_span=two_span,
                    scale=1.0 if call.per_sequence_scale else call.softmax_scale,
                    scales=call.softmax_scale if call.per_sequence_scale else None, mask_diagonal=call.mask_diagonal,
                    dropout_p=call.dropout_p, seed=dropout_seed(call.dropout_p))


def _tables_in(call: AttentionCall) -> list:
    """Position tables in q's dtype, contiguous; the cast is part of the autograd graph."""
    return [None if t is None else t.to(call.q.dtype).contiguous() for t in (call.pos_key, call.pos_query)]


@attention_op
def disentangled_attention(call: AttentionCall) -> torch.Tensor:
    """Triton DeBERTa attention over ``[B, H, N, d]``; semantics of :func:`reference.disentangled_attention`."""
    _check_kernel_inputs(call.q, {"k": call.k, "v": call.v, "pos_key": call.pos_key, "pos_query": call.pos_query,
                                  "attention_mask": call.attention_mask})
    batch, heads, n, _ = call.q.shape
    q, k, v = call.q.contiguous(), call.k.contiguous(), call.v.contiguous()
    mask = None if call.attention_mask is None else call.attention_mask.ne(0).to(torch.int8).contiguous()
    problem = _make_problem(call, num_seqs=batch, n_ctx=n, strides=(q.stride(0), q.stride(1), q.stride(2)),
                            stat_shape=(batch, heads, n), stat_strides=(heads * n, n), mask=mask, cu_seqlens=None)
    return _DisentangledAttention.apply(q, k, v, *_tables_in(call), problem)


@varlen_attention_op
def disentangled_attention_varlen(call: AttentionCall) -> torch.Tensor:
    """Packed Triton form over ``[total_tokens, H, d]``; relative positions restart in every sequence."""
    _check_kernel_inputs(call.q, {"k": call.k, "v": call.v, "pos_key": call.pos_key, "pos_query": call.pos_query,
                                  "cu_seqlens": call.cu_seqlens})
    total, heads, _ = call.q.shape
    q, k, v = call.q.contiguous(), call.k.contiguous(), call.v.contiguous()
    problem = _make_problem(call, num_seqs=len(call.bounds) - 1, n_ctx=call.max_seqlen,
                            strides=(0, q.stride(1), q.stride(0)), stat_shape=(heads, total), stat_strides=(0, total),
                            mask=None, cu_seqlens=call.cu_seqlens.to(torch.int32).contiguous())
    return _DisentangledAttention.apply(q, k, v, *_tables_in(call), problem)
