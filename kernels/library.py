"""The ops as ``torch.library`` custom ops (namespace ``distaff``), so compiled and graph-captured models keep them.

Each op is a forward custom op and, where its backward is not a few torch operations, a backward custom op,
both with a fake (meta) implementation that only computes output shapes: ``torch.compile(model,
fullgraph=True)`` traces a model through them without a graph break, and ``FakeTensorMode`` runs them
without touching data. Both implementations run inside: the Triton one (forward and backward kernels),
and the reference, whose backward recomputes its forward under autograd (it is the CPU and test path).

The public ops in :mod:`distaff.kernels` route here while ``torch.compile`` traces; eager calls run the
implementation directly (no recomputation). Every op, forward and backward, real and fake, checks its own inputs
(``kernels/contract.py``: shapes, dtypes, devices, ``impl``, from metadata only), so a direct call of
``torch.ops.distaff.*`` is checked as a call through the public ops is.
Only torch is imported at module level; the Triton modules are imported by the implementations that use them.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import replace
from typing import Callable, Optional, Sequence

import torch

from . import reference
from .contract import (IGNORE_INDEX, AttentionCall, MaskedLMLoss, attention_op, attention_stat_shapes,
                       check_attention_op, check_attention_saved, check_bias_gelu_inputs, check_gradient,
                       check_layer_norm_inputs, check_masked_lm_inputs, check_masked_lm_op, check_row_statistics,
                       dropout_seed, kernel_strides, varlen_attention_op)

if __name__ != "distaff.kernels.library":  # a second copy would register every op again (kernels/__init__.py)
    raise ImportError(f"{__file__} imported as {__name__!r}: the distaff:: ops are registered once, by "
                      "distaff.kernels.library; import distaff.kernels (a distaff checkout's root on sys.path makes "
                      "its folders importable as top-level packages)")


def _triton(module: str):
    return importlib.import_module(f".{module}", __package__)


def _empty(like: torch.Tensor) -> torch.Tensor:
    """Stands in for an absent output (custom ops return tensors, never None)."""
    return like.new_empty((0,))


def _no_words(like: torch.Tensor) -> torch.Tensor:
    """Stands in for the packed padding mask where there is none (the reference, no mask)."""
    return like.new_empty((0,), dtype=torch.int32)


def _or_none(t: torch.Tensor) -> torch.Tensor | None:
    return None if t.numel() == 0 and t.dim() == 1 else t


@contextlib.contextmanager
def _autograd():
    """Autograd inside a custom op's implementation, which runs below the autograd dispatch keys: the
    reference recomputes its forward under autograd to get its gradients."""
    keys = (torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
            | torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView))
    excluded = torch._C._dispatch_tls_local_exclude_set() - keys
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded), torch.enable_grad():
        yield


def _reference_grads(fn: Callable, inputs: Sequence[torch.Tensor | None], grads: Sequence[torch.Tensor | None],
                     *args) -> list[torch.Tensor]:
    """Gradients of ``fn(*inputs, *args)``'s outputs, weighted by ``grads``, with respect to every floating
    input (recomputed under autograd); an empty tensor for absent inputs."""
    with _autograd():
        leaves = [None if t is None else t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
        outs = fn(*leaves, *args)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        found = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
    by_leaf = dict(zip(map(id, wanted), found))
    return [torch.empty(0) if t is None else
            (by_leaf.get(id(t)) if by_leaf.get(id(t)) is not None else torch.zeros_like(t)) for t in leaves]


# --------------------------------------------------------------------------- attention


def _call(q, k, v, pos_key, pos_query, mask, cu_seqlens, scales, scale, max_seqlen, position_buckets,
          max_relative_positions, dropout_p, mask_diagonal, keep_scores, seed) -> AttentionCall:
    return AttentionCall(q, k, v, pos_key, pos_query, position_buckets, max_relative_positions, dropout_p,
                         scale if scales is None else scales, attention_mask=mask, cu_seqlens=cu_seqlens,
                         max_seqlen=max_seqlen, mask_diagonal=mask_diagonal, seed=seed, keep_scores=keep_scores)


def _reference_attention(call: AttentionCall) -> torch.Tensor:
    fn = reference.disentangled_attention if call.cu_seqlens is None else reference.disentangled_attention_varlen
    return fn.__wrapped__(call)


# Both attention ops take q, k and v as laid out (a model's projections: no copy in) and their fakes give outputs
# the strides those imply (``contract.kernel_strides``): ``needs_exact_strides`` makes a compiled graph hand the
# real op the strides its fake saw.
@torch.library.custom_op("distaff::attention", mutates_args=(), tags=(torch.Tag.needs_exact_strides,))
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_key: Optional[torch.Tensor],
                  pos_query: Optional[torch.Tensor], mask: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                  scales: Optional[torch.Tensor], scale: float, max_seqlen: int, position_buckets: int,
                  max_relative_positions: int, dropout_p: float, mask_diagonal: bool, keep_scores: bool,
                  impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                      torch.Tensor, torch.Tensor]:
    """``(out, lse, end, seed, kept_c2p, kept_p2c, mask_words)``: lse, end terms, the kept position scores and
    the packed padding mask are the Triton backward's (empty for the reference, for scores the plan does not keep:
    ``_Problem.kept_shape``, and without a mask: ``_Problem.packed_mask_shape``; the backward reads the words
    instead of packing the mask again, a launch a layer); ``seed`` is the dropout seed drawn for this call, an
    int64 CPU scalar the backward reuses."""
    check_attention_op(q, k, v, pos_key, pos_query, mask, cu_seqlens, scales, scale, max_seqlen, position_buckets,
                       max_relative_positions, dropout_p, impl, values=True)
    if dropout_p > 0 and q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("distaff attention: dropout_p > 0 inside a CUDA graph capture would replay one dropout "
                           "mask on every replay (the seed is a host value); capture with dropout_p=0 (e.g. "
                           "attention_probs_dropout_prob=0 or eval mode) or leave the attention outside the graph")
    seed = dropout_seed(dropout_p)
    call = _call(q, k, v, pos_key, pos_query, mask, cu_seqlens, scales, scale, max_seqlen, position_buckets,
                 max_relative_positions, dropout_p, mask_diagonal, keep_scores, seed)
    seed_tensor = torch.tensor(seed, dtype=torch.int64)
    if impl == "reference":
        with torch.no_grad():
            return _reference_attention(call), _empty(q), _empty(q), seed_tensor, _empty(q), _empty(q), _no_words(q)
    attention = _triton("attention")
    q, k, v, problem = attention.plan(call)
    problem = problem.packed()
    out, lse, end, kept_c2p, kept_p2c = attention.attention_forward(q, k, v, pos_key, pos_query, problem)
    return out, lse, end, seed_tensor, kept_c2p, kept_p2c, _no_words(q) if problem.mask is None else problem.mask


@_attention_op.register_fake
def _(q, k, v, pos_key, pos_query, mask, cu_seqlens, scales, scale, max_seqlen, position_buckets,
      max_relative_positions, dropout_p, mask_diagonal, keep_scores, impl):
    check_attention_op(q, k, v, pos_key, pos_query, mask, cu_seqlens, scales, scale, max_seqlen, position_buckets,
                       max_relative_positions, dropout_p, impl, values=False)
    seed = torch.empty((), dtype=torch.int64, device="cpu")
    if impl == "reference":
        return torch.empty_like(q), _empty(q), _empty(q), seed, _empty(q), _empty(q), _no_words(q)
    has_tables = pos_key is not None or pos_query is not None
    stats, _ = attention_stat_shapes(q, cu_seqlens is not None, has_tables)
    out = q.new_empty_strided(q.shape, kernel_strides(q))  # the layout the kernels write (planning.plan)
    # the end terms' shape and whether and what the forward keeps are the plan's (host arithmetic on the shapes: no
    # device value is read)
    problem = _triton("attention").plan(_call(q, k, v, pos_key, pos_query, mask, cu_seqlens, scales, scale,
                                               max_seqlen, position_buckets, max_relative_positions, dropout_p,
                                               mask_diagonal, keep_scores, 0))[-1]
    end = q.new_empty(problem.end_terms_shape(q, has_tables), dtype=torch.float32)
    kept = (q.new_empty(problem.kept_shape(t is not None)) for t in (pos_key, pos_query))
    words = q.new_empty(problem.packed_mask_shape(), dtype=torch.int32)
    return out, q.new_empty(stats, dtype=torch.float32), end, seed, *kept, words


@torch.library.custom_op("distaff::attention_backward", mutates_args=(), tags=(torch.Tag.needs_exact_strides,))
def _attention_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           pos_key: Optional[torch.Tensor], pos_query: Optional[torch.Tensor],
                           mask: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                           scales: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor, end: torch.Tensor,
                           seed: torch.Tensor, kept_c2p: torch.Tensor, kept_p2c: torch.Tensor,
                           mask_words: torch.Tensor, scale: float, max_seqlen: int, position_buckets: int,
                           max_relative_positions: int, dropout_p: float, mask_diagonal: bool, keep_scores: bool,
                           impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dq, dk, dv, d_pos_key, d_pos_query`` (empty for an absent table). ``mask_words``: the forward's packed
    mask, or empty (the mask is packed again)."""
    _check_attention_backward(grad_out, q, k, v, pos_key, pos_query, mask, cu_seqlens, scales, out, lse, end, seed,
                              mask_words, scale, max_seqlen, position_buckets, max_relative_positions, dropout_p,
                              impl, values=True)
    call = _call(q, k, v, pos_key, pos_query, mask, cu_seqlens, scales, scale, max_seqlen, position_buckets,
                 max_relative_positions, dropout_p, mask_diagonal, keep_scores, int(seed))  # CPU scalar: no sync
    if impl == "reference":
        grads = _reference_grads(lambda *t: _reference_attention(replace(call, q=t[0], k=t[1], v=t[2], pos_key=t[3],
                                                                         pos_query=t[4])),
                                 [q, k, v, pos_key, pos_query], [grad_out])
    else:
        attention = _triton("attention")
        q, k, v, problem = attention.plan(call)
        if mask_words.numel():
            problem = replace(problem, mask=mask_words)
        grads = attention.attention_backward(grad_out, q, k, v, pos_key, pos_query, out, lse, end, problem,
                                             (kept_c2p, kept_p2c))
    dq, dk, dv = (g.to(t.dtype) for g, t in zip(grads, (q, k, v)))
    # The tables' gradients contiguous whatever the tables' layout, as the fake says (a model's tables are views).
    d_tables = (_empty(q) if g is None or t is None else g.to(t.dtype).contiguous()
                for g, t in zip(grads[3:], (pos_key, pos_query)))
    return dq, dk, dv, *d_tables


