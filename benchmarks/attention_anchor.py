"""FlashAttention-2 in the design of Triton's fused-attention tutorial, written here so that its launches can be
compiled and judged like the others (``attention_judge.py``): the forward is a calibration anchor, and forward
plus backward at the judge's own shapes are the content-only reference (plain attention: no position terms,
no mask, no dropout) that shows what DeBERTa's disentangled terms cost beyond it.

Forward: one program per 128-query block and (batch, head); K and V streamed in 64-key tiles through a
software pipeline; online softmax in base 2; the output and the row log-sum-exp written once. Backward, as the
tutorial's: ``delta = rowsum(dO * O)`` first, then dK/dV of a 128-key block over 32-query tiles and dQ of a
128-query block over 32-key tiles, recomputing the probabilities from the saved log-sum-exp (here as two
launches; the tutorial runs both loops in one program).

The published figure the forward is held against (pytorch/benchmark PR #2296, "Add colfax_cutlass backend to
flash_attention operator": ``triton_tutorial_flash_v2`` on an H100, batch 128, 8 heads, head dim 128,
non-causal forward) was measured with that project's copy of the tutorial kernel and autotuner; the tile,
warps and stages below are the H100 pick assumed for head dim 128, not a measured choice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (N, published forward ms) of triton_tutorial_flash_v2 in PR #2296's table (H100, B=128, H=8, d=128).
PUBLISHED_H100 = ((1024, 1.55574), (8192, 85.1293))
BATCH, HEADS, HEAD_DIM = 128, 8, 128
BLOCK_M, BLOCK_N, WARPS, STAGES = 128, 64, 8, 3
# The tutorial's backward tiles (its BLOCK_M1, BLOCK_N1 = 32, 128 for dK/dV; BLOCK_M2, BLOCK_N2 = 128, 32 for
# dQ), warps and stages.
BWD_DKDV, BWD_DQ, BWD_WARPS, BWD_STAGES = (32, 128), (128, 32), 4, 3
LOG2E = 1.4426950408889634


@triton.jit
def _rows_at(ptr, rows, HEAD_DIM: tl.constexpr):
    """Pointers to ``rows`` (a block of token indices) of the contiguous ``[N, HEAD_DIM]`` matrix at ``ptr`` (one
    head's): ``[len(rows), HEAD_DIM]``."""
    return ptr + rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]


@triton.jit
def _flash2_fwd(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, seq_len, scale_log2,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m, head = tl.program_id(0), tl.program_id(1)
    base = head.to(tl.int64) * seq_len * HEAD_DIM
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    q = tl.load(_rows_at(q_ptr + base, rows, HEAD_DIM))
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    keys = tl.arange(0, BLOCK_N)
    for start_n in range(0, seq_len, BLOCK_N):
        offsets = base + (start_n + keys)[:, None] * HEAD_DIM + cols[None, :]
        k = tl.load(k_ptr + offsets)
        scores = tl.dot(q, tl.trans(k)) * scale_log2
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        p = tl.math.exp2(scores - new_max[:, None])
        alpha = tl.math.exp2(row_max - new_max)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + offsets)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        row_max = new_max
    tl.store(_rows_at(out_ptr + base, rows, HEAD_DIM), (acc / row_sum[:, None]).to(q.dtype))
    tl.store(lse_ptr + head * seq_len + rows, row_max + tl.math.log2(row_sum))


