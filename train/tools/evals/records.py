"""``<run>/evals.jsonl``: one record per (checkpoint, evaluation, seed), and the same results filed in the run's
W&B run and TensorBoard folder.

A record: ``step``, ``checkpoint`` (its folder relative to the run directory, or absolute), ``source`` (run, branch
or average), ``name``, ``kind``, ``seed``, ``metric`` and ``value`` (the evaluation's figure), ``metrics`` (its other
figures: each probing task, the majority baseline, ...), ``seeds`` (the evaluation's seeds), ``config_hash`` (the
fingerprint of the run config the checkpoint was trained with, as in ``summary.json``), ``task_hash`` (the
evaluation's settings but its seeds and ``every``: changing them makes the records of the old settings stale, and the
evaluation runs again), ``seconds`` and ``time``. Appends are whole lines under an exclusive lock, so the trainer's
side process, Slurm jobs and ``distaff evals`` may write at once; a write that fails (a full disk) leaves no part of
its line. A failure is a line of ``evals/failures.jsonl``. Read back, a line that is not a record (torn by a crash,
edited by hand) is passed over and reported once with its line number; a value that is not finite (NaN, inf) is what
a diverged checkpoint scores, shown as ``diverged``; a (checkpoint, evaluation, seed) recorded twice counts once, by
its newest record.

Once every seed of an evaluation of a checkpoint is in, its mean (and standard deviation over seeds) goes to W&B
under ``eval/<name>/<metric>``, charted at the checkpoint's step (``progress/step``): into the run's own W&B run,
resumed by the id its checkpoint recorded (online, in W&B's shared mode: the trainer may be writing it), and into
``<run>/tensorboard`` when the run logs there. A branch's results go to the branch's run; an average's to the file
alone (it belongs to no W&B run).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
import statistics
from pathlib import Path
from typing import Any

from distaff.train.core.files import NAME, NUMBER, WHOLE, append_record, read_records
from distaff.train.run.config import EvalTaskSection, RunSection, config_fingerprint, config_from_dict
from distaff.train.run.metrics import TensorBoardSink, WandbSink
from distaff.train.tools.evals.catalog import Target

EVALS_FILE = "evals.jsonl"
FAILURES_FILE = Path("evals") / "failures.jsonl"
SELECTION_KEYS = ("seeds", "every")      # which checkpoints and seeds: not part of what an evaluation measures
# what a line of each file must hold to be read as a record (its other fields are read where present)
RESULT_FIELDS = {"step": WHOLE, "checkpoint": NAME, "source": NAME, "name": NAME, "seed": WHOLE, "metric": NAME,
                 "value": NUMBER, "metrics": (dict,), "task_hash": NAME}
FAILURE_FIELDS = {"checkpoint": NAME, "name": NAME, "seed": WHOLE, "error": NAME}


def task_hash(task: EvalTaskSection) -> str:
    values = {k: v for k, v in dataclasses.asdict(task).items() if k not in SELECTION_KEYS}
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def append(path: Path, record: dict[str, Any]) -> None:
    """``record`` as one whole line at the end of ``path`` (or nothing, on a full disk: the error names the file)."""
    append_record(path, record)


def read(path: Path) -> list[dict[str, Any]]:
    """The result records of ``path`` (none if it does not exist); a line that is not one is passed over, counted.
    A (checkpoint, evaluation, seed, settings) recorded twice (an evaluation run again by hand, say) counts once:
    its newest record, the one furthest down the file (appends are in time order, under a lock)."""
    newest = {record_key(r): r for r in read_records(path, RESULT_FIELDS, "evaluation results")}
    return list(newest.values())


def read_failures(path: Path) -> list[dict[str, Any]]:
    """The failure records of ``path`` (``evals/failures.jsonl``)."""
    return read_records(path, FAILURE_FIELDS, "evaluation failures")


def diverged(value: float) -> bool:
    """A seed's figure that is not finite (NaN, inf): what a diverged checkpoint scores, shown as such."""
    return not math.isfinite(value)


def key(target: Target, task: EvalTaskSection, seed: int) -> tuple[str, str, int, str]:
    return target.name, task.name, seed, task_hash(task)


def record_key(record: dict[str, Any]) -> tuple[str, str, int, str]:
    return record["checkpoint"], record["name"], record["seed"], record["task_hash"]


