"""One evaluation of one checkpoint on one seed, by the tools that already do it:

- ``probe``: ``distaff probe``'s tasks (train/tools/probe.py) built once per run and evaluation from the sentences of
  ``text`` none of the run's training shards holds (cached under ``evals/tasks/``), each split into train and dev
  rows by the seed, and its linear probe of the checkpoint's frozen encoder: the figure is the dev accuracy, averaged
  over ``probe_tasks`` (each task's and its majority-class baseline beside it);
- ``finetune``: ``distaff finetune`` of the checkpoint (its config, ``max_steps`` and ``overrides``) on ``train``,
  scored on ``dev`` (or ``dev_fraction`` of train split by the seed), in a process of its own: the dev ``metric``;
- ``heldout``: train/tools/checkpoint_eval.py's held-out figures on another prepared dataset, masked by the seed:
  the loss (accuracy and the rest beside it).

An RTD checkpoint holds two networks: its discriminator, exported as a Hugging Face encoder (``distaff export-hf``),
is what the probe and fine-tuning read.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from distaff.train.core.errors import RunFailure
from distaff.train.core.files import replaced_folder
from distaff.train.data.manifest import is_remote
from distaff.train.run.config import EvalTaskSection, config_file, config_from_dict, source_dirs
from distaff.train.tools import probe
from distaff.train.tools.baselines import frozen_encoder
from distaff.train.tools.checkpoint_eval import heldout_metrics
from distaff.train.tools.export import export
from distaff.train.tools.evals.records import task_hash

TASKS_CACHE = Path("evals") / "tasks"
ENCODER = "checkpoint"      # the probe's name for the encoder it scores


@dataclass(frozen=True)
class Score:
    metric: str
    value: float
    metrics: dict[str, float] = field(default_factory=dict)     # the evaluation's other figures


@dataclass
class CheckpointModel:
    """A checkpoint as the probe and fine-tuning read it, prepared once for all its evaluations and seeds."""
    folder: Path
    meta: dict[str, Any]
    work: Path                  # the checkpoint's work folder (an RTD discriminator is exported into it)
    _encoder: probe.Encoder | None = None
    _features: dict[int, Callable] = field(default_factory=dict)

    def encoder(self) -> probe.Encoder:
        if self._encoder is None:
            path = self.folder
            if self.meta.get("config", {}).get("train", {}).get("objective") == "rtd":
                path = export(self.folder, self.work / "discriminator", overwrite=True)
            self._encoder = probe.Encoder(ENCODER, path)
        return self._encoder

    def features(self, max_length: int) -> Callable:
        """The frozen encoder's probe features (each text encoded once, for every task and seed)."""
        if max_length not in self._features:
            self._features[max_length] = frozen_encoder(self.encoder().path, max_length, None, "--checkpoint")
        return self._features[max_length]

    def pretraining_data(self) -> list[str]:
        """The run's local data dirs (the probe drops the sentences they hold)."""
        cfg = config_from_dict(self.meta["config"])
        return [d for d in dict.fromkeys(source_dirs(cfg).values()) if not is_remote(d) and Path(d).is_dir()]


def probe_score(task: EvalTaskSection, model: CheckpointModel, seed: int, run_dir: Path) -> Score:
    args = probe.parse_args(_probe_argv(task, model, seed, run_dir / TASKS_CACHE / f"{task.name}-{task_hash(task)}"))
    tasks = _probe_tasks(args, model)
    encoder = model.encoder()
    rows = probe.score_seed(seed, tasks, [encoder], {encoder.name: model.features(args.max_length)}, args, model.work)
    accuracy = {r["task"]: r["dev_accuracy"] for r in rows if r["method"] == "probe"}
    majority = {f"{r['task']}_majority": r["dev_accuracy"] for r in rows if r["method"] == "majority"}
    return Score("accuracy", statistics.mean(accuracy.values()), {**accuracy, **majority})


def _probe_argv(task: EvalTaskSection, model: CheckpointModel, seed: int, cache: Path) -> list[str]:
    data = model.pretraining_data()
    return ["--text", task.text, *(["--text-column", task.text_column] if task.text_column else []),
            "--model", f"{ENCODER}={model.folder}", "--tasks", *task.probe_tasks, "--seeds", str(seed),
            "--out", str(cache), *(["--max-sentences", str(task.max_sentences)] if task.max_sentences else []),
            *(["--pretraining-data", *data] if data else [])]


def _probe_tasks(args: Any, model: CheckpointModel) -> dict[str, Path]:
    """The probing tasks' files, built the first time (held-out sentences, then the tasks) into ``args.out``."""
    out = Path(args.out)
    if not (out / "tasks.json").is_file():
        sentences, report = probe.held_out_sentences(args, [model.encoder()])
        with replaced_folder(out) as fresh:     # whole or not at all: another process may build it too
            probe.write_tasks(fresh, sentences, args, report)
    return {name: out / "tasks" / f"{name}.tsv" for name in args.tasks}


def finetune_score(task: EvalTaskSection, model: CheckpointModel, seed: int) -> Score:
    dev = [] if task.dev else ["data.dev=", f"data.dev_fraction={task.dev_fraction}", f"data.split_seed={seed}"]
    budget = [f"train.max_steps={task.max_steps}"] if task.max_steps else []
    args = SimpleNamespace(finetune_config=config_file(task.config, "finetune"),
                           finetune_overrides=[*dev, *budget, *task.overrides])
    summary = probe.finetune(model.encoder(), Path(task.train), Path(task.dev) if task.dev else None, None,
                             model.work / f"{task.name}-seed-{seed}", seed, args)
    metric = task.metric or summary["metric"]
    value = summary.get(f"eval_{metric}")
    if not isinstance(value, (int, float)):
        raise RunFailure(f"distaff finetune reported no dev {metric} (eval_{metric}) in "
                         f"{model.work / f'{task.name}-seed-{seed}' / 'summary.json'}")
    return Score(metric, value)


def heldout_score(task: EvalTaskSection, model: CheckpointModel, seed: int) -> Score:
    values = heldout_metrics(model.folder, task.batches, task.data, seed=seed)
    return Score("loss", values["eval_loss"],
                 {name.removeprefix("eval_"): v for name, v in values.items() if name != "eval_loss"})


def score(task: EvalTaskSection, model: CheckpointModel, seed: int, run_dir: Path) -> Score:
    """``task`` on ``model`` with ``seed``."""
    if task.kind == "probe":
        return probe_score(task, model, seed, run_dir)
    if task.kind == "finetune":
        return finetune_score(task, model, seed)
    return heldout_score(task, model, seed)
