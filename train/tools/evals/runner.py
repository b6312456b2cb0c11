"""The missing evaluations of one checkpoint: each (evaluation, seed) without a record is run, and its record (or
its failure) written as soon as it is known, so a process stopped midway loses only the evaluation in progress.

One process at a time evaluates a checkpoint: it holds the lock of the checkpoint's work folder
(``evals/work/<checkpoint>/``, train/core/runlock.py: a requeued Slurm attempt takes over its own earlier attempt's
lock); another finds it held and leaves the checkpoint to it. A checkpoint that is damaged or gone (pruned and not
pinned) is a failure of each of its evaluations, reported, never an error of the run. When nothing is missing any
more, the work folder and the checkpoint's pin are removed.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from distaff.train.core.errors import describe
from distaff.train.core.runlock import DirectoryBusy, DirLock
from distaff.train.run.checkpoint_files import checkpoint_problem, is_complete, read_meta
from distaff.train.run.config import EvalTaskSection
from distaff.train.tools.evals import records
from distaff.train.tools.evals.catalog import Target
from distaff.train.tools.evals.scoring import CheckpointModel, score

WORK = Path("evals") / "work"


@dataclass
class Outcome:
    ran: int = 0                                        # evaluations recorded now
    failed: list[str] = field(default_factory=list)     # one line each
    busy: str = ""                                      # another process holds the checkpoint: who


def work_folder(target: Target) -> Path:
    return target.run_dir / WORK / target.name.strip("/").replace("/", "__")


def evaluate(target: Target, tasks: list[EvalTaskSection], filing: records.Filing) -> Outcome:
    """Run ``tasks``' missing seeds on ``target``, record each, file each evaluation once all its seeds are in."""
    todo = records.missing(target, tasks, records.read(target.run_dir / records.EVALS_FILE))
    if not todo:
        _unpin(target)
        return Outcome()
    work = work_folder(target)
    try:
        lock = DirLock(work, "the evaluation's work folder")
    except DirectoryBusy as err:
        return Outcome(busy=str(err))
    with lock:
        outcome = _run(target, todo, filing, work)
    if not outcome.failed:
        shutil.rmtree(work, ignore_errors=True)
        _unpin(target)
    return outcome


def _run(target: Target, todo: list[tuple[EvalTaskSection, int]], filing: records.Filing, work: Path) -> Outcome:
    outcome = Outcome()
    problem = _unreadable(target)
    if problem:
        for task, seed in todo:
            _failed(outcome, target, task, seed, problem)
        return outcome
    meta = read_meta(target.folder)
    model = CheckpointModel(target.folder, meta, work)
    print(f"distaff evals: {target.label}: reading {target.folder}", flush=True)
    tasks = [task for i, (task, _) in enumerate(todo) if all(t is not task for t, _ in todo[:i])]
    for task in tasks:
        for seed in [s for t, s in todo if t is task]:
            print(f"distaff evals: {target.label}: {task.name} ({task.kind}), seed {seed}", flush=True)
            started = time.monotonic()
            try:
                result = score(task, model, seed, target.run_dir)
            except Exception as err:  # noqa: BLE001 - one evaluation's failure is reported, the others still run
                _failed(outcome, target, task, seed, describe(err))
                continue
            records.append(target.run_dir / records.EVALS_FILE,
                           records.result(target, task, seed, result, time.monotonic() - started, meta["config"]))
            outcome.ran += 1
            print(f"distaff evals: {target.label}: {task.name} seed {seed}: {result.metric} {result.value:.4f}",
                  flush=True)
        if not records.missing(target, [task], records.read(target.run_dir / records.EVALS_FILE)):
            filing.file(target, task, meta)
    return outcome


def _unreadable(target: Target) -> str | None:
    """Why ``target`` cannot be evaluated (gone, damaged), or None."""
    if not is_complete(target.folder):
        return (f"{target.folder} is gone (checkpoint.keep pruned it before it was evaluated, and it was not pinned); "
                "keep more checkpoints")
    problem = checkpoint_problem(target.folder)
    return f"{target.folder}: damaged checkpoint: {problem}" if problem else None


def _failed(outcome: Outcome, target: Target, task: EvalTaskSection, seed: int, error: str) -> None:
    line = f"{target.label}: {task.name} seed {seed}: {error}"
    print(f"distaff evals: failed: {line}", flush=True)
    records.append(target.run_dir / records.FAILURES_FILE, records.failure(target, task, seed, error))
    outcome.failed.append(line)


def _unpin(target: Target) -> None:
    if target.pin is not None and target.pin.is_dir():
        shutil.rmtree(target.pin, ignore_errors=True)
