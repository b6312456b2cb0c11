"""Evaluations attached to a run's checkpoints: the runner (``python -m distaff.train.tools.evals RUN --checkpoint
CKPT``, what the trainer starts inline, beside training or in a Slurm job) and ``distaff evals RUN`` (backfill, the
table and the plot). A probe, a fine-tune or held-out figures of one checkpoint come from ``distaff probe``
(train/tools/probe.py), ``distaff finetune`` and train/tools/checkpoint_eval.py, called, not copied.

Modules: ``catalog`` (which checkpoints: the run's, its decay branches', its averages'; pins), ``scoring`` (one
evaluation of one checkpoint on one seed), ``records`` (``evals.jsonl``, and filing in W&B and TensorBoard),
``runner`` (one checkpoint's missing evaluations), ``report`` (the table and the plot), ``cli``.

Imports: what ``distaff.train.tools`` imports, and ``distaff.train.tools`` itself (probe, checkpoint_eval,
export). Imported by: nothing in the package but ``distaff.launch.cli``; the trainer starts it as a process
(train/pretrain/attached_evals.py).
"""