@triton.jit
def _flash2_bwd_delta(out_ptr, dout_ptr, delta_ptr, seq_len, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    start_m, head = tl.program_id(0), tl.program_id(1)
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offsets = head.to(tl.int64) * seq_len * HEAD_DIM + rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    o = tl.load(out_ptr + offsets).to(tl.float32)
    do = tl.load(dout_ptr + offsets).to(tl.float32)
    tl.store(delta_ptr + head * seq_len + rows, tl.sum(o * do, 1))


@triton.jit
def _flash2_bwd_dkdv(q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, seq_len, sm_scale,
                     scale_log2, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_n, head = tl.program_id(0), tl.program_id(1)
    base = head.to(tl.int64) * seq_len * HEAD_DIM
    keys = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.load(_rows_at(k_ptr + base, keys, HEAD_DIM))
    v = tl.load(_rows_at(v_ptr + base, keys, HEAD_DIM))
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for start_m in range(0, seq_len, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q = tl.load(_rows_at(q_ptr + base, rows, HEAD_DIM))
        do = tl.load(_rows_at(dout_ptr + base, rows, HEAD_DIM))
        lse = tl.load(lse_ptr + head * seq_len + rows)
        delta = tl.load(delta_ptr + head * seq_len + rows)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * scale_log2 - lse[None, :])
        dv += tl.dot(p_t.to(do.dtype), do)
        ds_t = p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q)
    tl.store(_rows_at(dk_ptr + base, keys, HEAD_DIM), (dk * sm_scale).to(k.dtype))
    tl.store(_rows_at(dv_ptr + base, keys, HEAD_DIM), dv.to(v.dtype))


@triton.jit
def _flash2_bwd_dq(q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr, seq_len, sm_scale, scale_log2,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m, head = tl.program_id(0), tl.program_id(1)
    base = head.to(tl.int64) * seq_len * HEAD_DIM
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = tl.load(_rows_at(q_ptr + base, rows, HEAD_DIM))
    do = tl.load(_rows_at(dout_ptr + base, rows, HEAD_DIM))
    lse = tl.load(lse_ptr + head * seq_len + rows)
    delta = tl.load(delta_ptr + head * seq_len + rows)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(0, seq_len, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(_rows_at(k_ptr + base, keys, HEAD_DIM))
        v = tl.load(_rows_at(v_ptr + base, keys, HEAD_DIM))
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * scale_log2 - lse[:, None])
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    tl.store(_rows_at(dq_ptr + base, rows, HEAD_DIM), (dq * sm_scale).to(q.dtype))


def _meta(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def launch(n: int, batch: int = BATCH, heads: int = HEADS, head_dim: int = HEAD_DIM) -> tuple:
    """``(kernel, args, kwargs, grid)`` of the forward at length ``n`` (meta tensors: nothing is allocated or
    run; the judge compiles the launch)."""
    q, k, v, out = (_meta(batch, heads, n, head_dim) for _ in range(4))
    args = (q, k, v, out, _meta(batch, heads, n, dtype=torch.float32), n, LOG2E / head_dim ** 0.5)
    kwargs = dict(HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=WARPS, num_stages=STAGES)
    return _flash2_fwd, args, kwargs, (triton.cdiv(n, BLOCK_M), batch * heads, 1)


def backward_launches(n: int, batch: int, heads: int, head_dim: int) -> list[tuple]:
    """The backward's three launches at length ``n`` (delta, dK/dV, dQ), as :func:`launch` gives the forward's."""
    q, k, v, dout, dq, dk, dv, out = (_meta(batch, heads, n, head_dim) for _ in range(8))
    lse, delta = (_meta(batch, heads, n, dtype=torch.float32) for _ in range(2))
    scale = head_dim ** -0.5
    common = dict(HEAD_DIM=head_dim, num_warps=BWD_WARPS, num_stages=BWD_STAGES)
    rows = batch * heads
    return [(_flash2_bwd_delta, (out, dout, delta, n), dict(HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, num_warps=4),
             (triton.cdiv(n, BLOCK_M), rows, 1)),
            (_flash2_bwd_dkdv, (q, k, v, dout, lse, delta, dk, dv, n, scale, scale * LOG2E),
             dict(BLOCK_M=BWD_DKDV[0], BLOCK_N=BWD_DKDV[1], **common), (triton.cdiv(n, BWD_DKDV[1]), rows, 1)),
            (_flash2_bwd_dq, (q, k, v, dout, lse, delta, dq, n, scale, scale * LOG2E),
             dict(BLOCK_M=BWD_DQ[0], BLOCK_N=BWD_DQ[1], **common), (triton.cdiv(n, BWD_DQ[0]), rows, 1))]
