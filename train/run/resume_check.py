"""What a run may not change when it resumes, checked before the engine is built: one check for pretraining
and fine-tuning (and their ``--check``).

A checkpoint holds weights of one architecture, an optimizer state partitioned for one ZeRO stage, and a
position in one data stream dealt with one seed: resuming it with another model, ZeRO stage, objective, seed
or data would fail deep inside DeepSpeed after minutes of start-up, or worse, train on silently. The learning
rate, batch size, step count, logging and checkpointing may change on resume; so may the fields that leave the
weights' meaning alone (dropout, kernels, activation checkpointing).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from distaff.train.core.errors import ConfigError, describe, is_bad_input, shown
from distaff.train.model.config import ModelConfig
from distaff.train.run.checkpoint import rank_state, resolve_resume
from distaff.train.run.checkpoint_files import read_meta

# model fields a resumed run may change: they change neither the weights' shapes nor what they compute
RESUME_FREE_MODEL_FIELDS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_impl", "kernel_impl",
                            "activation_checkpointing", "keep_position_scores", "initializer_range")
_MISSING = "(missing)"     # a run field the checkpoint's config lacks: equal to no value


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


def _saved_model(meta: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's model fields; a field it lacks is shown as missing and compared as the field's default, the
    value a checkpoint saved before the field existed was trained with."""
    saved = meta.get("model_config")
    values = dict(saved) if isinstance(saved, dict) else {}
    for field in dataclasses.fields(ModelConfig):
        if field.name not in values:
            default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
            values[field.name] = _Missing(default)
    return values


class _Missing:
    """A model field a checkpoint's meta.json lacks: equal to the field's default only."""

    def __init__(self, default: Any):
        self.default = default

    def __eq__(self, other: object) -> bool:
        return other == self.default

    __hash__ = None

    def __repr__(self) -> str:
        return f"missing (default {self.default!r})"


def resume_problem(folder: Path, run: RunIdentity) -> str | None:
    """Why checkpoint ``folder`` cannot be resumed by ``run``, naming the key; None if it can. A value the
    checkpoint lacks counts as a difference, never as a match."""
    meta = read_meta(folder)
    config = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    saved = {"run.seed": (config.get("run") or {}).get("seed", _MISSING),
             "zero.stage": (config.get("zero") or {}).get("stage", _MISSING), "train.objective": _saved_objective(meta)}
    mine = {"run.seed": run.seed, "zero.stage": run.zero_stage, "train.objective": run.objective}
    for key, value in saved.items():
        if value != mine[key]:
            return f"{key}: {shown(value)} in checkpoint {folder}, {shown(mine[key])} in this run"
    old_model = _saved_model(meta)
    # in ModelConfig's field order; a field this version dropped is not compared
    changed = [name for name in run.model if name not in RESUME_FREE_MODEL_FIELDS
               and old_model.get(name, _MISSING) != run.model[name]]   # _Missing compares as the default
    if changed:
        name, also = changed[0], ", ".join(f"model.{n} {shown(old_model.get(n))} -> {shown(run.model.get(n))}"
                                           for n in changed[1:4])
        return (f"model.{name}: {shown(old_model.get(name))} in checkpoint {folder}, {shown(run.model.get(name))} in "
                f"this run{f' (also {also})' if also else ''}")
    return run.data_problem(rank_state(folder, 0).get("data", {}), f"checkpoint {folder}")


def check_resumable(resume: str, root: Path, run: RunIdentity, *, is_main: bool = True,
                    from_rank0: Callable[[str], str] = lambda text: text,
                    report: Callable[[str], None] = print, branch_from: str = "") -> Path | None:
    """The checkpoint this run resumes from (None: a new run), chosen as the run chooses it, before any engine:
    rank 0 (``is_main``) resolves ``checkpoint.resume``, verifying the files (the newest sound one for ``auto``, each
    damaged one passed over said through ``report``) and tells every rank (``from_rank0``, collective in a run);
    then every rank refuses together, with a ConfigError, a checkpoint whose model, data, seed, ZeRO stage or
    objective ``run`` changed; with ``auto`` and no checkpoint of its own, ``branch_from``'s (a decay branch).
    ``distaff pretrain --check`` and ``finetune --check`` call this too."""
    verdict = ""
    if is_main:
        try:
            folder = resolve_resume(resume, root, report, branch_from)
            verdict = f"ok:{folder}" if folder is not None else "none:"
        except Exception as err:  # noqa: BLE001 - every rank must learn of it, not wait
            verdict = f"{'bad' if is_bad_input(err) else 'error'}:{describe(err)}"
    kind, _, detail = from_rank0(verdict).partition(":")
    if kind == "bad":           # an unusable checkpoint.resume or latest marker: every rank refuses, one line each
        raise ConfigError(detail)
    if kind == "error":
        raise RuntimeError(f"rank 0 could not choose a checkpoint to resume from: {detail}")
    folder = Path(detail) if kind == "ok" else None
    problem = resume_problem(folder, run) if folder is not None else None
    if problem:
        if "resumes only with" in problem:     # the data check says what to do itself
            raise ConfigError(problem)
        raise ConfigError(f"{problem}; a run resumes only with the model, data, seed, ZeRO stage and objective it "
                          "started with: restore it, or start over with checkpoint.resume=none (or another "
                          "run.out_dir)")
    return folder
