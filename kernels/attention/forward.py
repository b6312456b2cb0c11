"""The fused forward: each program walks (sequence, query block) items of one head; a block's key blocks come in
three runs (top-saturated, general, saturated in bucket 0) walked by straight-line loops that read their key
side a tile ahead, or in one loop that reads each tile's path from the bucket table. Also the per-token end
terms that saturated tiles add, and the host function that launches both."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from .dense import _dense_bias, _dense_scores_at, _mirrored_buckets, HeadMajor, dense_scores, dense_strides
from .planning import END_ELEMENTS, _Problem, programs_per_head
from .scores import (CONTENT, GENERAL, LOG2E, PER_TILE, SATURATED, _dropout_keep, _end_row_column, _item, _load_rows,
                     _load_stat, _locate, _mask_words, _pair_visible, _path_ends, _program_items, _side_visible,
                     _skewed_read, _store_rows, _store_window_products, _table_ahead, _tile_scores, _window_buckets,
                     _window_rows, _words_visible)


@triton.jit
def _end_pair(own_ptr, rel_ptr, out, stat_numel, i0, offs_r, offs_d, stride_n, seq_len, ok,
              TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr):
    """``own . rel[0]`` and ``own . rel[top]`` of a block of rows, stored ``stat_numel`` apart."""
    own = _load_rows(own_ptr, i0, offs_r, offs_d, stride_n, seq_len).to(tl.float32)
    for end in tl.static_range(2):
        row = tl.load(rel_ptr + end * (TWO_SPAN - 1) * HEAD_DIM + offs_d).to(tl.float32)
        tl.store(out + end * stat_numel, tl.sum(own * row[None, :], 1), mask=ok)


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
def _column_words(mask_ptr, j0, limit, offs_n, HAS_MASK: tl.constexpr):
    """The padding-mask word of each key column ``j0 + offs_n`` as a word pair (:func:`_mask_words`' form), loaded
    per column. The one scalar word a run carries to its next tile was moved to a uniform register as soon as
    it was loaded (``R2UR``), so a saturated tile waited out the round trip it had issued a tile ahead (sm_80,
    550 of its 1,960 cycles at a 600-cycle trip); a register per column is consumed only by the next tile."""
    words = (0, 0)
    if HAS_MASK:
        cols = j0 + offs_n
        column_words = tl.load(mask_ptr + cols // 32, mask=cols < limit, other=0)
        words = (column_words, column_words)
    return words


@triton.jit
def _key_tile(K, V, mask_ptr, END, base, stat_off, stat_numel, j0, limit, seq_len, stride_n, offs_n, offs_d, top,
              PATH: tl.constexpr, HAS_P2C: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr,
              KEYS_AHEAD: tl.constexpr):
    """What a forward tile of key block ``j0`` reads on its key side: the padding mask's words and, on a
    saturated run, its keys' p2c end terms; with ``KEYS_AHEAD`` (``Tiles.keys_ahead``) a saturated run also its
    K and V rows, and each column's mask word (:func:`_column_words`). A run issues these a tile ahead (two
    stages by hand), so no tile waits on them; nothing at or past ``limit`` (the run's end, or the sequence's)
    is read, no row at or past the sequence's end. A general tile loads its K and V rows itself: a tile ahead
    they would be live across its window products, where the registers are spent (255 on sm_80 without them:
    20-40 B spilled)."""
    p_end = ()
    rows = ()
    if PATH == SATURATED and KEYS_AHEAD:
        words = _column_words(mask_ptr, j0, limit, offs_n, HAS_MASK)
        rows = (_load_rows(K + base, j0, offs_n, offs_d, stride_n, seq_len),
                _load_rows(V + base, j0, offs_n, offs_d, stride_n, seq_len))
    else:
        words = _mask_words(mask_ptr, j0, limit, BLOCK_N, HAS_MASK)
    if PATH == SATURATED:
        p_end = tl.zeros([BLOCK_N], tl.float32)
        if HAS_P2C:
            end = tl.where(top, 1, 0).to(tl.int64)
            p_end = _load_stat(END + (2 + end) * stat_numel + stat_off, j0, offs_n, limit, 0.0)
    return words, p_end, rows


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
def _general_buckets(TABLE, MIRROR, d0, offs_m, offs_n, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
                     SPLIT: tl.constexpr, DENSE_SCORES: tl.constexpr):
    """The buckets a general tile with ``i0 - j0 = d0`` reads: with ``DENSE_SCORES`` each score's,
    ``bucket(d0 + a - b)`` (``[BM, BN]``, from the mirrored table in L1), else its window's
    (:func:`_window_buckets`)."""
    if DENSE_SCORES:
        buckets = _mirrored_buckets(MIRROR, d0, offs_m, offs_n)
    else:
        buckets = _window_buckets(TABLE, d0 - (BLOCK_N - 1), WINDOW, SPLIT)
    return buckets


@triton.jit
def _fwd_run(acc, m_i, l_i, q, row_ok, K, V, KR, QR, TABLE, MIRROR, mask_ptr, END, scratch, dense, i0, j_start,
             j_end, seed, scale, dropout_p, n_ctx, seq_len, base, stat_off, stat_numel, stride_n, offs_m, offs_n,
             offs_d, top, PATH: tl.constexpr, TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, SPLIT: tl.constexpr, HAS_C2P: tl.constexpr,
             HAS_P2C: tl.constexpr, HAS_MASK: tl.constexpr, MASK_DIAGONAL: tl.constexpr, DROPOUT: tl.constexpr,
             HOIST: tl.constexpr, KEYS_AHEAD: tl.constexpr, DENSE_SCORES: tl.constexpr, PRECISION: tl.constexpr,
             STAGES: tl.constexpr):
    """Online softmax over key blocks ``j_start, j_start + BN, ... < j_end``, all on path ``PATH`` (saturated at
    the top end when ``top``, or general). Each tile's mask words and end terms (:func:`_key_tile`) were loaded a
    tile before it, the query rows' visibility (``row_ok``) once per block and a saturated run's c2p end terms,
    one per query row, once per run; a general run's window buckets a tile ahead when it hoists, its window rows
    and K rows at the tile's start, its V rows after the window products. With ``DENSE_SCORES`` a general tile
    reads its c2p and p2c from the dense products (``dense``: the sequence's rows of ``C2P`` and ``P2C``) at the
    buckets it loads from the mirrored table (``MIRROR``): no window rows, products or scratch. ``STAGES``: the
    run's pipeline stages (``Tiles.saturated_stages`` on the saturated runs; None: the launch's)."""
    limit = tl.minimum(seq_len, j_end)
    c_end = tl.zeros([BLOCK_M], tl.float32)
    if PATH == SATURATED and HAS_C2P:
        c_end = _load_stat(END + tl.where(top, 1, 0).to(tl.int64) * stat_numel + stat_off, i0, offs_m, seq_len, 0.0)
    buckets = ()
    if PATH == GENERAL and not DENSE_SCORES:
        buckets = _general_buckets(TABLE, MIRROR, i0 - j_start, offs_m, offs_n, BLOCK_N, WINDOW, SPLIT, False)
    ahead = _key_tile(K, V, mask_ptr, END, base, stat_off, stat_numel, j_start, limit, seq_len, stride_n, offs_n,
                      offs_d, top, PATH, HAS_P2C, HAS_MASK, BLOCK_N, KEYS_AHEAD)
    for j0 in tl.range(j_start, j_end, BLOCK_N, num_stages=STAGES):  # STAGES None: the launch's
        words, p_end, rows = ahead
        ahead = _key_tile(K, V, mask_ptr, END, base, stat_off, stat_numel, j0 + BLOCK_N, limit, seq_len, stride_n,
                          offs_n, offs_d, top, PATH, HAS_P2C, HAS_MASK, BLOCK_N, KEYS_AHEAD)
        current = buckets
        if PATH == GENERAL and HOIST and not DENSE_SCORES:  # the next tile's, a tile ahead (the table reaches past)
            buckets = _general_buckets(TABLE, MIRROR, i0 - j0 - BLOCK_N, offs_m, offs_n, BLOCK_N, WINDOW, SPLIT,
                                       False)
        elif PATH == GENERAL:  # a dense tile's [BM, BN] buckets held a tile ahead spilled (8-28 B)
            current = _general_buckets(TABLE, MIRROR, i0 - j0, offs_m, offs_n, BLOCK_N, WINDOW, SPLIT,
                                       DENSE_SCORES)
        if PATH == GENERAL and DENSE_SCORES:  # first: the round trip the tile waits for
            position = _dense_bias(dense[0], dense[1], current, i0, j0, offs_m, offs_n, seq_len, HAS_C2P, HAS_P2C,
                                   TWO_SPAN, False)
        elif PATH == GENERAL:
            krw, qrw = _window_rows(KR, QR, current, offs_d, HEAD_DIM, SPLIT, HAS_C2P, HAS_P2C, BLOCK_M < 64)
        if PATH == SATURATED and KEYS_AHEAD:
            k, v = rows
        else:
            k = _load_rows(K + base, j0, offs_n, offs_d, stride_n, seq_len)
            if PATH == SATURATED:
                v = _load_rows(V + base, j0, offs_n, offs_d, stride_n, seq_len)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if PATH == GENERAL and DENSE_SCORES:
            v = _load_rows(V + base, j0, offs_n, offs_d, stride_n, seq_len)
            s += position
        elif PATH == GENERAL:
            # consecutive general tiles alternate two scratch buffers: a tile's stores never race the last one's loads
            buffer = scratch + ((j0 // BLOCK_N) % 2) * ((BLOCK_M + BLOCK_N) * WINDOW)
            _store_window_products(q, k, krw, qrw, buffer, offs_m, offs_n, BLOCK_M, WINDOW, SPLIT, HAS_C2P,
                                   HAS_P2C, PRECISION)
            v = _load_rows(V + base, j0, offs_n, offs_d, stride_n, seq_len)  # not held across the products
            s += _skewed_read(buffer, offs_m, offs_n, BLOCK_M, BLOCK_N, WINDOW, HAS_C2P, HAS_P2C, False)
        else:
            s += _end_row_column(c_end, p_end, False)
        col_ok = _words_visible(words, j0, offs_n, limit, BLOCK_N, HAS_MASK)
        visible = _pair_visible(row_ok, col_ok, i0, j0, offs_m, offs_n, BLOCK_M, BLOCK_N, MASK_DIAGONAL, False)
        s = tl.where(visible, s * (scale * LOG2E), float("-inf"))
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, seed, i0, j0, n_ctx, dropout_p, BLOCK_M, BLOCK_N,
                                      DROPOUT, PRECISION)
    return acc, m_i, l_i


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
        s, _, _, general = _tile_scores(q, k, KR, QR, TABLE, row, mask_ptr, (0, 0), END, (), scratch, (), stat_off,
                                        stat_numel, i0, j0, seq_len, scale, offs_m, offs_n, offs_d, general, TWO_SPAN,
                                        HEAD_DIM, BLOCK_M, BLOCK_N, WINDOW, SPLIT, HAS_C2P, HAS_P2C, HAS_MASK,
                                        MASK_DIAGONAL, False, HOIST, True, False, False, PRECISION)
        v = _load_rows(V + base, j0, offs_n, offs_d, stride_n, seq_len)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, seed, i0, j0, n_ctx, dropout_p, BLOCK_M, BLOCK_N,
                                      DROPOUT, PRECISION)
    return acc, m_i, l_i


@triton.jit
def _fwd_block(Q, K, V, KR, QR, TABLE, MIRROR, mask_ptr, END, O, LSE, scratch, dense, i0, seed, scale, dropout_p,
               n_ctx, seq_len, base, rel_off, stat_off, stat_numel, stride_n, top_start, bottom_end,
               TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               WINDOW: tl.constexpr, SPLIT: tl.constexpr, HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr,
               HAS_MASK: tl.constexpr, MASK_DIAGONAL: tl.constexpr, DROPOUT: tl.constexpr,
               PATHS_APART: tl.constexpr, HOIST: tl.constexpr, KEYS_AHEAD: tl.constexpr,
               DENSE_SCORES: tl.constexpr, PRECISION: tl.constexpr, SATURATED_STAGES: tl.constexpr):
    """Output and base-2 log-sum-exp of query block ``i0``: online softmax over the key blocks. With
    ``PATHS_APART``, walked as three runs, the top-saturated tiles, the general ones and those saturated in
    bucket 0 (the general ones from the dense products ``dense`` with ``DENSE_SCORES``); else in one loop that
    reads each tile's path from the table."""
    offs_m, offs_n, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, HEAD_DIM)
    q = _load_rows(Q + base, i0, offs_m, offs_d, stride_n, seq_len)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    KR, QR = KR + rel_off, QR + rel_off
    if (HAS_C2P or HAS_P2C) and PATHS_APART:
        row_ok = _side_visible(mask_ptr, i0, offs_m, seq_len, BLOCK_M, HAS_MASK)  # once per block, not per tile
        lo, hi = _general_blocks(i0, seq_len, top_start, bottom_end, BLOCK_M, BLOCK_N)
        acc, m_i, l_i = _fwd_run(acc, m_i, l_i, q, row_ok, K, V, KR, QR, TABLE, MIRROR, mask_ptr, END, scratch,
                                 dense, i0, 0, lo, seed, scale, dropout_p, n_ctx, seq_len, base, stat_off, stat_numel,
                                 stride_n, offs_m, offs_n, offs_d, True, SATURATED, TWO_SPAN, HEAD_DIM, BLOCK_M,
                                 BLOCK_N, WINDOW, SPLIT, HAS_C2P, HAS_P2C, HAS_MASK, MASK_DIAGONAL, DROPOUT, HOIST,
                                 KEYS_AHEAD, DENSE_SCORES, PRECISION, SATURATED_STAGES)
        acc, m_i, l_i = _fwd_run(acc, m_i, l_i, q, row_ok, K, V, KR, QR, TABLE, MIRROR, mask_ptr, END, scratch,
                                 dense, i0, lo, hi, seed, scale, dropout_p, n_ctx, seq_len, base, stat_off, stat_numel,
                                 stride_n, offs_m, offs_n, offs_d, False, GENERAL, TWO_SPAN, HEAD_DIM, BLOCK_M, BLOCK_N,
                                 WINDOW, SPLIT, HAS_C2P, HAS_P2C, HAS_MASK, MASK_DIAGONAL, DROPOUT, HOIST, KEYS_AHEAD,
                                 DENSE_SCORES, PRECISION, None)
        acc, m_i, l_i = _fwd_run(acc, m_i, l_i, q, row_ok, K, V, KR, QR, TABLE, MIRROR, mask_ptr, END, scratch,
                                 dense, i0, hi, seq_len, seed, scale, dropout_p, n_ctx, seq_len, base, stat_off,
                                 stat_numel, stride_n, offs_m, offs_n, offs_d, False, SATURATED, TWO_SPAN, HEAD_DIM,
                                 BLOCK_M, BLOCK_N, WINDOW, SPLIT, HAS_C2P, HAS_P2C, HAS_MASK, MASK_DIAGONAL, DROPOUT,
                                 HOIST, KEYS_AHEAD, DENSE_SCORES, PRECISION, SATURATED_STAGES)
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
def _attn_fwd(Q, K, V, KR, QR, TABLE, MIRROR, MASK, CU, SCALES, END, O, LSE, SCRATCH, C2P, P2C,
              seed, scale, dropout_p, n_ctx, n_heads, num_seqs, items_per_program, stat_numel, scratch_elements,
              top_start, bottom_end, stride_b, stride_h, stride_n, stride_lb, stride_lh, dense_lb, dense_lh,
              TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              WINDOW: tl.constexpr, SPLIT: tl.constexpr, HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr,
              HAS_MASK: tl.constexpr, VARLEN: tl.constexpr, DROPOUT: tl.constexpr, SCALE_PER_SEQ: tl.constexpr,
              MASK_DIAGONAL: tl.constexpr, PATHS_APART: tl.constexpr, HOIST: tl.constexpr,
              KEYS_AHEAD: tl.constexpr, DENSE_SCORES: tl.constexpr, PRECISION: tl.constexpr,
              SATURATED_STAGES: tl.constexpr):
    """Program (p, head) walks a run of (sequence, query block) items of one head. With ``DENSE_SCORES`` the
    general tiles read their position terms from ``C2P`` and ``P2C`` (head-major ``[H, rows, 2k]``, rows
    ``dense_lb`` apart per sequence and ``dense_lh`` per head: :func:`dense.dense_scores`)."""
    pid, head = tl.program_id(0), tl.program_id(1)
    scratch = SCRATCH + (head * tl.num_programs(0) + pid).to(tl.int64) * scratch_elements
    blocks = tl.cdiv(n_ctx, BLOCK_M)
    first, end = _program_items(items_per_program, num_seqs, blocks)
    for item in range(first, end):
        i0, seq_len, base, rel_off, stat_off, mask_ptr, seq_seed, seq_scale = _item(
            CU, MASK, SCALES, item, blocks, head, seed, scale, n_ctx, n_heads, stride_b, stride_h, stride_n,
            stride_lb, stride_lh, TWO_SPAN, HEAD_DIM, BLOCK_M, VARLEN, SCALE_PER_SEQ)
        if i0 < seq_len:
            dense = _dense_scores_at(C2P, P2C, stat_off, item // blocks, stride_lb, stride_lh, dense_lb, dense_lh,
                                     TWO_SPAN, DENSE_SCORES)
            _fwd_block(Q, K, V, KR, QR, TABLE, MIRROR, mask_ptr, END, O, LSE, scratch, dense, i0, seq_seed,
                       seq_scale, dropout_p, n_ctx, seq_len, base, rel_off, stat_off, stat_numel, stride_n, top_start,
                       bottom_end, TWO_SPAN, HEAD_DIM, BLOCK_M, BLOCK_N, WINDOW, SPLIT, HAS_C2P, HAS_P2C, HAS_MASK,
                       MASK_DIAGONAL, DROPOUT, PATHS_APART, HOIST, KEYS_AHEAD, DENSE_SCORES, PRECISION,
                       SATURATED_STAGES)
        tl.debug_barrier()  # the next item's first tile may reuse the scratch buffer this one read last


