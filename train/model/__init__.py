"""The DeBERTa-v2/v3 encoder, readable in one sitting (``deberta``), its typed config, the variants that
are config switches (RoPE, RealFormer, RTD's generator and discriminator and their loss weighting), the
sequence classifier, FLOP counts, conversion to and from Hugging Face weights, and ``hf_kernels``, which puts
the fused kernels into a user's own ``transformers`` DeBERTa model.

Imports: ``distaff.train.core``, ``distaff.kernels``. Imported by: ``run``, ``pretrain``, ``finetune``,
``tools``. Knows nothing of DeepSpeed, the data stream or the training loop. The exported classes are imported
on first use, so a model's config (``config``, ``flops``, ``param_count``: what ``distaff plan`` reads) needs no
torch.
"""

import importlib

# a public name -> the module that holds it, imported when the name is first read
LAZY = {"DebertaForMaskedLM": "deberta", "DebertaModel": "deberta", "apply_distaff_kernels": "hf_kernels"}


def __getattr__(name: str):
    if name in LAZY:
        return getattr(importlib.import_module(f"{__name__}.{LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DebertaForMaskedLM", "DebertaModel", "apply_distaff_kernels"]
