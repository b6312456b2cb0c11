"""The DeBERTa-v2/v3 encoder, readable in one sitting (``deberta``), its typed config, the variants that
are config switches (RoPE, RealFormer, RTD's generator and discriminator and their loss weighting), the
sequence classifier, FLOP counts, conversion to and from Hugging Face weights, and ``hf_kernels``, which puts
the fused kernels into a user's own ``transformers`` DeBERTa model.

Imports: ``distaff.train.core``, ``distaff.kernels``. Imported by: ``run``, ``pretrain``, ``finetune``,
``tools``. Knows nothing of DeepSpeed, the data stream or the training loop.
"""

from distaff.train.model.deberta import DebertaForMaskedLM, DebertaModel
from distaff.train.model.hf_kernels import apply_distaff_kernels

__all__ = ["DebertaForMaskedLM", "DebertaModel", "apply_distaff_kernels"]
