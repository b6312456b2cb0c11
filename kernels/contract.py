"""The kernels' shared contract: implementation names, constants, input validation, result types.

Both implementations of every op (``reference`` and the Triton modules) validate their inputs and
return their results through this module, so a rule is written once.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from .shapes import IGNORE_INDEX, IMPLS, TRITON_HEAD_DIMS, attention_span  # noqa: F401 (re-exported: the contract)


def default_softmax_scale(head_dim: int, pos_key: torch.Tensor | None, pos_query: torch.Tensor | None) -> float:
    """``1 / sqrt(d * (1 + number of position terms))``, DeBERTa's scaling."""
    factor = 1 + (pos_key is not None) + (pos_query is not None)
    return 1.0 / math.sqrt(head_dim * factor)


def check_softmax_scale(softmax_scale: float | torch.Tensor | None, num_seqs: int, device: torch.device,
                        form: str) -> None:
    """A scale is a Python number, None (the default) or a float32 tensor of one scale per sequence
    (``form`` names that shape in errors: ``[B]`` padded, ``[S]`` packed)."""
    if softmax_scale is None or not isinstance(softmax_scale, torch.Tensor):
        return
    if softmax_scale.dtype != torch.float32 or tuple(softmax_scale.shape) != (num_seqs,):
        raise ValueError(f"softmax_scale as a tensor must be float32 {form} = ({num_seqs},), one scale per "
                         f"sequence; got {softmax_scale.dtype} {tuple(softmax_scale.shape)}")
    if softmax_scale.device != device:
        raise ValueError(f"softmax_scale is on {softmax_scale.device} but q is on {device}")
    if softmax_scale.requires_grad:
        raise ValueError("softmax_scale as a tensor is a constant of the op (no gradient flows into it); "
                         "pass it detached")


def resolve_scale(softmax_scale: float | torch.Tensor | None, head_dim: int, pos_key: torch.Tensor | None,
                  pos_query: torch.Tensor | None) -> float | torch.Tensor:
    """The scale an implementation applies: DeBERTa's default, the float given, or the per-sequence tensor."""
    if softmax_scale is None:
        return default_softmax_scale(head_dim, pos_key, pos_query)
    return softmax_scale.contiguous() if isinstance(softmax_scale, torch.Tensor) else float(softmax_scale)


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           pos_key: torch.Tensor | None, pos_query: torch.Tensor | None,
                           span: int, attention_mask: torch.Tensor | None, dropout_p: float) -> None:
    """Validate shapes of the padded contract; errors name the offending argument."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, H, N, d], got shape {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(t.shape)}")
    _, heads, _, head_dim = q.shape
    for name, t in (("pos_key", pos_key), ("pos_query", pos_query)):
        if t is not None and tuple(t.shape) != (heads, 2 * span, head_dim):
            raise ValueError(f"{name} must be [H, 2*span, d] = {(heads, 2 * span, head_dim)}, got {tuple(t.shape)}")
    if attention_mask is not None and tuple(attention_mask.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(f"attention_mask must be [B, N] = {(q.shape[0], q.shape[2])}, got {tuple(attention_mask.shape)}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")


def readable_on_host(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s values costs no device sync: a real CPU tensor (a fake one has no values)."""
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type == "cpu" and not is_fake(t)


def check_on_device(ok: torch.Tensor, message: str) -> None:
    """Assert ``ok`` (a bool tensor) without a host sync: on a GPU a failing check stops the stream with
    ``message`` (a device-side assert, as an out-of-range index would); on the CPU it raises at once."""
    torch._assert_async(ok, message)


def check_varlen_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """The packed form's shapes and ``cu_seqlens``' dtype, from metadata alone."""
    if q.dim() != 3:
        raise ValueError(f"q must be [total_tokens, H, d], got shape {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(t.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor of >= 2 offsets, got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")


def check_varlen_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                        max_seqlen: int) -> tuple[int, ...]:
    """Validate the packed form. A CPU ``cu_seqlens`` is checked on the host and its offsets returned;
    a device one is checked on the device (no host sync) and ``()`` returned."""
    check_varlen_shapes(q, k, v, cu_seqlens)
    total = q.shape[0]
    if not readable_on_host(cu_seqlens):
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        ok = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == total) & (lengths >= 0).all() & (lengths <= max_seqlen).all()
        check_on_device(ok, f"cu_seqlens must rise from 0 to total_tokens={total} with no sequence longer than "
                            f"max_seqlen={max_seqlen}")
        return ()
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to total_tokens={total}, got {bounds}")
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    if longest > max_seqlen:
        raise ValueError(f"a sequence in cu_seqlens has {longest} tokens, more than max_seqlen={max_seqlen}")
    return tuple(bounds)


