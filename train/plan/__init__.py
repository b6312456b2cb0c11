"""``distaff plan``: before booking a cluster, what fits on a GPU and how long a run takes.

Holds the GPU kinds table (gpus), the memory model per GPU (memory: model states under ZeRO and
offload, every saved activation of a layer, the MLM head, the allocator margin), the step-time model
(step_time, which adds up gpu_time's parts: GEMMs from the FLOP count, attention from the judge's table,
fused ops, optimizer, ZeRO communication; or cpu_time's, measured, for CPU ranks), the published anchors it is
checked against (anchors), the live-tensor tracker that checks the memory model against a real step (measure)
and the command (cli).

Imports: distaff.train.core, distaff.train.model and distaff.train.run (never a trainer's loop). Imported
by distaff.launch (the one-line summary of `slurm submit` / `launch --dry-run`) and `distaff plan`. No two of its
modules import each other (tests/test_layering.py), and planning a GPU run imports no torch.
"""
