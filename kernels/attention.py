"""Fused DeBERTa disentangled attention in Triton: flash-style forward, deterministic backward.

Scores of a ``[BLOCK, BLOCK]`` tile (rows ``i0..``, columns ``j0..``) are
``(Q K^T + c2p + p2c) * scale`` with ``c2p[a, b] = Q_a . Kr[idx(i0+a, j0+b)]`` and
``p2c[a, b] = K_b . Qr[idx(i0+a, j0+b)]``. The distances ``i - j`` of a tile form one contiguous
window of ``2*BLOCK - 1`` values and the bucket table is monotone with steps of 0 or 1, so the
tile reads one contiguous *slab* of at most ``2*BLOCK - 1`` rows of ``Kr`` / ``Qr`` starting at
bucket ``t_lo``. The kernels compute ``Q @ slab(Kr)^T`` and ``K @ slab(Qr)^T`` with ``tl.dot``
and gather each score's column in registers (``loc = idx - t_lo``); no ``[B, H, N, 2*span]``
tensor and no ``N x N`` tensor is ever written.

Backward (no atomics, deterministic):

* ``_attn_bwd_dkdv``: one program per key block loops over query blocks -> ``dK``, ``dV`` and,
  per program, a partial ``dQr`` over all ``2*span`` buckets (read-modify-write of rows the
  program owns).
* ``_attn_bwd_dq``: one program per query block loops over key blocks -> ``dQ`` and partial ``dKr``.
* The partials are summed by ``torch.sum`` (fixed order) into ``dKr`` / ``dQr``.

A tile's score gradient ``dS`` is moved to distance coordinates by a pure skew (a register
gather), then to bucket coordinates by a one-hot ``tl.dot`` that merges distances sharing a
bucket; tiles whose window maps one-to-one onto buckets (near the diagonal) skip the merge.

Dropout keeps ``(i, j)`` iff ``tl.rand(seed + b*H + h, i * n_ctx + j) >= p``: regenerated in
backward, no mask in memory. Design notes and costs: ``docs/kernels.md``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .reference import dropout_seed, check_attention_inputs, check_varlen_inputs, default_softmax_scale
from .relative_position import attention_span, bucket_table

_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


# --------------------------------------------------------------------------- tile helpers


@triton.jit
def _sequence(cu_ptr, seq, n_ctx, VARLEN: tl.constexpr):
    """First token and length of sequence ``seq`` (packed form) or ``(0, n_ctx)`` (padded form)."""
    start = 0
    seq_len = n_ctx
    if VARLEN:
        start = tl.load(cu_ptr + seq)
        seq_len = tl.load(cu_ptr + seq + 1) - start
    return start, seq_len


@triton.jit
def _bucket_window(table_ptr, i0, j0, offs_m, offs_n, BLOCK: tl.constexpr):
    """Bucket range ``[t_lo, t_hi]`` of the tile and each score's slab row ``loc = idx - t_lo``.

    ``table_ptr`` points at distance 0; window column ``c`` is distance ``i0 - j0 - BLOCK + 1 + c``.
    """
    r0 = i0 - j0 - (BLOCK - 1)
    t_lo = tl.load(table_ptr + r0)
    t_hi = tl.load(table_ptr + r0 + 2 * BLOCK - 2)
    loc = tl.load(table_ptr + (i0 - j0) + offs_m[:, None] - offs_n[None, :]) - t_lo
    return t_lo, t_hi, loc


@triton.jit
def _load_slab(rel_ptr, t_lo, offs_w, offs_d, TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rows ``t_lo .. t_lo + 2*BLOCK - 1`` of one head's ``[2*span, d]`` position table."""
    rows = t_lo + offs_w
    return tl.load(rel_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=(rows < TWO_SPAN)[:, None], other=0.0)


