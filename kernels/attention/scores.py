"""What one tile of the fused attention computes, shared by the forward and both backward kernels (device code):
locating a (sequence, head), loading rows, a tile's visibility from the packed padding mask, its path (general
or saturated), the window products through the scratch buffer read back skewed, the end terms of a saturated
tile, and the dropout bits."""

from __future__ import annotations

import triton
import triton.language as tl
from .dense import _dense_bias, _score_buckets, _terms_sum


LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E)


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
def _program_items(items_per_program, num_seqs, blocks):
    """``[first, end)``: the run of (sequence, block) items program ``program_id(0)`` walks, ``blocks`` per sequence."""
    first = tl.program_id(0) * items_per_program
    return first, tl.minimum(first + items_per_program, num_seqs * blocks)


@triton.jit
def _item(CU, MASK, SCALES, item, blocks, head, seed, scale, n_ctx, n_heads, stride_b, stride_h, stride_n, stride_lb,
          stride_lh, TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, VARLEN: tl.constexpr,
          SCALE_PER_SEQ: tl.constexpr):
    """Item ``item`` of head ``head``: its block's first token, where its sequence lives (:func:`_locate`), the
    sequence's padding-mask words, dropout seed and softmax scale."""
    seq = item // blocks
    seq_len, base, rel_off, stat_off = _locate(CU, seq, head, n_ctx, stride_b, stride_h, stride_n, stride_lb,
                                               stride_lh, TWO_SPAN, HEAD_DIM, VARLEN)
    return ((item % blocks) * BLOCK, seq_len, base, rel_off, stat_off, MASK + seq * _mask_stride(n_ctx),
            seed + seq * n_heads + head, _sequence_scale(SCALES, seq, scale, SCALE_PER_SEQ))


@triton.jit
def _load_rows(ptr, row0, offs_r, offs_d, stride_n, seq_len):
    """``[len(offs_r), d]`` rows ``row0 + offs_r`` of one sequence, zero past its end."""
    rows = row0 + offs_r
    ok = rows < seq_len
    return tl.load(ptr + rows[:, None] * stride_n + offs_d[None, :], mask=ok[:, None], other=0.0)


@triton.jit
def _rows_after_loop(row0, offs, RECOMPUTE: tl.constexpr):
    """The first row of a block's outputs, stored after its tile loop. With ``RECOMPUTE``, ``row0`` as its maximum
    over ``offs``' lanes (a few shuffles, once): a value the compiler cannot prove equal to ``row0``, so the
    stores' offsets are computed there instead of reused from the block's input loads before the loop and held,
    live or spilled, across it (20 B spilled at 255 registers in sm_80's 64-key dk/dv tiles)."""
    if RECOMPUTE:
        row0 = tl.max(row0 + offs * 0, 0)
    return row0


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
def _end_vectors(END, stat_off, stat_numel, i0, j0, offs_m, offs_n, seq_len, top, ok, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr):
    """The end terms of a saturated tile at its end ``top``: ``END[0 | 1]`` (Q . Kr[0 | top]) of its query rows
    and ``END[2 | 3]`` (K . Qr[0 | top]) of its key columns, read only where ``ok`` (zeros elsewhere: without a
    saturated tile anywhere ``END`` is a one-element stand-in, never read)."""
    c = tl.zeros([BLOCK_M], tl.float32)
    p = tl.zeros([BLOCK_N], tl.float32)
    end = tl.where(top, 1, 0).to(tl.int64)  # ``top`` may be a tensor or a constant
    rows, cols = i0 + offs_m, j0 + offs_n
    if HAS_C2P:
        c = tl.load(END + end * stat_numel + stat_off + rows, mask=(rows < seq_len) & ok, other=0.0)
    if HAS_P2C:
        p = tl.load(END + (2 + end) * stat_numel + stat_off + cols, mask=(cols < seq_len) & ok, other=0.0)
    return c, p


@triton.jit
def _end_row_column(c, p, TRANSPOSED: tl.constexpr):
    """c2p + p2c of a saturated tile from its rows' and its columns' end terms: ``[BM, BN]``, or ``[BN, BM]``
    when ``TRANSPOSED``."""
    if TRANSPOSED:
        bias = p[:, None] + c[None, :]
    else:
        bias = c[:, None] + p[None, :]
    return bias


@triton.jit
def _end_bias(END, ends, stat_off, stat_numel, i0, j0, offs_m, offs_n, seq_len, top, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, TRANSPOSED: tl.constexpr,
              ENDS_AHEAD: tl.constexpr):
    """c2p + p2c of a saturated tile at its end ``top``: from ``ends``, read a tile ahead, with ``ENDS_AHEAD``,
    else read here (:func:`_end_vectors`)."""
    if ENDS_AHEAD:
        c_end, p_end = ends
    else:
        c_end, p_end = _end_vectors(END, stat_off, stat_numel, i0, j0, offs_m, offs_n, seq_len, top, True, BLOCK_M,
                                    BLOCK_N, HAS_C2P, HAS_P2C)
    return _end_row_column(c_end, p_end, TRANSPOSED)


