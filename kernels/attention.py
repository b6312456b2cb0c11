"""Fused DeBERTa disentangled attention in Triton: flash-style forward, deterministic backward.

Scores of a tile of ``BLOCK_M`` query rows (``i0 + a``) and ``BLOCK_N`` key columns (``j0 + b``) are
``(Q K^T + c2p + p2c) * scale`` with ``c2p[a, b] = Q_a . Kr[idx(i, j)]`` and ``p2c[a, b] = K_b . Qr[idx(i, j)]``.
The distances ``i - j`` of a tile form one *window* of ``BLOCK_M + BLOCK_N - 1`` values starting at
``r0 = i0 - j0 - (BLOCK_N - 1)``; window column ``c = a - b + BLOCK_N - 1``. A tile takes one of two paths:

* **saturated** (every distance of the window in bucket 0 or in the top bucket ``2k - 1``: far from the
  diagonal, most tiles at long N): c2p is one value per query row and p2c one per key column. Those
  values, ``Q_i . Kr[end]`` and ``K_j . Qr[end]`` for both ends, are computed once per token by
  ``_attn_end_terms`` (the ``END`` tensor), so the tile adds two vectors to ``Q K^T``. The host launches it
  only when some tile can saturate (``_Problem.saturates``; none does at 512 tokens with v3's settings).
* **general**: ``X = Q @ Kr[bucket(r0 + c)]^T`` (``[BLOCK_M, WINDOW]``, one table row per window
  distance, gathered by the bucket table) and ``Y = K @ Qr[bucket(r0 + c)]^T`` on tensor cores, written
  to the program's scratch buffer and read back *skewed*: score ``(a, b)`` reads ``X[a, a - b + BN - 1]``
  (address ``a * (WINDOW + 1) - b + BN - 1``) and ``Y[b, a - b + BN - 1]`` (``b * (WINDOW - 1) + a + BN - 1``).
  The skew is one store and one load per element, affine addresses, no per-element index arithmetic;
  Triton's register gather (``tl.gather``) costs about 30 instructions per element here (docs/kernels.md).

Backward (no atomics, deterministic): ``_attn_bwd_delta`` (``rowsum(dO * O)``), then two kernels that
recompute the scores: ``_attn_bwd_dq`` (query blocks: ``dQ`` and the c2p table gradient ``dKr``) and
``_attn_bwd_dkdv`` (key blocks, the tile held transposed: ``dK``, ``dV`` and the p2c gradient ``dQr``).
A position gradient needs ``dS`` in distance coordinates: each general tile stores its ``dS`` into a
per-program *band* (row, distance) with the same affine skew; after the tile loop of a block, the band
is read in chunks of distances whose buckets are contiguous: ``merged = band @ one_hot`` adds the distances
that share a bucket (the identity where they are one-to-one), then ``dQ += merged @ Kr[b .. b + CHUNK)`` and
``dKr[b ..] += merged^T @ Q``. Saturated tiles add their ``dS`` row sums (column sums for p2c) into two
accumulators per block, turned into rank-1 updates once per block. A program walks a run of (sequence,
block) items of one head and keeps one float32 ``[2k, d]`` partial of its head; ``torch.sum`` adds the
partials in a fixed order. Programs, partials and scratch are sized to a budget (``PARTIAL_BUDGET``).

Optional features are ``tl.constexpr`` specialisations: ``SCALE_PER_SEQ`` (one softmax scale per
sequence), ``MASK_DIAGONAL`` (``i != j``, tested only on tiles that meet the diagonal), ``VARLEN``.
A row left without keys gets ``lse = +inf`` and output 0, hence ``P = 0`` and ``dS = 0`` in backward.

Dropout keeps ``(i, j)`` iff a 32-bit integer hash of ``(seed + b*H + h, i * N + j)`` is at least
``p * 2**32``: under ten integer instructions per score (Philox costs ~55), regenerated in backward, never
stored.
Tile sizes per kernel, head dim and target are chosen so every configuration compiles without
register spills (``compile_check``); the static speed figures are read by ``static_perf`` and
``benchmarks/attention_judge.py``; design notes: ``docs/kernels.md``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .contract import TRITON_HEAD_DIMS, AttentionCall, attention_op, dropout_seed, varlen_attention_op
from .relative_position import attention_span, bucket_table

# Largest value a 32-bit in-kernel offset may take (see check_offsets_fit_int32).
INT32_MAX = 2**31 - 1
LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E)


# --------------------------------------------------------------------------- tile helpers


@triton.jit
def _locate(CU, seq, head, n_ctx, stride_b, stride_h, stride_n, stride_lb, stride_lh,
            TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, VARLEN: tl.constexpr):
    """Where (sequence ``seq``, head ``head``) lives: its length, the int64 offset of its first
    token in q/k/v/o (``base``), the offset of the head's ``[2*span, d]`` position table and the
    int64 offset of its first row statistic (lse / delta / end terms). Offsets inside one sequence stay
    32-bit (the host checks they fit)."""
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
def _load_stat(ptr, row0, offs_r, seq_len, other):
    """Row statistics ``row0 + offs_r`` (float32, ``other`` past the sequence's end)."""
    rows = row0 + offs_r
    return tl.load(ptr + rows, mask=rows < seq_len, other=other)


@triton.jit
def _saturated(table_row, TWO_SPAN: tl.constexpr):
    """Whether the tile whose table reads are ``table_row`` (:func:`_table_ahead`) lies wholly in bucket 0 or in
    the top bucket (the table is monotone: its window's two end buckets decide), and whether that end is the
    top."""
    t_lo, t_hi, _ = table_row
    return (t_lo == t_hi) & ((t_lo == 0) | (t_lo == TWO_SPAN - 1)), t_lo != 0


@triton.jit
def _end_bias(END, stat_off, stat_numel, i0, j0, offs_m, offs_n, seq_len, top, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, TRANSPOSED: tl.constexpr):
    """c2p + p2c of a saturated tile from the per-token end terms: ``END[0 | 1]`` (Q . Kr[0 | top]) of its
    query rows plus ``END[2 | 3]`` (K . Qr[0 | top]) of its key columns; ``[BM, BN]``, or ``[BN, BM]``
    when ``TRANSPOSED``."""
    c = tl.zeros([BLOCK_M], tl.float32)
    p = tl.zeros([BLOCK_N], tl.float32)
    end = tl.where(top, 1, 0).to(tl.int64)  # ``top`` may be a tensor or a constant
    if HAS_C2P:
        c = _load_stat(END + end * stat_numel + stat_off, i0, offs_m, seq_len, 0.0)
    if HAS_P2C:
        p = _load_stat(END + (2 + end) * stat_numel + stat_off, j0, offs_n, seq_len, 0.0)
    if TRANSPOSED:
        bias = p[:, None] + c[None, :]
    else:
        bias = c[:, None] + p[None, :]
    return bias


@triton.jit
def _position_rows(ptr, buckets, offs_d, HEAD_DIM: tl.constexpr):
    """``[len(buckets), d]``: the rows of one head's position table (``Kr`` or ``Qr``) that ``buckets`` name."""
    return tl.load(ptr + buckets[:, None] * HEAD_DIM + offs_d[None, :])


@triton.jit
def _window_buckets(table_ptr, r0, WINDOW: tl.constexpr, SPLIT: tl.constexpr):
    """The buckets of the window's distances ``r0 .. r0 + WINDOW - 1``, as a tuple of ``SPLIT`` column slices."""
    buckets = ()
    for h in tl.static_range(SPLIT):
        buckets = buckets + (tl.load(table_ptr + r0 + h * (WINDOW // SPLIT) + tl.arange(0, WINDOW // SPLIT)),)
    return buckets


@triton.jit
def _path_ends(table_ptr, r0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The two end buckets of the window starting at distance ``r0``: they decide the tile's path."""
    return tl.load(table_ptr + r0), tl.load(table_ptr + r0 + BLOCK_M + BLOCK_N - 2)


@triton.jit
def _table_ahead(table_ptr, ahead, r0, step, AHEAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 WINDOW: tl.constexpr, SPLIT: tl.constexpr):
    """``((t_lo, t_hi, window buckets), what the loop carries)``: this tile's table reads in a loop whose next
    tile's window starts ``step`` further. With ``AHEAD`` the two end buckets (the path test) come from
    ``ahead`` (:func:`_path_ends`), read a tile earlier, and
    the window's buckets are read at the tile's start, so the row gathers no longer wait behind the path test
    (reading them a tile ahead too spilled); ``ahead`` gets the next tile's ends (the table reaches a tile past
    either end). Without it the ends are read now and the products read their buckets slice by slice."""
    if AHEAD:
        current = (ahead[0], ahead[1], _window_buckets(table_ptr, r0, WINDOW, SPLIT))
        ahead = _path_ends(table_ptr, r0 + step, BLOCK_M, BLOCK_N)
    else:  # no window buckets: the products load them slice by slice
        t_lo, t_hi = _path_ends(table_ptr, r0, BLOCK_M, BLOCK_N)
        current = (t_lo, t_hi, ())
    return current, ahead


@triton.jit
def _term_rows(ptr, buckets, offs_d, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, HAS_TERM: tl.constexpr):
    """One term's window rows (``Kr`` or ``Qr`` at the window's buckets) as a tuple of ``SPLIT`` column slices
    ``[WINDOW / SPLIT, d]``; empty when the term is off."""
    rows = ()
    if HAS_TERM:
        for h in tl.static_range(SPLIT):
            rows = rows + (_position_rows(ptr, buckets[h], offs_d, HEAD_DIM),)
    return rows


@triton.jit
def _window_rows(KR, QR, buckets, offs_d, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, HAS_C2P: tl.constexpr,
                 HAS_P2C: tl.constexpr, C2P_LAST: tl.constexpr):
    """The position rows of a window, ``Krw[c] = Kr[bucket(r0 + c)]`` and ``Qrw`` alike (:func:`_term_rows`),
    from its buckets (:func:`_window_buckets`). One term's rows are loaded after the other's: ``C2P_LAST`` when
    the query side has fewer than 64 rows. That term's product is an ``mma.sync`` whose row operand is
    converted through shared memory, behind a barrier, right after its load; a load after that barrier cannot
    be issued before it, so the other term's rows go first."""
    if C2P_LAST:
        qrw = _term_rows(QR, buckets, offs_d, HEAD_DIM, SPLIT, HAS_P2C)
        krw = _term_rows(KR, buckets, offs_d, HEAD_DIM, SPLIT, HAS_C2P)
    else:
        krw = _term_rows(KR, buckets, offs_d, HEAD_DIM, SPLIT, HAS_C2P)
        qrw = _term_rows(QR, buckets, offs_d, HEAD_DIM, SPLIT, HAS_P2C)
    return krw, qrw


@triton.jit
def _window_product(a, rows, scratch, row0, offs_r, cols, WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    """One column slice of one window product, ``a rows^T``, stored at ``scratch`` rows ``row0 + offs_r``."""
    x = tl.dot(a, tl.trans(rows), input_precision=PRECISION)
    tl.store(scratch + (row0 + offs_r[:, None]) * WINDOW + cols[None, :], x.to(scratch.dtype.element_ty))


@triton.jit
def _store_window_products(q, k, krw, qrw, scratch, offs_m, offs_n, BLOCK_M: tl.constexpr, WINDOW: tl.constexpr,
                           SPLIT: tl.constexpr, HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr,
                           PRECISION: tl.constexpr):
    """``X = Q Krw^T`` and ``Y = K Qrw^T`` of a general tile from its window rows (:func:`_window_rows`), into
    ``scratch`` (``[BM + BN, WINDOW]``) for :func:`_skewed_read`."""
    for h in tl.static_range(SPLIT):
        cols = h * (WINDOW // SPLIT) + tl.arange(0, WINDOW // SPLIT)
        if HAS_C2P:
            _window_product(q, krw[h], scratch, 0, offs_m, cols, WINDOW, PRECISION)
        if HAS_P2C:
            _window_product(k, qrw[h], scratch, BLOCK_M, offs_n, cols, WINDOW, PRECISION)


@triton.jit
def _window_products(q, k, KR, QR, table_ptr, r0, buckets, scratch, offs_m, offs_n, offs_d, HOIST: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, WINDOW: tl.constexpr, SPLIT: tl.constexpr,
                     HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, PRECISION: tl.constexpr):
    """A general tile's window products into ``scratch``, computed in ``SPLIT`` column slices to bound
    registers. With ``HOIST`` every slice's rows are loaded before any product: a load issued after a
    scratch store cannot be moved above it (they may alias), so loading between the stores puts the round
    trips one after another. Without it, each row block is loaded just before its product (fewest live
    registers)."""
    if HOIST:
        krw, qrw = _window_rows(KR, QR, buckets, offs_d, HEAD_DIM, SPLIT, HAS_C2P, HAS_P2C, BLOCK_M < 64)
        _store_window_products(q, k, krw, qrw, scratch, offs_m, offs_n, BLOCK_M, WINDOW, SPLIT, HAS_C2P, HAS_P2C,
                               PRECISION)
    else:
        for h in tl.static_range(SPLIT):
            cols = h * (WINDOW // SPLIT) + tl.arange(0, WINDOW // SPLIT)
            slice_buckets = tl.load(table_ptr + r0 + cols)
            if HAS_C2P:
                _window_product(q, _position_rows(KR, slice_buckets, offs_d, HEAD_DIM), scratch, 0, offs_m, cols,
                                WINDOW, PRECISION)
            if HAS_P2C:
                _window_product(k, _position_rows(QR, slice_buckets, offs_d, HEAD_DIM), scratch, BLOCK_M, offs_n,
                                cols, WINDOW, PRECISION)


@triton.jit
def _skewed_read(scratch, offs_m, offs_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
                 HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, TRANSPOSED: tl.constexpr):
    """c2p + p2c of a general tile (``[BM, BN]``, or ``[BN, BM]`` when ``TRANSPOSED``): the window products
    in ``scratch`` read back skewed. The barrier makes every warp's stores visible before any warp reads;
    the caller alternates two scratch buffers so the next tile's stores never race this tile's loads."""
    tl.debug_barrier()
    rows = offs_m[:, None]
    cols = offs_n[None, :]
    if TRANSPOSED:
        rows = offs_m[None, :]
        cols = offs_n[:, None]
    bias = tl.zeros(rows.shape, tl.float32) + tl.zeros(cols.shape, tl.float32)
    if HAS_C2P:
        bias += tl.load(scratch + rows * (WINDOW + 1) - cols + (BLOCK_N - 1)).to(tl.float32)
    if HAS_P2C:
        bias += tl.load(scratch + BLOCK_M * WINDOW + cols * (WINDOW - 1) + rows + (BLOCK_N - 1)).to(tl.float32)
    return bias


@triton.jit
def _mask_words(mask_ptr, idx0, limit, SIZE: tl.constexpr, HAS_MASK: tl.constexpr):
    """The padding-mask bits of tokens ``idx0 .. idx0 + SIZE - 1`` (``SIZE`` <= 64 dividing 64, ``idx0`` a multiple
    of ``SIZE``): one scalar load of a 32-bit word per 32 tokens (the host packs the mask: :func:`mask_bits`).
    Reading the mask's bytes took one load per pair of columns a thread holds, each consumed before the next
    (ptxas reuses their registers). Nothing is read at or past ``limit``, nor without a mask."""
    lo = 0
    hi = 0
    if HAS_MASK:
        ok = idx0 < limit
        lo = tl.load(mask_ptr + idx0 // 32, mask=ok, other=0)
        hi = lo
        if SIZE > 32:
            hi = tl.load(mask_ptr + idx0 // 32 + 1, mask=ok, other=0)
    return lo, hi


@triton.jit
def _mask_stride(n_ctx):
    """Words per sequence of the packed padding mask (``mask_bits``): one per 32 tokens, and one more."""
    return (n_ctx + 31) // 32 + 1


@triton.jit
def _word_bits(words, idx0, offs, SIZE: tl.constexpr):
    """Whether tokens ``idx0 + offs`` are set in their mask words (:func:`_mask_words`). A block of 32 or 64
    starts a word, so a token's bit is its offset's (constants the compiler folds into the shifts)."""
    lo, hi = words
    word = lo
    if SIZE > 32:
        word = tl.where(offs < 32, lo, hi)
    if SIZE >= 32:
        bit = offs % 32
    else:
        bit = idx0 % 32 + offs
    return ((word >> bit) & 1) != 0


@triton.jit
def _words_visible(words, idx0, offs, limit, SIZE: tl.constexpr, HAS_MASK: tl.constexpr):
    """Which tokens ``idx0 + offs`` are real: before ``limit`` and set in the mask's words (:func:`_mask_words`)."""
    idx = idx0 + offs
    ok = idx < limit
    if HAS_MASK:
        ok &= _word_bits(words, idx0, offs, SIZE)
    return ok


@triton.jit
def _side_visible(mask_ptr, idx0, offs, limit, SIZE: tl.constexpr, HAS_MASK: tl.constexpr):
    """Which tokens ``idx0 + offs`` of one side of a tile are real (:func:`_words_visible`), words read now."""
    return _words_visible(_mask_words(mask_ptr, idx0, limit, SIZE, HAS_MASK), idx0, offs, limit, SIZE, HAS_MASK)


@triton.jit
def _off_diagonal(visible, i0, j0, offs_m, offs_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  TRANSPOSED: tl.constexpr):
    """``visible`` without the pairs ``i == j``. Query-block tiles (the forward's, dq's) test every tile: a pair is
    on the diagonal when ``a - b == j0 - i0``, each element comparing its own constant offset difference with one
    scalar (a branch on the tiles that meet the diagonal kept their visibility live across it and spilled).
    Key-block tiles (dk/dv's, transposed) test only the tiles that meet it, by their indices (the other forms
    spilled there). Each choice is the one that compiles without spills in every configuration."""
    if TRANSPOSED:  # the backward's key blocks: on the tiles that meet the diagonal only (else they spilled)
        if (i0 < j0 + BLOCK_N) & (j0 < i0 + BLOCK_M):
            visible = visible & ((j0 + offs_n)[:, None] != (i0 + offs_m)[None, :])
    else:
        visible = visible & ((offs_m[:, None] - offs_n[None, :]) != j0 - i0)
    return visible


@triton.jit
def _pair_visible(row_ok, col_ok, i0, j0, offs_m, offs_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASK_DIAGONAL: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Visible pairs of a tile from its two sides' visibility; under ``MASK_DIAGONAL`` also ``i != j``
    (:func:`_off_diagonal`)."""
    if TRANSPOSED:
        visible = col_ok[:, None] & row_ok[None, :]
    else:
        visible = row_ok[:, None] & col_ok[None, :]
    if MASK_DIAGONAL:
        visible = _off_diagonal(visible, i0, j0, offs_m, offs_n, BLOCK_M, BLOCK_N, TRANSPOSED)
    return visible


@triton.jit
def _visible(row_words, col_words, i0, j0, offs_m, offs_n, seq_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             HAS_MASK: tl.constexpr, MASK_DIAGONAL: tl.constexpr, TRANSPOSED: tl.constexpr, ROWS: tl.constexpr):
    """Visible pairs of a tile from the mask words of its sides: its keys real; with ``ROWS`` its query rows
    too (the backward needs no query side: a query row with nothing visible has ``lse = +inf``, so its ``P``
    and ``dS`` are 0 whatever its scores); under ``MASK_DIAGONAL`` also ``i != j``, tested only on the tiles
    whose rectangle meets the diagonal (a uniform scalar branch)."""
    col_ok = (j0 + offs_n) < seq_len
    if HAS_MASK:
        col_ok &= _word_bits(col_words, j0, offs_n, BLOCK_N)
    if ROWS:
        row_ok = (i0 + offs_m) < seq_len
        if HAS_MASK:
            row_ok &= _word_bits(row_words, i0, offs_m, BLOCK_M)
    else:
        row_ok = tl.full([BLOCK_M], 1, tl.int1)
    if TRANSPOSED:
        visible = col_ok[:, None] & row_ok[None, :]
    else:
        visible = row_ok[:, None] & col_ok[None, :]
    if MASK_DIAGONAL:
        visible = _off_diagonal(visible, i0, j0, offs_m, offs_n, BLOCK_M, BLOCK_N, TRANSPOSED)
    return visible


@triton.jit
def _sequence_scale(SCALES, seq, scale, SCALE_PER_SEQ: tl.constexpr):
    """The softmax scale of sequence ``seq``: its entry of ``SCALES`` (float32 [num_seqs]) or the one float."""
    seq_scale = scale
    if SCALE_PER_SEQ:
        seq_scale = tl.load(SCALES + seq)
    return seq_scale


@triton.jit
def _mix32(x):
    """A 32-bit integer hash with full avalanche (Wellons' "lowbias32"): 2 multiplies, 3 xor-shifts."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def _dropout_keep(seed, i0, j0, n_ctx, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  TRANSPOSED: tl.constexpr):
    """Keep bits of tile ``(i0, j0)``: ``(i, j)`` keeps iff ``mix32((i * n + j) ^ mix32(seed)) >= p * 2**32``.
    A pure function of ``(seed, i, j)``, so forward and both backward kernels, whatever their tiles, draw
    the same bits. ``[BM, BN]``, or ``[BN, BM]`` when ``TRANSPOSED``."""
    rows = i0 + tl.arange(0, BLOCK_M)
    cols = j0 + tl.arange(0, BLOCK_N)
    if TRANSPOSED:
        counter = cols[:, None] + rows[None, :] * n_ctx
    else:
        counter = rows[:, None] * n_ctx + cols[None, :]
    key = _mix32(seed.to(tl.uint32))
    threshold = (tl.zeros([], tl.float32) + dropout_p * 4294967296.0).to(tl.uint32)
    return _mix32(counter.to(tl.uint32) ^ key) >= threshold


# A tile's path: where its c2p + p2c come from (a loop that walks one path only makes it a constant).
CONTENT = tl.constexpr(0)    # no position terms
GENERAL = tl.constexpr(1)    # window products read back skewed
SATURATED = tl.constexpr(2)  # wholly in bucket 0 or the top bucket: end terms
PER_TILE = tl.constexpr(3)   # any of the above, read per tile from the bucket table


@triton.jit
def _tile_scores(q, k, KR, QR, table_ptr, table_row, mask_ptr, keys, END, scratch, stat_off, stat_numel, i0, j0,
                 seq_len, scale, offs_m, offs_n, offs_d, general,
                 TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 WINDOW: tl.constexpr, SPLIT: tl.constexpr, HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr,
                 HAS_MASK: tl.constexpr, MASK_DIAGONAL: tl.constexpr, TRANSPOSED: tl.constexpr,
                 HOIST: tl.constexpr, ROWS: tl.constexpr, PRECISION: tl.constexpr):
    """Scores of tile ``(i0, j0)`` times ``scale * log2(e)`` (``-inf`` where not visible, whatever the scale:
    a scale of 0 must not make ``-inf * 0``), whether it is saturated and at which end (read per tile from
    the bucket table), and the count of general tiles so far (it picks the scratch buffer). ``keys``: the tile's
    keys' padding-mask words (:func:`_mask_words`, read at the tile's start) or, when ``TRANSPOSED`` (a key block),
    their visibility (read once per block). Query rows are tested only with ``ROWS`` (the forward; the backward
    needs no query side, :func:`_visible`), and then both sides' words are read here, after the products (read
    at the tile's start, they spilled at d = 128 on sm_90)."""
    if TRANSPOSED:
        s = tl.dot(k, tl.trans(q), input_precision=PRECISION)
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    saturated, top = _saturated(table_row, TWO_SPAN)
    if HAS_C2P or HAS_P2C:
        if saturated:
            s += _end_bias(END, stat_off, stat_numel, i0, j0, offs_m, offs_n, seq_len, top, BLOCK_M, BLOCK_N,
                           HAS_C2P, HAS_P2C, TRANSPOSED)
        else:
            buffer = scratch + (general % 2) * ((BLOCK_M + BLOCK_N) * WINDOW)
            _window_products(q, k, KR, QR, table_ptr, i0 - j0 - (BLOCK_N - 1), table_row[2], buffer, offs_m, offs_n,
                             offs_d, HOIST, HEAD_DIM, BLOCK_M, WINDOW, SPLIT, HAS_C2P, HAS_P2C, PRECISION)
            s += _skewed_read(buffer, offs_m, offs_n, BLOCK_M, BLOCK_N, WINDOW, HAS_C2P, HAS_P2C, TRANSPOSED)
            general += 1
    row_words = (0, 0)
    if ROWS:
        row_words = _mask_words(mask_ptr, i0, seq_len, BLOCK_M, HAS_MASK)
    if TRANSPOSED:  # the block's keys: their visibility came with the block
        visible = _pair_visible(tl.full([BLOCK_M], 1, tl.int1), keys, i0, j0, offs_m, offs_n, BLOCK_M, BLOCK_N,
                                MASK_DIAGONAL, True)
    else:
        if ROWS:  # the one-loop forward: both sides' words read here, after the products
            keys = _mask_words(mask_ptr, j0, seq_len, BLOCK_N, HAS_MASK)
        visible = _visible(row_words, keys, i0, j0, offs_m, offs_n, seq_len, BLOCK_M, BLOCK_N, HAS_MASK,
                           MASK_DIAGONAL, False, ROWS)
    return tl.where(visible, s * (scale * LOG2E), float("-inf")), saturated, top, general


@triton.jit
def _store_band(band, ds, r0, lo, offs_m, offs_n, BAND: tl.constexpr, BLOCK_N: tl.constexpr,
                TRANSPOSED: tl.constexpr):
    """Write a general tile's ``dS`` into the band in distance coordinates: row ``a`` (query) or ``b`` (key,
    ``TRANSPOSED``), column ``r0 + c - lo`` for window column ``c = a - b + BN - 1``."""
    shift = r0 - lo + (BLOCK_N - 1)
    if TRANSPOSED:  # ds is [BN, BM]: key b, query a at b * BAND + shift + a - b
        tl.store(band + shift + offs_n[:, None] * (BAND - 1) + offs_m[None, :], ds)
    else:
        tl.store(band + shift + offs_m[:, None] * (BAND + 1) - offs_n[None, :], ds)


@triton.jit
def _accumulate_row(row_ptr, offs_d, row_grad):
    """``part[t] += row_grad`` for one bucket of this program's own partial buffer. The barrier (``bar.sync``)
    makes the stores visible to every warp before the next read-modify-write, which may touch the row."""
    tl.store(row_ptr + offs_d, tl.load(row_ptr + offs_d) + row_grad)
    tl.debug_barrier()


@triton.jit
def _band_gradients(acc, own, band, rel_ptr, part_ptr, fold_ptr, merge_ptr, lo, fold_lo, block0, d_lo, d_hi, first,
                    last, offs_r, offs_d, HEAD_DIM: tl.constexpr, BAND: tl.constexpr,
                    CHUNK: tl.constexpr, OTHER: tl.constexpr, SIGN: tl.constexpr, PRECISION: tl.constexpr):
    """One position term's gradients from a block's band (distances ``d_lo..d_hi`` of its general tiles):
    ``acc[r] += sum_dist band[r, dist] rel[bucket(dist)]`` and
    ``part[t] += sum_{bucket(dist) = t} band[:, dist]^T own``; the band starts at distance ``lo``.

    Band row ``r`` is token ``block0 + r`` of the program's own side; its partner at distance ``dist`` is
    token ``block0 + r - SIGN * dist`` (``SIGN`` 1 for queries, -1 for keys), valid when it lies in a
    general tile (``first .. last + OTHER``). Distances go in chunks of ``CHUNK`` aligned to ``fold_lo``; a
    chunk's buckets are contiguous (its first bucket and count in ``fold_ptr``, read a chunk ahead), and its
    one-hot ``[distance, bucket]`` matrix (``merge_ptr``; both precomputed on the host by ``band_folds``)
    merges its columns into bucket columns: ``merged = band_chunk @ one_hot``, then ``acc += merged rel[b..]``
    and ``part[b..] += merged^T own``. Every load of a chunk then depends only on the loop index and the
    bucket read a chunk before, so its round trips overlap instead of following one another (bucket table,
    then gathered rows; bucket count, then one-hot; first bucket, then partials).
    """
    offs_c = tl.arange(0, CHUNK)
    d_hi = tl.where(last >= first, d_hi, d_lo - 1)  # no general tile: nothing to read
    c_start = fold_lo + (d_lo - fold_lo) // CHUNK * CHUNK
    fold = fold_ptr + 2 * ((c_start - fold_lo) // CHUNK)
    b_lo = tl.load(fold, mask=c_start <= d_hi, other=0)
    count = tl.load(fold + 1, mask=c_start <= d_hi, other=0)
    for c0 in range(c_start, d_hi + 1, CHUNK):
        dist = c0 + offs_c
        partner = (block0 + offs_r)[:, None] - SIGN * dist[None, :]
        ok = (partner >= first) & (partner < last + OTHER) & ((dist >= d_lo) & (dist <= d_hi))[None, :]
        chunk = tl.load(band + offs_r[:, None] * BAND + (dist - lo)[None, :], mask=ok, other=0.0)
        index = (c0 - fold_lo) // CHUNK
        one_hot = tl.load(merge_ptr + index * CHUNK * CHUNK + offs_c[:, None] * CHUNK + offs_c[None, :])
        rows = b_lo + offs_c
        rel = tl.load(rel_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=(offs_c < count)[:, None], other=0.0)
        # the partial buffer has CHUNK rows of padding past its 2k: the rows past the chunk's buckets add zeros
        part = part_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :]
        old = tl.load(part)
        more = c0 + CHUNK <= d_hi
        b_lo = tl.load(fold_ptr + 2 * (index + 1), mask=more, other=0)
        count = tl.load(fold_ptr + 2 * (index + 1) + 1, mask=more, other=0)
        merged = tl.dot(chunk, one_hot, input_precision=PRECISION).to(own.dtype)
        acc = tl.dot(merged, rel, acc, input_precision=PRECISION)
        tl.store(part, old + tl.dot(tl.trans(merged), own, input_precision=PRECISION))
        tl.debug_barrier()  # the next chunk's partial rows may overlap these: every warp's stores first
    return acc


@triton.jit
def _end_gradients(acc, own, sums_lo, sums_hi, rel_ptr, part_ptr, offs_d, TWO_SPAN: tl.constexpr,
                   HEAD_DIM: tl.constexpr):
    """The saturated tiles' rank-1 terms of a block: ``acc += sums[:, None] rel[end]`` and
    ``part[end] += sums @ own`` for both ends (bucket 0 and the top)."""
    rel_lo = tl.load(rel_ptr + offs_d).to(tl.float32)
    rel_hi = tl.load(rel_ptr + (TWO_SPAN - 1) * HEAD_DIM + offs_d).to(tl.float32)
    acc += sums_lo[:, None] * rel_lo[None, :] + sums_hi[:, None] * rel_hi[None, :]
    _accumulate_row(part_ptr, offs_d, tl.sum(sums_lo[:, None] * own.to(tl.float32), 0))
    _accumulate_row(part_ptr + (TWO_SPAN - 1) * HEAD_DIM, offs_d, tl.sum(sums_hi[:, None] * own.to(tl.float32), 0))
    return acc


@triton.jit
def _end_pair(own_ptr, rel_ptr, out, stat_numel, i0, offs_r, offs_d, stride_n, seq_len, ok,
              TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr):
    """``own . rel[0]`` and ``own . rel[top]`` of a block of rows, stored ``stat_numel`` apart."""
    own = _load_rows(own_ptr, i0, offs_r, offs_d, stride_n, seq_len).to(tl.float32)
    for end in tl.static_range(2):
        row = tl.load(rel_ptr + end * (TWO_SPAN - 1) * HEAD_DIM + offs_d).to(tl.float32)
        tl.store(out + end * stat_numel, tl.sum(own * row[None, :], 1), mask=ok)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _attn_end_terms(Q, K, KR, QR, CU, END, n_ctx, n_heads, stat_numel, stride_b, stride_h, stride_n,
                    stride_lb, stride_lh, TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                    HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, VARLEN: tl.constexpr):
    """``END[0..3]`` of a block of tokens: ``Q . Kr[0]``, ``Q . Kr[top]``, ``K . Qr[0]``, ``K . Qr[top]``
    (float32, in the lse layout): what saturated tiles add per query row and per key column."""
    bh = tl.program_id(1)
    seq_len, base, rel_off, stat_off = _locate(CU, bh // n_heads, bh % n_heads, n_ctx, stride_b, stride_h,
                                               stride_n, stride_lb, stride_lh, TWO_SPAN, HEAD_DIM, VARLEN)
    i0 = tl.program_id(0) * BLOCK
    if i0 < seq_len:
        offs_r, offs_d = tl.arange(0, BLOCK), tl.arange(0, HEAD_DIM)
        ok = (i0 + offs_r) < seq_len
        out = END + stat_off + i0 + offs_r
        if HAS_C2P:
            _end_pair(Q + base, KR + rel_off, out, stat_numel, i0, offs_r, offs_d, stride_n, seq_len, ok, TWO_SPAN,
                      HEAD_DIM)
        if HAS_P2C:
            _end_pair(K + base, QR + rel_off, out + 2 * stat_numel, stat_numel, i0, offs_r, offs_d, stride_n, seq_len,
                      ok, TWO_SPAN, HEAD_DIM)


@triton.jit
def _general_blocks(i0, seq_len, top_start, bottom_end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[lo, hi)``: the key blocks whose tiles with query block ``i0`` are general. Those before ``lo`` lie
    wholly in the top bucket, those from ``hi`` on wholly in bucket 0 (the table is monotone, so a tile's
    window ``[r0, r0 + BM + BN - 2]``, ``r0 = i0 - j0 - (BN - 1)``, decides by its ends). From host-known
    limits: no table read or branch per tile, and the general loop can load its next tile's buckets ahead."""
    end = tl.cdiv(seq_len, BLOCK_N) * BLOCK_N
    last_top = i0 - (BLOCK_N - 1) - top_start            # the largest top-saturated j0, if >= 0
    lo = tl.where(last_top >= 0, (tl.maximum(last_top, 0) // BLOCK_N + 1) * BLOCK_N, 0)
    first_bottom = i0 + BLOCK_M - 1 - bottom_end          # the smallest j0 saturated in bucket 0, if > 0
    hi = tl.where(first_bottom > 0, tl.cdiv(tl.maximum(first_bottom, 1), BLOCK_N) * BLOCK_N, 0)
    lo = tl.minimum(lo, end)
    return lo, tl.minimum(tl.maximum(hi, lo), end)


@triton.jit
def _key_tile(mask_ptr, END, stat_off, stat_numel, j0, limit, offs_n, top, PATH: tl.constexpr,
              HAS_P2C: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr):
    """What a forward tile of key block ``j0`` reads on its key side apart from its rows: the padding mask's
    words and, on a saturated run, its keys' p2c end terms. A run issues these a tile ahead (two stages by hand),
    so no tile waits on them; nothing at or past ``limit`` (the run's end, or the sequence's) is read. The K and
    V rows are loaded in the tile (a tile ahead, they took 61 more registers: spills with dropout)."""
    words = _mask_words(mask_ptr, j0, limit, BLOCK_N, HAS_MASK)
    p_end = ()
    if PATH == SATURATED:
        p_end = tl.zeros([BLOCK_N], tl.float32)
        if HAS_P2C:
            end = tl.where(top, 1, 0).to(tl.int64)
            p_end = _load_stat(END + (2 + end) * stat_numel + stat_off, j0, offs_n, limit, 0.0)
    return words, p_end


@triton.jit
def _softmax_step(acc, m_i, l_i, s, v, seed, i0, j0, n_ctx, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  DROPOUT: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of the online softmax in base 2: the running max ``m``, sum ``l`` and accumulator."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows with nothing visible yet keep m = -inf; subtract 0 so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:
        p = tl.where(_dropout_keep(seed, i0, j0, n_ctx, dropout_p, BLOCK_M, BLOCK_N, False), p, 0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _fwd_run(acc, m_i, l_i, q, row_ok, K, V, KR, QR, TABLE, mask_ptr, END, scratch, i0, j_start, j_end, seed, scale,
             dropout_p, n_ctx, seq_len, base, stat_off, stat_numel, stride_n, offs_m, offs_n, offs_d, top,
             PATH: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             WINDOW: tl.constexpr, SPLIT: tl.constexpr, HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr,
             HAS_MASK: tl.constexpr, MASK_DIAGONAL: tl.constexpr, DROPOUT: tl.constexpr, HOIST: tl.constexpr,
             PRECISION: tl.constexpr):
    """Online softmax over key blocks ``j_start, j_start + BN, ... < j_end``, all on path ``PATH`` (saturated at
    the top end when ``top``, or general). Each tile's mask words and end terms (:func:`_key_tile`) were loaded a
    tile before it, the query rows' visibility (``row_ok``) once per block and a saturated run's c2p end terms,
    one per query row, once per run; a general run's window buckets a tile ahead when it hoists, its window rows
    and K rows at the tile's start, its V rows after the window products."""
    limit = tl.minimum(seq_len, j_end)
    c_end = tl.zeros([BLOCK_M], tl.float32)
    if PATH == SATURATED and HAS_C2P:
        c_end = _load_stat(END + tl.where(top, 1, 0).to(tl.int64) * stat_numel + stat_off, i0, offs_m, seq_len, 0.0)
    buckets = ()
    if PATH == GENERAL:
        buckets = _window_buckets(TABLE, i0 - j_start - (BLOCK_N - 1), WINDOW, SPLIT)
    ahead = _key_tile(mask_ptr, END, stat_off, stat_numel, j_start, limit, offs_n, top, PATH, HAS_P2C, HAS_MASK,
                      BLOCK_N)
    for j0 in range(j_start, j_end, BLOCK_N):
        words, p_end = ahead
        ahead = _key_tile(mask_ptr, END, stat_off, stat_numel, j0 + BLOCK_N, limit, offs_n, top, PATH, HAS_P2C,
                          HAS_MASK, BLOCK_N)
        current = buckets
        if PATH == GENERAL and HOIST:  # the next tile's buckets, a tile ahead (the table reaches past the last)
            buckets = _window_buckets(TABLE, i0 - j0 - (2 * BLOCK_N - 1), WINDOW, SPLIT)
        elif PATH == GENERAL:
            current = _window_buckets(TABLE, i0 - j0 - (BLOCK_N - 1), WINDOW, SPLIT)
        if PATH == GENERAL:  # first: the round trip the products wait for
            krw, qrw = _window_rows(KR, QR, current, offs_d, HEAD_DIM, SPLIT, HAS_C2P, HAS_P2C, BLOCK_M < 64)
        k = _load_rows(K + base, j0, offs_n, offs_d, stride_n, seq_len)
        if PATH == SATURATED:
            v = _load_rows(V + base, j0, offs_n, offs_d, stride_n, seq_len)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if PATH == GENERAL:
            # consecutive general tiles alternate two scratch buffers: a tile's stores never race the last one's loads
            buffer = scratch + ((j0 // BLOCK_N) % 2) * ((BLOCK_M + BLOCK_N) * WINDOW)
            _store_window_products(q, k, krw, qrw, buffer, offs_m, offs_n, BLOCK_M, WINDOW, SPLIT, HAS_C2P,
                                   HAS_P2C, PRECISION)
            v = _load_rows(V + base, j0, offs_n, offs_d, stride_n, seq_len)  # not held across the products
            s += _skewed_read(buffer, offs_m, offs_n, BLOCK_M, BLOCK_N, WINDOW, HAS_C2P, HAS_P2C, False)
        else:
            s += _end_row_column(c_end, p_end)
        col_ok = _words_visible(words, j0, offs_n, limit, BLOCK_N, HAS_MASK)
        visible = _pair_visible(row_ok, col_ok, i0, j0, offs_m, offs_n, BLOCK_M, BLOCK_N, MASK_DIAGONAL, False)
        s = tl.where(visible, s * (scale * LOG2E), float("-inf"))
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, seed, i0, j0, n_ctx, dropout_p, BLOCK_M, BLOCK_N,
                                      DROPOUT, PRECISION)
    return acc, m_i, l_i


@triton.jit
def _end_row_column(c_end, p_end):
    """c2p + p2c of a saturated forward tile: its rows' and its columns' end terms, ``[BM, BN]``."""
    return c_end[:, None] + p_end[None, :]


@triton.jit
def _fwd_tiles(acc, m_i, l_i, q, K, V, KR, QR, TABLE, mask_ptr, END, scratch, i0, seed, scale, dropout_p, n_ctx,
               seq_len, base, stat_off, stat_numel, stride_n, offs_m, offs_n, offs_d, PATH: tl.constexpr,
               TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               WINDOW: tl.constexpr, SPLIT: tl.constexpr, HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr,
               HAS_MASK: tl.constexpr, MASK_DIAGONAL: tl.constexpr, DROPOUT: tl.constexpr, HOIST: tl.constexpr,
               PRECISION: tl.constexpr):
    """Online softmax over every key block in one loop whose tiles read their path (``PER_TILE``) from the
    table, or take no position terms (``CONTENT``)."""
    general = 0
    ahead = ()
    if PATH == PER_TILE and HOIST:
        ahead = _path_ends(TABLE, i0 - (BLOCK_N - 1), BLOCK_M, BLOCK_N)
    for j0 in range(0, seq_len, BLOCK_N):
        k = _load_rows(K + base, j0, offs_n, offs_d, stride_n, seq_len)
        row = (0, 0, ())
        if PATH == PER_TILE:
            row, ahead = _table_ahead(TABLE, ahead, i0 - j0 - (BLOCK_N - 1), -BLOCK_N, HOIST, BLOCK_M, BLOCK_N,
                                      WINDOW, SPLIT)
        s, _, _, general = _tile_scores(q, k, KR, QR, TABLE, row, mask_ptr, (0, 0), END, scratch, stat_off, stat_numel,
                                        i0, j0, seq_len, scale, offs_m, offs_n, offs_d, general, TWO_SPAN, HEAD_DIM,
                                        BLOCK_M, BLOCK_N, WINDOW, SPLIT, HAS_C2P, HAS_P2C, HAS_MASK, MASK_DIAGONAL,
                                        False, HOIST, True, PRECISION)
        v = _load_rows(V + base, j0, offs_n, offs_d, stride_n, seq_len)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, seed, i0, j0, n_ctx, dropout_p, BLOCK_M, BLOCK_N,
                                      DROPOUT, PRECISION)
    return acc, m_i, l_i


@triton.jit
def _fwd_block(Q, K, V, KR, QR, TABLE, mask_ptr, END, O, LSE, scratch, i0, seed, scale, dropout_p, n_ctx,
               seq_len, base, rel_off, stat_off, stat_numel, stride_n, top_start, bottom_end,
               TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               WINDOW: tl.constexpr, SPLIT: tl.constexpr, HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr,
               HAS_MASK: tl.constexpr, MASK_DIAGONAL: tl.constexpr, DROPOUT: tl.constexpr,
               PATHS_APART: tl.constexpr, HOIST: tl.constexpr, PRECISION: tl.constexpr):
    """Output and base-2 log-sum-exp of query block ``i0``: online softmax over the key blocks. With
    ``PATHS_APART``, walked as three runs, the top-saturated tiles, the general ones and those saturated in
    bucket 0; else in one loop that reads each tile's path from the table."""
    offs_m, offs_n, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, HEAD_DIM)
    q = _load_rows(Q + base, i0, offs_m, offs_d, stride_n, seq_len)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    KR, QR = KR + rel_off, QR + rel_off
    if (HAS_C2P or HAS_P2C) and PATHS_APART:
        row_ok = _side_visible(mask_ptr, i0, offs_m, seq_len, BLOCK_M, HAS_MASK)  # once per block, not per tile
        lo, hi = _general_blocks(i0, seq_len, top_start, bottom_end, BLOCK_M, BLOCK_N)
        acc, m_i, l_i = _fwd_run(acc, m_i, l_i, q, row_ok, K, V, KR, QR, TABLE, mask_ptr, END, scratch, i0, 0, lo,
                                 seed, scale, dropout_p, n_ctx, seq_len, base, stat_off, stat_numel, stride_n, offs_m,
                                 offs_n, offs_d, True, SATURATED, HEAD_DIM, BLOCK_M, BLOCK_N, WINDOW, SPLIT, HAS_C2P,
                                 HAS_P2C, HAS_MASK, MASK_DIAGONAL, DROPOUT, HOIST, PRECISION)
        acc, m_i, l_i = _fwd_run(acc, m_i, l_i, q, row_ok, K, V, KR, QR, TABLE, mask_ptr, END, scratch, i0, lo, hi,
                                 seed, scale, dropout_p, n_ctx, seq_len, base, stat_off, stat_numel, stride_n, offs_m,
                                 offs_n, offs_d, False, GENERAL, HEAD_DIM, BLOCK_M, BLOCK_N, WINDOW, SPLIT, HAS_C2P,
                                 HAS_P2C, HAS_MASK, MASK_DIAGONAL, DROPOUT, HOIST, PRECISION)
        acc, m_i, l_i = _fwd_run(acc, m_i, l_i, q, row_ok, K, V, KR, QR, TABLE, mask_ptr, END, scratch, i0, hi,
                                 seq_len, seed, scale, dropout_p, n_ctx, seq_len, base, stat_off, stat_numel, stride_n,
                                 offs_m, offs_n, offs_d, False, SATURATED, HEAD_DIM, BLOCK_M, BLOCK_N, WINDOW, SPLIT,
                                 HAS_C2P, HAS_P2C, HAS_MASK, MASK_DIAGONAL, DROPOUT, HOIST, PRECISION)
    else:
        acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, K, V, KR, QR, TABLE, mask_ptr, END, scratch, i0, seed, scale,
                                   dropout_p, n_ctx, seq_len, base, stat_off, stat_numel, stride_n, offs_m, offs_n,
                                   offs_d, PER_TILE if HAS_C2P or HAS_P2C else CONTENT, TWO_SPAN, HEAD_DIM, BLOCK_M,
                                   BLOCK_N, WINDOW, SPLIT, HAS_C2P, HAS_P2C, HAS_MASK, MASK_DIAGONAL, DROPOUT, HOIST,
                                   PRECISION)
    has_any = l_i > 0.0
    out = acc / tl.where(has_any, l_i, 1.0)[:, None]
    if DROPOUT:
        out = out / (1.0 - dropout_p)
    _store_rows(O + base, i0, offs_m, offs_d, stride_n, seq_len, out)
    # Fully masked rows get lse = +inf so that backward's exp2(s - lse) is 0 there.
    lse = tl.where(has_any, tl.where(m_i == float("-inf"), 0.0, m_i) + tl.log2(tl.where(has_any, l_i, 1.0)),
                   float("inf"))
    tl.store(LSE + stat_off + i0 + offs_m, lse, mask=(i0 + offs_m) < seq_len)


@triton.jit
def _attn_fwd(Q, K, V, KR, QR, TABLE, MASK, CU, SCALES, END, O, LSE, SCRATCH,
              seed, scale, dropout_p, n_ctx, n_heads, num_seqs, items_per_program, stat_numel, scratch_elements,
              top_start, bottom_end, stride_b, stride_h, stride_n, stride_lb, stride_lh,
              TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              WINDOW: tl.constexpr, SPLIT: tl.constexpr, HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr,
              HAS_MASK: tl.constexpr, VARLEN: tl.constexpr, DROPOUT: tl.constexpr, SCALE_PER_SEQ: tl.constexpr,
              MASK_DIAGONAL: tl.constexpr, PATHS_APART: tl.constexpr, HOIST: tl.constexpr,
              PRECISION: tl.constexpr):
    """Program (p, head) walks a run of (sequence, query block) items of one head."""
    pid, head = tl.program_id(0), tl.program_id(1)
    scratch = SCRATCH + (head * tl.num_programs(0) + pid).to(tl.int64) * scratch_elements
    blocks = tl.cdiv(n_ctx, BLOCK_M)
    first = pid * items_per_program
    for item in range(first, tl.minimum(first + items_per_program, num_seqs * blocks)):
        seq = item // blocks
        seq_len, base, rel_off, stat_off = _locate(CU, seq, head, n_ctx, stride_b, stride_h, stride_n,
                                                   stride_lb, stride_lh, TWO_SPAN, HEAD_DIM, VARLEN)
        i0 = (item % blocks) * BLOCK_M
        if i0 < seq_len:
            _fwd_block(Q, K, V, KR, QR, TABLE, MASK + seq * _mask_stride(n_ctx), END, O, LSE, scratch, i0,
                       seed + seq * n_heads + head, _sequence_scale(SCALES, seq, scale, SCALE_PER_SEQ), dropout_p,
                       n_ctx, seq_len, base, rel_off, stat_off, stat_numel, stride_n, top_start, bottom_end,
                       TWO_SPAN, HEAD_DIM, BLOCK_M, BLOCK_N, WINDOW, SPLIT, HAS_C2P, HAS_P2C, HAS_MASK, MASK_DIAGONAL,
                       DROPOUT, PATHS_APART, HOIST, PRECISION)
        tl.debug_barrier()  # the next item's first tile may reuse the scratch buffer this one read last


@triton.jit
def _score_grads(s, lse, delta, dp, seed, i0, j0, n_ctx, dropout_p, scale, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Recomputed (dropped) probabilities and the score gradient ``dS`` (scale included) of a tile from
    its scores ``s`` (base 2, as ``_tile_scores`` gives them) and ``dP = dO V^T`` (both transposed when
    ``TRANSPOSED``)."""
    if TRANSPOSED:
        p = tl.exp2(s - lse[None, :])
        delta = delta[None, :]
    else:
        p = tl.exp2(s - lse[:, None])
        delta = delta[:, None]
    p_dropped = p
    if DROPOUT:
        keep = _dropout_keep(seed, i0, j0, n_ctx, dropout_p, BLOCK_M, BLOCK_N, TRANSPOSED)
        p_dropped = tl.where(keep, p / (1.0 - dropout_p), 0.0)
        dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
    return p_dropped, p * (dp - delta) * scale


@triton.jit
def _dq_block(Q, K, V, KR, QR, TABLE, mask_ptr, END, DO, LSE, DELTA, DQ, part_ptr, scratch, FOLD, MERGE, i0,
              seed, scale, dropout_p, n_ctx, seq_len, base, rel_off, stat_off, stat_numel, stride_n, lo,
              TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              WINDOW: tl.constexpr, SPLIT: tl.constexpr, BAND: tl.constexpr, CHUNK: tl.constexpr,
              HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_MASK: tl.constexpr, MASK_DIAGONAL: tl.constexpr,
              DROPOUT: tl.constexpr, HOIST: tl.constexpr, PRECISION: tl.constexpr):
    """dQ of query block ``i0`` (all key blocks), and its c2p gradient added to the partial dKr."""
    offs_m, offs_n, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, HEAD_DIM)
    band = scratch + 2 * (BLOCK_M + BLOCK_N) * WINDOW
    band_lo = tl.maximum(lo, i0 - (tl.cdiv(n_ctx, BLOCK_N) * BLOCK_N - 1))  # the block's smallest distance
    q = _load_rows(Q + base, i0, offs_m, offs_d, stride_n, seq_len)
    do = _load_rows(DO + base, i0, offs_m, offs_d, stride_n, seq_len)
    lse = _load_stat(LSE + stat_off, i0, offs_m, seq_len, float("inf"))
    delta = _load_stat(DELTA + stat_off, i0, offs_m, seq_len, 0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    sums_lo = tl.zeros([BLOCK_M], tl.float32)
    sums_hi = tl.zeros([BLOCK_M], tl.float32)
    general = 0
    first, last = seq_len, -BLOCK_N  # key blocks of the general tiles
    ahead = ()
    if HOIST:
        ahead = _path_ends(TABLE, i0 - (BLOCK_N - 1), BLOCK_M, BLOCK_N)
    for j0 in range(0, seq_len, BLOCK_N):
        row, ahead = _table_ahead(TABLE, ahead, i0 - j0 - (BLOCK_N - 1), -BLOCK_N, HOIST, BLOCK_M, BLOCK_N, WINDOW,
                                  SPLIT)
        keys = _mask_words(mask_ptr, j0, seq_len, BLOCK_N, HAS_MASK)
        k = _load_rows(K + base, j0, offs_n, offs_d, stride_n, seq_len)
        v = _load_rows(V + base, j0, offs_n, offs_d, stride_n, seq_len)
        s, saturated, top, general = _tile_scores(
            q, k, KR + rel_off, QR + rel_off, TABLE, row, mask_ptr, keys, END, scratch, stat_off, stat_numel, i0, j0,
            seq_len,
            scale, offs_m, offs_n, offs_d, general, TWO_SPAN, HEAD_DIM, BLOCK_M, BLOCK_N, WINDOW, SPLIT, HAS_C2P, HAS_P2C,
            HAS_MASK, MASK_DIAGONAL, False, HOIST, False, PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        _, ds = _score_grads(s, lse, delta, dp, seed, i0, j0, n_ctx, dropout_p, scale, BLOCK_M, BLOCK_N, DROPOUT,
                             False)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
        if HAS_C2P:  # dQ_a += sum_b dS[a,b] Kr[idx];  dKr[t] += sum_{idx=t} dS[a,b] Q_a
            if saturated:
                row_sums = tl.sum(ds, 1)
                sums_lo += tl.where(top, 0.0, row_sums)
                sums_hi += tl.where(top, row_sums, 0.0)
            else:
                _store_band(band, ds.to(band.dtype.element_ty), i0 - j0 - (BLOCK_N - 1), band_lo, offs_m, offs_n,
                            BAND, BLOCK_N, False)
                first = tl.minimum(first, j0)
                last = tl.maximum(last, j0)
    if HAS_C2P:
        tl.debug_barrier()
        q = _load_rows(Q + base, i0, offs_m, offs_d, stride_n, seq_len)  # reloaded: not held across the loop
        dq = _band_gradients(dq, q, band, KR + rel_off, part_ptr, FOLD, MERGE, band_lo, lo, i0,
                             i0 - last - (BLOCK_N - 1), i0 - first + BLOCK_M - 1, first, last, offs_m, offs_d, HEAD_DIM,
                             BAND, CHUNK, BLOCK_N, 1, PRECISION)
        dq = _end_gradients(dq, q, sums_lo, sums_hi, KR + rel_off, part_ptr, offs_d, TWO_SPAN, HEAD_DIM)
    _store_rows(DQ + base, i0, offs_m, offs_d, stride_n, seq_len, dq)


@triton.jit
def _attn_bwd_dq(Q, K, V, KR, QR, TABLE, MASK, CU, SCALES, END, DO, LSE, DELTA, DQ, DKR_PART, SCRATCH, FOLD, MERGE,
                 seed, scale, dropout_p, n_ctx, n_heads, num_seqs, items_per_program, stat_numel, scratch_elements,
                 lo, stride_b, stride_h, stride_n, stride_lb, stride_lh,
                 TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 WINDOW: tl.constexpr, SPLIT: tl.constexpr, BAND: tl.constexpr, CHUNK: tl.constexpr,
                 HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_MASK: tl.constexpr, VARLEN: tl.constexpr,
                 DROPOUT: tl.constexpr, SCALE_PER_SEQ: tl.constexpr, MASK_DIAGONAL: tl.constexpr,
                 HOIST: tl.constexpr, PRECISION: tl.constexpr):
    """Program (p, head) walks a run of (sequence, query block) items of one head into one partial dKr."""
    pid, head = tl.program_id(0), tl.program_id(1)
    program = (head * tl.num_programs(0) + pid).to(tl.int64)
    part_ptr = DKR_PART + program * (TWO_SPAN + CHUNK) * HEAD_DIM  # padded rows: see _band_gradients
    scratch = SCRATCH + program * scratch_elements
    blocks = tl.cdiv(n_ctx, BLOCK_M)
    first = pid * items_per_program
    for item in range(first, tl.minimum(first + items_per_program, num_seqs * blocks)):
        seq = item // blocks
        seq_len, base, rel_off, stat_off = _locate(CU, seq, head, n_ctx, stride_b, stride_h, stride_n,
                                                   stride_lb, stride_lh, TWO_SPAN, HEAD_DIM, VARLEN)
        i0 = (item % blocks) * BLOCK_M
        if i0 < seq_len:
            _dq_block(Q, K, V, KR, QR, TABLE, MASK + seq * _mask_stride(n_ctx), END, DO, LSE, DELTA, DQ, part_ptr, scratch, FOLD,
                      MERGE, i0, seed + seq * n_heads + head, _sequence_scale(SCALES, seq, scale, SCALE_PER_SEQ),
                      dropout_p, n_ctx, seq_len, base, rel_off, stat_off, stat_numel, stride_n, lo, TWO_SPAN, HEAD_DIM,
                      BLOCK_M, BLOCK_N, WINDOW, SPLIT, BAND, CHUNK, HAS_C2P, HAS_P2C, HAS_MASK, MASK_DIAGONAL, DROPOUT,
                      HOIST, PRECISION)
        tl.debug_barrier()


@triton.jit
def _dkdv_block(Q, K, V, KR, QR, TABLE, mask_ptr, END, DO, LSE, DELTA, DK, DV, part_ptr, scratch, FOLD, MERGE, j0,
                seed, scale, dropout_p, n_ctx, seq_len, base, rel_off, stat_off, stat_numel, stride_n, lo,
                TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                WINDOW: tl.constexpr, SPLIT: tl.constexpr, BAND: tl.constexpr, CHUNK: tl.constexpr,
                HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_MASK: tl.constexpr, MASK_DIAGONAL: tl.constexpr,
                DROPOUT: tl.constexpr, HOIST: tl.constexpr, PRECISION: tl.constexpr):
    """dK, dV of key block ``j0`` (all query blocks; tiles held as ``[BN, BM]``), and its p2c gradient
    added to the partial dQr."""
    offs_m, offs_n, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, HEAD_DIM)
    band = scratch + 2 * (BLOCK_M + BLOCK_N) * WINDOW
    band_lo = tl.maximum(lo, -(j0 + BLOCK_N - 1))  # the block's smallest distance
    k = _load_rows(K + base, j0, offs_n, offs_d, stride_n, seq_len)
    v = _load_rows(V + base, j0, offs_n, offs_d, stride_n, seq_len)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    sums_lo = tl.zeros([BLOCK_N], tl.float32)
    sums_hi = tl.zeros([BLOCK_N], tl.float32)
    general = 0
    first, last = seq_len, -BLOCK_M  # query blocks of the general tiles
    ahead = ()
    if HOIST:
        ahead = _path_ends(TABLE, -j0 - (BLOCK_N - 1), BLOCK_M, BLOCK_N)
    keys = _side_visible(mask_ptr, j0, offs_n, seq_len, BLOCK_N, HAS_MASK)  # the block's keys: once
    for i0 in range(0, seq_len, BLOCK_M):
        row, ahead = _table_ahead(TABLE, ahead, i0 - j0 - (BLOCK_N - 1), BLOCK_M, HOIST, BLOCK_M, BLOCK_N, WINDOW,
                                  SPLIT)
        q = _load_rows(Q + base, i0, offs_m, offs_d, stride_n, seq_len)
        do = _load_rows(DO + base, i0, offs_m, offs_d, stride_n, seq_len)
        lse = _load_stat(LSE + stat_off, i0, offs_m, seq_len, float("inf"))
        delta = _load_stat(DELTA + stat_off, i0, offs_m, seq_len, 0.0)
        s, saturated, top, general = _tile_scores(
            q, k, KR + rel_off, QR + rel_off, TABLE, row, mask_ptr, keys, END, scratch, stat_off, stat_numel, i0,
            j0, seq_len, scale, offs_m, offs_n, offs_d, general, TWO_SPAN, HEAD_DIM, BLOCK_M, BLOCK_N, WINDOW, SPLIT,
            HAS_C2P, HAS_P2C, HAS_MASK, MASK_DIAGONAL, True, HOIST, False, PRECISION)
        dp = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        p_dropped, ds = _score_grads(s, lse, delta, dp, seed, i0, j0, n_ctx, dropout_p, scale, BLOCK_M, BLOCK_N,
                                     DROPOUT, True)
        dv = tl.dot(p_dropped.to(do.dtype), do, dv, input_precision=PRECISION)
        dk = tl.dot(ds.to(q.dtype), q, dk, input_precision=PRECISION)
        if HAS_P2C:  # dK_b += sum_a dS[a,b] Qr[idx];  dQr[t] += sum_{idx=t} dS[a,b] K_b
            if saturated:
                col_sums = tl.sum(ds, 1)
                sums_lo += tl.where(top, 0.0, col_sums)
                sums_hi += tl.where(top, col_sums, 0.0)
            else:
                _store_band(band, ds.to(band.dtype.element_ty), i0 - j0 - (BLOCK_N - 1), band_lo, offs_m, offs_n,
                            BAND, BLOCK_N, True)
                first = tl.minimum(first, i0)
                last = tl.maximum(last, i0)
    if HAS_P2C:
        tl.debug_barrier()
        k = _load_rows(K + base, j0, offs_n, offs_d, stride_n, seq_len)  # reloaded: not held across the loop
        # key b at distance dist pairs with query j0 + b + dist: band rows are keys, SIGN -1
        dk = _band_gradients(dk, k, band, QR + rel_off, part_ptr, FOLD, MERGE, band_lo, lo, j0,
                             first - j0 - (BLOCK_N - 1), last + BLOCK_M - 1 - j0, first, last, offs_n, offs_d, HEAD_DIM,
                             BAND, CHUNK, BLOCK_M, -1, PRECISION)
        dk = _end_gradients(dk, k, sums_lo, sums_hi, QR + rel_off, part_ptr, offs_d, TWO_SPAN, HEAD_DIM)
    _store_rows(DK + base, j0, offs_n, offs_d, stride_n, seq_len, dk)
    _store_rows(DV + base, j0, offs_n, offs_d, stride_n, seq_len, dv)


@triton.jit
def _attn_bwd_dkdv(Q, K, V, KR, QR, TABLE, MASK, CU, SCALES, END, DO, LSE, DELTA, DK, DV, DQR_PART, SCRATCH,
                   FOLD, MERGE, seed, scale, dropout_p, n_ctx, n_heads, num_seqs, items_per_program, stat_numel,
                   scratch_elements, lo, stride_b, stride_h, stride_n, stride_lb, stride_lh,
                   TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   WINDOW: tl.constexpr, SPLIT: tl.constexpr, BAND: tl.constexpr, CHUNK: tl.constexpr,
                   HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_MASK: tl.constexpr, VARLEN: tl.constexpr,
                   DROPOUT: tl.constexpr, SCALE_PER_SEQ: tl.constexpr, MASK_DIAGONAL: tl.constexpr,
                   HOIST: tl.constexpr, PRECISION: tl.constexpr):
    """Program (p, head) walks a run of (sequence, key block) items of one head into one partial dQr."""
    pid, head = tl.program_id(0), tl.program_id(1)
    program = (head * tl.num_programs(0) + pid).to(tl.int64)
    part_ptr = DQR_PART + program * (TWO_SPAN + CHUNK) * HEAD_DIM  # padded rows: see _band_gradients
    scratch = SCRATCH + program * scratch_elements
    blocks = tl.cdiv(n_ctx, BLOCK_N)
    first = pid * items_per_program
    for item in range(first, tl.minimum(first + items_per_program, num_seqs * blocks)):
        seq = item // blocks
        seq_len, base, rel_off, stat_off = _locate(CU, seq, head, n_ctx, stride_b, stride_h, stride_n,
                                                   stride_lb, stride_lh, TWO_SPAN, HEAD_DIM, VARLEN)
        j0 = (item % blocks) * BLOCK_N
        if j0 < seq_len:
            _dkdv_block(Q, K, V, KR, QR, TABLE, MASK + seq * _mask_stride(n_ctx), END, DO, LSE, DELTA, DK, DV, part_ptr, scratch,
                        FOLD, MERGE, j0, seed + seq * n_heads + head,
                        _sequence_scale(SCALES, seq, scale, SCALE_PER_SEQ), dropout_p, n_ctx, seq_len, base, rel_off,
                        stat_off, stat_numel, stride_n, lo, TWO_SPAN,
                        HEAD_DIM, BLOCK_M, BLOCK_N, WINDOW, SPLIT, BAND, CHUNK, HAS_C2P, HAS_P2C, HAS_MASK,
                        MASK_DIAGONAL, DROPOUT, HOIST, PRECISION)
        tl.debug_barrier()


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
    columns: int = 64  # window columns per slice of the window products (fewer: fewer live registers)
    # A general tile loads every slice's window rows before its products, so their round trips overlap, and
    # the forward's general loop (``paths_apart``) loads the next tile's buckets a tile ahead. False, for
    # tiles that spill otherwise: the backward and the one-loop forward load one slice's rows at a time, and
    # the general loop loads its buckets in the tile that uses them.
    hoist: bool = True
    # ... also with the diagonal mask (False where that alone spilled: sm_90's d = 64 dk/dv, 4 B).
    hoist_diagonal: bool = True

    @property
    def window(self) -> int:
        """Columns of a tile's scratch products: its ``BLOCK_M + BLOCK_N - 1`` distances, rounded to a
        power of two."""
        return triton.next_power_of_2(self.block_m + self.block_n - 1)

    @property
    def split(self) -> int:
        """Column slices the window products are computed in."""
        return max(1, self.window // self.columns)

    @property
    def chunk(self) -> int:
        """Distances a backward block reads from its band at a time."""
        return min(64, self.window)

    @property
    def paths_apart(self) -> bool:
        """Whether the forward walks its saturated and general tiles in separate loops. A loop of content
        products alone lays its two chained products out as ``[warps, 1]`` (16 query rows a warp), so with
        more than ``BLOCK_M / 16`` warps it would repeat products: those tiles keep one loop that branches
        per tile (compile check: 8 warps on 64 rows issued each saturated tile's products twice)."""
        return self.num_warps * 16 <= self.block_m

    def content_only(self) -> Tiles:
        """The forward's tiles without position terms: its two chained products give a warp 16 query rows
        (Triton lays them out as ``[warps, 1]``), so warps beyond ``BLOCK_M / 16`` would repeat others' work."""
        return replace(self, num_warps=min(self.num_warps, max(1, self.block_m // 16)))


KERNELS = ("fwd", "dkdv", "dq")
# (inputs, head dim, target) -> tiles of the three kernels: for each, the tile with the fewest estimated
# instructions per score (benchmarks/attention_judge.py) among those that compile with no spill and no warp
# repeating another's products in every configuration the compile check covers (d = 16 takes d = 32's;
# float32 inputs at d <= 64 take d = 64's).
# 64-row forward tiles on 4 warps give Hopper its warpgroup MMA. Candidates and figures: docs/kernels.md.
_T = Tiles
_TILES = {
    # d <= 32: the products with d columns need 64 rows on 4 warps (32 on 2) or warps repeat each other.
    ("half", 32, 90): dict(fwd=_T(64, 64, 4, 1), dq=_T(32, 32, 2, 1), dkdv=_T(32, 32, 2, 1)),
    ("half", 32, 80): dict(fwd=_T(32, 32, 4, 1), dq=_T(32, 16, 2, 1), dkdv=_T(16, 32, 2, 1)),
    ("half", 32, 100): dict(fwd=_T(32, 64, 4, 1), dq=_T(32, 32, 2, 1), dkdv=_T(32, 32, 2, 1, hoist=False)),
    # d = 64 dk/dv, sm_90: rows not hoisted under the diagonal mask (hoisted, 4-8 B spilled with the per-sequence
    # scale and dropout once the mask was read as words).
    ("half", 64, 90): dict(fwd=_T(64, 64, 4, 1), dq=_T(32, 64, 4, 1), dkdv=_T(64, 32, 4, 1, hoist_diagonal=False)),
    # d = 128, dk/dv, sm_90 and sm_80: every tile without repeated warps spills in some configuration the
    # compile check covers (sm_90: 32 x 16 on 4 warps 8-16 B with p2c alone, 64 x 16 4-16 B, 16 x 16 on 2 8 B;
    # sm_80: 32 x 16 20-48 B, 16 x 16 on 2 88-116 B); 16 x 16 on 4 warps repeats half its products (issued /
    # unique 2.0) and spills nothing: the one exception to the no-repetition rule.
    # d = 128 forward, sm_90: window products in 16-column slices (64 spilled 4 B with the diagonal mask, and 32
    # did once the mask was read as words), rows not hoisted (hoisted, 4 B spilled; dq 12 B).
    ("half", 128, 90): dict(fwd=_T(64, 64, 8, 1, columns=16, hoist=False), dq=_T(32, 64, 8, 1, hoist=False),
                            dkdv=_T(16, 16, 4, 1)),
    ("half", 64, 80): dict(fwd=_T(32, 32, 4, 1), dq=_T(16, 16, 2, 1), dkdv=_T(16, 16, 2, 1)),
    ("half", 128, 80): dict(fwd=_T(32, 32, 4, 1), dq=_T(16, 32, 4, 1), dkdv=_T(16, 16, 4, 1)),
    # sm_100: dk/dv rows not hoisted (hoisted, 8-96 B spilled); forward buckets not loaded ahead (20 B).
    ("half", 64, 100): dict(fwd=_T(64, 64, 4, 1, hoist=False), dq=_T(32, 64, 4, 1),
                            dkdv=_T(64, 64, 8, 1, hoist=False)),
    ("half", 128, 100): dict(fwd=_T(32, 64, 4, 1), dq=_T(16, 64, 4, 1), dkdv=_T(64, 16, 4, 1, hoist=False)),
    ("fp32", 64, 90): dict(fwd=_T(64, 64, 8, 1), dq=_T(32, 32, 4, 1), dkdv=_T(32, 32, 4, 1)),
    ("fp32", 128, 90): dict(fwd=_T(64, 64, 8, 1), dq=_T(16, 16, 2, 1), dkdv=_T(16, 16, 2, 1)),
    ("fp32", 64, 80): dict(fwd=_T(32, 32, 4, 1), dq=_T(16, 16, 2, 1), dkdv=_T(16, 16, 2, 1)),
    ("fp32", 128, 80): dict(fwd=_T(32, 16, 4, 1), dq=_T(16, 16, 2, 1), dkdv=_T(16, 16, 2, 1)),
    ("fp32", 64, 100): dict(fwd=_T(64, 64, 4, 1), dq=_T(32, 32, 4, 1), dkdv=_T(32, 32, 4, 1)),
    ("fp32", 128, 100): dict(fwd=_T(32, 16, 4, 1), dq=_T(16, 16, 2, 1), dkdv=_T(16, 16, 2, 1)),
}
# The interpreter runs programs one after another: few, larger tiles are fastest. Two warps make the forward
# walk its paths apart, as on the GPU's 64-row tiles (tests take four warps for the one-loop forward).
INTERPRETER_TILES = Tiles(32, 32, 2, 1)
# Compute capability the host code plans for when its tensors are not on a GPU (the compile check
# records launches for each target by setting it).
PLANNED_CAPABILITY = 90
# Warps per SM the programs of one launch are sized for (the kernels use up to 255 registers a thread,
# so about 8 warps fit), and the SMs assumed off a GPU, per planned capability (A100, H100, B200).
WARPS_PER_SM = 8
PLANNED_SMS = {80: 108, 90: 132, 100: 148}
# The backward's partial position gradients, scratch buffers and delta may take at most this
# fraction of the bytes of dq + dk + dv; it caps the programs per head.
PARTIAL_BUDGET = 1.0
DELTA_ELEMENTS = 2048  # elements of dO and O per program of the delta kernel (rows = this / d)
END_ELEMENTS = 2048    # elements of Q and K per program of the end-terms kernel (rows = this / d; 4096 spills)


def capability(device: torch.device) -> int:
    """The compute capability kernels are planned for: the GPU's, else :data:`PLANNED_CAPABILITY`."""
    if device.type != "cuda":
        return PLANNED_CAPABILITY
    major, _ = torch.cuda.get_device_capability(device)
    return {9: 90, 10: 100}.get(major, 80)  # Hopper, datacenter Blackwell; the rest run mma.sync like Ampere


def multiprocessors(device: torch.device) -> int:
    """The device's SMs, or those of the GPU planned for (:data:`PLANNED_CAPABILITY`) off a GPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return PLANNED_SMS[PLANNED_CAPABILITY]


def tiles_for(kernel: str, head_dim: int, dtype: torch.dtype, cc: int = 90) -> Tiles:
    """The launch shape of ``kernel`` ("fwd", "dkdv" or "dq") for inputs of ``head_dim`` and ``dtype``
    on compute capability ``cc``."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return INTERPRETER_TILES
    inputs = "fp32" if dtype == torch.float32 else "half"
    size = 32 if head_dim <= 32 and inputs == "half" else max(64, head_dim)
    return _TILES[(inputs, size, cc)][kernel]


def tile_saturation(n: int, tiles: Tiles, position_buckets: int, max_relative_positions: int) -> torch.Tensor:
    """Which tiles of one length-``n`` sequence take the saturated path, as the kernels decide it
    (rows: query blocks, columns: key blocks): the window lies wholly in bucket 0 or the top bucket."""
    bm, bn = tiles.block_m, tiles.block_n
    reach = n + bm + bn  # every distance a tile's window covers, its overhang past n included
    span = attention_span(position_buckets, max_relative_positions)
    table = bucket_table(reach, position_buckets, max_relative_positions).long()
    first = torch.arange(0, n, bm)[:, None] - torch.arange(0, n, bn)[None, :] - (bn - 1) + reach
    lo, hi = table[first], table[first + bm + bn - 2]
    return (lo == hi) & ((lo == 0) | (lo == 2 * span - 1))


@dataclass(frozen=True)
class TilePaths:
    """How many tiles of one sequence take each path of a kernel."""

    saturated: int  # one end bucket: c2p / p2c are per-row / per-column vectors, rank-1 gradients
    general: int    # the rest: window products through the scratch, band gradients

    @property
    def total(self) -> int:
        return self.saturated + self.general


def tile_paths(n: int, tiles: Tiles, position_buckets: int, max_relative_positions: int) -> TilePaths:
    """The path counts of a kernel with ``tiles`` over one sequence of ``n`` tokens."""
    saturated = int(tile_saturation(n, tiles, position_buckets, max_relative_positions).sum())
    blocks = -(-n // tiles.block_m) * -(-n // tiles.block_n)
    return TilePaths(saturated, blocks - saturated)


@dataclass(frozen=True, eq=False)
class DistanceTable:
    """The bucket index of every distance in ``[-max_distance, max_distance]``, built once per shape on the
    host (a pure function of the distances and the bucket settings), with the limits the backward's band
    is planned from: no device value is ever read to plan a launch (issue 30: no host syncs)."""

    host: torch.Tensor   # int32 [2 * max_distance + 1], on the CPU
    key: tuple           # (max_distance, position_buckets, max_relative_positions)
    top: int             # the largest bucket index
    bottom_end: int      # the last distance in bucket 0 (or -max_distance - 1 when none is)
    top_start: int       # the first distance in the top bucket (or max_distance + 1 when none is)

    @property
    def max_distance(self) -> int:
        return self.key[0]


@contextlib.contextmanager
def _on_host():
    """Host planning runs on real CPU tensors, also while a fake-tensor mode traces the op."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.inference_mode(False), torch.no_grad():
        yield


@functools.lru_cache(maxsize=64)
def _distance_table(max_distance: int, position_buckets: int, max_relative_positions: int) -> DistanceTable:
    """The reference bucket table on the host, checked to rise by at most one per unit of distance.

    That property makes a chunk of distances map onto contiguous buckets (the band merge).
    """
    with _on_host():
        table = bucket_table(max_distance, position_buckets, max_relative_positions, "cpu")
        step = int((table[1:] - table[:-1]).max()) if table.numel() > 1 else 0
        if step > 1:
            raise NotImplementedError(
                f"position_buckets={position_buckets}, max_relative_positions={max_relative_positions}: the bucket "
                f"index jumps by {step} between neighbouring distances; the Triton kernel needs steps <= 1 "
                "(max_relative_positions >= about 2.7 * position_buckets / 2); use impl='reference'")
        top = int(table[-1])
        bottom_end = int((table == 0).sum()) - 1 - max_distance
        top_start = max_distance - int((table == top).sum()) + 1 if top > 0 else max_distance + 1
    return DistanceTable(table, (max_distance, position_buckets, max_relative_positions), top, bottom_end, top_start)


_DEVICE_COPIES: dict = {}  # (what the host tensor is, device) -> its device copy, reused by every later call
_MAX_DEVICE_COPIES = 512


def _on_device(key: tuple, host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``: copied once per device and kept, so a call that CUDA graphs capture (after a
    warm-up call) makes no host-to-device copy; under a fake-tensor mode a fresh fake copy, never kept."""
    fake_mode = torch._guards.detect_fake_mode()
    if fake_mode is not None:
        return fake_mode.from_tensor(host).to(device)
    copy = _DEVICE_COPIES.get((key, device))
    if copy is None:
        if len(_DEVICE_COPIES) >= _MAX_DEVICE_COPIES:
            _DEVICE_COPIES.clear()
        copy = _DEVICE_COPIES[(key, device)] = host.to(device)
    return copy


def band_range(table: DistanceTable, n_ctx: int, tiles: Tiles, kernel: str) -> tuple[int, int, int]:
    """``(lo, hi, width)`` of a backward kernel's band: ``lo``/``hi`` bound every distance of a general tile's
    window (a general window meets the unsaturated middle of the table), ``width`` the distances one block
    of the kernel ("dq": a query block, "dkdv": a key block) meets; the kernels start a block's band at
    the larger of ``lo`` and its own smallest distance. Host arithmetic only."""
    length = tiles.block_m + tiles.block_n - 1
    keys, queries = -(-n_ctx // tiles.block_n) * tiles.block_n, -(-n_ctx // tiles.block_m) * tiles.block_m
    lo = max(table.bottom_end + 2 - length, -(keys - 1))
    hi = min(table.top_start - 2 + length, queries - 1)
    block = keys + tiles.block_m - 1 if kernel == "dq" else queries + tiles.block_n - 1
    return lo, hi, max(1, min(hi - lo + 1, block))


@functools.lru_cache(maxsize=256)
def band_folds(table: DistanceTable, lo: int, hi: int, chunk: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per ``chunk``-distance chunk from ``lo`` up to ``hi``: int32 ``[first bucket, bucket count]`` and the
    one-hot ``[distance, bucket]`` matrix in ``dtype`` that ``_band_gradients`` merges its columns with
    (host tensors, built once per shape)."""
    with _on_host():
        offsets = torch.arange(chunk)
        starts = torch.arange(lo, hi + 1, chunk)
        buckets = table.host[starts[:, None] + offsets[None, :] + table.max_distance].long()
        first = buckets[:, :1]
        info = torch.cat([first, buckets[:, -1:] - first + 1], 1).to(torch.int32).contiguous()
        return info, ((buckets - first)[:, :, None] == offsets[None, None, :]).to(dtype).contiguous()


@dataclass(frozen=True)
class _Problem:
    """Everything but the five differentiable tensors: geometry, index table, masks and RNG."""

    num_seqs: int
    n_heads: int
    n_ctx: int              # padded length, or max_seqlen of the packed form
    strides: tuple          # (batch, head, token) strides of q/k/v/o (head dim contiguous)
    stat_shape: tuple       # per-row statistics (lse, delta): [B, H, N] (padded) or [H, total_tokens] (packed)
    stat_strides: tuple     # (sequence, head) strides into them; the token stride is 1
    table: DistanceTable    # bucket index of every distance from -max_distance to +max_distance (host)
    device_table: torch.Tensor  # its device copy, from distance 0 on (what the kernels index)
    mask: torch.Tensor | None   # the padding mask's words (int32 [num_seqs, mask_words], ``mask_bits``), or None
    cu_seqlens: torch.Tensor | None
    two_span: int
    scale: float                 # the one scale, or 1.0 (unused) when ``scales`` is given
    scales: torch.Tensor | None  # float32 [num_seqs]: one softmax scale per sequence
    mask_diagonal: bool
    dropout_p: float
    seed: int
    cc: int                      # compute capability the tiles are chosen for
    sms: int                     # the device's multiprocessors

    def slots(self, tiles: Tiles) -> int:
        """Programs of a launch with ``tiles`` the device runs at once (``WARPS_PER_SM`` warps per SM)."""
        return self.sms * max(1, WARPS_PER_SM // tiles.num_warps)

    @property
    def stat_numel(self) -> int:
        return int(torch.Size(self.stat_shape).numel())

    def saturation_limits(self) -> dict[str, int]:
        """The distances from which a tile's window lies wholly in the top bucket (``top_start``; never, when
        the table's top is not the last bucket ``_end_bias`` reads) or up to which wholly in bucket 0
        (``bottom_end``): the forward splits its key blocks by them (``_general_blocks``)."""
        top = self.table.top_start if self.table.top == self.two_span - 1 else 2 ** 30
        return {"top_start": top, "bottom_end": self.table.bottom_end}

    def saturates(self, q: torch.Tensor) -> bool:
        """Whether a tile of any kernel can lie wholly in bucket 0 or the top bucket: only such a tile reads the
        end terms. The highest window of a kernel's tiles starts at ``i0 - (BN - 1)`` for its last query block
        and key block 0, the lowest ends at ``BM - 1 - j0`` for query block 0 and its last key block (the
        table is monotone). At 512 tokens and DeBERTa-v3's 512 relative positions no tile saturates."""
        limits, last = self.saturation_limits(), self.n_ctx - 1
        for kernel in KERNELS:
            tiles = self.tiles(kernel, q)
            highest_start = last // tiles.block_m * tiles.block_m - (tiles.block_n - 1)
            lowest_end = tiles.block_m - 1 - last // tiles.block_n * tiles.block_n
            if highest_start >= limits["top_start"] or lowest_end <= limits["bottom_end"]:
                return True
        return False

    def tiles(self, kernel: str, q: torch.Tensor) -> Tiles:
        return tiles_for(kernel, q.shape[-1], q.dtype, self.cc)

    def launch(self, kernel, tiles: Tiles, grid: tuple, q: torch.Tensor, has_c2p: bool, has_p2c: bool,
               **args) -> None:
        """Launch one of the attention kernels on ``grid``."""
        kernel[grid](
            TABLE=self.device_table,
            MASK=q if self.mask is None else self.mask,  # q stands in for absent optional tensors
            CU=q if self.cu_seqlens is None else self.cu_seqlens,
            SCALES=q if self.scales is None else self.scales,
            seed=self.seed, scale=self.scale, dropout_p=self.dropout_p, n_ctx=self.n_ctx, n_heads=self.n_heads,
            num_seqs=self.num_seqs, stat_numel=self.stat_numel,
            stride_b=self.strides[0], stride_h=self.strides[1], stride_n=self.strides[2],
            stride_lb=self.stat_strides[0], stride_lh=self.stat_strides[1],
            TWO_SPAN=self.two_span, HEAD_DIM=q.shape[-1], BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
            WINDOW=tiles.window, SPLIT=tiles.split, HAS_C2P=has_c2p, HAS_P2C=has_p2c,
            HAS_MASK=self.mask is not None, VARLEN=self.cu_seqlens is not None, DROPOUT=self.dropout_p > 0,
            SCALE_PER_SEQ=self.scales is not None, MASK_DIAGONAL=self.mask_diagonal,
            HOIST=tiles.hoist and (tiles.hoist_diagonal or not self.mask_diagonal),
            PRECISION="tf32",  # fp32 inputs use TF32 tensor cores (docs/kernels.md); half inputs ignore it
            num_warps=tiles.num_warps, num_stages=tiles.num_stages, **args)

    def _rows(self, kernel, q: torch.Tensor, block: int, **args) -> None:
        """Launch a per-row-block kernel (delta, end terms) over (row blocks, sequences x heads)."""
        kernel[(triton.cdiv(self.n_ctx, block), self.num_seqs * self.n_heads)](
            CU=q if self.cu_seqlens is None else self.cu_seqlens, n_ctx=self.n_ctx, n_heads=self.n_heads,
            stride_b=self.strides[0], stride_h=self.strides[1], stride_n=self.strides[2],
            stride_lb=self.stat_strides[0], stride_lh=self.stat_strides[1], HEAD_DIM=q.shape[-1], BLOCK=block,
            VARLEN=self.cu_seqlens is not None, num_warps=4, **args)

    def row_delta(self, out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
        """``rowsum(dO * O)`` (= ``rowsum(P * dP)``) in float32, laid out like the lse."""
        delta = torch.empty(self.stat_shape, dtype=torch.float32, device=out.device)
        self._rows(_attn_bwd_delta, out, DELTA_ELEMENTS // out.shape[-1], O=out, DO=grad_out, DELTA=delta)
        return delta

    def end_terms(self, q, k, pos_key, pos_query) -> torch.Tensor:
        """``[4, *stat_shape]`` float32: each token's c2p and p2c values against bucket 0 and the top bucket;
        nothing to compute (a one-element stand-in, never read) without position terms or saturated tiles."""
        if (pos_key is None and pos_query is None) or not self.saturates(q):
            return q.new_empty((1,), dtype=torch.float32)
        end = torch.zeros((4, *self.stat_shape), dtype=torch.float32, device=q.device)
        self._rows(_attn_end_terms, q, END_ELEMENTS // q.shape[-1], Q=q, K=k, KR=q if pos_key is None else pos_key,
                   QR=q if pos_query is None else pos_query, END=end, stat_numel=self.stat_numel,
                   TWO_SPAN=self.two_span, HAS_C2P=pos_key is not None, HAS_P2C=pos_query is not None)
        return end


def programs_per_head(items: int, per_program_bytes: int, budget_bytes: int, n_heads: int, slots: int) -> int:
    """How many programs share a head's ``items`` (sequence, block) pairs: enough to fill the device's
    ``slots`` (at most one per item), and few enough that their buffers (``per_program_bytes`` each)
    fit ``budget_bytes``; at least one."""
    wanted = min(items, max(1, slots // n_heads))
    if per_program_bytes:
        wanted = min(wanted, budget_bytes // (n_heads * per_program_bytes))
    return max(1, wanted)


def mask_bits(mask: torch.Tensor, n_ctx: int) -> torch.Tensor:
    """The 2-D padding mask ``[B, n_ctx]`` packed 32 tokens to an int32 word (bit ``j % 32`` of word ``j // 32``
    set where token ``j`` is real), one word past the last token: the kernels read a tile side's visibility with
    one scalar load per 32 tokens (``_mask_words``), not one byte load per token pair a thread holds."""
    words = -(-n_ctx // 32) + 1  # as _mask_stride
    padded = torch.nn.functional.pad(mask.ne(0), (0, words * 32 - n_ctx)).view(mask.shape[0], words, 32)
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    return (padded.to(torch.int32) << shifts).sum(-1, dtype=torch.int32)


def attention_forward(q, k, v, pos_key, pos_query, problem: _Problem):
    """Output, base-2 row log-sum-exp and the end terms of the fused forward."""
    out = torch.empty_like(q)
    lse = torch.empty(problem.stat_shape, dtype=torch.float32, device=q.device)
    end = problem.end_terms(q, k, pos_key, pos_query)
    has_terms = pos_key is not None or pos_query is not None
    tiles = problem.tiles("fwd", q) if has_terms else problem.tiles("fwd", q).content_only()
    items = problem.num_seqs * triton.cdiv(problem.n_ctx, tiles.block_m)
    scratch_elements = 2 * (tiles.block_m + tiles.block_n) * tiles.window if has_terms else 0
    programs = programs_per_head(items, 0, 0, problem.n_heads, problem.slots(tiles))
    scratch = q.new_empty(max(1, problem.n_heads * programs * scratch_elements))
    problem.launch(_attn_fwd, tiles, (programs, problem.n_heads), q, pos_key is not None, pos_query is not None,
                   Q=q, K=k, V=v, KR=q if pos_key is None else pos_key, QR=q if pos_query is None else pos_query,
                   END=end, O=out, LSE=lse, SCRATCH=scratch, items_per_program=triton.cdiv(items, programs),
                   scratch_elements=scratch_elements, PATHS_APART=tiles.paths_apart,
                   **problem.saturation_limits())
    return out, lse, end


@dataclass(frozen=True)
class BackwardBuffers:
    """What one program of a backward kernel keeps in memory: its float32 partial of the kernel's position
    table gradient (``2k`` rows plus a chunk of padding, see ``_band_gradients``) and its scratch (two
    window-product buffers, the band), both absent without the terms they serve."""

    partial_rows: int
    scratch_elements: int
    element_size: int
    head_dim: int

    @property
    def program_bytes(self) -> int:
        return self.partial_rows * self.head_dim * 4 + self.scratch_elements * self.element_size


def backward_buffers(tiles: Tiles, two_span: int, band: int, q: torch.Tensor, kernel: str, has_term: bool,
                     has_terms: bool) -> BackwardBuffers:
    """The buffers of a program of ``kernel`` ("dq" or "dkdv"); ``has_term``: it computes its own position
    gradient (c2p for dq, p2c for dk/dv); ``has_terms``: the scores have a position term at all."""
    block = tiles.block_m if kernel == "dq" else tiles.block_n
    products = 2 * (tiles.block_m + tiles.block_n) * tiles.window if has_terms else 0
    return BackwardBuffers(two_span + tiles.chunk if has_term else 0, products + (block * band if has_term else 0),
                           q.element_size(), q.shape[-1])


def _backward_kernel(problem: _Problem, kernel, name: str, q, has_term: bool, budget: int, part_name: str,
                     **args) -> torch.Tensor | None:
    """Launch a backward kernel over (sequence, block) items of each head; its summed partials."""
    tiles = problem.tiles(name, q)
    items = problem.num_seqs * triton.cdiv(problem.n_ctx, tiles.block_m if name == "dq" else tiles.block_n)
    lo, hi, band = band_range(problem.table, problem.n_ctx, tiles, name)
    folds = band_folds(problem.table, lo, hi, tiles.chunk, q.dtype)
    fold, merge = (_on_device((problem.table.key, lo, hi, tiles.chunk, q.dtype, i), t, q.device)
                   for i, t in enumerate(folds))
    has_terms = args["KR"] is not q or args["QR"] is not q
    buffers = backward_buffers(tiles, problem.two_span, band, q, name, has_term, has_terms)
    programs = programs_per_head(items, buffers.program_bytes, budget, problem.n_heads, problem.slots(tiles))
    shape = (problem.n_heads, programs, buffers.partial_rows, q.shape[-1]) if has_term else (1,)
    partial = torch.zeros(shape, dtype=torch.float32, device=q.device)
    scratch = q.new_empty(max(1, problem.n_heads * programs * buffers.scratch_elements))
    problem.launch(kernel, tiles, (programs, problem.n_heads), q, args["KR"] is not q, args["QR"] is not q,
                   items_per_program=triton.cdiv(items, programs),
                   scratch_elements=buffers.scratch_elements, lo=lo, FOLD=fold, MERGE=merge, BAND=band,
                   CHUNK=tiles.chunk, SCRATCH=scratch, **{part_name: partial}, **args)
    return partial.sum(1)[:, :problem.two_span] if has_term else None  # fixed order: deterministic


def attention_backward(grad_out, q, k, v, pos_key, pos_query, out, lse, end, problem: _Problem):
    """``dq, dk, dv, d_pos_key, d_pos_query`` (None for absent position terms).

    Extra memory beyond the gradients: ``delta`` and one kernel's partials and scratch at a time,
    together at most ``PARTIAL_BUDGET`` x the bytes of ``dq + dk + dv`` (and at least one program per head).
    """
    grad_out = grad_out.contiguous()
    delta = problem.row_delta(out, grad_out)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # What else is alive beside the partials: delta, the end terms and a head's summed partials before their cast.
    others = (delta.numel() + end.numel()) * 4 + 2 * problem.n_heads * problem.two_span * q.shape[-1] * 4
    budget = int(PARTIAL_BUDGET * 3 * q.numel() * q.element_size()) - others
    common = dict(Q=q, K=k, V=v, KR=q if pos_key is None else pos_key, QR=q if pos_query is None else pos_query,
                  END=end, DO=grad_out, LSE=lse, DELTA=delta)
    d_pos_query = _backward_kernel(problem, _attn_bwd_dkdv, "dkdv", q, pos_query is not None, budget, "DQR_PART",
                                   DK=dk, DV=dv, **common)
    d_pos_key = _backward_kernel(problem, _attn_bwd_dq, "dq", q, pos_key is not None, budget, "DKR_PART", DQ=dq,
                                 **common)
    return (dq, dk, dv, None if d_pos_key is None else d_pos_key.to(pos_key.dtype),
            None if d_pos_query is None else d_pos_query.to(pos_query.dtype))


class _DisentangledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pos_key, pos_query, problem: _Problem):
        out, lse, end = attention_forward(q, k, v, pos_key, pos_query, problem)
        ctx.save_for_backward(q, k, v, pos_key, pos_query, out, lse, end)
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
    position tables (``n_heads * 2*span * d``) and, with dropout, the hashed counter ``i * n_ctx + j``.
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
    # Tiles read the table from distance -(n_ctx + BLOCK_N) up to n_ctx + WINDOW.
    cc = capability(q.device)
    tiles = [tiles_for(kernel, q.shape[-1], q.dtype, cc) for kernel in KERNELS]
    max_distance = n_ctx + max(t.window + t.block_m + t.block_n for t in tiles)
    table = _distance_table(max_distance, call.position_buckets, call.max_relative_positions)
    device_table = _on_device(table.key, table.host, q.device)[max_distance:]  # element 0 is distance 0
    return _Problem(num_seqs=num_seqs, n_heads=heads, n_ctx=n_ctx,
                    strides=strides, stat_shape=stat_shape, stat_strides=stat_strides, table=table,
                    device_table=device_table, mask=mask, cu_seqlens=cu_seqlens, two_span=two_span,
                    scale=1.0 if call.per_sequence_scale else call.softmax_scale,
                    scales=call.softmax_scale if call.per_sequence_scale else None, mask_diagonal=call.mask_diagonal,
                    dropout_p=call.dropout_p, seed=dropout_seed(call.dropout_p) if call.seed is None else call.seed, cc=cc, sms=multiprocessors(q.device))


def _tables_in(call: AttentionCall) -> list:
    """Position tables in q's dtype, contiguous; the cast is part of the autograd graph."""
    return [None if t is None else t.to(call.q.dtype).contiguous() for t in (call.pos_key, call.pos_query)]


def plan(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, _Problem]:
    """Contiguous ``q, k, v`` and the launch plan of a validated call, padded or packed (host work only:
    no device value is read). The dropout seed is ``call.seed`` when given (the custom op's backward
    replans with its forward's seed), else a fresh one."""
    _check_kernel_inputs(call.q, {"k": call.k, "v": call.v, "pos_key": call.pos_key, "pos_query": call.pos_query,
                                  "attention_mask": call.attention_mask, "cu_seqlens": call.cu_seqlens})
    q, k, v = call.q.contiguous(), call.k.contiguous(), call.v.contiguous()
    if call.cu_seqlens is None:
        batch, heads, n, _ = q.shape
        mask = None if call.attention_mask is None else mask_bits(call.attention_mask, n)
        problem = _make_problem(call, num_seqs=batch, n_ctx=n, strides=(q.stride(0), q.stride(1), q.stride(2)),
                                stat_shape=(batch, heads, n), stat_strides=(heads * n, n), mask=mask, cu_seqlens=None)
    else:
        total, heads, _ = q.shape
        problem = _make_problem(call, num_seqs=call.cu_seqlens.numel() - 1, n_ctx=call.max_seqlen,
                                strides=(0, q.stride(1), q.stride(0)), stat_shape=(heads, total),
                                stat_strides=(0, total), mask=None,
                                cu_seqlens=call.cu_seqlens.to(torch.int32).contiguous())
    return q, k, v, problem


def _apply(call: AttentionCall) -> torch.Tensor:
    q, k, v, problem = plan(call)
    return _DisentangledAttention.apply(q, k, v, *_tables_in(call), problem)


@attention_op
def disentangled_attention(call: AttentionCall) -> torch.Tensor:
    """Triton DeBERTa attention over ``[B, H, N, d]``; semantics of :func:`reference.disentangled_attention`."""
    return _apply(call)


@varlen_attention_op
def disentangled_attention_varlen(call: AttentionCall) -> torch.Tensor:
    """Packed Triton form over ``[total_tokens, H, d]``; relative positions restart in every sequence."""
    return _apply(call)
