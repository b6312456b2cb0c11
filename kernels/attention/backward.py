"""The fused backward, deterministic and without atomics: ``delta = rowsum(dO * O)``, then ``_attn_bwd`` launched
twice, over query blocks (dQ and the c2p table gradient) and over key blocks (tiles held transposed: dK,
dV and the p2c table gradient), which recompute the scores; the position gradients go through a per-program
band in distance coordinates and one float32 partial table per program, summed on the host in a fixed order."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from ..contract import in_kernel_layout
from .dense import (_add_end_sums, _buckets_ahead, _dense_rows, _dense_scores_at, _joined_column, _store_buckets,
                    _terms_ahead, _zero_outside, HeadMajor, dense_buffer, dense_scores, dense_strides,
                    position_gradients)
from .planning import DELTA_ELEMENTS, _on_device, _Problem, band_folds, band_range, programs_per_head, Tiles
from .scores import (_dropout_keep, _ends_ahead, _item, _load_rows, _load_stat, _locate, _mask_words, _path_ends,
                     _program_items, _rows_after_loop, _side_visible, _store_rows, _table_ahead, _tile_scores)


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
def _band_gradients(acc, own, band, rel_ptr, part_ptr, dense, rows_ok, folds, lo, fold_lo, block0, d_lo,
                    d_hi, first, last, offs_r, offs_d, TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BAND: tl.constexpr, CHUNK: tl.constexpr, OTHER: tl.constexpr, SIGN: tl.constexpr,
                    DENSE: tl.constexpr, PRECISION: tl.constexpr):
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

    With ``DENSE`` the merged chunk goes to the block's rows of the dense buffer (``dense``, bucket columns;
    ``rows_ok``: the rows inside the sequence) instead, each bucket stored once (:func:`dense._store_buckets`),
    and the buckets no chunk reaches are zeroed (:func:`dense._zero_outside`): ``dense.position_gradients`` does
    both products as torch GEMMs after the kernel, and ``acc``, ``own``, ``rel_ptr`` and ``part_ptr`` are not
    touched.
    """
    fold_ptr, merge_ptr, joins_ptr = folds[0], folds[1], folds[2]
    offs_c = tl.arange(0, CHUNK)
    d_hi = tl.where(last >= first, d_hi, d_lo - 1)  # no general tile: nothing to read
    c_start = fold_lo + (d_lo - fold_lo) // CHUNK * CHUNK
    fold = fold_ptr + 2 * ((c_start - fold_lo) // CHUNK)
    b_lo = tl.load(fold, mask=c_start <= d_hi, other=0)
    count = tl.load(fold + 1, mask=c_start <= d_hi, other=0)
    joined_at = offs_r  # DENSE: where the chunk reads back a bucket the previous one wrote, row by row
    if DENSE:
        joined_at = tl.load(joins_ptr + (c_start - fold_lo) // CHUNK * CHUNK + offs_r, mask=c_start <= d_hi,
                            other=-1)
    b_first, b_last = 0, 0  # DENSE: the buckets the chunks write (none: all zeroed after the loop)
    if DENSE:
        last_fold = fold_ptr + 2 * (tl.maximum(d_hi - fold_lo, 0) // CHUNK)
        b_end = tl.load(last_fold, mask=c_start <= d_hi, other=0) + tl.load(last_fold + 1, mask=c_start <= d_hi,
                                                                                other=0)
        b_first = tl.where(c_start <= d_hi, b_lo, TWO_SPAN)
        b_last = tl.where(c_start <= d_hi, b_end - 1, TWO_SPAN - 1)
    for c0 in range(c_start, d_hi + 1, CHUNK):
        dist = c0 + offs_c
        partner = (block0 + offs_r)[:, None] - SIGN * dist[None, :]
        ok = (partner >= first) & (partner < last + OTHER) & ((dist >= d_lo) & (dist <= d_hi))[None, :]
        chunk = tl.load(band + offs_r[:, None] * BAND + (dist - lo)[None, :], mask=ok, other=0.0)
        index = (c0 - fold_lo) // CHUNK
        one_hot = tl.load(merge_ptr + index * CHUNK * CHUNK + offs_c[:, None] * CHUNK + offs_c[None, :])
        b_now, count_now = b_lo, count
        if DENSE:  # the first chunk joins none (the bucket before it is the previous chunk's, not this block's)
            joined = _joined_column(dense, tl.where(c0 > c_start, joined_at, -1), rows_ok, offs_r, TWO_SPAN)
        else:
            rows = b_now + offs_c
            rel = tl.load(rel_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=(offs_c < count_now)[:, None],
                          other=0.0)
            # the partial buffer has CHUNK rows of padding past its 2k: the rows past the chunk's buckets add zeros
            part = part_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :]
            old = tl.load(part)
        more = c0 + CHUNK <= d_hi
        b_lo = tl.load(fold_ptr + 2 * (index + 1), mask=more, other=0)
        count = tl.load(fold_ptr + 2 * (index + 1) + 1, mask=more, other=0)
        if DENSE:
            joined_at = tl.load(joins_ptr + (index + 1) * CHUNK + offs_r, mask=more, other=-1)
        merged = tl.dot(chunk, one_hot, input_precision=PRECISION)
        if DENSE:
            _store_buckets(dense, merged, joined, b_now, count_now, rows_ok, offs_r, offs_c, TWO_SPAN)
        else:
            merged = merged.to(own.dtype)
            acc = tl.dot(merged, rel, acc, input_precision=PRECISION)
            tl.store(part, old + tl.dot(tl.trans(merged), own, input_precision=PRECISION))
            tl.debug_barrier()  # the next chunk's partial rows may overlap these: every warp's stores first
    if DENSE:  # after the chunks, whose reads of the fold table this waited for
        _zero_outside(dense, rows_ok, b_first, b_last, TWO_SPAN, CHUNK)
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
def _program_start(SCRATCH, scratch_elements, n_ctx, num_seqs, items_per_program, BLOCK: tl.constexpr):
    """Program (p, head) of the backward kernel: its scratch, the blocks of a sequence (``BLOCK`` tokens each) and
    its run ``[first, end)`` of (sequence, block) items."""
    program = (tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)).to(tl.int64)
    blocks = tl.cdiv(n_ctx, BLOCK)
    first, end = _program_items(items_per_program, num_seqs, blocks)
    return SCRATCH + program * scratch_elements, blocks, first, end