@_attention_backward_op.register_fake
def _(grad_out, q, k, v, pos_key, pos_query, mask, cu_seqlens, scales, out, lse, end, seed, kept_c2p, kept_p2c,
      mask_words, scale, max_seqlen, position_buckets, max_relative_positions, dropout_p, mask_diagonal, keep_scores,
      impl):
    _check_attention_backward(grad_out, q, k, v, pos_key, pos_query, mask, cu_seqlens, scales, out, lse, end, seed,
                              mask_words, scale, max_seqlen, position_buckets, max_relative_positions, dropout_p,
                              impl, values=False)
    if impl == "reference":
        grads = tuple(torch.empty_like(t) for t in (q, k, v))
    else:  # dq, dk and dv in the kernels' layout (planning.plan)
        grads = tuple(t.new_empty_strided(t.shape, kernel_strides(q)) for t in (q, k, v))
    return *grads, *(_empty(q) if t is None else t.new_empty(t.shape) for t in (pos_key, pos_query))


def _check_attention_backward(grad_out, q, k, v, pos_key, pos_query, mask, cu_seqlens, scales, out, lse, end, seed,
                              mask_words, scale, max_seqlen, position_buckets, max_relative_positions, dropout_p,
                              impl, values: bool) -> None:
    check_attention_op(q, k, v, pos_key, pos_query, mask, cu_seqlens, scales, scale, max_seqlen, position_buckets,
                       max_relative_positions, dropout_p, impl, values=values)
    check_attention_saved(grad_out, q, out, lse, end, seed, cu_seqlens is not None,
                          pos_key is not None or pos_query is not None, impl)
    if mask_words.numel() == 0:
        return
    got = f"got {mask_words.dtype} {tuple(mask_words.shape)} on {mask_words.device}"
    if mask is None or impl != "triton":
        raise ValueError(f"mask_words must be empty without a padding mask or with impl='reference', {got}")
    # words of another mask would be a silent wrong result: only the shape and dtype the forward gives are taken
    packed = (mask.shape[0], _triton("attention").mask.mask_words(q.shape[-2]))
    if (tuple(mask_words.shape), mask_words.dtype, mask_words.device) != (packed, torch.int32, q.device):
        raise ValueError(f"mask_words must be the forward's packed mask (int32 {packed} on {q.device}) or empty, {got}")


