"""distaff.kernels: fused Triton kernels for DeBERTa training, each with a PyTorch reference.

Every public op takes the keyword ``impl="auto" | "triton" | "reference"``: ``auto`` runs Triton on
CUDA tensors and the reference elsewhere; ``triton`` forces the Triton path, which also runs on
CPU tensors when ``TRITON_INTERPRET=1`` is set before import. The ops here only choose; each
implementation writes its signature once (``reference.<op>`` and ``<module>.<op>``), and ``library``
registers them as ``distaff::`` custom ops with fake implementations (torch.compile, CUDA graphs). This package
imports only torch and triton (the latter lazily, so the reference path works without a usable
triton); it is imported by ``distaff.train``. What checks the kernels ahead of time (compiling for GPU
targets, reading the compiled code) is apart, in ``distaff.kernels.aot``, and nothing here imports it.

Importing the package imports no torch of its own: ``shapes`` (the implementation names, the constants, the
position span) is read at once, every other name on first use (:func:`__getattr__`), so a model's config, and
``distaff plan``, are read without torch. Where torch is already imported, the ``distaff::`` ops are registered at
once (``library``), as before: ``torch.ops.distaff.*`` is callable right after ``import distaff.kernels``; a
process that imports torch only later registers them with its first op (or ``import distaff.kernels.library``).
"""

from __future__ import annotations

import importlib
import sys

from .shapes import IGNORE_INDEX, IMPLS, TRITON_HEAD_DIMS, attention_span

# With a checkout's root on sys.path (Python started there with ``-c`` or ``-m``: ``python -m pytest``), this folder
# is also importable as a top-level ``kernels``, and ``import transformers`` imports any ``kernels`` it finds (its
# probe for the Hugging Face ``kernels`` package). That copy registers nothing: a second ``library`` would register
# the ``distaff::`` ops again from other function objects, and later traces of them crashed (segfaults,
# ``vector::reserve`` errors) at random.
if "torch" in sys.modules and __name__ == "distaff.kernels":  # torch's cost is paid already: register the ops now
    from . import library  # noqa: F401

# a public name -> the submodule that holds it, imported when the name is first read
LAZY = {"MaskedLMLoss": "contract", "bucket_table": "relative_position",
        "relative_position_index": "relative_position", "resolve_impl": "dispatch", "triton_available": "dispatch",
        "disentangled_attention": "dispatch", "disentangled_attention_varlen": "dispatch", "layer_norm": "dispatch",
        "bias_gelu": "dispatch", "masked_lm_loss": "dispatch"}


def __getattr__(name: str):
    if name in LAZY:
        return getattr(importlib.import_module(f".{LAZY[name]}", __name__), name)
    if name in ("reference", "library"):     # submodules the ops are written in
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "IGNORE_INDEX", "IMPLS", "MaskedLMLoss", "TRITON_HEAD_DIMS", "attention_span", "bias_gelu", "bucket_table",
    "disentangled_attention", "disentangled_attention_varlen", "layer_norm", "masked_lm_loss", "reference",
    "relative_position_index", "resolve_impl", "triton_available",
]