@triton.jit
def _ends_ahead(END, stat_off, stat_numel, i0, j0, path_ends, offs_m, offs_n, seq_len, TWO_SPAN: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr):
    """The end terms (:func:`_end_vectors`) of tile ``(i0, j0)`` from its two end buckets (:func:`_path_ends`),
    read a tile before the tile uses them: nothing when it is general or past the sequence."""
    saturated, top = _saturated((path_ends[0], path_ends[1], ()), TWO_SPAN)
    return _end_vectors(END, stat_off, stat_numel, i0, j0, offs_m, offs_n, seq_len, top, saturated, BLOCK_M, BLOCK_N,
                        HAS_C2P, HAS_P2C)


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
                 WINDOW: tl.constexpr, SPLIT: tl.constexpr, GENERAL_ONLY: tl.constexpr = False):
    """``((t_lo, t_hi, window buckets), what the loop carries)``: this tile's table reads in a loop whose next
    tile's window starts ``step`` further. With ``AHEAD`` the two end buckets (the path test) come from
    ``ahead`` (:func:`_path_ends`), read a tile earlier, and
    the window's buckets are read at the tile's start, so the row gathers no longer wait behind the path test
    (reading them a tile ahead too spilled); ``ahead`` gets the next tile's ends (the table reaches a tile past
    either end). Without it the ends are read now and the products read their buckets slice by slice.
    ``GENERAL_ONLY`` (a backward reading dense scores where no tile of the launch saturates: ``Tiles.values_ahead``):
    nothing is read, ``(0, 1)`` stand for the ends, a path test the compiler decides (general) and whose saturated
    branch it drops; dense tiles read no window buckets."""
    if GENERAL_ONLY:
        current = (0, 1, ())
    elif AHEAD:
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
    of ``SIZE``): one scalar load of a 32-bit word per 32 tokens (packed by :func:`.mask.mask_bits`).
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
    col_ok = _words_visible(col_words, j0, offs_n, seq_len, BLOCK_N, HAS_MASK)
    if ROWS:
        row_ok = _words_visible(row_words, i0, offs_m, seq_len, BLOCK_M, HAS_MASK)
    else:
        row_ok = tl.full([BLOCK_M], 1, tl.int1)
    return _pair_visible(row_ok, col_ok, i0, j0, offs_m, offs_n, BLOCK_M, BLOCK_N, MASK_DIAGONAL, TRANSPOSED)


@triton.jit
def _sequence_scale(SCALES, seq, scale, SCALE_PER_SEQ: tl.constexpr):
    """The softmax scale of sequence ``seq``: its entry of ``SCALES`` (float32 [num_seqs]) or the one float."""
    seq_scale = scale
    if SCALE_PER_SEQ:
        seq_scale = tl.load(SCALES + seq)
    return seq_scale


@triton.jit
def _mix32_rounds(x):
    """Wellons' "lowbias32" between its first and last xor-shifts: multiply, xor-shift, multiply."""
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    return x


@triton.jit
def _mix32(x):
    """A 32-bit integer hash with full avalanche (Wellons' "lowbias32"): 2 multiplies, 3 xor-shifts."""
    x = _mix32_rounds(x ^ (x >> 16))
    return x ^ (x >> 16)


@triton.jit
def _dropout_keep(seed, i0, j0, n_ctx, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  TRANSPOSED: tl.constexpr):
    """Keep bits of tile ``(i0, j0)``: ``(i, j)`` keeps iff ``h >= p * 2**32`` for ``h`` lowbias32 (:func:`_mix32`)
    of ``x = (i << 16) ^ j ^ mix32(seed)`` without its last xor-shift. A pure function of ``(seed, i, j)``, so
    forward and both backward kernels, whatever their tiles, draw the same bits; ``(i << 16) ^ j`` is distinct for
    every pair while ``N <= 65,536``. Four integer instructions a score (two shift-and-xor pairs) are gone from
    lowbias32 in full:

    * its first xor-shift is taken apart: with ``i, j < 2**16``, ``x >> 16 = i ^ (key >> 16)``, so ``x ^ (x >> 16)
      = ((i << 16) ^ i) ^ (j ^ key ^ (key >> 16))``, a row part and a column part (``[BM]`` and ``[BN]`` vectors a
      tile); the key in the row part instead spilled sm_80's packed forward with dropout (128 B);
    * its last xor-shift changes only the low 16 bits (``x >> 16`` has none above them), which the test reads only
      where the top 16 tie the threshold's (2^-16 of draws), and those bits are well mixed all the same.

    The row and column parts meet by an xor, which the compiler cannot reassociate: ``i * N + j`` let it hoist the
    tile's constant part ``a * N + b`` out of the tile loop as a ``[BM, BN]`` tensor held in registers (16 a
    thread), which spilled sm_90's 64-row dk/dv blocks."""
    key = _mix32(seed.to(tl.uint32))
    rows = (i0 + tl.arange(0, BLOCK_M)).to(tl.uint32)
    rows = (rows << 16) ^ rows
    cols = (j0 + tl.arange(0, BLOCK_N)).to(tl.uint32) ^ (key ^ (key >> 16))
    if TRANSPOSED:
        counter = cols[:, None] ^ rows[None, :]
    else:
        counter = rows[:, None] ^ cols[None, :]
    threshold = (tl.zeros([], tl.float32) + dropout_p * 4294967296.0).to(tl.uint32)
    return _mix32_rounds(counter) >= threshold


