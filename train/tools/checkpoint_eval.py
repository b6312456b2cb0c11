"""A pretraining checkpoint's held-out figures, in one process: what the run's own evaluation reports (the
objective's ``eval_*`` metrics on the held-out split of its data, train/run/steps.py's ``Evaluator``), for a
checkpoint no run is evaluating: an average (``distaff average --eval``), a decay branch's end, an older step.

The model is rebuilt as the run built it (its config and tokenizer, from the checkpoint's ``meta.json``) with the
checkpoint's fp32 weights (any ZeRO stage, train/run/weights.py). The held-out batches and their masking (and RTD's
replacements, from the evaluation stream of rank 0) depend on the run's seed only, so two checkpoints of one run,
or of runs on one seed, are scored on the same tokens; a run on several ranks splits the same split between them,
so its own figures can differ from these in the last digits.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from distaff.train.data.loader import EvalLoader, open_data_dir
from distaff.train.pretrain.objectives import objective_for
from distaff.train.pretrain.trainer import build_model_config
from distaff.train.run.checkpoint_files import META
from distaff.train.run.config import ConfigError, config_from_dict
from distaff.train.run.steps import Evaluator
from distaff.train.run.weights import fp32_state_dict


@contextmanager
def one_process_group() -> Iterator[None]:
    """A one-rank gloo group (the evaluator's sums are collectives), unless one is already up."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def heldout_metrics(checkpoint: Path, batches: int = 0, data_dir: str = "", seed: int | None = None) -> dict[str, float]:
    """The ``eval_*`` figures of pretraining checkpoint ``checkpoint`` on ``batches`` held-out batches (0: the whole
    split) of its run's data (or ``data_dir``: the same data elsewhere, or other data prepared with its tokenizer),
    masked as the run's seed masks them (or ``seed``'s)."""
    meta = json.loads((checkpoint / META).read_text())
    if "task" in meta or "train" not in meta.get("config", {}):
        raise ConfigError(f"{checkpoint}: not a pretraining checkpoint; held-out figures are the pretraining objective's")
    cfg = config_from_dict(meta["config"])
    cfg.data.dir = data_dir or cfg.data.dir
    manifest, tokenizer = open_data_dir(cfg.data.dir)
    objective = objective_for(cfg, build_model_config(cfg, tokenizer))
    model = objective.build(0)
    model.load_state_dict(fp32_state_dict(checkpoint), strict=True)
    loader = EvalLoader(cfg.data.dir, manifest, tokenizer, batch_size=cfg.data.eval_batch_size or cfg.data.batch_size,
                        token_budget=cfg.data.token_budget(manifest.seq_len, eval=True), rank=0, world_size=1,
                        seed=cfg.run.seed if seed is None else seed, masking=objective.masking)
    with one_process_group():
        return Evaluator(loader, batches, 1, torch.device("cpu"), objective)(model)


def metrics_line(values: dict[str, float]) -> str:
    """The figures a person compares: loss and accuracy (MLM), or the discriminator's accuracy and AUC (RTD)."""
    if "eval_rtd_auc" in values:
        return (f"held-out loss {values['eval_loss']:.4f}, discriminator accuracy {values['eval_rtd_accuracy']:.4f}, "
                f"AUC {values['eval_rtd_auc']:.4f}, generator loss {values['eval_gen_loss']:.4f}")
    return f"held-out loss {values['eval_loss']:.4f}, MLM accuracy {values['eval_accuracy']:.4f}"
