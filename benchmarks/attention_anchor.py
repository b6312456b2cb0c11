"""A second calibration anchor for ``attention_judge.py``: a plain FlashAttention-2 forward in Triton, the
design of Triton's fused-attention tutorial (one program per 128-query block and (batch, head); K and V
streamed in 64-key tiles through a software pipeline; online softmax in base 2; the output and the row
log-sum-exp written once), written here so that its launch can be compiled and judged like the others.

The published figure it is held against (pytorch/benchmark PR #2296, "Add colfax_cutlass backend to
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


@triton.jit
def _flash2_fwd(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, seq_len, scale_log2,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m, head = tl.program_id(0), tl.program_id(1)
    base = head.to(tl.int64) * seq_len * HEAD_DIM
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + base + rows[:, None] * HEAD_DIM + cols[None, :])
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
    tl.store(out_ptr + base + rows[:, None] * HEAD_DIM + cols[None, :], (acc / row_sum[:, None]).to(q.dtype))
    tl.store(lse_ptr + head * seq_len + rows, row_max + tl.math.log2(row_sum))


def launch(n: int) -> tuple:
    """``(kernel, args, kwargs, grid)`` of the anchor's forward at length ``n`` (meta tensors: nothing is
    allocated or run; the judge compiles the launch)."""
    shape = (BATCH, HEADS, n, HEAD_DIM)
    q, k, v, out = (torch.empty(shape, dtype=torch.bfloat16, device="meta") for _ in range(4))
    lse = torch.empty((BATCH, HEADS, n), dtype=torch.float32, device="meta")
    args = (q, k, v, out, lse, n, 1.4426950408889634 / HEAD_DIM ** 0.5)
    kwargs = dict(HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=WARPS, num_stages=STAGES)
    return _flash2_fwd, args, kwargs, (triton.cdiv(n, BLOCK_M), BATCH * HEADS, 1)