def end_terms(problem: _Problem, q, k, pos_key, pos_query) -> torch.Tensor:
    """``[4, *stat_shape]`` float32: each token's c2p and p2c values against bucket 0 and the top bucket;
    nothing to compute (a one-element stand-in, never read) without position terms or saturated tiles."""
    shape = problem.end_terms_shape(q, pos_key is not None or pos_query is not None)
    if shape == (1,):
        return q.new_empty(shape, dtype=torch.float32)
    end = torch.zeros(shape, dtype=torch.float32, device=q.device)
    problem.launch_rows(_attn_end_terms, q, END_ELEMENTS // q.shape[-1], Q=q, K=k,
                        KR=q if pos_key is None else pos_key, QR=q if pos_query is None else pos_query, END=end,
                        stat_numel=problem.stat_numel, TWO_SPAN=problem.two_span, HAS_C2P=pos_key is not None,
                        HAS_P2C=pos_query is not None)
    return end


def attention_forward(q, k, v, pos_key, pos_query, problem: _Problem):
    """Output, base-2 row log-sum-exp, the end terms and the kept ``C2P`` and ``P2C`` of the fused forward; its
    general tiles read their position terms from dense GEMM products when the plan says so (``_Problem.forward``),
    which it keeps for the backward with ``_Problem.keep_scores`` (else, and for an absent term, an empty
    stand-in: ``_Problem.kept_shape``)."""
    problem = problem.packed()
    out = q.new_empty_strided(q.shape, q.stride())  # q's layout (planning.plan): the fake's too
    lse = torch.empty(problem.stat_shape, dtype=torch.float32, device=q.device)
    end = end_terms(problem, q, k, pos_key, pos_query)
    has_terms = pos_key is not None or pos_query is not None
    tiles = problem.tiles("fwd" if has_terms else "content", q)
    dense = has_terms and problem.forward == "dense"
    items = problem.num_seqs * triton.cdiv(problem.n_ctx, tiles.block_m)
    scratch_elements = 2 * (tiles.block_m + tiles.block_n) * tiles.window if has_terms and not dense else 0
    programs = programs_per_head(items, 0, 0, problem.n_heads, problem.slots(tiles))
    scratch = q.new_empty(max(1, problem.n_heads * programs * scratch_elements))
    c2p, p2c = dense_scores(HeadMajor(q, k), pos_key, pos_query) if dense else (q, q)
    _, dense_lb, dense_lh = dense_strides(problem)
    problem.launch(_attn_fwd, tiles, (programs, problem.n_heads), q, pos_key is not None, pos_query is not None,
                   Q=q, K=k, V=v, KR=q if pos_key is None else pos_key, QR=q if pos_query is None else pos_query,
                   MIRROR=problem.device_mirror, END=end, O=out, LSE=lse, SCRATCH=scratch, C2P=c2p, P2C=p2c,
                   dense_lb=dense_lb, dense_lh=dense_lh,
                   items_per_program=triton.cdiv(items, programs), scratch_elements=scratch_elements,
                   PATHS_APART=tiles.paths_apart, DENSE_SCORES=dense, SATURATED_STAGES=tiles.saturated_stages,
                   KEYS_AHEAD=tiles.keys_ahead and not problem.mask_diagonal,  # Tiles.keys_ahead
                   **problem.saturation_limits())
    kept = (c2p if problem.keep_scores and pos_key is not None else q.new_empty((0,)),
            p2c if problem.keep_scores and pos_query is not None else q.new_empty((0,)))
    return out, lse, end, *kept
