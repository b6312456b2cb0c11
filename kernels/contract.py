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

from .relative_position import attention_span

IMPLS = ("auto", "triton", "reference")
IGNORE_INDEX = -100  # label of positions without an MLM target (PyTorch's cross-entropy default)
TRITON_HEAD_DIMS = (16, 32, 64, 128)  # head sizes the fused attention kernels are built for


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


def check_varlen_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                        max_seqlen: int) -> tuple[int, ...]:
    """Validate the packed form. A CPU ``cu_seqlens`` is checked on the host and its offsets returned;
    a device one is checked on the device (no host sync) and ``()`` returned."""
    if q.dim() != 3:
        raise ValueError(f"q must be [total_tokens, H, d], got shape {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(t.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor of >= 2 offsets, got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
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

    @property
    def per_sequence_scale(self) -> bool:
        return isinstance(self.softmax_scale, torch.Tensor)


def attention_op(implementation: Callable[[AttentionCall], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The padded attention signature, written once: validates, resolves the scale and calls
    ``implementation`` with the :class:`AttentionCall`."""

    @functools.wraps(implementation)
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_key: torch.Tensor | None = None,
           pos_query: torch.Tensor | None = None, *, position_buckets: int, max_relative_positions: int,
           attention_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
           softmax_scale: float | torch.Tensor | None = None, mask_diagonal: bool = False) -> torch.Tensor:
        span = attention_span(position_buckets, max_relative_positions)
        check_attention_inputs(q, k, v, pos_key, pos_query, span, attention_mask, dropout_p)
        check_softmax_scale(softmax_scale, q.shape[0], q.device, "[B]")
        scale = resolve_scale(softmax_scale, q.shape[-1], pos_key, pos_query)
        return implementation(AttentionCall(q, k, v, pos_key, pos_query, position_buckets, max_relative_positions,
                                            float(dropout_p), scale, attention_mask=attention_mask,
                                            mask_diagonal=bool(mask_diagonal)))

    return op


def varlen_attention_op(implementation: Callable[[AttentionCall], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The packed attention signature, written once (see :func:`attention_op`)."""

    @functools.wraps(implementation)
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_key: torch.Tensor | None = None,
           pos_query: torch.Tensor | None = None, *, cu_seqlens: torch.Tensor, max_seqlen: int,
           position_buckets: int, max_relative_positions: int, dropout_p: float = 0.0,
           softmax_scale: float | torch.Tensor | None = None, mask_diagonal: bool = False) -> torch.Tensor:
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
                                            mask_diagonal=bool(mask_diagonal)))

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