def dropout_seed(dropout_p: float) -> int:
    """A fresh kernel seed (0 without dropout), drawn on the host from torch's global CPU generator, so
    torch.manual_seed makes dropout reproducible; no device value is read, also under a fake-tensor mode."""
    if dropout_p <= 0:
        return 0
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return int(torch.randint(0, 1 << 62, (1,)))


class MaskedLMLoss(NamedTuple):
    """Mean cross-entropy over labelled tokens, with the counts a trainer logs."""

    loss: torch.Tensor          # scalar; 0 (with zero gradients) when nothing is labelled
    num_labelled: torch.Tensor  # int64 scalar
    num_correct: torch.Tensor   # int64 scalar: labelled tokens whose argmax is the label

    @property
    def accuracy(self) -> torch.Tensor:
        return self.num_correct.float() / self.num_labelled.clamp_min(1).float()


def check_masked_lm_inputs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           labels: torch.Tensor) -> None:
    """Shapes and label dtype of a masked-LM loss call; errors name the offending argument."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match hidden {tuple(hidden.shape[:-1])}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [vocab, {hidden.shape[-1]}], got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [vocab={weight.shape[0]}], got {tuple(bias.shape)}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")


@dataclass(frozen=True)
class AttentionCall:
    """A validated attention call: the tensors, the position settings and the resolved scale.

    Padded form: ``q, k, v`` are ``[B, H, N, d]`` and ``attention_mask`` ``[B, N]`` (or None).
    Packed form: ``q, k, v`` are ``[total_tokens, H, d]``, ``bounds`` the host copy of ``cu_seqlens``.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    pos_key: torch.Tensor | None
    pos_query: torch.Tensor | None
    position_buckets: int
    max_relative_positions: int
    dropout_p: float
    softmax_scale: float | torch.Tensor  # a float, or float32 [num_seqs]: one scale per sequence
    attention_mask: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    bounds: tuple = ()  # host offsets when cu_seqlens is a CPU tensor, else () (never read from a device)
    mask_diagonal: bool = False  # query i never sees key i of its own sequence
    seed: int | None = None  # the dropout seed; None: a fresh one (dropout_seed) per call
    keep_scores: bool = True  # the Triton forward's dense position scores kept for the backward (planning)

    @property
    def per_sequence_scale(self) -> bool:
        return isinstance(self.softmax_scale, torch.Tensor)


def _tensor_or_none(scale: float | torch.Tensor | None) -> torch.Tensor | None:
    return scale if isinstance(scale, torch.Tensor) else None


def _float_or_none(scale: float | torch.Tensor | None) -> float | None:
    return None if scale is None or isinstance(scale, torch.Tensor) else float(scale)