# A tile's path: where its c2p + p2c come from (a loop that walks one path only makes it a constant).
CONTENT = tl.constexpr(0)    # no position terms
GENERAL = tl.constexpr(1)    # window products read back skewed
SATURATED = tl.constexpr(2)  # wholly in bucket 0 or the top bucket: end terms
PER_TILE = tl.constexpr(3)   # any of the above, read per tile from the bucket table


@triton.jit
def _tile_scores(q, k, KR, QR, table_ptr, table_row, mask_ptr, keys, END, ends, scratch, dense, stat_off, stat_numel,
                 i0, j0, seq_len, scale, offs_m, offs_n, offs_d, general,
                 TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 WINDOW: tl.constexpr, SPLIT: tl.constexpr, HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr,
                 HAS_MASK: tl.constexpr, MASK_DIAGONAL: tl.constexpr, TRANSPOSED: tl.constexpr,
                 HOIST: tl.constexpr, ROWS: tl.constexpr, ENDS_AHEAD: tl.constexpr, DENSE_SCORES: tl.constexpr,
                 PRECISION: tl.constexpr, buckets=(), BUCKETS_AHEAD: tl.constexpr = False, values=(),
                 VALUES_AHEAD: tl.constexpr = False):
    """Scores of tile ``(i0, j0)`` times ``scale * log2(e)`` (``-inf`` where not visible, whatever the scale:
    a scale of 0 must not make ``-inf * 0``), whether it is saturated and at which end (read per tile from
    the bucket table), and the count of general tiles so far (it picks the scratch buffer). ``keys``: the tile's
    keys' padding-mask words (:func:`_mask_words`, read at the tile's start) or, when ``TRANSPOSED`` (a key block),
    their visibility (read once per block). Query rows are tested only with ``ROWS`` (the forward; the backward
    needs no query side, :func:`_visible`), and then both sides' words are read here, after the products (read
    at the tile's start, they spilled at d = 128 on sm_90). A saturated tile's end terms are ``ends``, read a tile
    ahead (:func:`_ends_ahead`), with ``ENDS_AHEAD``; else read here. With ``DENSE_SCORES`` a general tile reads
    its c2p and p2c from the dense products (``dense``: the sequence's rows of ``C2P`` and ``P2C``) at each
    score's bucket, issued before the content product: no window rows, products or scratch; with
    ``BUCKETS_AHEAD`` those buckets are ``buckets``, loaded a tile before (``dense._buckets_ahead``); with
    ``VALUES_AHEAD`` the terms themselves are ``values``, gathered a tile before (``dense._dense_terms``)."""
    saturated, top = _saturated(table_row, TWO_SPAN)
    if DENSE_SCORES and (HAS_C2P or HAS_P2C):  # either path's terms before the content product
        if saturated:
            position = _end_bias(END, ends, stat_off, stat_numel, i0, j0, offs_m, offs_n, seq_len, top, BLOCK_M,
                                 BLOCK_N, HAS_C2P, HAS_P2C, TRANSPOSED, ENDS_AHEAD)
        else:
            if VALUES_AHEAD:
                position = _terms_sum(values, HAS_C2P, HAS_P2C)
            else:
                if BUCKETS_AHEAD:
                    tile_buckets = buckets
                else:
                    tile_buckets = _score_buckets(table_ptr, i0 - j0, offs_m, offs_n, TRANSPOSED)
                position = _dense_bias(dense[0], dense[1], tile_buckets, i0, j0, offs_m, offs_n, seq_len, HAS_C2P,
                                       HAS_P2C, TWO_SPAN, TRANSPOSED)
    if TRANSPOSED:
        s = tl.dot(k, tl.trans(q), input_precision=PRECISION)
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if DENSE_SCORES and (HAS_C2P or HAS_P2C):
        s += position
    elif HAS_C2P or HAS_P2C:
        if saturated:
            s += _end_bias(END, ends, stat_off, stat_numel, i0, j0, offs_m, offs_n, seq_len, top, BLOCK_M, BLOCK_N,
                           HAS_C2P, HAS_P2C, TRANSPOSED, ENDS_AHEAD)
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
