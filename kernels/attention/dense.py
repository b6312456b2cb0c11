"""Dense position products: the position scores as two torch GEMMs, and the backward's position gradients, the
backward kernels writing each block's score gradient in bucket coordinates to HBM and four torch GEMMs turning it
into the position terms' gradients.

Scores (``dense_scores``): ``C2P[h, row(i), t] = Q_i . Kr[t]`` and ``P2C[h, row(j), t] = K_j . Qr[t]``, one
batched GEMM each, head-major ``[H, rows, 2k]`` in the input dtype (the rows as below); a general tile of the
forward (``planning.forward_design``) or of either backward kernel (``planning.backward_scores_design``, the
products kept from the forward or the GEMMs run again at the backward's start) reads score ``(i, j)``'s terms at
``C2P[row(i), bucket(i - j)]`` and ``P2C[row(j), bucket(i - j)]`` (``_score_buckets``, ``_dense_bias``).

``dC2P[h, row(i), t] = sum_{j: idx(i, j) = t} dS[i, j]`` (what ``_attn_bwd`` merges from its band per query
block, plus its saturated tiles' row sums at the two ends) and ``dP2C[h, row(j), t] = sum_{i: idx(i, j) = t}
dS[i, j]`` (the same kernel, per key block), ``dS`` with the softmax scale in it. Then

    dQ += dC2P @ Kr,   dKr = dC2P^T @ Q,   dK += dP2C @ Qr,   dQr = dP2C^T @ K

per head, each one batched GEMM over the heads (the sequences' rows are the GEMM's rows, or its reduction for
the table gradients: no partial tables, no atomics, deterministic). The buffers are head-major, ``[H, rows, 2k]``
(``rows`` = B x N padded, the packed tokens varlen), so every GEMM's operand is a plain strided matrix. They hold
the input dtype, the precision the fused design rounds its merged band to before its in-kernel GEMMs (the
interpreter tests hold both designs to the same tolerances); cuBLAS accumulates in float32. dQ and dK take one
rounding more than in the fused design: the kernel's content part and the GEMM's position part are each rounded
to the input dtype before they are added (bf16: a relative 2^-8 per element, well inside the bf16 tolerance).

Memory: two buffers of ``H x rows x 2k`` elements (at B = 32, N = 512, H = 12, 2k = 512, bf16: 201 MB each), never
N x N. ``planning.backward_design`` decides per launch plan whether this design runs (docs/kernels.md).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _dense_rows(DENSE_GRAD, stat_off, seq, head, row0, stride_lb, stride_lh, dense_lb, dense_lh,
                TWO_SPAN: tl.constexpr):
    """Where a block's first row (``row0`` of sequence ``seq``, head ``head``) starts in a head-major dense
    buffer: the row statistics' offset ``stat_off`` moved from their (sequence, head) strides to the buffer's."""
    row = stat_off + seq.to(tl.int64) * (dense_lb - stride_lb) + head.to(tl.int64) * (dense_lh - stride_lh) + row0
    return DENSE_GRAD + row * TWO_SPAN


@triton.jit
def _dense_scores_at(C2P, P2C, stat_off, seq, stride_lb, stride_lh, dense_lb, dense_lh, TWO_SPAN: tl.constexpr,
                     DENSE_SCORES: tl.constexpr):
    """``(C2P, P2C)`` at row 0 of sequence ``seq`` of this program's head (``program_id(1)``), or ``()`` without
    ``DENSE_SCORES``."""
    dense = ()
    if DENSE_SCORES:
        head = tl.program_id(1)
        dense = (_dense_rows(C2P, stat_off, seq, head, 0, stride_lb, stride_lh, dense_lb, dense_lh, TWO_SPAN),
                 _dense_rows(P2C, stat_off, seq, head, 0, stride_lb, stride_lh, dense_lb, dense_lh, TWO_SPAN))
    return dense


@triton.jit
def _score_bucket_ptrs(TABLE, d0, offs_m, offs_n, TRANSPOSED: tl.constexpr):
    """Where ``bucket(d0 + a - b)`` of every score ``(a, b)`` of a tile with ``i0 - j0 = d0`` sits in the distance
    table: ``[BM, BN]``, or ``[BN, BM]`` when ``TRANSPOSED`` (a key block's tiles)."""
    if TRANSPOSED:
        ptrs = TABLE + d0 + offs_m[None, :] - offs_n[:, None]
    else:
        ptrs = TABLE + d0 + offs_m[:, None] - offs_n[None, :]
    return ptrs


@triton.jit
def _mirrored_bucket_ptrs(MIRROR, d0, offs_m, offs_n):
    """:func:`_score_bucket_ptrs` of a ``[BM, BN]`` tile in the mirrored table (``MIRROR[x]`` is distance ``-x``'s
    entry), at ``-(d0 + a - b)``: the addresses rise along a row."""
    return MIRROR - d0 - offs_m[:, None] + offs_n[None, :]


@triton.jit
def _score_buckets(TABLE, d0, offs_m, offs_n, TRANSPOSED: tl.constexpr):
    """``bucket(d0 + a - b)`` of every score ``(a, b)`` of a tile with ``i0 - j0 = d0``, from the distance table
    (L1-resident): ``[BM, BN]``, or ``[BN, BM]`` when ``TRANSPOSED`` (a key block's tiles)."""
    return tl.load(_score_bucket_ptrs(TABLE, d0, offs_m, offs_n, TRANSPOSED))


@triton.jit
def _buckets_ahead(TABLE, MIRROR, d0, offs_m, offs_n, needed, TRANSPOSED: tl.constexpr):
    """The buckets of a backward tile with ``i0 - j0 = d0``, read a tile ahead: as :func:`_score_buckets`
    (``[BN, BM]`` when ``TRANSPOSED``: the direct table's addresses rise along a row there) or, for a ``[BM, BN]``
    tile, from the mirrored table (:func:`_mirrored_buckets`: the layout the gathers take, so no 64-bit gather
    address changes layout). Only if ``needed`` (the tile exists: the tables do not reach a block past the
    sequence's last), else zeros."""
    if TRANSPOSED:
        ptrs = _score_bucket_ptrs(TABLE, d0, offs_m, offs_n, True)
    else:
        ptrs = _mirrored_bucket_ptrs(MIRROR, d0, offs_m, offs_n)
    return tl.load(ptrs, mask=needed, other=0)


@triton.jit
def _mirrored_buckets(MIRROR, d0, offs_m, offs_n):
    """:func:`_score_buckets` of a ``[BM, BN]`` tile read from the mirrored table (:func:`_mirrored_bucket_ptrs`):
    the addresses rise along a row, as the dense products' gathers and the scores do, so the load takes their
    layout. The direct table's addresses fall along a row; its load took a column-major layout, and each tile then
    moved the gathers' 64-bit addresses and their values between layouts through shared memory (sm_80's forward:
    119 -> 55 shared-memory instructions and 10 -> 6 barriers a warp and tile, docs/kernels.md)."""
    return tl.load(_mirrored_bucket_ptrs(MIRROR, d0, offs_m, offs_n))


@triton.jit
def _dense_terms(C2P, P2C, buckets, i0, j0, offs_m, offs_n, seq_len, HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr,
                 TWO_SPAN: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The present terms of a general tile read from the dense products (:func:`dense_scores`) at its scores'
    buckets (:func:`_score_buckets`), as loaded (the input dtype, not yet converted: a loop may carry them to the
    next tile, ``Tiles.values_ahead``): ``(C2P[i, bucket(i - j)],)`` and / or ``(P2C[j, bucket(i - j)],)``
    (``C2P``, ``P2C``: the sequence's row 0), laid out as ``buckets``; nothing read past the sequence."""
    rows, cols = i0 + offs_m, j0 + offs_n
    if TRANSPOSED:
        ok = (cols < seq_len)[:, None] & (rows < seq_len)[None, :]
        row_at, col_at = rows[None, :], cols[:, None]
    else:
        ok = (rows < seq_len)[:, None] & (cols < seq_len)[None, :]
        row_at, col_at = rows[:, None], cols[None, :]
    terms = ()
    if HAS_C2P:
        terms = terms + (tl.load(C2P + row_at * TWO_SPAN + buckets, mask=ok, other=0.0),)
    if HAS_P2C:
        terms = terms + (tl.load(P2C + col_at * TWO_SPAN + buckets, mask=ok, other=0.0),)
    return terms


@triton.jit
def _terms_ahead(dense, TABLE, MIRROR, buckets, i0, j0, d_after, needed, offs_m, offs_n, seq_len,
                 HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, TWO_SPAN: tl.constexpr, TRANSPOSED: tl.constexpr):
    """``Tiles.values_ahead``: the terms of tile ``(i0, j0)`` gathered at ``buckets`` (:func:`_dense_terms`,
    ``dense``: the sequence's rows of ``C2P`` and ``P2C``), and the buckets of the tile after it (``i0 - j0 =
    d_after``, if ``needed``: :func:`_buckets_ahead`), read now for the gathers one tile later."""
    terms = _dense_terms(dense[0], dense[1], buckets, i0, j0, offs_m, offs_n, seq_len, HAS_C2P, HAS_P2C, TWO_SPAN,
                         TRANSPOSED)
    return terms, _buckets_ahead(TABLE, MIRROR, d_after, offs_m, offs_n, needed, TRANSPOSED)


@triton.jit
def _terms_sum(terms, HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr):
    """c2p + p2c in float32 from :func:`_dense_terms`."""
    if HAS_C2P and HAS_P2C:
        total = terms[0].to(tl.float32) + terms[1].to(tl.float32)
    else:
        total = terms[0].to(tl.float32)
    return total


@triton.jit
def _dense_bias(C2P, P2C, buckets, i0, j0, offs_m, offs_n, seq_len, HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr,
                TWO_SPAN: tl.constexpr, TRANSPOSED: tl.constexpr):
    """c2p + p2c of a general tile read from the dense products at its scores' buckets (:func:`_dense_terms`),
    float32."""
    return _terms_sum(_dense_terms(C2P, P2C, buckets, i0, j0, offs_m, offs_n, seq_len, HAS_C2P, HAS_P2C, TWO_SPAN,
                                   TRANSPOSED), HAS_C2P, HAS_P2C)


@triton.jit
def _zero_outside(dense, rows_ok, b_first, b_last, TWO_SPAN: tl.constexpr, CHUNK: tl.constexpr):
    """Zero a block's rows of a dense buffer (``dense``: its first row; ``rows_ok``: the rows in the sequence) in
    the buckets its band chunks do not write, those before ``b_first`` and after ``b_last``, ``CHUNK`` buckets at a
    time. The buffer is ``torch.empty``: a zero-fill launch wrote all of it to HBM once more (201 MB a buffer at
    B = 32, N = 512, bf16), and zeroing every bucket before the chunks wrote most of them twice. Every row is some
    block's (a padded sequence's rows run to ``N``, its padding rows included; a packed one's to its length), so
    every row is written. The chunks' buckets are disjoint from these: no barrier between them."""
    offs_r, offs_c = tl.arange(0, rows_ok.shape[0]), tl.arange(0, CHUNK)
    zeros = tl.zeros([rows_ok.shape[0], CHUNK], tl.float32).to(dense.dtype.element_ty)
    written = b_last + 1 - b_first
    for c0 in range(0, TWO_SPAN - written, CHUNK):  # the buckets outside, as one run: those past b_last moved down
        cols = c0 + offs_c
        cols = tl.where(cols < b_first, cols, cols + written)
        tl.store(dense + offs_r[:, None] * TWO_SPAN + cols[None, :], zeros,
                 mask=rows_ok[:, None] & (cols < TWO_SPAN)[None, :])


@triton.jit
def _joined_column(dense, at, rows_ok, offs_r, TWO_SPAN: tl.constexpr):
    """What the previous band chunk wrote to the block's rows in bucket ``at`` (per row, all equal), the chunk's
    first, where it was that chunk's last (``planning.band_folds``), else (``at`` -1) zeros."""
    return tl.load(dense + offs_r * TWO_SPAN + at, mask=rows_ok & (at >= 0), other=0.0).to(tl.float32)


@triton.jit
def _store_buckets(dense, merged, joined, b_lo, count, rows_ok, offs_r, offs_c, TWO_SPAN: tl.constexpr):
    """Write a band chunk's merged columns (``merged[r, c]``: bucket ``b_lo + c``, ``count`` of them) to the block's
    rows of the dense buffer, its first bucket plus what the previous chunk wrote there (``joined``,
    :func:`_joined_column`), then a barrier (the next chunk may read that bucket). Every other bucket is written
    once, with no read of the buffer."""
    merged += tl.where(offs_c[None, :] == 0, joined[:, None], 0.0)
    tl.store(dense + offs_r[:, None] * TWO_SPAN + (b_lo + offs_c)[None, :], merged.to(dense.dtype.element_ty),
             mask=rows_ok[:, None] & (offs_c < count)[None, :])
    tl.debug_barrier()


@triton.jit
def _add_end_sums(dense, sums_lo, sums_hi, rows_ok, offs_r, TWO_SPAN: tl.constexpr):
    """The saturated tiles' ``dS`` row (or column) sums of a block into its buffer rows' buckets 0 and
    ``2k - 1``, after a barrier: other warps wrote those buckets (zeros or a band chunk's)."""
    tl.debug_barrier()
    lo = dense + offs_r * TWO_SPAN
    hi = lo + (TWO_SPAN - 1)
    tl.store(lo, (tl.load(lo, mask=rows_ok, other=0.0).to(tl.float32) + sums_lo).to(dense.dtype.element_ty),
             mask=rows_ok)
    tl.store(hi, (tl.load(hi, mask=rows_ok, other=0.0).to(tl.float32) + sums_hi).to(dense.dtype.element_ty),
             mask=rows_ok)


def dense_strides(problem) -> tuple[int, int, int]:
    """``(rows, sequence stride, head stride)`` of a head-major dense buffer ``[H, rows, 2k]`` for ``problem``:
    padded, a sequence's rows follow the previous one's (``N`` apart); packed, the rows are the tokens."""
    rows = problem.stat_numel // problem.n_heads
    return rows, (problem.n_ctx if problem.stat_strides[0] else 0), rows


def dense_buffer(problem, q: torch.Tensor) -> torch.Tensor:
    """An ``[H, rows, 2k]`` score-gradient buffer in ``q``'s dtype, not zeroed: each backward block zeroes its own
    rows (:func:`_zero_outside`, :func:`_store_buckets`), so buckets no distance of a row reaches are 0."""
    rows = dense_strides(problem)[0]
    return torch.empty((problem.n_heads, rows, problem.two_span), dtype=q.dtype, device=q.device)


def _by_head(x: torch.Tensor) -> torch.Tensor:
    """``[H, rows, d]``: ``x`` padded ``[B, H, N, d]`` (a view of a model's ``[B, N, H*d]`` projection, whose
    sequences' rows are one stride apart; a copy of a contiguous one, whose are not) or packed ``[total, H, d]``
    (a view, each row ``H x d`` apart)."""
    if x.dim() == 4:
        return x.transpose(0, 1).reshape(x.shape[1], -1, x.shape[-1])
    return x.transpose(0, 1)


class HeadMajor:
    """Q and K as ``[H, rows, d]`` GEMM operands, each made on first use and kept: for a caller's contiguous
    ``[B, H, N, d]`` making one is a copy of the whole tensor, and a backward with both dense designs reads each
    twice (the recomputed scores, then the position gradients), so it is made once."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor):
        self.inputs = q, k

    @functools.cached_property
    def q(self) -> torch.Tensor:
        return _by_head(self.inputs[0])

    @functools.cached_property
    def k(self) -> torch.Tensor:
        return _by_head(self.inputs[1])


def dense_scores(heads: HeadMajor, pos_key: torch.Tensor | None,
                 pos_query: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(C2P, P2C)``: ``Q Kr^T`` and ``K Qr^T`` per head, ``[H, rows, 2k]`` in the inputs' dtype (cuBLAS
    accumulates in float32); the input ``q`` stands in for a term that is off (never read)."""
    stand_in = heads.inputs[0]
    c2p = stand_in if pos_key is None else torch.bmm(heads.q, pos_key.transpose(1, 2))
    p2c = stand_in if pos_query is None else torch.bmm(heads.k, pos_query.transpose(1, 2))
    return c2p, p2c


def position_gradients(d_scores: torch.Tensor, own: torch.Tensor, table: torch.Tensor,
                       grad_own: torch.Tensor) -> torch.Tensor:
    """One position term's gradients from its dense score gradient ``d_scores`` (``[H, rows, 2k]``): adds
    ``d_scores @ table`` to ``grad_own`` (dQ with Kr, or dK with Qr) and returns the table's gradient
    ``d_scores^T @ own`` (``[H, 2k, d]``, the sequences summed inside the GEMM's reduction; ``own`` head-major,
    :class:`HeadMajor`)."""
    by_head = grad_own.transpose(0, 1)
    rows = d_scores.shape[1]
    if _merges(by_head):  # the model's layouts: the GEMM accumulates into dQ (dK) itself, no separate sum pass
        by_head.view(by_head.shape[0], rows, by_head.shape[-1]).baddbmm_(d_scores, table)
    else:  # contiguous [B, H, N, d]: the sequences' rows are not one stride apart
        by_head.add_(torch.bmm(d_scores, table).view(by_head.shape))
    return torch.bmm(d_scores.transpose(1, 2), own)


def _merges(by_head: torch.Tensor) -> bool:
    """Whether ``[H, B, N, d]`` views as ``[H, B * N, d]`` (a sequence's rows follow the previous one's, as in a
    ``[B, N, H * d]`` projection's view); a packed ``[H, T, d]`` always does."""
    return by_head.dim() == 3 or by_head.stride(1) == by_head.shape[2] * by_head.stride(2)