def attention_op(implementation: Callable[[AttentionCall], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The padded attention signature, written once: validates, resolves the scale and calls
    ``implementation`` with the :class:`AttentionCall`."""

    @functools.wraps(implementation)
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_key: torch.Tensor | None = None,
           pos_query: torch.Tensor | None = None, *, position_buckets: int, max_relative_positions: int,
           attention_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
           softmax_scale: float | torch.Tensor | None = None, mask_diagonal: bool = False,
           keep_scores: bool = True) -> torch.Tensor:
        span = attention_span(position_buckets, max_relative_positions)
        check_attention_inputs(q, k, v, pos_key, pos_query, span, attention_mask, dropout_p)
        check_attention_tensors(q, k, v, pos_key, pos_query, attention_mask, None, _tensor_or_none(softmax_scale),
                                _float_or_none(softmax_scale))
        check_softmax_scale(softmax_scale, q.shape[0], q.device, "[B]")
        scale = resolve_scale(softmax_scale, q.shape[-1], pos_key, pos_query)
        return implementation(AttentionCall(q, k, v, pos_key, pos_query, position_buckets, max_relative_positions,
                                            float(dropout_p), scale, attention_mask=attention_mask,
                                            mask_diagonal=bool(mask_diagonal), keep_scores=bool(keep_scores)))

    return op


def varlen_attention_op(implementation: Callable[[AttentionCall], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The packed attention signature, written once (see :func:`attention_op`)."""

    @functools.wraps(implementation)
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_key: torch.Tensor | None = None,
           pos_query: torch.Tensor | None = None, *, cu_seqlens: torch.Tensor, max_seqlen: int,
           position_buckets: int, max_relative_positions: int, dropout_p: float = 0.0,
           softmax_scale: float | torch.Tensor | None = None, mask_diagonal: bool = False,
           keep_scores: bool = True) -> torch.Tensor:
        check_attention_tensors(q, k, v, pos_key, pos_query, None, cu_seqlens, _tensor_or_none(softmax_scale),
                                _float_or_none(softmax_scale))
        bounds = check_varlen_inputs(q, k, v, cu_seqlens, max_seqlen)
        span = attention_span(position_buckets, max_relative_positions)
        # The padded contract's checker covers pos_key/pos_query and dropout_p on a one-token view.
        one = q[:1].transpose(0, 1)[None]
        check_attention_inputs(one, one, one, pos_key, pos_query, span, None, dropout_p)
        check_softmax_scale(softmax_scale, cu_seqlens.numel() - 1, q.device, "[S] (len(cu_seqlens) - 1)")
        scale = resolve_scale(softmax_scale, q.shape[-1], pos_key, pos_query)
        return implementation(AttentionCall(q, k, v, pos_key, pos_query, position_buckets, max_relative_positions,
                                            float(dropout_p), scale, cu_seqlens=cu_seqlens,
                                            max_seqlen=int(max_seqlen), bounds=bounds,
                                            mask_diagonal=bool(mask_diagonal), keep_scores=bool(keep_scores)))

    return op


def check_targets(targets: torch.Tensor, n_vocab: int, ignore_index: int | None) -> None:
    """Every selected label is a vocabulary row (a bad label would index out of bounds): on the host for
    CPU labels, on the device (no host sync) otherwise."""
    if not targets.numel():
        return
    if not readable_on_host(targets):
        check_on_device(((targets >= 0) & (targets < n_vocab)).all(),
                        f"a label is outside the vocabulary [0, {n_vocab}) and is not ignore_index={ignore_index}")
        return
    bad = (targets < 0) | (targets >= n_vocab)
    if bool(bad.any()):
        raise ValueError(f"label {targets[bad][0].item()} is outside the vocabulary [0, {n_vocab}) and is not "
                         f"ignore_index={ignore_index}")


# --------------------------------------------------------------------------- the custom ops' own checks
#
# ``torch.ops.distaff.*`` (library.py) may be called directly (a user's model, a compiled graph) with no wrapper in
# front: each op checks its inputs itself, forward and backward, real and fake implementation alike, with the
# functions below. They read metadata only (shapes, dtypes, devices, the impl string), so they cost nothing, read no
# device value and run under FakeTensorMode and torch.compile; packed offsets are checked by value only where
# check_varlen_inputs can (on the host for CPU offsets, by a device-side assert otherwise).

OP_IMPLS = ("triton", "reference")      # what a distaff:: op runs: the public ops resolve "auto" before calling it
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_impl(impl: object) -> None:
    if impl not in OP_IMPLS:
        raise ValueError(f"impl must be one of {OP_IMPLS} in a distaff:: op (the public distaff.kernels ops resolve "
                         f"'auto'), got {impl!r}")


def check_devices(tensors: dict[str, torch.Tensor | None]) -> None:
    """Every tensor on the device of the first one named."""
    (first, lead), *rest = [(name, t) for name, t in tensors.items() if t is not None]
    for name, t in rest:
        if t.device != lead.device:
            raise ValueError(f"{name} is on {t.device} but {first} is on {lead.device}")


def check_dtypes(like: str, dtype: torch.dtype, tensors: dict[str, torch.Tensor | None]) -> None:
    """Every tensor of ``dtype``, the dtype of ``like``."""
    for name, t in tensors.items():
        if t is not None and t.dtype != dtype:
            raise TypeError(f"{name} must have the dtype of {like} ({dtype}), got {t.dtype}")


def check_floating(tensors: dict[str, torch.Tensor | None]) -> None:
    for name, t in tensors.items():
        if t is not None and not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def _check_shape(name: str, t: torch.Tensor, shape: tuple, what: str = "") -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must be {what or list(shape)} = {tuple(shape)}, got {tuple(t.shape)}")


def _check_triton_input(name: str, t: torch.Tensor, what: str) -> None:
    if t.dtype not in TRITON_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32 for the Triton {what}, got {t.dtype}")
    if t.numel() == 0:
        raise ValueError(f"{what} (triton) got an empty {name} of shape {tuple(t.shape)}")


def check_attention_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_key: torch.Tensor | None,
                            pos_query: torch.Tensor | None, mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                            scales: torch.Tensor | None, scale: float | None) -> None:
    """Every attention input on q's device, q floating-point and k, v of its dtype, a finite scale: checked by the
    public ops (:func:`attention_op`) and the custom op alike."""
    check_devices({"q": q, "k": k, "v": v, "pos_key": pos_key, "pos_query": pos_query, "attention_mask": mask,
                   "cu_seqlens": cu_seqlens, "softmax_scale": scales})
    check_floating({"q": q, "pos_key": pos_key, "pos_query": pos_query})
    check_dtypes("q", q.dtype, {"k": k, "v": v})
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be a finite number, got {scale}")