def _attention_setup(ctx, inputs, output) -> None:
    q, k, v, pos_key, pos_query, mask, cu_seqlens, scales = inputs[:8]
    ctx.save_for_backward(q, k, v, pos_key, pos_query, mask, cu_seqlens, scales, *output)
    ctx.options = inputs[8:]


def _attention_backward(ctx, grad_out, *_others):
    q, k, v, pos_key, pos_query, mask, cu_seqlens, scales, out, lse, end, seed, *kept = ctx.saved_tensors
    grads = _attention_backward_op(grad_out, q, k, v, pos_key, pos_query, mask, cu_seqlens, scales, out, lse, end,
                                   seed, *kept, *ctx.options)
    return (*(_or_none(g) for g in grads), None, None, None, *(None,) * len(ctx.options))


_attention_op.register_autograd(_attention_backward, setup_context=_attention_setup)


def _attention(impl: str) -> Callable[[AttentionCall], torch.Tensor]:
    def run(call: AttentionCall) -> torch.Tensor:
        tables = [None if t is None else t.to(call.q.dtype).contiguous() for t in (call.pos_key, call.pos_query)]
        scale = call.softmax_scale
        out = _attention_op(call.q, call.k, call.v, *tables,
                            call.attention_mask, call.cu_seqlens, scale if call.per_sequence_scale else None,
                            1.0 if call.per_sequence_scale else float(scale), call.max_seqlen, call.position_buckets,
                            call.max_relative_positions, call.dropout_p, call.mask_diagonal, call.keep_scores,
                            impl)[0]
        return out

    return run


