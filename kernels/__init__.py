"""distaff.kernels: fused Triton kernels for DeBERTa training, each with a PyTorch reference.

Every public op takes ``impl="auto" | "triton" | "reference"``: ``auto`` runs Triton on CUDA
tensors and the reference elsewhere; ``triton`` forces the Triton path, which also runs on CPU
tensors when ``TRITON_INTERPRET=1`` is set before import. This package imports only torch and
triton (the latter lazily, so the reference path works without a usable triton).
"""

from __future__ import annotations

import importlib
import os

import torch

from . import reference
from .reference import MaskedLMLoss
from .relative_position import attention_span, bucket_table, relative_position_index

IMPLS = ("auto", "triton", "reference")

# op name -> module holding its Triton implementation (a function of the same name).
_TRITON_MODULES = {
    "disentangled_attention": "attention",
    "disentangled_attention_varlen": "attention",
    "layer_norm": "fused_layer_norm",
    "bias_gelu": "gelu",
    "masked_lm_loss": "mlm_loss",
}


def triton_available(device: torch.device | None = None) -> bool:
    """Whether the Triton path can run on ``device`` (CUDA, or any device under the interpreter)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return device is not None and device.type == "cuda"


def resolve_impl(impl: str, device: torch.device) -> str:
    """Turn ``impl`` into ``"triton"`` or ``"reference"`` for tensors on ``device``."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "triton" if device.type == "cuda" else "reference"
    if impl == "triton" and not triton_available(device):
        raise RuntimeError(f"impl='triton' needs CUDA tensors or TRITON_INTERPRET=1; got tensors on {device}")
    return impl


def _dispatch(name: str, impl: str, device: torch.device):
    if resolve_impl(impl, device) == "reference":
        return getattr(reference, name)
    module = importlib.import_module(f".{_TRITON_MODULES[name]}", __name__)
    return getattr(module, name)


def disentangled_attention(q, k, v, pos_key=None, pos_query=None, *, position_buckets: int,
                           max_relative_positions: int, attention_mask=None, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, impl: str = "auto") -> torch.Tensor:
    """DeBERTa disentangled attention; see :func:`distaff.kernels.reference.disentangled_attention`."""
    fn = _dispatch("disentangled_attention", impl, q.device)
    return fn(q, k, v, pos_key, pos_query, position_buckets=position_buckets,
              max_relative_positions=max_relative_positions, attention_mask=attention_mask,
              dropout_p=dropout_p, softmax_scale=softmax_scale)


def disentangled_attention_varlen(q, k, v, pos_key=None, pos_query=None, *, cu_seqlens, max_seqlen: int,
                                  position_buckets: int, max_relative_positions: int, dropout_p: float = 0.0,
                                  softmax_scale: float | None = None, impl: str = "auto") -> torch.Tensor:
    """Packed ``[total_tokens, H, d]`` form; see :func:`distaff.kernels.reference.disentangled_attention_varlen`."""
    fn = _dispatch("disentangled_attention_varlen", impl, q.device)
    return fn(q, k, v, pos_key, pos_query, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
              position_buckets=position_buckets, max_relative_positions=max_relative_positions,
              dropout_p=dropout_p, softmax_scale=softmax_scale)


def layer_norm(x, weight, bias, eps: float, residual=None, impl: str = "auto") -> torch.Tensor:
    """``LayerNorm(x + residual)``; see :func:`distaff.kernels.reference.layer_norm`."""
    return _dispatch("layer_norm", impl, x.device)(x, weight, bias, eps, residual)


def bias_gelu(x, bias, impl: str = "auto") -> torch.Tensor:
    """``gelu(x + bias)`` (erf); see :func:`distaff.kernels.reference.bias_gelu`."""
    return _dispatch("bias_gelu", impl, x.device)(x, bias)


def masked_lm_loss(hidden, weight, bias, labels, ignore_index: int = -100, impl: str = "auto") -> MaskedLMLoss:
    """MLM loss on labelled positions only; see :func:`distaff.kernels.reference.masked_lm_loss`."""
    return _dispatch("masked_lm_loss", impl, hidden.device)(hidden, weight, bias, labels, ignore_index)


__all__ = [
    "IMPLS", "MaskedLMLoss", "attention_span", "bias_gelu", "bucket_table", "disentangled_attention",
    "disentangled_attention_varlen", "layer_norm", "masked_lm_loss", "reference", "relative_position_index",
    "resolve_impl", "triton_available",
]