def check_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_key: torch.Tensor | None,
                       pos_query: torch.Tensor | None, mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                       scales: torch.Tensor | None, scale: float, max_seqlen: int, position_buckets: int,
                       max_relative_positions: int, dropout_p: float, impl: str, *, values: bool) -> None:
    """``distaff::attention``'s inputs, padded or packed (``values``: also ``cu_seqlens``' offsets, as
    :func:`check_varlen_inputs` checks them; the fake implementation checks metadata only)."""
    check_impl(impl)
    check_attention_tensors(q, k, v, pos_key, pos_query, mask, cu_seqlens, scales, scale)
    check_dtypes("q", q.dtype, {"pos_key": pos_key, "pos_query": pos_query})   # the public ops cast them first
    span = attention_span(position_buckets, max_relative_positions)
    if cu_seqlens is None:
        check_attention_inputs(q, k, v, pos_key, pos_query, span, mask, dropout_p)
        check_softmax_scale(scales, q.shape[0], q.device, "[B]")
    else:
        if mask is not None:
            raise ValueError("attention_mask must be None in the packed form (cu_seqlens marks the sequences)")
        check_varlen_inputs(q, k, v, cu_seqlens, max_seqlen) if values else check_varlen_shapes(q, k, v, cu_seqlens)
        one = q[:1].transpose(0, 1)[None]       # the padded checks of the tables and dropout on a one-token view
        check_attention_inputs(one, one, one, pos_key, pos_query, span, None, dropout_p)
        check_softmax_scale(scales, cu_seqlens.shape[0] - 1, q.device, "[S] (len(cu_seqlens) - 1)")
        if max_seqlen < 1 and q.shape[0] > 0:
            raise ValueError(f"max_seqlen must be >= 1 for {q.shape[0]} packed tokens, got {max_seqlen}")
    if impl == "triton":
        _check_triton_input("q", q, "attention")
        if q.shape[-1] not in TRITON_HEAD_DIMS:
            raise ValueError(f"head dim d must be one of {TRITON_HEAD_DIMS} for the Triton kernel, got {q.shape[-1]}")


def attention_stat_shapes(q: torch.Tensor, packed: bool, has_tables: bool) -> tuple[tuple, tuple]:
    """The shapes of the Triton forward's saved row statistics (lse) and end terms."""
    stats = (q.shape[1], q.shape[0]) if packed else tuple(q.shape[:3])
    return stats, ((4, *stats) if has_tables else (1,))


