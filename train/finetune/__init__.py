"""Fine-tuning a classifier or regressor on a pretrained encoder: the trainer (``python -m
distaff.train.finetune``), its config and metrics, labelled files and their batches, SiFT, and loading an
encoder from a distaff run, a model folder or a Hugging Face folder.

Imports: ``distaff.train.core``, ``data``, ``model``, ``run``, ``distaff.kernels``. Imported by: ``tools``;
``distaff.launch`` reads ``finetune.config`` only. Does not import ``pretrain``.
"""