@triton.jit
def _program_partial(partial, item, TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr):
    """The partial table of the program walking ``item`` (``partial``: the launch's ``(PART,
    items_per_program)``), located from the item after the block's tile loop: a pointer held across it
    spilled (sm_90's 64-row blocks)."""
    program = (tl.program_id(1) * tl.num_programs(0) + item // partial[1]).to(tl.int64)
    return partial[0] + program * (TWO_SPAN + CHUNK) * HEAD_DIM  # padded rows: see _band_gradients


@triton.jit
def _band_start(scratch, lo, i0, j0, n_ctx, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                TRANSPOSED: tl.constexpr, DENSE_SCORES: tl.constexpr):
    """A block's band (past the two window-product buffers of the scratch, which the tiles that read dense scores
    have not) and its smallest distance: the query block ``i0`` against the last key block, or (``TRANSPOSED``)
    the first query block against the key block ``j0``."""
    band = scratch
    if not DENSE_SCORES:
        band += 2 * (BLOCK_M + BLOCK_N) * WINDOW
    if TRANSPOSED:
        return band, tl.maximum(lo, -(j0 + BLOCK_N - 1))
    return band, tl.maximum(lo, i0 - (tl.cdiv(n_ctx, BLOCK_N) * BLOCK_N - 1))


@triton.jit
def _tile_position(ds, saturated, top, sums_lo, sums_hi, first, last, band, band_lo, i0, j0, offs_m, offs_n,
                   BAND: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSED: tl.constexpr):
    """A tile's share of its block's position gradient: a saturated tile's ``dS`` row sums (its rows are the
    block's side) go to the end it sits at; a general tile's ``dS`` goes to the band, and its other side's
    block (key block ``j0``, or query block ``i0`` when ``TRANSPOSED``) widens the general range
    ``first .. last``."""
    if saturated:
        row_sums = tl.sum(ds, 1)
        sums_lo += tl.where(top, 0.0, row_sums)
        sums_hi += tl.where(top, row_sums, 0.0)
    else:
        _store_band(band, ds.to(band.dtype.element_ty), i0 - j0 - (BLOCK_N - 1), band_lo, offs_m, offs_n, BAND,
                    BLOCK_N, TRANSPOSED)
        other = i0 if TRANSPOSED else j0
        first = tl.minimum(first, other)
        last = tl.maximum(last, other)
    return sums_lo, sums_hi, first, last


@triton.jit
def _finish_block(grads, outs, OWN, REL, partial, DENSE_GRAD, band, folds, sums_lo, sums_hi, first, last, block0,
                  band_lo, lo, item, n_ctx, seq_len, base, stat_off, stride_n, stride_lb, stride_lh, dense_lb,
                  dense_lh, offs_r, offs_d, TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BAND: tl.constexpr, CHUNK: tl.constexpr, HAS_TERM: tl.constexpr,
                  DENSE: tl.constexpr, PRECISION: tl.constexpr, PER_ITEM: tl.constexpr, TRANSPOSED: tl.constexpr):
    """A block's end, after its tile loop: its gradients ``grads`` stored at ``outs`` (``(dQ,)``, or ``(dK, dV)``
    when ``TRANSPOSED``: the block is then key block ``block0``) with the first one's position part (``HAS_TERM``):
    its band's (:func:`_band_gradients`) and its saturated tiles' end terms, added to it and to the partial table,
    or with ``DENSE`` written in bucket coordinates to the block's rows of ``DENSE_GRAD`` (located here from the
    program's ``item``: a 64-bit pointer held across the loop spilled). In the dense design the gradients are
    complete before the band pass (their position part comes after the kernel), so they are stored first rather
    than held across it."""
    row0 = _rows_after_loop(block0, offs_r, PER_ITEM)  # recomputed with a program per item (sm_80's 64-key
    # blocks spilled 20 B without; the fused design's persistent ones spilled 4-132 B with it)
    if DENSE:
        _store_block(grads[0], grads, outs, base, row0, offs_r, offs_d, stride_n, seq_len, TRANSPOSED)
    acc = grads[0]
    if HAS_TERM:
        tl.debug_barrier()
        part_ptr = _program_partial(partial, item, TWO_SPAN, HEAD_DIM, CHUNK)
        rows_ok = (row0 + offs_r) < seq_len
        dense = _dense_rows(DENSE_GRAD, stat_off, item // tl.cdiv(n_ctx, BLOCK_N if TRANSPOSED else BLOCK_M),
                            tl.program_id(1), row0, stride_lb, stride_lh, dense_lb, dense_lh, TWO_SPAN)
        own = OWN
        if not DENSE:
            own = _load_rows(OWN + base, row0, offs_r, offs_d, stride_n, seq_len)  # reloaded: not held across the loop
        if TRANSPOSED:  # key b at distance dist pairs with query row0 + b + dist: band rows are keys, SIGN -1
            acc = _band_gradients(acc, own, band, REL, part_ptr, dense, rows_ok, folds, band_lo, lo, row0,
                                  first - row0 - (BLOCK_N - 1), last + BLOCK_M - 1 - row0, first, last, offs_r,
                                  offs_d, TWO_SPAN, HEAD_DIM, BAND, CHUNK, BLOCK_M, -1, DENSE, PRECISION)
        else:
            acc = _band_gradients(acc, own, band, REL, part_ptr, dense, rows_ok, folds, band_lo, lo, row0,
                                  row0 - last - (BLOCK_N - 1), row0 - first + BLOCK_M - 1, first, last, offs_r,
                                  offs_d, TWO_SPAN, HEAD_DIM, BAND, CHUNK, BLOCK_N, 1, DENSE, PRECISION)
        if DENSE:
            _add_end_sums(dense, sums_lo, sums_hi, rows_ok, offs_r, TWO_SPAN)
        else:
            acc = _end_gradients(acc, own, sums_lo, sums_hi, REL, part_ptr, offs_d, TWO_SPAN, HEAD_DIM)
    if not DENSE:
        _store_block(acc, grads, outs, base, row0, offs_r, offs_d, stride_n, seq_len, TRANSPOSED)


@triton.jit
def _store_block(first, grads, outs, base, row0, offs_r, offs_d, stride_n, seq_len, TRANSPOSED: tl.constexpr):
    """A block's gradients at its rows from ``row0``: ``first`` (dQ, or dK when ``TRANSPOSED``) at ``outs[0]``,
    and when ``TRANSPOSED`` dV (``grads[1]``) at ``outs[1]``."""
    _store_rows(outs[0] + base, row0, offs_r, offs_d, stride_n, seq_len, first)
    if TRANSPOSED:
        _store_rows(outs[1] + base, row0, offs_r, offs_d, stride_n, seq_len, grads[1])


@triton.jit
def _next_tile(i0, j0, steps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSED: tl.constexpr):
    """``(i, j, d, at)``: the tile ``steps`` after ``(i0, j0)`` in a block's tile loop (over query blocks when
    ``TRANSPOSED``, a key block's loop, else over key blocks), its ``i - j`` and where the loop then is (``i`` or
    ``j``: the tile exists while that is inside the sequence). ``d`` is ``i0 - j0`` moved by the steps, the value
    the tile loop already has: ``i - j`` written out cost sm_80's N = 8192 dq an instruction and 5% of its judged
    time (ptxas scheduled the loop otherwise)."""
    if TRANSPOSED:
        i, j = i0 + steps * BLOCK_M, j0
        d = i0 + steps * BLOCK_M - j0
        at = i
    else:
        i, j = i0, j0 + steps * BLOCK_N
        d = i0 - j0 - steps * BLOCK_N
        at = j
    return i, j, d, at


@triton.jit
def _terms_then_buckets(dense, TABLE, MIRROR, buckets, i0, j0, steps, offs_m, offs_n, seq_len, HAS_C2P: tl.constexpr,
                        HAS_P2C: tl.constexpr, TWO_SPAN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        TRANSPOSED: tl.constexpr):
    """``Tiles.values_ahead``: the terms of the tile ``steps`` after ``(i0, j0)`` at its ``buckets`` and the
    buckets of the tile after that one (:func:`dense._terms_ahead`)."""
    i, j, _, _ = _next_tile(i0, j0, steps, BLOCK_M, BLOCK_N, TRANSPOSED)
    _, _, d_after, at = _next_tile(i0, j0, steps + 1, BLOCK_M, BLOCK_N, TRANSPOSED)
    return _terms_ahead(dense, TABLE, MIRROR, buckets, i, j, d_after, at < seq_len, offs_m, offs_n, seq_len, HAS_C2P,
                        HAS_P2C, TWO_SPAN, TRANSPOSED)


@triton.jit
def _reads_before_loop(TABLE, MIRROR, END, dense, stat_off, stat_numel, i0, j0, offs_m, offs_n, seq_len,
                       TWO_SPAN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_C2P: tl.constexpr,
                       HAS_P2C: tl.constexpr, HOIST: tl.constexpr, ENDS_AHEAD: tl.constexpr,
                       BUCKETS_AHEAD: tl.constexpr, VALUES_AHEAD: tl.constexpr, TRANSPOSED: tl.constexpr):
    """``(path ends, end terms, buckets, terms)``: what a block's tile loop reads a tile ahead, read for its
    first tile ``(i0, j0)`` (each ``()`` where its flag is off): the two end buckets (``HOIST``), with them the
    end terms (``ENDS_AHEAD``), the tile's buckets (``BUCKETS_AHEAD``) and, with ``VALUES_AHEAD``, its terms now
    and the next tile's buckets (the loop reads each next tile's terms at its end)."""
    ahead = ()
    if HOIST and not VALUES_AHEAD:
        ahead = _path_ends(TABLE, i0 - j0 - (BLOCK_N - 1), BLOCK_M, BLOCK_N)
    ends = ()
    if ENDS_AHEAD:  # with the path ends (HOIST), a saturated tile's end terms come a tile ahead
        ends = _ends_ahead(END, stat_off, stat_numel, i0, j0, ahead, offs_m, offs_n, seq_len, TWO_SPAN, BLOCK_M,
                           BLOCK_N, HAS_C2P, HAS_P2C)
    buckets = ()
    if BUCKETS_AHEAD:
        buckets = _buckets_ahead(TABLE, MIRROR, i0 - j0, offs_m, offs_n, seq_len > 0, TRANSPOSED)
    values = ()
    if VALUES_AHEAD:
        values, buckets = _terms_then_buckets(dense, TABLE, MIRROR, buckets, i0, j0, 0, offs_m, offs_n, seq_len,
                                              HAS_C2P, HAS_P2C, TWO_SPAN, BLOCK_M, BLOCK_N, TRANSPOSED)
    return ahead, ends, buckets, values


@triton.jit
def _reads_for_next(TABLE, MIRROR, END, ahead, ends, buckets, stat_off, stat_numel, i0, j0, offs_m, offs_n, seq_len,
                    TWO_SPAN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_C2P: tl.constexpr,
                    HAS_P2C: tl.constexpr, ENDS_AHEAD: tl.constexpr, BUCKETS_AHEAD: tl.constexpr,
                    VALUES_AHEAD: tl.constexpr, TRANSPOSED: tl.constexpr):
    """``(end terms, buckets)`` of the tile after ``(i0, j0)``, read once this tile's scores are issued, while it
    computes: its buckets (``Tiles.buckets_ahead``; with ``VALUES_AHEAD`` they come with the terms instead) and
    its end terms (``ENDS_AHEAD``); unchanged where off."""
    i1, j1, d1, at = _next_tile(i0, j0, 1, BLOCK_M, BLOCK_N, TRANSPOSED)
    if BUCKETS_AHEAD and not VALUES_AHEAD:
        buckets = _buckets_ahead(TABLE, MIRROR, d1, offs_m, offs_n, at < seq_len, TRANSPOSED)
    if ENDS_AHEAD:
        ends = _ends_ahead(END, stat_off, stat_numel, i1, j1, ahead, offs_m, offs_n, seq_len, TWO_SPAN, BLOCK_M,
                           BLOCK_N, HAS_C2P, HAS_P2C)
    return ends, buckets


@triton.jit
def _score_grads(s, lse, delta, dp, seed, i0, j0, n_ctx, dropout_p, keep_scale, scale, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The kept probabilities and the score gradient ``dS`` (scale included) of a tile from its scores ``s``
    (base 2, as ``_tile_scores`` gives them) and ``dP = dO V^T`` (both transposed when ``TRANSPOSED``).

    With dropout, ``dS = P (keep dP / (1 - p) - delta) scale``, ``1 / (1 - p)`` (``keep_scale``) computed on the
    host: a launch argument, read from the constant bank, holds no register and costs no division. The first
    value (``keep P``) leaves it out: a key block (``_block``) scales dV once instead of every score. The scale
    goes into ``dP``'s factor and ``delta`` (a row's) instead of a multiply a score: ``dP scale - delta scale``
    is one fused multiply-add without dropout."""
    if TRANSPOSED:
        p = tl.exp2(s - lse[None, :])
        delta = (delta * scale)[None, :]
    else:
        p = tl.exp2(s - lse[:, None])
        delta = (delta * scale)[:, None]
    p_dropped = p
    if DROPOUT:
        keep = _dropout_keep(seed, i0, j0, n_ctx, dropout_p, BLOCK_M, BLOCK_N, TRANSPOSED)
        p_dropped = tl.where(keep, p, 0.0)
        dp = tl.where(keep, dp * (keep_scale * scale), 0.0)
    else:
        dp = dp * scale
    return p_dropped, p * (dp - delta)


@triton.jit
def _block(Q, K, V, KR, QR, TABLE, MIRROR, mask_ptr, END, DO, LSE, DELTA, GRAD, GRAD_V, partial, DENSE_GRAD, scratch,
           dense, folds, block0, seed, scale, dropout_p, keep_scale, n_ctx, seq_len, base, rel_off, stat_off,
           stat_numel, stride_n, lo, item, stride_lb, stride_lh, dense_lb, dense_lh,
           TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           WINDOW: tl.constexpr, SPLIT: tl.constexpr, BAND: tl.constexpr, CHUNK: tl.constexpr,
           HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_MASK: tl.constexpr, MASK_DIAGONAL: tl.constexpr,
           DROPOUT: tl.constexpr, HOIST: tl.constexpr, ENDS_AHEAD: tl.constexpr, DENSE: tl.constexpr,
           DENSE_SCORES: tl.constexpr, BUCKETS_AHEAD: tl.constexpr, VALUES_AHEAD: tl.constexpr,
           PRECISION: tl.constexpr, PER_ITEM: tl.constexpr, TRANSPOSED: tl.constexpr):
    """One block's gradients: query block ``block0`` against every key block (dQ into ``GRAD``, and its c2p
    gradient), or with ``TRANSPOSED`` key block ``block0`` against every query block, its tiles held as ``[BN, BM]``
    (dK and dV into ``GRAD`` and ``GRAD_V``, and its p2c gradient). The block's own rows are read once, the other
    side's a tile at a time. The position gradient goes to the partial table, or with ``DENSE`` in bucket
    coordinates to the block's rows of the dense buffer ``DENSE_GRAD`` (located after the tile loop from the
    program's ``item``: a 64-bit pointer held across it spilled). ``MIRROR`` (the mirrored bucket table) is read by
    query blocks only, ``GRAD_V`` written by key blocks only."""
    BLOCK_OWN: tl.constexpr = BLOCK_N if TRANSPOSED else BLOCK_M  # the block's rows
    BLOCK_OTHER: tl.constexpr = BLOCK_M if TRANSPOSED else BLOCK_N  # a tile's rows of the other side
    HAS_TERM: tl.constexpr = HAS_P2C if TRANSPOSED else HAS_C2P  # the position term the block's rows index
    offs_m, offs_n, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, HEAD_DIM)
    if TRANSPOSED:  # the block's keys and values, their visibility, dK and dV
        band, band_lo = _band_start(scratch, lo, 0, block0, n_ctx, BLOCK_N, WINDOW, BLOCK_M, True, DENSE_SCORES)
        k = _load_rows(K + base, block0, offs_n, offs_d, stride_n, seq_len)
        v = _load_rows(V + base, block0, offs_n, offs_d, stride_n, seq_len)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    else:  # the block's queries, output gradients and row statistics, dQ
        band, band_lo = _band_start(scratch, lo, block0, 0, n_ctx, BLOCK_N, WINDOW, BLOCK_M, False, DENSE_SCORES)
        q = _load_rows(Q + base, block0, offs_m, offs_d, stride_n, seq_len)
        do = _load_rows(DO + base, block0, offs_m, offs_d, stride_n, seq_len)
        lse = _load_stat(LSE + stat_off, block0, offs_m, seq_len, float("inf"))
        delta = _load_stat(DELTA + stat_off, block0, offs_m, seq_len, 0.0)
        dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    sums_lo = tl.zeros([BLOCK_OWN], tl.float32)
    sums_hi = tl.zeros([BLOCK_OWN], tl.float32)
    general = 0
    first, last = seq_len, -BLOCK_OTHER  # the other side's blocks of the general tiles
    ahead, ends, buckets, values = _reads_before_loop(
        TABLE, MIRROR, END, dense, stat_off, stat_numel, 0 if TRANSPOSED else block0, block0 if TRANSPOSED else 0,
        offs_m, offs_n, seq_len, TWO_SPAN, BLOCK_M, BLOCK_N, HAS_C2P, HAS_P2C, HOIST, ENDS_AHEAD, BUCKETS_AHEAD,
        VALUES_AHEAD, TRANSPOSED)
    if TRANSPOSED:
        keys = _side_visible(mask_ptr, block0, offs_n, seq_len, BLOCK_N, HAS_MASK)  # the block's keys: once
    for other in range(0, seq_len, BLOCK_OTHER):  # the tile loop
        if TRANSPOSED:
            i0, j0 = other, block0
        else:
            i0, j0 = block0, other
        row, ahead = _table_ahead(TABLE, ahead, i0 - j0 - (BLOCK_N - 1), BLOCK_M if TRANSPOSED else -BLOCK_N, HOIST,
                                  BLOCK_M, BLOCK_N, WINDOW, SPLIT, VALUES_AHEAD)
        if TRANSPOSED:
            q = _load_rows(Q + base, i0, offs_m, offs_d, stride_n, seq_len)
            do = _load_rows(DO + base, i0, offs_m, offs_d, stride_n, seq_len)
            lse = _load_stat(LSE + stat_off, i0, offs_m, seq_len, float("inf"))
            delta = _load_stat(DELTA + stat_off, i0, offs_m, seq_len, 0.0)
        else:
            keys = _mask_words(mask_ptr, j0, seq_len, BLOCK_N, HAS_MASK)
            k = _load_rows(K + base, j0, offs_n, offs_d, stride_n, seq_len)
            v = _load_rows(V + base, j0, offs_n, offs_d, stride_n, seq_len)
        s, saturated, top, general = _tile_scores(
            q, k, KR + rel_off, QR + rel_off, TABLE, row, mask_ptr, keys, END, ends, scratch, dense, stat_off,
            stat_numel, i0, j0, seq_len, scale, offs_m, offs_n, offs_d, general, TWO_SPAN, HEAD_DIM, BLOCK_M, BLOCK_N,
            WINDOW, SPLIT, HAS_C2P, HAS_P2C, HAS_MASK, MASK_DIAGONAL, TRANSPOSED, HOIST, False, ENDS_AHEAD,
            DENSE_SCORES, PRECISION, buckets, BUCKETS_AHEAD, values, VALUES_AHEAD)
        ends, buckets = _reads_for_next(TABLE, MIRROR, END, ahead, ends, buckets, stat_off, stat_numel, i0, j0, offs_m,
                                        offs_n, seq_len, TWO_SPAN, BLOCK_M, BLOCK_N, HAS_C2P, HAS_P2C, ENDS_AHEAD,
                                        BUCKETS_AHEAD, VALUES_AHEAD, TRANSPOSED)
        if TRANSPOSED:
            dp = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        else:
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        p_dropped, ds = _score_grads(s, lse, delta, dp, seed, i0, j0, n_ctx, dropout_p, keep_scale, scale, BLOCK_M,
                                     BLOCK_N, DROPOUT, TRANSPOSED)
        if TRANSPOSED:
            dv = tl.dot(p_dropped.to(do.dtype), do, dv, input_precision=PRECISION)
            dk = tl.dot(ds.to(q.dtype), q, dk, input_precision=PRECISION)
        else:
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
        # dQ_a += sum_b dS[a,b] Kr[idx], dKr[t] += sum_{idx=t} dS[a,b] Q_a (query blocks, c2p); transposed for keys
        if HAS_TERM:
            sums_lo, sums_hi, first, last = _tile_position(ds, saturated, top, sums_lo, sums_hi, first, last, band,
                                                           band_lo, i0, j0, offs_m, offs_n, BAND, BLOCK_N, TRANSPOSED)
        if VALUES_AHEAD:  # the next tile's terms, in flight over the back edge and the next tile's pipeline wait
            values, buckets = _terms_then_buckets(dense, TABLE, MIRROR, buckets, i0, j0, 1, offs_m, offs_n,
                                                  seq_len, HAS_C2P, HAS_P2C, TWO_SPAN, BLOCK_M, BLOCK_N, TRANSPOSED)
    if TRANSPOSED:
        if DROPOUT:  # the kept probabilities' 1 / (1 - p), left out of every score by _score_grads
            dv = dv * keep_scale
        grads, outs, own, rel, offs_own = (dk, dv), (GRAD, GRAD_V), K, QR + rel_off, offs_n
    else:
        grads, outs, own, rel, offs_own = (dq,), (GRAD,), Q, KR + rel_off, offs_m
    _finish_block(grads, outs, own, rel, partial, DENSE_GRAD, band, folds, sums_lo, sums_hi, first, last, block0,
                  band_lo, lo, item, n_ctx, seq_len, base, stat_off, stride_n, stride_lb, stride_lh, dense_lb, dense_lh,
                  offs_own, offs_d, TWO_SPAN, HEAD_DIM, BLOCK_M, BLOCK_N, BAND, CHUNK,
                  HAS_TERM, DENSE, PRECISION, PER_ITEM, TRANSPOSED)


@triton.jit
def _attn_bwd(Q, K, V, KR, QR, TABLE, MIRROR, MASK, CU, SCALES, END, DO, LSE, DELTA, GRAD, GRAD_V, PART, DENSE_GRAD,
              SCRATCH, C2P, P2C, FOLD, MERGE, JOINS, seed, scale, dropout_p, keep_scale, n_ctx, n_heads, num_seqs,
              items_per_program, stat_numel, scratch_elements, lo, stride_b, stride_h, stride_n, stride_lb, stride_lh,
              dense_lb, dense_lh,
              TWO_SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              WINDOW: tl.constexpr, SPLIT: tl.constexpr, BAND: tl.constexpr, CHUNK: tl.constexpr,
              HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_MASK: tl.constexpr, VARLEN: tl.constexpr,
              DROPOUT: tl.constexpr, SCALE_PER_SEQ: tl.constexpr, MASK_DIAGONAL: tl.constexpr,
              HOIST: tl.constexpr, ENDS_AHEAD: tl.constexpr, DENSE: tl.constexpr, DENSE_SCORES: tl.constexpr,
              BUCKETS_AHEAD: tl.constexpr, VALUES_AHEAD: tl.constexpr, PRECISION: tl.constexpr,
              PER_ITEM: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Program (p, head) walks a run of (sequence, block) items of one head (:func:`_block`): query blocks, or with
    ``TRANSPOSED`` key blocks, into one partial table ``PART`` (or, ``DENSE``, into its blocks' rows of the dense
    buffer); with ``DENSE_SCORES`` its general tiles read their position terms from ``C2P`` and ``P2C`` (laid out as
    the dense buffer); ``PER_ITEM``: one item a program (``one_item_per_program``)."""
    BLOCK: tl.constexpr = BLOCK_N if TRANSPOSED else BLOCK_M  # an item's block: keys, or queries
    scratch, blocks, first, end = _program_start(SCRATCH, scratch_elements, n_ctx, num_seqs, items_per_program, BLOCK)
    # Key blocks count their items and test each: the run's end held across the tile loop spilled there. Query
    # blocks loop up to it: the counted form cost their tiles 174 cycles of chain on sm_90 (ptxas scheduled it so).
    if TRANSPOSED:
        start, stop = 0, items_per_program
    else:
        start, stop = first, end
    for step in range(start, stop):
        if TRANSPOSED:
            item = first + step
        else:
            item = step
        if (not TRANSPOSED) or item < num_seqs * blocks:
            block0, seq_len, base, rel_off, stat_off, mask_ptr, seq_seed, seq_scale = _item(
                CU, MASK, SCALES, item, blocks, tl.program_id(1), seed, scale, n_ctx, n_heads, stride_b, stride_h,
                stride_n, stride_lb, stride_lh, TWO_SPAN, HEAD_DIM, BLOCK, VARLEN,
                SCALE_PER_SEQ)
            if block0 < seq_len:
                dense = _dense_scores_at(C2P, P2C, stat_off, item // blocks, stride_lb, stride_lh, dense_lb, dense_lh,
                                         TWO_SPAN, DENSE_SCORES)
                _block(Q, K, V, KR, QR, TABLE, MIRROR, mask_ptr, END, DO, LSE, DELTA, GRAD, GRAD_V,
                       (PART, items_per_program), DENSE_GRAD, scratch, dense, (FOLD, MERGE, JOINS), block0, seq_seed,
                       seq_scale, dropout_p, keep_scale, n_ctx, seq_len, base, rel_off, stat_off, stat_numel, stride_n,
                       lo, item, stride_lb, stride_lh, dense_lb, dense_lh, TWO_SPAN, HEAD_DIM, BLOCK_M, BLOCK_N, WINDOW,
                       SPLIT, BAND, CHUNK, HAS_C2P, HAS_P2C, HAS_MASK, MASK_DIAGONAL, DROPOUT, HOIST, ENDS_AHEAD,
                       DENSE, DENSE_SCORES, BUCKETS_AHEAD, VALUES_AHEAD, PRECISION, PER_ITEM, TRANSPOSED)
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


