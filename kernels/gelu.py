"""Fused bias-add + exact (erf) GELU in Triton, forward and backward.

``bias_gelu(x, bias)`` is ``gelu(x + bias)`` for the DeBERTa feed-forward, where ``x`` is the
intermediate projection computed without its bias. Both kernels work on ``[BLOCK_M, BLOCK_N]``
tiles of the ``[rows, hidden]`` view, in float32 whatever the storage dtype. Backward saves only
``x`` (the pre-activation is recomputed from it and the bias) and reduces the bias gradient
without atomics: each program walks a range of row tiles of one column block, keeps its column
sums in registers and writes them to a ``[P, hidden]`` float32 buffer that ``torch.sum`` reduces.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .contract import check_bias_gelu_inputs
from .reduction import reduction_programs

BLOCK_M = 16
BLOCK_N = 256


@triton.jit
def _gelu_and_grad(u):
    """``gelu(u)`` and ``gelu'(u)`` with ``gelu(u) = u * Phi(u)``, ``Phi`` the normal CDF."""
    cdf = 0.5 * (1.0 + tl.math.erf(u * 0.7071067811865476))
    pdf = tl.exp(-0.5 * u * u) * 0.3989422804014327
    return u * cdf, cdf + u * pdf


@triton.jit
def _tile(x_ptr, bias_ptr, row0, col_block, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Offsets, mask and pre-activation ``x + bias`` (float32) of one tile."""
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offsets = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    bias = tl.load(bias_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32) + bias[None, :]
    return offsets, mask, u


@triton.jit
def _bias_gelu_forward(x_ptr, bias_ptr, out_ptr, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offsets, mask, u = _tile(x_ptr, bias_ptr, tl.program_id(0) * BLOCK_M, tl.program_id(1),
                             n_rows, n_cols, BLOCK_M, BLOCK_N)
    y, _ = _gelu_and_grad(u)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_backward(dy_ptr, x_ptr, bias_ptr, dx_ptr, dbias_part_ptr, n_rows, n_cols, tiles_per_program,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    program, col_block = tl.program_id(0), tl.program_id(1)
    dbias = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = program * tiles_per_program
    last = tl.minimum(first + tiles_per_program, tl.cdiv(n_rows, BLOCK_M))
    for tile in range(first, last):
        offsets, mask, u = _tile(x_ptr, bias_ptr, tile * BLOCK_M, col_block, n_rows, n_cols, BLOCK_M, BLOCK_N)
        _, slope = _gelu_and_grad(u)
        dx = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * slope
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dbias += tl.sum(dx, axis=0)  # masked lanes hold dy = 0
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(dbias_part_ptr + program * n_cols + cols, dbias, mask=cols < n_cols)


def bias_gelu_forward(x2d: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu(x + bias)`` of a ``[rows, hidden]`` tensor, in the promoted dtype of ``x`` and ``bias``."""
    n_rows, n_cols = x2d.shape
    out = torch.empty(n_rows, n_cols, dtype=torch.promote_types(x2d.dtype, bias.dtype), device=x2d.device)
    grid = (triton.cdiv(n_rows, BLOCK_M), triton.cdiv(n_cols, BLOCK_N))
    _bias_gelu_forward[grid](x_ptr=x2d, bias_ptr=bias, out_ptr=out, n_rows=n_rows, n_cols=n_cols,
                             BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return out


def bias_gelu_backward(dy: torch.Tensor, x2d: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dx`` (in ``dy``'s dtype) and the float32 bias gradient."""
    n_rows, n_cols = x2d.shape
    dx = torch.empty(n_rows, n_cols, dtype=dy.dtype, device=dy.device)
    row_tiles, col_blocks = triton.cdiv(n_rows, BLOCK_M), triton.cdiv(n_cols, BLOCK_N)
    # Spread the reduction programs over the column blocks; each owns a range of row tiles.
    row_programs = max(1, reduction_programs(row_tiles * col_blocks, dy.device) // col_blocks)
    tiles_per_program = triton.cdiv(row_tiles, row_programs)
    programs = triton.cdiv(row_tiles, tiles_per_program)
    dbias_part = torch.empty(programs, n_cols, dtype=torch.float32, device=dy.device)
    _bias_gelu_backward[(programs, col_blocks)](dy_ptr=dy, x_ptr=x2d, bias_ptr=bias, dx_ptr=dx,
                                                dbias_part_ptr=dbias_part, n_rows=n_rows, n_cols=n_cols,
                                                tiles_per_program=tiles_per_program, BLOCK_M=BLOCK_M,
                                                BLOCK_N=BLOCK_N)
    return dx, dbias_part.sum(0)


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        x2d = x.reshape(-1, x.shape[-1]).contiguous()
        ctx.save_for_backward(x2d, bias)
        ctx.shape = x.shape
        return bias_gelu_forward(x2d, bias).reshape(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, bias = ctx.saved_tensors
        dx, d_bias = bias_gelu_backward(grad_out.reshape(x2d.shape).contiguous(), x2d, bias)
        d_x = dx.reshape(ctx.shape).to(x2d.dtype) if ctx.needs_input_grad[0] else None
        return d_x, d_bias.to(bias.dtype) if ctx.needs_input_grad[1] else None


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu(x + bias)`` (erf form) with ``bias`` of shape ``[x.shape[-1]]``; output in the
    promoted dtype of ``x`` and ``bias``, as ``x + bias`` would be."""
    check_bias_gelu_inputs(x, bias)
    return _BiasGelu.apply(x, bias.contiguous())
