"""What a run may not change when it resumes, checked before the engine is built: one check for pretraining
and fine-tuning (and their ``--check``).

A checkpoint holds weights of one architecture, an optimizer state partitioned for one ZeRO stage, and a
position in one data stream dealt with one seed: resuming it with another model, ZeRO stage, objective, seed
or data would fail deep inside DeepSpeed after minutes of start-up, or worse, train on silently. The learning
rate, batch size, step count, logging and checkpointing may change on resume; so may the fields that leave the
weights' meaning alone (dropout, kernels, activation checkpointing).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from distaff.train.core.errors import ConfigError, shown
from distaff.train.run.checkpoint import rank_state, resume_candidate
from distaff.train.run.checkpoint_files import META

# model fields a resumed run may change: they change neither the weights' shapes nor what they compute
RESUME_FREE_MODEL_FIELDS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_impl", "kernel_impl",
                            "activation_checkpointing", "initializer_range")


@dataclass(frozen=True)
class RunIdentity:
    """What this run is, as far as a checkpoint's compatibility goes."""
    model: dict[str, Any]               # the resolved ModelConfig.to_dict()
    seed: int
    zero_stage: int
    objective: str                      # train.objective, "classification"/"regression" for fine-tuning
    # why rank 0's saved data-stream state cannot continue in this run's data (another data folder, batch
    # dealing...), naming the key; None if it can
    data_problem: Callable[[dict[str, Any], str], str | None]


def _saved_objective(meta: dict[str, Any]) -> str:
    config = meta.get("config", {})
    if "train" in config and "objective" in config["train"]:
        return config["train"]["objective"]
    return config.get("data", {}).get("task", "classification")


def resume_problem(folder: Path, run: RunIdentity) -> str | None:
    """Why checkpoint ``folder`` cannot be resumed by ``run``, naming the key; None if it can."""
    meta = json.loads((folder / META).read_text())
    config = meta.get("config", {})
    saved = {"run.seed": config.get("run", {}).get("seed"), "zero.stage": config.get("zero", {}).get("stage"),
             "train.objective": _saved_objective(meta)}
    mine = {"run.seed": run.seed, "zero.stage": run.zero_stage, "train.objective": run.objective}
    for key, value in saved.items():
        if value is not None and value != mine[key]:
            return f"{key}: {shown(value)} in checkpoint {folder}, {shown(mine[key])} in this run"
    old_model = meta.get("model_config", {})
    # in ModelConfig's field order; a field the checkpoint predates (or this version dropped) is not compared
    changed = [name for name in run.model if name in old_model and name not in RESUME_FREE_MODEL_FIELDS
               and old_model[name] != run.model[name]]
    if changed:
        name, also = changed[0], ", ".join(f"model.{n} {shown(old_model.get(n))} -> {shown(run.model.get(n))}"
                                           for n in changed[1:4])
        return (f"model.{name}: {shown(old_model.get(name))} in checkpoint {folder}, {shown(run.model.get(name))} in "
                f"this run{f' (also {also})' if also else ''}")
    return run.data_problem(rank_state(folder, 0).get("data", {}), f"checkpoint {folder}")


def check_resumable(resume: str, root: Path, run: RunIdentity, branch_from: str = "") -> Path | None:
    """The checkpoint ``checkpoint.resume`` (or ``checkpoint.branch_from``) would resume from (None: a new run),
    refused with a ConfigError when ``run`` changed what a run may not change on resume."""
    folder = resume_candidate(resume, root, branch_from)
    if folder is None:
        return None
    problem = resume_problem(folder, run)
    if problem:
        if "resumes only with" in problem:     # the data check says what to do itself
            raise ConfigError(problem)
        raise ConfigError(f"{problem}; a run resumes only with the model, data, seed, ZeRO stage and objective it "
                          "started with: restore it, or start over with checkpoint.resume=none (or another "
                          "run.out_dir)")
    return folder