# The fused backward's partial position gradients, scratch buffers and delta may take at most this
# fraction of the bytes of dq + dk + dv; it caps the programs per head (the dense designs run a program per
# item: ``one_item_per_program``).
PARTIAL_BUDGET = 1.0


@dataclass(frozen=True)
class BackwardBuffers:
    """What one program of a backward kernel keeps in memory: its float32 partial of the kernel's position
    table gradient (``2k`` rows plus a chunk of padding, see ``_band_gradients``; none in the dense design, whose
    buffer is the launch's, outside this budget) and its scratch (two window-product buffers, the band), both
    absent without the terms they serve."""

    partial_rows: int
    scratch_elements: int
    element_size: int
    head_dim: int

    @property
    def program_bytes(self) -> int:
        return self.partial_rows * self.head_dim * 4 + self.scratch_elements * self.element_size


def backward_buffers(tiles: Tiles, two_span: int, band: int, q: torch.Tensor, kernel: str, has_term: bool,
                     has_terms: bool, dense: bool = False, dense_scores: bool = False) -> BackwardBuffers:
    """The buffers of a program of ``kernel`` ("dq" or "dkdv"); ``has_term``: it computes its own position
    gradient (c2p for dq, p2c for dk/dv); ``has_terms``: the scores have a position term at all; ``dense``: the
    dense gradient design (no partial table); ``dense_scores``: the scores read from dense products (no window
    products)."""
    block = tiles.block_m if kernel == "dq" else tiles.block_n
    products = 2 * (tiles.block_m + tiles.block_n) * tiles.window if has_terms and not dense_scores else 0
    partial_rows = two_span + tiles.chunk if has_term and not dense else 0
    return BackwardBuffers(partial_rows, products + (block * band if has_term else 0), q.element_size(), q.shape[-1])


