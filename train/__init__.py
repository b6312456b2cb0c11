"""Everything between a text corpus and a trained encoder, one package per area.

Layers, each importing only those below it (``tests/test_layering.py`` enforces it; docs/architecture.md):
``core`` (errors, files, processes) <- ``data`` (text to shards to batches) and ``model`` (DeBERTa and its
variants) <- ``run`` (config, engine, checkpoints, metrics: what every run shares) <- ``pretrain`` and
``finetune`` (the trainers) <- ``tools`` (ablate, grow, embed, probe, export); ``plan`` (``distaff plan``) reads
``run``, ``model`` and ``core``. All may import ``distaff.kernels`` except ``core``; nothing here imports
``distaff.launch``.
"""

import os

# Before any torch import of an entry point: OpenMP workers that wait sleep instead of spinning against the
# other processes of the machine (train/core/threads.py). The user's own OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
