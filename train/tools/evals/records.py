"""``<run>/evals.jsonl``: one record per (checkpoint, evaluation, seed), and the same results filed in the run's
W&B run and TensorBoard folder.

A record: ``step``, ``checkpoint`` (its folder relative to the run directory, or absolute), ``source`` (run, branch
or average), ``name``, ``kind``, ``seed``, ``metric`` and ``value`` (the evaluation's figure), ``metrics`` (its other
figures: each probing task, the majority baseline, ...), ``seeds`` (the evaluation's seeds), ``config_hash`` (the
fingerprint of the run config the checkpoint was trained with, as in ``summary.json``), ``task_hash`` (the
evaluation's settings but its seeds and ``every``: changing them makes the records of the old settings stale, and the
evaluation runs again), ``seconds`` and ``time``. Appends are whole lines under an exclusive lock, so the trainer's
side process, Slurm jobs and ``distaff evals`` may write at once. A failure is a line of ``evals/failures.jsonl``.

Once every seed of an evaluation of a checkpoint is in, its mean (and standard deviation over seeds) goes to W&B
under ``eval/<name>/<metric>``, charted at the checkpoint's step (``progress/step``): into the run's own W&B run,
resumed by the id its checkpoint recorded (online, in W&B's shared mode: the trainer may be writing it), and into
``<run>/tensorboard`` when the run logs there. A branch's results go to the branch's run; an average's to the file
alone (it belongs to no W&B run).
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import hashlib
import json
import os
import statistics
from pathlib import Path
from typing import Any

from distaff.train.run.config import EvalTaskSection, RunSection, config_fingerprint, config_from_dict
from distaff.train.run.metrics import TensorBoardSink, WandbSink, warn
from distaff.train.tools.evals.catalog import Target

EVALS_FILE = "evals.jsonl"
FAILURES_FILE = Path("evals") / "failures.jsonl"
SELECTION_KEYS = ("seeds", "every")      # which checkpoints and seeds: not part of what an evaluation measures


def task_hash(task: EvalTaskSection) -> str:
    values = {k: v for k, v in dataclasses.asdict(task).items() if k not in SELECTION_KEYS}
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def append(path: Path, record: dict[str, Any]) -> None:
    """``record`` as one line at the end of ``path``, under an exclusive lock (after a newline, if a writer that
    died left a torn line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        size = handle.seek(0, os.SEEK_END)
        torn = size > 0 and (handle.seek(size - 1), handle.read(1))[1] != b"\n"
        handle.write((("\n" if torn else "") + json.dumps(record) + "\n").encode())
        handle.flush()
        os.fsync(handle.fileno())


def read(path: Path) -> list[dict[str, Any]]:
    """The result records of ``path`` (none if it does not exist); a line that is not one is passed over, counted."""
    return _lines(path, {"checkpoint", "name", "seed", "task_hash", "value"})


def read_failures(path: Path) -> list[dict[str, Any]]:
    """The failure records of ``path`` (``evals/failures.jsonl``)."""
    return _lines(path, {"checkpoint", "name", "seed", "error"})


def _lines(path: Path, fields: set[str]) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    found, bad = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line) if line.strip() else None
        except ValueError:
            record = None
        if isinstance(record, dict) and fields <= set(record):
            found.append(record)
        elif line.strip():
            bad += 1
    if bad:
        warn(f"evals: {bad} line(s) of {path} are not records (a writer stopped mid-line?); passed over")
    return found


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
    """Mean and standard deviation over seeds (None for one seed: no deviation measured)."""
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else None


def chart_row(task: EvalTaskSection, step: int, records: list[dict[str, Any]]) -> dict[str, Any]:
    """The W&B/TensorBoard row of one evaluation of one checkpoint: means over its seeds (and the deviation)."""
    mean, std = spread([r["value"] for r in records])
    metric = records[0]["metric"]
    row = {"step": step, f"eval_{task.name}/{metric}": mean}
    if std is not None:
        row[f"eval_{task.name}/{metric}_std"] = std
    for other in records[0]["metrics"]:
        values = [r["metrics"][other] for r in records if isinstance(r["metrics"].get(other), (int, float))]
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