def one_item_per_program(problem: _Problem, scores: tuple) -> bool:
    """Whether a backward kernel runs a program per (sequence, block) item: in the dense designs (dense score
    gradients read from dense scores) a program keeps no partial table to share across items, and with one item
    Triton compiles the item loop away (``items_per_program`` is specialised at 1): the registers its state held
    across the tile loop go to the tiles (sm_80's 64-key dk/dv spilled 4-8 B walking several items, none with
    one). Each program then has its own band scratch: ``H x tokens x band`` elements (``band_range``; at most
    about ``2 max_relative_positions + BM + BN`` a row), counted by the memory plan (train/plan/memory.py)."""
    return problem.backward == "dense" and bool(scores)


def _backward_kernel(problem: _Problem, name: str, q, has_term: bool, budget: int, scores: tuple,
                     **args) -> torch.Tensor | None:
    """Launch the backward kernel over (sequence, block) items of each head, over query blocks (``name`` "dq") or
    key blocks ("dkdv"): its summed partials, or in the dense design its dense score gradient (``[H, rows, 2k]``,
    :mod:`.dense`); None without its position term. ``scores``: the dense ``(C2P, P2C)`` its general tiles read
    (``_Problem.backward_scores``), or ``()``."""
    dense = problem.backward == "dense" and has_term
    tiles = problem.tiles(name, q)
    rows = tiles.block_m if name == "dq" else tiles.block_n
    if dense and rows > tiles.chunk:  # band_folds' read-back table has a chunk's entries a chunk: one per block row
        raise ValueError(f"{name} tiles {tiles}: blocks of {rows} rows exceed the band chunk of {tiles.chunk} "
                         "distances the dense design's fold tables are laid out for")
    items = problem.num_seqs * triton.cdiv(problem.n_ctx, rows)
    lo, hi, band = band_range(problem.table, problem.n_ctx, tiles, name)
    folds = band_folds(problem.table, lo, hi, tiles.chunk, q.dtype)
    fold, merge, joins = (_on_device((problem.table.key, lo, hi, tiles.chunk, q.dtype, i), t, q.device)
                          for i, t in enumerate(folds))
    has_terms = args["KR"] is not q or args["QR"] is not q
    buffers = backward_buffers(tiles, problem.two_span, band, q, name, has_term, has_terms, dense, bool(scores))
    per_item = one_item_per_program(problem, scores)
    programs = (items if per_item else
                programs_per_head(items, buffers.program_bytes, budget, problem.n_heads, problem.slots(tiles)))
    # without partial tables (the dense design, or no term of its own) a one-element stand-in the kernel never reads:
    # empty, not zeros (a fill launch per kernel)
    if buffers.partial_rows:
        partial = torch.zeros((problem.n_heads, programs, buffers.partial_rows, q.shape[-1]), dtype=torch.float32,
                              device=q.device)
    else:
        partial = torch.empty((1,), dtype=torch.float32, device=q.device)
    d_scores = dense_buffer(problem, q) if dense else q
    _, dense_lb, dense_lh = dense_strides(problem)
    scratch = q.new_empty(max(1, problem.n_heads * programs * buffers.scratch_elements))
    # A saturated tile's end terms come with its path ends, a tile ahead, where those are read ahead (the tiles
    # hoist) and some tile can saturate at all: elsewhere the reads (masked off) would only cost general tiles.
    ends_ahead = tiles.hoists(problem.mask_diagonal) and problem.saturates(q)
    # Where no tile of the launch saturates, tiles reading dense scores may gather each next tile's terms at the end
    # of the one before (``Tiles.values_ahead``): no path test, no saturated branch.
    values_ahead = tiles.gathers_ahead(problem.mask_diagonal) and problem.general_only and bool(scores)
    problem.launch(_attn_bwd, tiles, (programs, problem.n_heads), q, args["KR"] is not q, args["QR"] is not q,
                   ENDS_AHEAD=ends_ahead, items_per_program=triton.cdiv(items, programs),
                   scratch_elements=buffers.scratch_elements, lo=lo, FOLD=fold, MERGE=merge, JOINS=joins, BAND=band,
                   CHUNK=tiles.chunk, SCRATCH=scratch, DENSE_GRAD=d_scores, dense_lb=dense_lb, dense_lh=dense_lh,
                   DENSE=dense, C2P=scores[0] if scores else q, P2C=scores[1] if scores else q,
                   DENSE_SCORES=bool(scores), BUCKETS_AHEAD=bool(scores) and tiles.buckets_ahead, PER_ITEM=per_item,
                   VALUES_AHEAD=values_ahead,
                   keep_scale=1.0 / (1.0 - problem.dropout_p), TRANSPOSED=name == "dkdv",
                   MIRROR=problem.device_mirror, PART=partial, **args)
    if dense:
        return d_scores
    return partial.sum(1)[:, :problem.two_span] if has_term else None  # fixed order: deterministic