def missing(target: Target, tasks: list[EvalTaskSection], records: list[dict[str, Any]]) -> list[tuple]:
    """(task, seed) of ``tasks`` that ``records`` hold no result of for ``target``."""
    done = {record_key(r) for r in records}
    return [(task, seed) for task in tasks for seed in task.seeds if key(target, task, seed) not in done]


def result(target: Target, task: EvalTaskSection, seed: int, score: Any, seconds: float,
           config: dict[str, Any]) -> dict[str, Any]:
    """The record of ``score`` (scoring.Score) of ``task`` on ``target`` with ``seed``."""
    return {"step": target.step, "checkpoint": target.name, "source": target.source, "name": task.name,
            "kind": task.kind, "seed": seed, "metric": score.metric, "value": score.value, "metrics": score.metrics,
            "seeds": list(task.seeds), "config_hash": config_fingerprint(config), "task_hash": task_hash(task),
            "seconds": round(seconds, 2), "time": now()}


def failure(target: Target, task: EvalTaskSection, seed: int, error: str) -> dict[str, Any]:
    return {"step": target.step, "checkpoint": target.name, "source": target.source, "name": task.name,
            "seed": seed, "task_hash": task_hash(task), "error": error, "time": now()}


def spread(values: list[float]) -> tuple[float, float | None]:
    """Mean and standard deviation over seeds (None for one seed: no deviation measured); NaN and no deviation when
    a seed diverged (W&B charts it as a gap)."""
    if any(map(diverged, values)):
        return math.nan, None
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else None


def chart_row(task: EvalTaskSection, step: int, records: list[dict[str, Any]]) -> dict[str, Any]:
    """The W&B/TensorBoard row of one evaluation of one checkpoint: means over its seeds (and the deviation)."""
    mean, std = spread([r["value"] for r in records])
    metric = records[0]["metric"]
    row = {"step": step, f"eval_{task.name}/{metric}": mean}
    if std is not None:
        row[f"eval_{task.name}/{metric}_std"] = std
    for other in records[0]["metrics"]:
        values = [r["metrics"][other] for r in records
                  if isinstance(r["metrics"].get(other), (int, float)) and math.isfinite(r["metrics"][other])]
        if len(values) == len(records):
            row[f"eval_{task.name}/{other}"] = statistics.mean(values)
    return row


class Filing:
    """The W&B run and TensorBoard folder of each run results are filed with, opened on first use."""

    def __init__(self) -> None:
        self.sinks: dict[Path, tuple[WandbSink | None, TensorBoardSink | None]] = {}

    def file(self, target: Target, task: EvalTaskSection, meta: dict[str, Any]) -> None:
        """Every seed of ``task`` on ``target`` is recorded: chart it (not an average's: it has no run)."""
        if target.source == "average":
            return
        records = [r for r in read(target.run_dir / EVALS_FILE)
                   if r["checkpoint"] == target.name and r["name"] == task.name and r["task_hash"] == task_hash(task)]
        if not records:
            return
        row = chart_row(task, target.step, records)
        wandb, tensorboard = self._open(target, meta)
        if wandb is not None:
            wandb.log(row, step=None)       # charted by its progress/step, the checkpoint's
        if tensorboard is not None:
            tensorboard.log(row, step=target.step)

    def _open(self, target: Target, meta: dict[str, Any]) -> tuple[WandbSink | None, TensorBoardSink | None]:
        if target.run_dir not in self.sinks:
            cfg = config_from_dict(meta["config"])
            run_id = (meta.get("train_state") or {}).get("wandb_run_id")
            wandb = None
            if run_id and cfg.wandb.mode != "disabled":
                wandb = WandbSink(cfg.wandb, run_name=cfg.run.name or RunSection.name, out_dir=target.run_dir / "evals",
                                  run_id=run_id, config=None, writer=f"evals-{os.getpid()}")
            tensorboard = TensorBoardSink(target.run_dir) if cfg.logging.tensorboard else None
            self.sinks[target.run_dir] = (wandb, tensorboard)
        return self.sinks[target.run_dir]

    def close(self) -> None:
        for wandb, tensorboard in self.sinks.values():
            for sink in (wandb, tensorboard):
                if sink is not None:
                    sink.finish(0)
        self.sinks.clear()