@triton.jit
def _tile_logits(q, k, krs, qrs, loc, visible, scale,
                 HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, PRECISION: tl.constexpr):
    """Scaled scores of one tile, ``-inf`` where the pair is not visible."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if HAS_C2P:  # Q @ slab(Kr)^T, then each score picks its bucket's column
        s += tl.gather(tl.dot(q, tl.trans(krs), input_precision=PRECISION), loc, 1)
    if HAS_P2C:  # K @ slab(Qr)^T, same for the transposed tile
        s += tl.trans(tl.gather(tl.dot(k, tl.trans(qrs), input_precision=PRECISION), tl.trans(loc), 1))
    return tl.where(visible, s * scale, float("-inf"))


@triton.jit
def _visible(mask_ptr, i0, j0, offs_m, offs_n, seq_len, HAS_MASK: tl.constexpr):
    rows = i0 + offs_m
    cols = j0 + offs_n
    row_ok = rows < seq_len
    col_ok = cols < seq_len
    if HAS_MASK:
        row_ok &= tl.load(mask_ptr + rows, mask=row_ok, other=0) != 0
        col_ok &= tl.load(mask_ptr + cols, mask=col_ok, other=0) != 0
    return row_ok[:, None] & col_ok[None, :]


@triton.jit
def _tile_scores(q, k, krs, qrs, kr_ptr, qr_ptr, table_ptr, mask_ptr, i0, j0, offs_m, offs_n, offs_w, offs_d,
                 seq_len, scale, TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                 HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr):
    """Scores of tile ``(i0, j0)`` with the position slabs and bucket window it read (reused by the
    backward's bucket merges). ``krs`` / ``qrs`` come in as placeholders for absent terms."""
    t_lo, t_hi, loc = _bucket_window(table_ptr, i0, j0, offs_m, offs_n, BLOCK)
    if HAS_C2P:
        krs = _load_slab(kr_ptr, t_lo, offs_w, offs_d, TWO_SPAN, HEAD_DIM)
    if HAS_P2C:
        qrs = _load_slab(qr_ptr, t_lo, offs_w, offs_d, TWO_SPAN, HEAD_DIM)
    visible = _visible(mask_ptr, i0, j0, offs_m, offs_n, seq_len, HAS_MASK)
    s = _tile_logits(q, k, krs, qrs, loc, visible, scale, HAS_C2P, HAS_P2C, PRECISION)
    return s, krs, qrs, t_lo, t_hi


@triton.jit
def _dropout_keep(seed, i0, j0, offs_m, offs_n, n_ctx):
    """Counter-based keep mask: one Philox draw per (sequence, head, i, j), never stored."""
    offsets = (i0 + offs_m)[:, None] * n_ctx + (j0 + offs_n)[None, :]
    return tl.rand(seed, offsets)


@triton.jit
def _to_buckets(d_dist, table_ptr, i0, j0, t_lo, t_hi, offs_w, BLOCK: tl.constexpr,
                DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """Sum the window columns (distances) of ``d_dist`` that share a bucket: column ``u`` = bucket ``t_lo + u``."""
    d_bucket = d_dist
    if t_hi - t_lo != 2 * BLOCK - 2:  # not one-to-one (log buckets or saturation): one-hot merge
        bucket_of = tl.load(table_ptr + i0 - j0 - (BLOCK - 1) + offs_w) - t_lo
        one_hot = (bucket_of[:, None] == offs_w[None, :]).to(DTYPE)
        d_bucket = tl.dot(d_dist.to(DTYPE), one_hot, input_precision=PRECISION)
    return d_bucket


@triton.jit
def _accumulate_rows(part_ptr, t_lo, offs_w, offs_d, rows_grad,
                     TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr):
    """``part[t_lo + u] += rows_grad[u]`` on rows this program owns (no other program writes them)."""
    rows = t_lo + offs_w
    ptrs = part_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :]
    ok = (rows < TWO_SPAN)[:, None]
    tl.store(ptrs, tl.load(ptrs, mask=ok, other=0.0) + rows_grad, mask=ok)
    tl.debug_barrier()  # the next tile's window may overlap these rows, read by other threads


# --------------------------------------------------------------------------- kernels


@triton.jit
def _attn_fwd(Q, K, V, KR, QR, TABLE, MASK, CU, O, LSE,
              seed, scale, dropout_p, n_ctx, n_heads,
              stride_b, stride_h, stride_n, stride_lb, stride_lh,
              TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
              HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_MASK: tl.constexpr,
              VARLEN: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    seq = bh // n_heads
    head = bh % n_heads
    start, seq_len = _sequence(CU, seq, n_ctx, VARLEN)
    i0 = pid_m * BLOCK
    if i0 >= seq_len:
        return
    offs_m = tl.arange(0, BLOCK)
    offs_n = tl.arange(0, BLOCK)
    offs_w = tl.arange(0, 2 * BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    base = seq.to(tl.int64) * stride_b + head * stride_h + start * stride_n
    kr_ptr = KR + head * TWO_SPAN * HEAD_DIM
    qr_ptr = QR + head * TWO_SPAN * HEAD_DIM
    mask_ptr = MASK + seq * n_ctx
    row_ok = (i0 + offs_m) < seq_len
    q = tl.load(Q + base + (i0 + offs_m)[:, None] * stride_n + offs_d[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    m_safe = tl.zeros([BLOCK], tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    krs = q
    qrs = q
    for j0 in range(0, seq_len, BLOCK):
        col_ok = (j0 + offs_n) < seq_len
        kv_offs = (j0 + offs_n)[:, None] * stride_n + offs_d[None, :]
        k = tl.load(K + base + kv_offs, mask=col_ok[:, None], other=0.0)
        v = tl.load(V + base + kv_offs, mask=col_ok[:, None], other=0.0)
        s, krs, qrs, _, _ = _tile_scores(q, k, krs, qrs, kr_ptr, qr_ptr, TABLE, mask_ptr, i0, j0, offs_m,
                                         offs_n, offs_w, offs_d, seq_len, scale, TWO_SPAN, HEAD_DIM, BLOCK,
                                         HAS_C2P, HAS_P2C, HAS_MASK, PRECISION)
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
    tl.store(O + base + (i0 + offs_m)[:, None] * stride_n + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    # Fully masked rows get lse = +inf so that backward's exp(s - lse) is 0 there.
    lse = tl.where(has_any, m_safe + tl.log(tl.where(has_any, l_i, 1.0)), float("inf"))
    tl.store(LSE + seq * stride_lb + head * stride_lh + start + i0 + offs_m, lse, mask=row_ok)


@triton.jit
def _probs_and_dscores(q, k, v, do, lse, delta, s, seed, bh, i0, j0, offs_m, offs_n, n_ctx, dropout_p, scale,
                       DROPOUT: tl.constexpr, PRECISION: tl.constexpr):
    """Recomputed (dropped) probabilities and the score gradient ``dS`` (scale included)."""
    p = tl.exp(s - lse[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    p_dropped = p
    if DROPOUT:
        keep = _dropout_keep(seed + bh, i0, j0, offs_m, offs_n, n_ctx) >= dropout_p
        p_dropped = tl.where(keep, p / (1.0 - dropout_p), 0.0)
        dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
    ds = p * (dp - delta[:, None]) * scale
    return p_dropped, ds


@triton.jit
def _attn_bwd_dkdv(Q, K, V, KR, QR, TABLE, MASK, CU, DO, LSE, DELTA, DK, DV, DQR_PART,
                   seed, scale, dropout_p, n_ctx, n_heads,
                   stride_b, stride_h, stride_n, stride_lb, stride_lh,
                   TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                   HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_MASK: tl.constexpr,
                   VARLEN: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    seq = bh // n_heads
    head = bh % n_heads
    start, seq_len = _sequence(CU, seq, n_ctx, VARLEN)
    j0 = pid_n * BLOCK
    if j0 >= seq_len:
        return
    offs_m = tl.arange(0, BLOCK)
    offs_n = tl.arange(0, BLOCK)
    offs_w = tl.arange(0, 2 * BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    base = seq.to(tl.int64) * stride_b + head * stride_h + start * stride_n
    kr_ptr = KR + head * TWO_SPAN * HEAD_DIM
    qr_ptr = QR + head * TWO_SPAN * HEAD_DIM
    mask_ptr = MASK + seq * n_ctx
    lse_ptr = LSE + seq * stride_lb + head * stride_lh + start
    delta_ptr = DELTA + seq * stride_lb + head * stride_lh + start
    part_ptr = DQR_PART + (bh * tl.num_programs(0) + pid_n).to(tl.int64) * TWO_SPAN * HEAD_DIM
    col_ok = (j0 + offs_n) < seq_len
    kv_offs = (j0 + offs_n)[:, None] * stride_n + offs_d[None, :]
    k = tl.load(K + base + kv_offs, mask=col_ok[:, None], other=0.0)
    v = tl.load(V + base + kv_offs, mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    # Window column c of key b holds query row a = c + b - (BLOCK - 1) (same distance skew).
    skew_rows = offs_w[None, :] + offs_n[:, None] - (BLOCK - 1)
    skew_ok = (skew_rows >= 0) & (skew_rows < BLOCK)
    skew_rows = tl.where(skew_ok, skew_rows, 0)
    krs = k
    qrs = k
    for i0 in range(0, seq_len, BLOCK):
        row_ok = (i0 + offs_m) < seq_len
        q_offs = (i0 + offs_m)[:, None] * stride_n + offs_d[None, :]
        q = tl.load(Q + base + q_offs, mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + base + q_offs, mask=row_ok[:, None], other=0.0)
        lse = tl.load(lse_ptr + i0 + offs_m, mask=row_ok, other=float("inf"))
        delta = tl.load(delta_ptr + i0 + offs_m, mask=row_ok, other=0.0)
        s, krs, qrs, t_lo, t_hi = _tile_scores(q, k, krs, qrs, kr_ptr, qr_ptr, TABLE, mask_ptr, i0, j0, offs_m,
                                               offs_n, offs_w, offs_d, seq_len, scale, TWO_SPAN, HEAD_DIM, BLOCK,
                                               HAS_C2P, HAS_P2C, HAS_MASK, PRECISION)
        p_dropped, ds = _probs_and_dscores(q, k, v, do, lse, delta, s, seed, bh, i0, j0, offs_m, offs_n,
                                           n_ctx, dropout_p, scale, DROPOUT, PRECISION)
        dv += tl.dot(tl.trans(p_dropped).to(do.dtype), do, input_precision=PRECISION)
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
        if HAS_P2C:  # dK_b += sum_a dS[a,b] Qr[idx];  dQr[t] += sum_{idx=t} dS[a,b] K_b
            ds_dist = tl.where(skew_ok, tl.gather(tl.trans(ds), skew_rows, 1), 0.0)
            ds_bucket = _to_buckets(ds_dist, TABLE, i0, j0, t_lo, t_hi, offs_w, BLOCK, k.dtype, PRECISION)
            dk += tl.dot(ds_bucket.to(k.dtype), qrs, input_precision=PRECISION)
            _accumulate_rows(part_ptr, t_lo, offs_w, offs_d,
                             tl.dot(tl.trans(ds_bucket).to(k.dtype), k, input_precision=PRECISION),
                             TWO_SPAN, HEAD_DIM)
    tl.store(DK + base + kv_offs, dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + base + kv_offs, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _attn_bwd_dq(Q, K, V, KR, QR, TABLE, MASK, CU, DO, LSE, DELTA, DQ, DKR_PART,
                 seed, scale, dropout_p, n_ctx, n_heads,
                 stride_b, stride_h, stride_n, stride_lb, stride_lh,
                 TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                 HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_MASK: tl.constexpr,
                 VARLEN: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    seq = bh // n_heads
    head = bh % n_heads
    start, seq_len = _sequence(CU, seq, n_ctx, VARLEN)
    i0 = pid_m * BLOCK
    if i0 >= seq_len:
        return
    offs_m = tl.arange(0, BLOCK)
    offs_n = tl.arange(0, BLOCK)
    offs_w = tl.arange(0, 2 * BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    base = seq.to(tl.int64) * stride_b + head * stride_h + start * stride_n
    kr_ptr = KR + head * TWO_SPAN * HEAD_DIM
    qr_ptr = QR + head * TWO_SPAN * HEAD_DIM
    mask_ptr = MASK + seq * n_ctx
    part_ptr = DKR_PART + (bh * tl.num_programs(0) + pid_m).to(tl.int64) * TWO_SPAN * HEAD_DIM
    row_ok = (i0 + offs_m) < seq_len
    q_offs = (i0 + offs_m)[:, None] * stride_n + offs_d[None, :]
    q = tl.load(Q + base + q_offs, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + base + q_offs, mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + seq * stride_lb + head * stride_lh + start + i0 + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + seq * stride_lb + head * stride_lh + start + i0 + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    # Window column c of query a holds key column b = a + BLOCK - 1 - c.
    skew_cols = offs_m[:, None] + (BLOCK - 1) - offs_w[None, :]
    skew_ok = (skew_cols >= 0) & (skew_cols < BLOCK)
    skew_cols = tl.where(skew_ok, skew_cols, 0)
    krs = q
    qrs = q
    for j0 in range(0, seq_len, BLOCK):
        col_ok = (j0 + offs_n) < seq_len
        kv_offs = (j0 + offs_n)[:, None] * stride_n + offs_d[None, :]
        k = tl.load(K + base + kv_offs, mask=col_ok[:, None], other=0.0)
        v = tl.load(V + base + kv_offs, mask=col_ok[:, None], other=0.0)
        s, krs, qrs, t_lo, t_hi = _tile_scores(q, k, krs, qrs, kr_ptr, qr_ptr, TABLE, mask_ptr, i0, j0, offs_m,
                                               offs_n, offs_w, offs_d, seq_len, scale, TWO_SPAN, HEAD_DIM, BLOCK,
                                               HAS_C2P, HAS_P2C, HAS_MASK, PRECISION)
        _, ds = _probs_and_dscores(q, k, v, do, lse, delta, s, seed, bh, i0, j0, offs_m, offs_n,
                                   n_ctx, dropout_p, scale, DROPOUT, PRECISION)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        if HAS_C2P:  # dQ_a += sum_b dS[a,b] Kr[idx];  dKr[t] += sum_{idx=t} dS[a,b] Q_a
            ds_dist = tl.where(skew_ok, tl.gather(ds, skew_cols, 1), 0.0)
            ds_bucket = _to_buckets(ds_dist, TABLE, i0, j0, t_lo, t_hi, offs_w, BLOCK, q.dtype, PRECISION)
            dq += tl.dot(ds_bucket.to(q.dtype), krs, input_precision=PRECISION)
            _accumulate_rows(part_ptr, t_lo, offs_w, offs_d,
                             tl.dot(tl.trans(ds_bucket).to(q.dtype), q, input_precision=PRECISION),
                             TWO_SPAN, HEAD_DIM)
    tl.store(DQ + base + q_offs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


# --------------------------------------------------------------------------- host side


def _block_size(head_dim: int) -> int:
    """Square tile edge. The interpreter is fastest with few, larger tiles; GPUs with 64 (32 at d=128)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return 32
    return 32 if head_dim > 64 else 64


@functools.lru_cache(maxsize=64)
def _distance_table(max_distance: int, position_buckets: int, max_relative_positions: int,
                    device: torch.device) -> torch.Tensor:
    """The reference bucket table, checked to rise by at most one per unit of distance.

    That property bounds a tile's buckets by its ``2*BLOCK - 1`` distances (the slab width).
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
    lse_shape: tuple        # per-row statistics: [B, H, N] (padded) or [H, total_tokens] (packed)
    lse_strides: tuple      # (sequence, head) strides into them; the token stride is 1
    table: torch.Tensor     # int32 bucket of every distance; element `table_mid` is distance 0
    table_mid: int
    mask: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    two_span: int
    scale: float
    dropout_p: float
    seed: int
    block: int

    def launch_args(self):
        return (self.seed, self.scale, self.dropout_p, self.n_ctx, self.n_heads, *self.strides, *self.lse_strides)

    def rows_to_lse_layout(self, rows: torch.Tensor) -> torch.Tensor:
        """A per-row statistic of q's layout (``[B, H, N]`` or ``[total, H]``) in the lse layout."""
        return rows if self.cu_seqlens is None else rows.t().contiguous()

    def flags(self, has_c2p: bool, has_p2c: bool, head_dim: int, dtype: torch.dtype) -> dict:
        return dict(TWO_SPAN=self.two_span, HEAD_DIM=head_dim, BLOCK=self.block, HAS_C2P=has_c2p,
                    HAS_P2C=has_p2c, HAS_MASK=self.mask is not None, VARLEN=self.cu_seqlens is not None,
                    DROPOUT=self.dropout_p > 0, PRECISION="ieee" if dtype == torch.float32 else "tf32",
                    num_warps=4)

    def grid(self):
        return (triton.cdiv(self.n_ctx, self.block), self.num_seqs * self.n_heads)

    def pointers(self, q):
        """Table at distance 0, mask and cu_seqlens (``q`` stands in for absent optional tensors)."""
        table = self.table[self.table_mid:]
        return (table, q if self.mask is None else self.mask, q if self.cu_seqlens is None else self.cu_seqlens)


class _DisentangledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pos_key, pos_query, problem: _Problem):
        out = torch.empty_like(q)
        lse = torch.empty(problem.lse_shape, dtype=torch.float32, device=q.device)
        kr = q if pos_key is None else pos_key
        qr = q if pos_query is None else pos_query
        _attn_fwd[problem.grid()](q, k, v, kr, qr, *problem.pointers(q), out, lse,
                                  *problem.launch_args(),
                                  **problem.flags(pos_key is not None, pos_query is not None, q.shape[-1], q.dtype))
        ctx.save_for_backward(q, k, v, pos_key, pos_query, out, lse)
        ctx.problem = problem
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, pos_key, pos_query, out, lse = ctx.saved_tensors
        problem: _Problem = ctx.problem
        grad_out = grad_out.contiguous()
        # rowsum(dO * O) = rowsum(P * dP): laid out like the lse.
        delta = problem.rows_to_lse_layout((grad_out.float() * out.float()).sum(-1))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        has_c2p, has_p2c = pos_key is not None, pos_query is not None
        head_dim = q.shape[-1]
        grid = problem.grid()
        # Per-program partial gradients of the position tables (summed below in a fixed order).
        part_shape = (problem.num_seqs, problem.n_heads, grid[0], problem.two_span, head_dim)
        dkr_part = torch.zeros(part_shape if has_c2p else (1,), dtype=torch.float32, device=q.device)
        dqr_part = torch.zeros(part_shape if has_p2c else (1,), dtype=torch.float32, device=q.device)
        kr = q if pos_key is None else pos_key
        qr = q if pos_query is None else pos_query
        args = problem.launch_args()
        flags = problem.flags(has_c2p, has_p2c, head_dim, q.dtype)
        pointers = problem.pointers(q)
        _attn_bwd_dkdv[grid](q, k, v, kr, qr, *pointers, grad_out, lse, delta, dk, dv, dqr_part, *args, **flags)
        _attn_bwd_dq[grid](q, k, v, kr, qr, *pointers, grad_out, lse, delta, dq, dkr_part, *args, **flags)
        d_pos_key = dkr_part.sum((0, 2)).to(pos_key.dtype) if has_c2p else None
        d_pos_query = dqr_part.sum((0, 2)).to(pos_query.dtype) if has_p2c else None
        return dq, dk, dv, d_pos_key, d_pos_query, None


def _check_kernel_inputs(q: torch.Tensor, tensors: dict) -> None:
    if q.dtype not in _DTYPES:
        raise TypeError(f"q must be float16, bfloat16 or float32 for the Triton kernel, got {q.dtype}")
    head_dim = q.shape[-1]
    if head_dim not in (16, 32, 64, 128):
        raise ValueError(f"head dim d must be 16, 32, 64 or 128 for the Triton kernel, got {head_dim}")
    for name, t in tensors.items():
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def _prepare_tables(q, pos_key, pos_query):
    """Position tables in q's dtype, contiguous; the cast is part of the autograd graph."""
    return [None if t is None else t.to(q.dtype).contiguous() for t in (pos_key, pos_query)]


def _make_problem(q: torch.Tensor, *, num_seqs: int, n_heads: int, n_ctx: int, strides: tuple, lse_shape: tuple,
                  lse_strides: tuple, mask, cu_seqlens, position_buckets: int, max_relative_positions: int,
                  dropout_p: float, scale: float) -> _Problem:
    block = _block_size(q.shape[-1])
    span = attention_span(position_buckets, max_relative_positions)
    # Distances reach +-(padded length + one tile) at the edge tiles' windows.
    max_distance = triton.cdiv(max(n_ctx, 1), block) * block + 2 * block
    table = _distance_table(max_distance, position_buckets, max_relative_positions, q.device)
    return _Problem(num_seqs=num_seqs, n_heads=n_heads, n_ctx=n_ctx, strides=strides, lse_shape=lse_shape,
                    lse_strides=lse_strides,
                    table=table, table_mid=max_distance, mask=mask, cu_seqlens=cu_seqlens, two_span=2 * span,
                    scale=float(scale), dropout_p=float(dropout_p), seed=dropout_seed(dropout_p), block=block)


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
) -> torch.Tensor:
    """Triton DeBERTa attention over ``[B, H, N, d]``; semantics of :func:`reference.disentangled_attention`."""
    span = attention_span(position_buckets, max_relative_positions)
    check_attention_inputs(q, k, v, pos_key, pos_query, span, attention_mask, dropout_p)
    _check_kernel_inputs(q, {"k": k, "v": v, "pos_key": pos_key, "pos_query": pos_query,
                             "attention_mask": attention_mask})
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(q.shape[-1], pos_key, pos_query)
    batch, heads, n, _ = q.shape
    if batch * n == 0:
        raise ValueError(f"q must hold at least one token, got shape {tuple(q.shape)}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    mask = None if attention_mask is None else attention_mask.ne(0).to(torch.int8).contiguous()
    problem = _make_problem(q, num_seqs=batch, n_heads=heads, n_ctx=n, strides=(q.stride(0), q.stride(1), q.stride(2)),
                            lse_shape=(batch, heads, n), lse_strides=(heads * n, n), mask=mask, cu_seqlens=None,
                            position_buckets=position_buckets, max_relative_positions=max_relative_positions,
                            dropout_p=dropout_p, scale=softmax_scale)
    return _DisentangledAttention.apply(q, k, v, *_prepare_tables(q, pos_key, pos_query), problem)


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
) -> torch.Tensor:
    """Packed Triton form over ``[total_tokens, H, d]``; relative positions restart in every sequence."""
    check_varlen_inputs(q, k, v, cu_seqlens, max_seqlen)
    span = attention_span(position_buckets, max_relative_positions)
    # The padded contract's checker covers pos_key/pos_query and dropout_p on a one-token view.
    one = q[:1].transpose(0, 1)[None]
    check_attention_inputs(one, one, one, pos_key, pos_query, span, None, dropout_p)
    _check_kernel_inputs(q, {"k": k, "v": v, "pos_key": pos_key, "pos_query": pos_query, "cu_seqlens": cu_seqlens})
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[0] == 0:
        raise ValueError("q must hold at least one token, got total_tokens=0")
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(q.shape[-1], pos_key, pos_query)
    total, heads, _ = q.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    problem = _make_problem(q, num_seqs=cu_seqlens.numel() - 1, n_heads=heads, n_ctx=int(max_seqlen),
                            strides=(0, q.stride(1), q.stride(0)), lse_shape=(heads, total), lse_strides=(0, total),
                            mask=None,
                            cu_seqlens=cu_seqlens.to(torch.int32).contiguous(),
                            position_buckets=position_buckets, max_relative_positions=max_relative_positions,
                            dropout_p=dropout_p, scale=softmax_scale)
    return _DisentangledAttention.apply(q, k, v, *_prepare_tables(q, pos_key, pos_query), problem)