def row_delta(problem: _Problem, out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """``rowsum(dO * O)`` (= ``rowsum(P * dP)``) in float32, laid out like the lse."""
    delta = torch.empty(problem.stat_shape, dtype=torch.float32, device=out.device)
    problem.launch_rows(_attn_bwd_delta, out, DELTA_ELEMENTS // out.shape[-1], O=out, DO=grad_out, DELTA=delta)
    return delta


def _backward_scores(problem: _Problem, heads: HeadMajor, pos_key, pos_query, kept: tuple) -> tuple:
    """``(C2P, P2C)`` for the backward's kernels: the forward's, when it kept them (``problem.keep_scores``),
    else recomputed by two GEMMs. Kept tensors of any other shape or dtype than the plan's (a caller's own) are
    refused by name: the kernels would read them out of bounds."""
    if not problem.keep_scores or not kept or all(t.numel() == 0 for t in kept):
        return dense_scores(heads, pos_key, pos_query)
    q = heads.inputs[0]
    for name, t, table in zip(("C2P", "P2C"), kept, (pos_key, pos_query)):
        wanted = problem.kept_shape(table is not None)
        if tuple(t.shape) != wanted or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"the kept {name} must be the forward's {wanted} {q.dtype} on {q.device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
    return tuple(q if table is None else t for t, table in zip(kept, (pos_key, pos_query)))


def attention_backward(grad_out, q, k, v, pos_key, pos_query, out, lse, end, problem: _Problem,
                       kept: tuple = ()):
    """``dq, dk, dv, d_pos_key, d_pos_query`` (None for absent position terms); ``kept``: the forward's kept
    ``(C2P, P2C)`` (``attention_forward``), or nothing.

    Extra memory beyond the gradients: ``delta`` and one kernel's partials and scratch at a time,
    together at most ``PARTIAL_BUDGET`` x the bytes of ``dq + dk + dv`` (and at least one program per head);
    in the dense design (``problem.backward``) also one ``[H, rows, 2k]`` score-gradient buffer at a time, and
    with dense scores (``problem.backward_scores``) the two ``[H, rows, 2k]`` products: the forward's where it
    kept them (``problem.keep_scores``), else recomputed here by two GEMMs (:func:`_backward_scores`); padded,
    with either dense design, head-major copies of Q and K (``dense.HeadMajor``), made once for both.
    """
    problem = problem.packed()  # the forward's, already packed, or a replanned call's
    # One layout for q, k, v, the output and their gradients (planning.plan): copies only for a caller's odd one.
    grad_out, out = (in_kernel_layout(t, q.stride()) for t in (grad_out, out))
    delta = row_delta(problem, out, grad_out)
    dq, dk, dv = (q.new_empty_strided(q.shape, q.stride()) for _ in range(3))
    # What else is alive beside the partials: delta, the end terms and a head's summed partials before their cast.
    others = (delta.numel() + end.numel()) * 4 + 2 * problem.n_heads * problem.two_span * q.shape[-1] * 4
    budget = int(PARTIAL_BUDGET * 3 * q.numel() * q.element_size()) - others
    common = dict(Q=q, K=k, V=v, KR=q if pos_key is None else pos_key, QR=q if pos_query is None else pos_query,
                  END=end, DO=grad_out, LSE=lse, DELTA=delta)
    has_terms = pos_key is not None or pos_query is not None
    heads = HeadMajor(q, k)  # shared by the scores' and the gradients' GEMMs
    common["scores"] = (_backward_scores(problem, heads, pos_key, pos_query, kept)
                        if has_terms and problem.backward_scores == "dense" else ())
    d_pos_query = _backward_kernel(problem, "dkdv", q, pos_query is not None, budget, GRAD=dk, GRAD_V=dv, **common)
    if problem.backward == "dense" and d_pos_query is not None:  # its buffer freed before dq's is made
        d_pos_query = position_gradients(d_pos_query, heads.k, pos_query, dk)
    d_pos_key = _backward_kernel(problem, "dq", q, pos_key is not None, budget, GRAD=dq, GRAD_V=q, **common)
    if problem.backward == "dense" and d_pos_key is not None:
        d_pos_key = position_gradients(d_pos_key, heads.q, pos_key, dq)
    return (dq, dk, dv, None if d_pos_key is None else d_pos_key.to(pos_key.dtype),
            None if d_pos_query is None else d_pos_query.to(pos_query.dtype))
