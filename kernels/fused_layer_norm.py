"""Fused residual-add + LayerNorm in Triton, forward and backward.

``layer_norm(x, weight, bias, eps, residual)`` computes ``LayerNorm(x + residual)`` over the last
dimension. Forward: one program per row holds the whole row in registers (hidden sizes up to
``MAX_HIDDEN``), computes the sum, the two-pass variance and the output in float32, and keeps only
the per-row mean and 1/std (float32) for backward; the residual sum is not stored but re-added in
backward, which reads ``x`` and ``residual`` again instead of writing and re-reading a third tensor.

Backward without atomics: each of ``P`` programs walks a contiguous range of rows, writes ``dx``
for them and keeps its own running ``sum(dy * xhat)`` and ``sum(dy)`` in registers; the ``[P, H]``
partial sums are then added by ``torch.sum`` in float32. The result is deterministic (the same
``P`` gives the same order of additions) and needs no zero-initialised accumulator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .contract import check_layer_norm_inputs
from .reduction import reduction_programs

MAX_HIDDEN = 65536  # one row must fit in one program's registers


@triton.jit
def _layer_norm_forward(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, mean_ptr, rstd_ptr, n_cols, eps,
                        HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    in_row = cols < n_cols
    offsets = row * n_cols + cols
    x = tl.load(x_ptr + offsets, mask=in_row, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + offsets, mask=in_row, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    centred = tl.where(in_row, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (centred * rstd * w + b).to(out_ptr.dtype.element_ty), mask=in_row)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _layer_norm_backward(dy_ptr, x_ptr, res_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr,
                         n_rows, n_cols, rows_per_program,
                         HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    in_row = cols < n_cols
    w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    # int64 bounds make the loop counter int64, so row * n_cols cannot overflow.
    first = program.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    for row in range(first, last):
        offsets = row * n_cols + cols
        x = tl.load(x_ptr + offsets, mask=in_row, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x += tl.load(res_ptr + offsets, mask=in_row, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = tl.where(in_row, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
        dy = tl.load(dy_ptr + offsets, mask=in_row, other=0.0).to(tl.float32)
        w_dy = w * dy
        # d/dx of (x - mean) * rstd projects out the mean and the xhat direction of w*dy.
        mean_w_dy_xhat = tl.sum(w_dy * xhat, axis=0) / n_cols
        mean_w_dy = tl.sum(w_dy, axis=0) / n_cols
        dx = (w_dy - xhat * mean_w_dy_xhat - mean_w_dy) * rstd
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=in_row)
        dw += dy * xhat
        db += dy
    tl.store(dw_part_ptr + program * n_cols + cols, dw, mask=in_row)
    tl.store(db_part_ptr + program * n_cols + cols, db, mask=in_row)


def _row_block(n_cols: int) -> tuple[int, int]:
    """``(BLOCK_N, num_warps)`` for a kernel that holds one whole row of ``n_cols`` elements."""
    if n_cols > MAX_HIDDEN:
        raise ValueError(f"hidden size {n_cols} exceeds the fused kernels' limit of {MAX_HIDDEN}")
    block = triton.next_power_of_2(n_cols)
    return block, min(max(block // 256, 1), 16)


def layer_norm_forward(x2d: torch.Tensor, res2d: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                       eps: float, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalised rows and the float32 per-row mean and 1/std that backward needs."""
    n_rows, n_cols = x2d.shape
    out = torch.empty(n_rows, n_cols, dtype=out_dtype, device=x2d.device)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x2d.device)
    rstd = torch.empty_like(mean)
    block, warps = _row_block(n_cols)
    _layer_norm_forward[(n_rows,)](x_ptr=x2d, res_ptr=res2d, w_ptr=weight, b_ptr=bias, out_ptr=out, mean_ptr=mean,
                                   rstd_ptr=rstd, n_cols=n_cols, eps=eps, HAS_RESIDUAL=res2d is not None,
                                   BLOCK_N=block, num_warps=warps)
    return out, mean, rstd


def layer_norm_backward(dy: torch.Tensor, x2d: torch.Tensor, res2d: torch.Tensor | None, weight: torch.Tensor,
                        mean: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dx`` (also the residual's gradient) and the float32 weight and bias gradients."""
    n_rows, n_cols = x2d.shape
    dx = torch.empty(n_rows, n_cols, dtype=dy.dtype, device=dy.device)
    programs = reduction_programs(n_rows, dy.device)
    rows_per_program = triton.cdiv(n_rows, programs)
    programs = triton.cdiv(n_rows, rows_per_program)
    dw_part = torch.empty(programs, n_cols, dtype=torch.float32, device=dy.device)
    db_part = torch.empty_like(dw_part)
    block, warps = _row_block(n_cols)
    _layer_norm_backward[(programs,)](dy_ptr=dy, x_ptr=x2d, res_ptr=res2d, w_ptr=weight, mean_ptr=mean,
                                      rstd_ptr=rstd, dx_ptr=dx, dw_part_ptr=dw_part, db_part_ptr=db_part,
                                      n_rows=n_rows, n_cols=n_cols, rows_per_program=rows_per_program,
                                      HAS_RESIDUAL=res2d is not None, BLOCK_N=block, num_warps=warps)
    return dx, dw_part.sum(0), db_part.sum(0)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, residual):
        n_cols = x.shape[-1]
        out_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
        x2d = x.reshape(-1, n_cols).contiguous()
        res2d = None if residual is None else residual.reshape(-1, n_cols).contiguous()
        out, mean, rstd = layer_norm_forward(x2d, res2d, weight, bias, eps, out_dtype)
        ctx.save_for_backward(x2d, res2d, weight, mean, rstd)
        ctx.shape, ctx.bias_dtype = x.shape, bias.dtype
        ctx.residual_dtype = None if residual is None else residual.dtype
        return out.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, res2d, weight, mean, rstd = ctx.saved_tensors
        dy = grad_out.reshape(x2d.shape).contiguous()
        dx, dw, db = layer_norm_backward(dy, x2d, res2d, weight, mean, rstd)
        dx = dx.reshape(ctx.shape)
        # d(x + residual)/dx = d(x + residual)/dresidual: both get dx, in their own dtype.
        d_x = dx.to(x2d.dtype) if ctx.needs_input_grad[0] else None
        d_res = dx.to(ctx.residual_dtype) if ctx.needs_input_grad[4] else None
        d_w = dw.to(weight.dtype) if ctx.needs_input_grad[1] else None
        d_b = db.to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        return d_x, d_w, d_b, None, d_res


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """``LayerNorm(x + residual)`` over the last dim; statistics in float32, output in the
    (promoted) input dtype. ``weight`` and ``bias`` are ``[hidden]`` tensors of any float dtype."""
    check_layer_norm_inputs(x, weight, bias, residual)
    return _LayerNorm.apply(x, weight.contiguous(), bias.contiguous(), float(eps), residual)
