"""Text to tokens to shards to batches: file readers (``sources``), the SentencePiece tokenizer, ``distaff
data prepare`` (tokenize, pack, write webdataset shards with a manifest), ``verify``, and the resumable
per-rank stream, loader (one source, or several mixed by weight) and masking collator that feed pretraining.

Imports: ``distaff.train.core``, ``distaff.kernels`` (the label ignore index). Imported by: ``run``,
``pretrain``, ``finetune``, ``tools``. Knows nothing of the model or of DeepSpeed.
"""