def kernel_strides(q: torch.Tensor) -> tuple[int, ...]:
    """The strides the Triton attention reads q, k, v and writes its output and their gradients with: ``q``'s
    own where ``q`` is dense, non-overlapping and has its head dim contiguous (a model's ``[B, N, H*d]``
    projection viewed as ``[B, H, N, d]`` is: no copy in, and the output viewed back is no copy out), else
    contiguous strides. The custom ops' fakes give their outputs these strides too, so a compiled graph sees
    the strides the kernels write."""
    dims = sorted((i for i in range(q.dim()) if q.shape[i] > 1), key=lambda i: q.stride(i))
    expected = 1
    for i in dims:
        if q.stride(i) != expected:
            return _contiguous_strides(q.shape)
        expected *= q.shape[i]
    if q.shape[-1] > 1 and q.stride(-1) != 1:
        return _contiguous_strides(q.shape)
    return tuple(q.stride())


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def in_kernel_layout(t: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """``t`` itself when it already has ``strides`` (:func:`kernel_strides`), else a copy with them (differentiable:
    part of the caller's autograd graph)."""
    if tuple(t.stride()) == tuple(strides):
        return t
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


def check_attention_saved(grad_out: torch.Tensor, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                          end: torch.Tensor, seed: torch.Tensor, packed: bool, has_tables: bool, impl: str) -> None:
    """What ``distaff::attention_backward`` receives besides the forward's inputs: the output's gradient and the
    forward's results (for Triton its row statistics), and the dropout seed, a CPU integer scalar."""
    check_devices({"q": q, "grad_out": grad_out, "out": out, "lse": lse, "end": end})
    check_floating({"grad_out": grad_out})
    _check_shape("grad_out", grad_out, q.shape, "the shape of q")
    _check_shape("out", out, q.shape, "the shape of q")
    if seed.device.type != "cpu" or seed.numel() != 1 or seed.dtype.is_floating_point:
        raise ValueError(f"seed must be the int64 CPU scalar the forward returned, got {seed.dtype} "
                         f"{tuple(seed.shape)} on {seed.device}")
    if impl == "triton":
        stats, ends = attention_stat_shapes(q, packed, has_tables)
        _check_shape("lse", lse, stats, "the forward's row statistics")
        if tuple(end.shape) not in (ends, (1,)):    # (1,): a stand-in when no tile of the forward saturated
            raise ValueError(f"end must be the forward's end terms {ends} (or its one-element stand-in), got "
                             f"{tuple(end.shape)}")
        check_dtypes("the forward's statistics", torch.float32, {"lse": lse, "end": end})


def check_layer_norm_inputs(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                            residual: torch.Tensor | None, impl: str = "triton") -> None:
    """``weight`` and ``bias`` of shape ``[x.shape[-1]]``, ``residual`` of x's shape, all on x's device; the Triton
    kernel takes no empty input."""
    check_impl(impl)
    hidden = x.shape[-1] if x.dim() else 0
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            raise ValueError(f"layer_norm needs a {name} tensor, got None")
        if t.shape != (hidden,):
            raise ValueError(f"{name} must be [{hidden}] (the last dim of x), got {tuple(t.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    check_devices({"x": x, "weight": weight, "bias": bias, "residual": residual})
    check_floating({"x": x, "weight": weight, "bias": bias, "residual": residual})
    if impl == "triton" and x.numel() == 0:
        raise ValueError(f"layer_norm got an empty input of shape {tuple(x.shape)}")


def check_bias_gelu_inputs(x: torch.Tensor, bias: torch.Tensor | None, impl: str = "triton") -> None:
    """``bias`` of shape ``[x.shape[-1]]`` on x's device; the Triton kernel takes no empty input."""
    check_impl(impl)
    if bias is None or x.dim() == 0 or bias.shape != (x.shape[-1],):
        got = None if bias is None else tuple(bias.shape)
        raise ValueError(f"bias must be [{x.shape[-1] if x.dim() else 0}] (the last dim of x), got {got}")
    check_devices({"x": x, "bias": bias})
    check_floating({"x": x, "bias": bias})
    if impl == "triton" and x.numel() == 0:
        raise ValueError(f"bias_gelu got an empty input of shape {tuple(x.shape)}")


def check_gradient(grad_out: torch.Tensor, of: torch.Tensor, name: str = "x") -> None:
    """A backward op's incoming gradient: the shape of its forward's output (``of``'s), on its device."""
    _check_shape("grad_out", grad_out, of.shape, f"the shape of {name}")
    check_devices({name: of, "grad_out": grad_out})
    check_floating({"grad_out": grad_out})


def check_row_statistics(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, impl: str) -> None:
    """The Triton layer norm's saved float32 mean and 1/std, one per row of ``x``."""
    if impl == "triton":
        rows = x.numel() // max(x.shape[-1], 1)
        for name, t in (("mean", mean), ("rstd", rstd)):
            _check_shape(name, t, (rows,), "one float32 per row of x")
        check_dtypes("the row statistics", torch.float32, {"mean": mean, "rstd": rstd})
        check_devices({"x": x, "mean": mean, "rstd": rstd})


def check_masked_lm_op(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                       row_chunk: int, vocab_block: int, needs_grad: list, impl: str) -> None:
    """``distaff::masked_lm_loss``'s inputs: the wrapper's shape and label checks, devices, dtypes (the Triton
    kernels take hidden, weight and bias in one dtype, prepared by ``mlm_loss.prepare``), the tiling."""
    check_impl(impl)
    check_masked_lm_inputs(hidden, weight, bias, labels)
    check_devices({"hidden": hidden, "weight": weight, "bias": bias, "labels": labels})
    check_floating({"hidden": hidden, "weight": weight, "bias": bias})
    if len(needs_grad) != 3:
        raise ValueError(f"needs_grad must say for hidden, weight and bias whether to compute a gradient, got "
                         f"{needs_grad}")
    if impl == "triton":
        check_dtypes("hidden", hidden.dtype, {"weight": weight, "bias": bias})
        _check_triton_input("hidden", hidden, "masked-LM loss")
        if row_chunk < 1 or vocab_block < 16 or vocab_block & (vocab_block - 1):
            raise ValueError(f"row_chunk must be >= 1 and vocab_block a power of two >= 16, got {row_chunk}, "
                             f"{vocab_block}")
