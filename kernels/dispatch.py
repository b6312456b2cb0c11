"""The public ops (``distaff.kernels.<op>``): each chooses its implementation for the tensors it is given
(the package's docstring says how) and runs it."""

from __future__ import annotations

import functools
import importlib
import os

import torch

from . import library, reference
from .shapes import IMPLS

# op name -> module holding its Triton implementation (a function of the same name).
TRITON_MODULES = {
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


def _dispatched(name: str):
    """The public op ``name``: the reference's signature and docs plus ``impl``; the first
    positional tensor decides the device. While ``torch.compile`` traces, either implementation runs as
    a ``distaff::`` custom op (:mod:`.library`: no graph break); eager calls run it directly."""
    reference_fn = getattr(reference, name)

    @functools.wraps(reference_fn)
    def op(first: torch.Tensor, *args, impl: str = "auto", **kwargs):
        resolved = resolve_impl(impl, first.device)
        if torch.compiler.is_compiling():
            return getattr(library, name)(first, *args, impl=resolved, **kwargs)
        if resolved == "reference":
            return reference_fn(first, *args, **kwargs)
        module = importlib.import_module(f".{TRITON_MODULES[name]}", __package__)
        return getattr(module, name)(first, *args, **kwargs)

    return op


disentangled_attention = _dispatched("disentangled_attention")
disentangled_attention_varlen = _dispatched("disentangled_attention_varlen")
layer_norm = _dispatched("layer_norm")
bias_gelu = _dispatched("bias_gelu")
masked_lm_loss = _dispatched("masked_lm_loss")