def disentangled_attention(*args, impl: str, **kwargs) -> torch.Tensor:
    """:func:`distaff.kernels.disentangled_attention` through ``distaff::attention``."""
    return attention_op(_attention(impl))(*args, **kwargs)


def disentangled_attention_varlen(*args, impl: str, **kwargs) -> torch.Tensor:
    """:func:`distaff.kernels.disentangled_attention_varlen` through ``distaff::attention``."""
    return varlen_attention_op(_attention(impl))(*args, **kwargs)


# --------------------------------------------------------------------------- layer norm


@torch.library.custom_op("distaff::layer_norm", mutates_args=())
def _layer_norm_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                   residual: Optional[torch.Tensor], impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, mean, rstd)``; the float32 row statistics are the Triton backward's (empty for the reference)."""
    _check_layer_norm(x, weight, bias, eps, residual, impl)
    if impl == "reference":
        with torch.no_grad():
            return reference.layer_norm(x, weight, bias, eps, residual), _empty(x), _empty(x)
    kernel, n_cols = _triton("fused_layer_norm"), x.shape[-1]
    out_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    res2d = None if residual is None else residual.reshape(-1, n_cols).contiguous()
    out, mean, rstd = kernel.layer_norm_forward(x.reshape(-1, n_cols).contiguous(), res2d, weight, bias, eps, out_dtype)
    return out.reshape(x.shape), mean, rstd


@_layer_norm_op.register_fake
def _(x, weight, bias, eps, residual, impl):
    _check_layer_norm(x, weight, bias, eps, residual, impl)
    out_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = x.new_empty(x.shape, dtype=out_dtype)
    if impl == "reference":
        return out, _empty(x), _empty(x)
    rows = x.numel() // x.shape[-1]
    return out, x.new_empty((rows,), dtype=torch.float32), x.new_empty((rows,), dtype=torch.float32)


