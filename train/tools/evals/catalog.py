"""Which checkpoints of a run are evaluated, and with which evaluations.

The run's own checkpoints whose step its ``evals`` section selects (train/pretrain/attached_evals.py's
:func:`tasks_at`), read from ``checkpoints/`` or, once ``checkpoint.keep`` pruned them, from their pins
(``evals/pinned/``); the end of each decay branch (``RUN/branches/*``, ``distaff decay``), filed in the branch's own
run directory; and each averaged checkpoint (``distaff average`` output: its ``meta.json`` names its sources) found
in the run directory (up to two folders deep) whose sources are the run's, or named with ``--average``, filed with
the run. Branch ends and averages get every evaluation of the run's ``evals`` section.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from distaff.train.core.errors import ConfigError
from distaff.train.data.errors import DataError
from distaff.train.pretrain.attached_evals import PINNED, pinned, tasks_at
from distaff.train.run.checkpoint_files import META, is_complete, read_meta, tag_for_step
from distaff.train.run.config import EvalTaskSection, RunConfig, config_from_dict, parse_overrides, read_config_values

CONFIG_FILE = "config.yaml"
BRANCHES = "branches"           # where `distaff decay` puts a run's branches (launch/decay.py, BRANCHES_DIR)
_STEP = re.compile(r"step-(\d+)")


@dataclass(frozen=True)
class Target:
    """A checkpoint to evaluate, and where its results are filed."""
    folder: Path        # what is read: a checkpoint folder, or its pin
    run_dir: Path       # whose evals.jsonl files its records: its own run's (a branch's), the parent's for an average
    name: str           # "checkpoint" in its records: relative to run_dir (checkpoints/step-00000012), or absolute
    step: int
    source: str         # run | branch | average
    label: str          # its row in the table

    @property
    def pin(self) -> Path | None:
        """Where its pin is (or would be); None for an average (never pinned)."""
        return None if self.source == "average" else self.run_dir / PINNED / Path(self.name).name


Plan = list[tuple[Target, list[EvalTaskSection]]]


def read_run_config(run_dir: Path, overrides: list[str] = ()) -> RunConfig:
    """The run's ``config.yaml`` (what its trainer saved) with ``evals.*`` overrides."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no {CONFIG_FILE} here: not the run directory (run.out_dir) of a pretraining "
                          "run that has started")
    for keys, _ in parse_overrides(list(overrides)):
        if keys[0] != "evals":
            raise ConfigError(f"override {'.'.join(keys)}: distaff evals changes the evals section only")
    return config_from_dict(read_config_values(path, overrides))


def step_of(name: str) -> int | None:
    match = _STEP.fullmatch(name)
    return int(match.group(1)) if match else None


def run_checkpoints(run_dir: Path) -> dict[str, Path]:
    """``step-*`` name -> folder: its pin when it has one (``checkpoint.keep`` may prune the checkpoint while it is
    read), else the complete checkpoint."""
    found = {p.name: p for p in (run_dir / "checkpoints").glob("step-*") if is_complete(p)}
    found.update({p.name: p for p in pinned(run_dir) if is_complete(p)})
    return dict(sorted(found.items()))


def own_targets(run_dir: Path, cfg: RunConfig) -> Plan:
    plan = []
    for name, folder in run_checkpoints(run_dir).items():
        step = step_of(name)
        tasks = tasks_at(cfg.evals, step, cfg.train.max_steps) if step is not None else []
        if tasks:
            plan.append((Target(folder, run_dir, f"checkpoints/{name}", step, "run", f"step {step}"), tasks))
    return plan


def branch_targets(run_dir: Path, cfg: RunConfig) -> Plan:
    """The last checkpoint (its ``train.max_steps``) of each decay branch that reached it."""
    plan = []
    for config in sorted((run_dir / BRANCHES).glob(f"*/{CONFIG_FILE}")):
        branch = config.parent
        end = config_from_dict(read_config_values(config)).train.max_steps
        folder = run_checkpoints(branch).get(tag_for_step(end))
        if folder is not None:
            target = Target(folder, branch, f"checkpoints/{folder.name}", end, "branch", f"{branch.name} step {end}")
            plan.append((target, list(cfg.evals.tasks)))
    return plan


def average_targets(run_dir: Path, cfg: RunConfig, named: list[Path]) -> Plan:
    """Averages in the run directory made of its checkpoints, and those ``named`` (``--average``)."""
    root = run_dir.resolve()
    found = {m.parent.parent.resolve() for pattern in (f"*/{META}", f"*/*/{META}") for m in run_dir.glob(pattern)}
    plan = []
    for folder in sorted(found | {p.resolve() for p in named}):
        meta = _average_meta(folder, folder in {p.resolve() for p in named})
        if meta is None:
            continue
        sources = meta["averaged_from"]
        if folder not in {p.resolve() for p in named} and not any(root in Path(s["checkpoint"]).parents
                                                                  for s in sources):
            continue
        name = str(folder.relative_to(root)) if root in folder.parents else str(folder)
        steps = ", ".join(str(s["step"]) for s in sources)
        label = f"average {folder.name} (steps {steps})"
        plan.append((Target(folder, run_dir, name, int(meta["step"]), "average", label), list(cfg.evals.tasks)))
    return plan


def _average_meta(folder: Path, named: bool) -> dict | None:
    """The meta of an averaged checkpoint; None (or for a ``named`` one, an error) for anything else."""
    try:
        meta = read_meta(folder) if is_complete(folder) else None
    except (OSError, DataError):
        meta = None
    if meta is not None and isinstance(meta.get("averaged_from"), list) and meta["averaged_from"]:
        return meta
    if named:
        raise ConfigError(f"--average {folder}: not a checkpoint written by `distaff average` (its {META} names no "
                          "averaged_from sources)")
    return None


def run_plan(run_dir: Path, cfg: RunConfig, averages: list[Path] = ()) -> Plan:
    """Every checkpoint ``distaff evals RUN`` evaluates: the run's, its branches' ends, its averages."""
    return own_targets(run_dir, cfg) + branch_targets(run_dir, cfg) + average_targets(run_dir, cfg, list(averages))


def find_target(plan: Plan, path: Path) -> tuple[Target, list[EvalTaskSection]] | None:
    """The entry of ``plan`` that ``path`` names: its folder, or the checkpoint or pin of the same name."""
    resolved = path.resolve()
    for target, tasks in plan:
        homes = {(target.run_dir / "checkpoints").resolve(), (target.run_dir / PINNED).resolve()}
        if resolved == target.folder.resolve() or (target.source != "average" and resolved.parent in homes
                                                   and resolved.name == target.folder.name):
            return target, tasks
    return None


def gone_target(path: Path, run_dir: Path, cfg: RunConfig) -> tuple[Target, list[EvalTaskSection]] | None:
    """A checkpoint (or pin) of the run that is no longer there, as the target it was (its records may be done)."""
    step = step_of(path.name)
    homes = {(run_dir / "checkpoints").resolve(), (run_dir / PINNED).resolve()}
    if step is None or path.resolve().parent not in homes:
        return None
    target = Target(path, run_dir, f"checkpoints/{path.name}", step, "run", f"step {step}")
    return target, tasks_at(cfg.evals, step, cfg.train.max_steps)
