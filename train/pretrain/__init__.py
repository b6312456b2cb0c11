"""Pretraining: the trainer (``python -m distaff.train.pretrain``, what every launcher starts per rank)
and its objectives (masked LM, DeBERTa-v3's replaced-token detection, T-TA).

Imports: ``distaff.train.core``, ``data``, ``model``, ``run``, ``distaff.kernels``. Imported by: ``tools``
(``distaff ablate`` starts it as a process). Does not import ``finetune``.
"""