@torch.library.custom_op("distaff::layer_norm_backward", mutates_args=())
def _layer_norm_backward_op(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                            eps: float, residual: Optional[torch.Tensor], mean: torch.Tensor, rstd: torch.Tensor,
                            impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dx, d_weight, d_bias, d_residual`` (empty without a residual), each in its input's dtype."""
    _check_layer_norm_backward(grad_out, x, weight, bias, eps, residual, mean, rstd, impl)
    if impl == "reference":
        grads = _reference_grads(reference.layer_norm, [x, weight, bias], [grad_out], eps, residual)
        dx = grads[0]
    else:
        n_cols = x.shape[-1]
        res2d = None if residual is None else residual.reshape(-1, n_cols).contiguous()
        dx, dw, db = _triton("fused_layer_norm").layer_norm_backward(
            grad_out.reshape(-1, n_cols).contiguous(), x.reshape(-1, n_cols).contiguous(), res2d, weight, mean, rstd)
        dx = dx.reshape(x.shape)
        grads = [dx, dw, db]
    # d(x + residual)/dx = d(x + residual)/d residual: both get dx, in their own dtype.
    return (dx.to(x.dtype), grads[1].to(weight.dtype), grads[2].to(bias.dtype),
            _empty(x) if residual is None else dx.to(residual.dtype, copy=True))


@_layer_norm_backward_op.register_fake
def _(grad_out, x, weight, bias, eps, residual, mean, rstd, impl):
    _check_layer_norm_backward(grad_out, x, weight, bias, eps, residual, mean, rstd, impl)
    return (torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias),
            _empty(x) if residual is None else torch.empty_like(residual))


def _check_layer_norm(x, weight, bias, eps, residual, impl) -> None:
    check_layer_norm_inputs(x, weight, bias, residual, impl)
    if not 0 <= eps < float("inf"):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")


def _check_layer_norm_backward(grad_out, x, weight, bias, eps, residual, mean, rstd, impl) -> None:
    _check_layer_norm(x, weight, bias, eps, residual, impl)
    check_gradient(grad_out, x)
    check_row_statistics(x, mean, rstd, impl)


def _layer_norm_setup(ctx, inputs, output) -> None:
    x, weight, bias, eps, residual, impl = inputs
    ctx.save_for_backward(x, weight, bias, residual, output[1], output[2])
    ctx.eps, ctx.impl = eps, impl


def _layer_norm_backward(ctx, grad_out, _mean, _rstd):
    x, weight, bias, residual, mean, rstd = ctx.saved_tensors
    dx, dw, db, dres = _layer_norm_backward_op(grad_out, x, weight, bias, ctx.eps, residual, mean, rstd, ctx.impl)
    return dx, dw, db, None, _or_none(dres), None


_layer_norm_op.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               residual: torch.Tensor | None = None, *, impl: str) -> torch.Tensor:
    """:func:`distaff.kernels.layer_norm` through ``distaff::layer_norm``."""
    check_layer_norm_inputs(x, weight, bias, residual, impl)
    return _layer_norm_op(x, weight.contiguous(), bias.contiguous(), float(eps), residual, impl)[0]


# --------------------------------------------------------------------------- bias + GELU


@torch.library.custom_op("distaff::bias_gelu", mutates_args=())
def _bias_gelu_op(x: torch.Tensor, bias: torch.Tensor, impl: str) -> torch.Tensor:
    check_bias_gelu_inputs(x, bias, impl)
    if impl == "reference":
        with torch.no_grad():
            return reference.bias_gelu(x, bias)
    return _triton("gelu").bias_gelu_forward(x.reshape(-1, x.shape[-1]).contiguous(), bias).reshape(x.shape)


@_bias_gelu_op.register_fake
def _(x, bias, impl):
    check_bias_gelu_inputs(x, bias, impl)
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, bias.dtype))


@torch.library.custom_op("distaff::bias_gelu_backward", mutates_args=())
def _bias_gelu_backward_op(grad_out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor,
                           impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    check_bias_gelu_inputs(x, bias, impl)
    check_gradient(grad_out, x)
    if impl == "reference":
        dx, d_bias = _reference_grads(reference.bias_gelu, [x, bias], [grad_out])
    else:
        x2d = x.reshape(-1, x.shape[-1]).contiguous()
        dx, d_bias = _triton("gelu").bias_gelu_backward(grad_out.reshape(x2d.shape).contiguous(), x2d, bias)
    return dx.reshape(x.shape).to(x.dtype), d_bias.to(bias.dtype)


@_bias_gelu_backward_op.register_fake
def _(grad_out, x, bias, impl):
    check_bias_gelu_inputs(x, bias, impl)
    check_gradient(grad_out, x)
    return torch.empty_like(x), torch.empty_like(bias)


def _bias_gelu_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.impl = inputs[2]


def _bias_gelu_backward(ctx, grad_out):
    x, bias = ctx.saved_tensors
    return (*_bias_gelu_backward_op(grad_out, x, bias, ctx.impl), None)


_bias_gelu_op.register_autograd(_bias_gelu_backward, setup_context=_bias_gelu_setup)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, *, impl: str) -> torch.Tensor:
    """:func:`distaff.kernels.bias_gelu` through ``distaff::bias_gelu``."""
    check_bias_gelu_inputs(x, bias, impl)
    return _bias_gelu_op(x, bias.contiguous(), impl)


