"""Everything between a text corpus and a trained encoder, one package per area.

Layers, each importing only those below it (``tests/test_layering.py`` enforces it; docs/architecture.md):
``core`` (errors, files, processes) <- ``data`` (text to shards to batches) and ``model`` (DeBERTa and its
variants) <- ``run`` (config, engine, checkpoints, metrics: what every run shares) <- ``pretrain`` and
``finetune`` (the trainers) <- ``tools`` (ablate, grow, embed, probe, export). All may import ``distaff.kernels``
except ``core``; nothing here imports ``distaff.launch``.
"""
