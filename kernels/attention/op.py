"""The autograd function and the public Triton ops (``disentangled_attention``, ``disentangled_attention_varlen``)
over the planned forward and backward."""

from __future__ import annotations

import torch

from ..contract import AttentionCall, attention_op, varlen_attention_op
from .backward import attention_backward
from .forward import attention_forward
from .planning import _Problem, _tables_in, plan


class _DisentangledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pos_key, pos_query, problem: _Problem):
        problem = problem.packed()  # once, for both passes
        out, lse, end, *kept = attention_forward(q, k, v, pos_key, pos_query, problem)
        ctx.save_for_backward(q, k, v, pos_key, pos_query, out, lse, end, *kept)
        ctx.problem = problem
        return out

    @staticmethod
    def backward(ctx, grad_out):
        *saved, kept_c2p, kept_p2c = ctx.saved_tensors
        return (*attention_backward(grad_out, *saved, ctx.problem, (kept_c2p, kept_p2c)), None)


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