# --------------------------------------------------------------------------- masked-LM loss


@torch.library.custom_op("distaff::masked_lm_loss", mutates_args=())
def _masked_lm_loss_op(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       labels: torch.Tensor, ignore_index: Optional[int], row_chunk: int, vocab_block: int,
                       needs_grad: list[bool], impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor, torch.Tensor, torch.Tensor]:
    """``loss, num_labelled, num_correct`` and the loss's gradients (unscaled by the incoming gradient) with
    respect to hidden, weight and bias, computed in the forward pass (the fused kernel's design); empty
    where ``needs_grad`` says no."""
    check_masked_lm_op(hidden, weight, bias, labels, row_chunk, vocab_block, needs_grad, impl)
    if impl == "reference":
        with _autograd():
            leaves = [None if t is None else t.detach().requires_grad_(need)
                      for t, need in zip((hidden, weight, bias), needs_grad)]
            result = reference.masked_lm_loss(*leaves, labels, ignore_index)
            wanted = [t for t in leaves if t is not None and t.requires_grad]
            found = iter(torch.autograd.grad(result.loss, wanted) if wanted else ())
        grads = [next(found) if t is not None and t.requires_grad else None for t in leaves]
        loss, num_labelled, num_correct = result.loss.detach(), result.num_labelled, result.num_correct
    else:
        loss, num_labelled, num_correct, grads = _triton("mlm_loss").loss_and_grads(
            hidden, weight, bias, labels, ignore_index, tuple(needs_grad), row_chunk, vocab_block)
    return (loss, num_labelled, num_correct,
            *(_empty(hidden) if g is None else g for g in grads))


@_masked_lm_loss_op.register_fake
def _(hidden, weight, bias, labels, ignore_index, row_chunk, vocab_block, needs_grad, impl):
    check_masked_lm_op(hidden, weight, bias, labels, row_chunk, vocab_block, needs_grad, impl)
    scalar = hidden.new_empty((), dtype=torch.float32)
    counts = [hidden.new_empty((), dtype=torch.int64) for _ in range(2)]
    grad_dtype = hidden.dtype if impl == "triton" else None
    shapes = [(hidden, grad_dtype or hidden.dtype), (weight, torch.float32 if impl == "triton" else weight.dtype),
              (bias, torch.float32 if impl == "triton" else None if bias is None else bias.dtype)]
    grads = [_empty(hidden) if t is None or not need else t.new_empty(t.shape, dtype=dtype)
             for (t, dtype), need in zip(shapes, needs_grad)]
    return (scalar, *counts, *grads)


def _masked_lm_loss_setup(ctx, inputs, output) -> None:
    hidden, weight, bias = inputs[:3]
    ctx.save_for_backward(*output[3:])
    ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)


def _masked_lm_loss_backward(ctx, grad_loss, _num_labelled, _num_correct, *_grads):
    grads = [None if g.numel() == 0 and g.dim() == 1 or dtype is None else (g * grad_loss).to(dtype)
             for g, dtype in zip(ctx.saved_tensors, ctx.dtypes)]
    return (*grads, None, None, None, None, None, None)


_masked_lm_loss_op.register_autograd(_masked_lm_loss_backward, setup_context=_masked_lm_loss_setup)


def masked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                   ignore_index: int | None = IGNORE_INDEX, *, impl: str, **options) -> MaskedLMLoss:
    """:func:`distaff.kernels.masked_lm_loss` through ``distaff::masked_lm_loss``."""
    check_masked_lm_inputs(hidden, weight, bias, labels)
    needs_grad = [torch.is_grad_enabled() and t is not None and t.requires_grad for t in (hidden, weight, bias)]
    if impl == "reference":
        args, chunks = (hidden, weight, bias), (0, 0)
    else:
        from . import mlm_loss

        args, chunks = mlm_loss.prepare(hidden, weight, bias, **options)
    loss, num_labelled, num_correct, *_ = _masked_lm_loss_op(*args, labels, ignore_index, *chunks, needs_grad, impl)
    return MaskedLMLoss(loss, num_labelled, num_correct)

