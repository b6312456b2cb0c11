"""What a launcher needs from a run config: where the run lives and what it is called.

The config is loaded and validated by the trainer's own loader, so a bad key or value fails at
submit time on the login node instead of minutes later on the compute nodes; every text a launcher
writes (the run's name and folder, the config path, the overrides) holds no control character.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distaff.launch.script_values import plain_text
from distaff.train.core.errors import MAX_COUNT, int_arg
from distaff.train.core.threads import MOST_GPUS_PER_NODE, RANKS_FLAG
from distaff.train.finetune.config import load_finetune_config
from distaff.train.run.config import config_file, load_config

# what started a run, written by `distaff launch` and `distaff slurm submit`; `distaff decay` reads it
LAUNCH_RECORD = Path("launch") / "command.json"

# ``--task``: the trainer module each launcher runs, the loader that validates its config, its kind of preset
TASKS = {"pretrain": ("distaff.train.pretrain", load_config, "run"),
         "finetune": ("distaff.train.finetune", load_finetune_config, "finetune")}


@dataclass(frozen=True)
class LaunchTarget:
    config: Path                 # absolute: every node reads the same file
    out_dir: Path                # absolute run directory (checkpoints, metrics, launcher files)
    name: str                    # run.name
    overrides: tuple[str, ...]   # the user's overrides plus run.out_dir pinned to ``out_dir``
    task: str = "pretrain"       # a key of TASKS
    data_workers: int = 0        # DataLoader worker processes per rank (data.num_workers; none in fine-tuning)

    @property
    def module(self) -> str:
        """The trainer module the ranks run (``python -m``)."""
        return TASKS[self.task][0]

    def trainer_args(self) -> list[str]:
        """Arguments of ``python -m <module>`` for this run."""
        return ["--config", str(self.config), *self.overrides]

    def text_values(self) -> list[tuple[str, str]]:
        """(what, value) of every text of this target a launcher writes into a script or command."""
        return [("run.name", self.name), ("run.out_dir", str(self.out_dir)), ("--config", str(self.config)),
                *(("override", item) for item in self.overrides)]


def add_ranks_flag(parser) -> None:
    parser.add_argument(RANKS_FLAG, type=int_arg(RANKS_FLAG, low=1, high=MAX_COUNT), metavar="N",
                        help="allow up to N ranks per node (default: this node's GPUs, else its cores, when the ranks "
                             f"run here; {MOST_GPUS_PER_NODE} on other nodes)")


def add_task_argument(parser) -> None:
    parser.add_argument("--task", choices=sorted(TASKS), default="pretrain",
                        help="what the ranks run: pretraining (default) or fine-tuning (distaff finetune)")


def resolve_launch_target(config: str | Path, overrides: list[str], task: str = "pretrain") -> LaunchTarget:
    """Load and validate ``config`` (a file, or a preset's name) + ``overrides``; pin the output dir to an
    absolute path.

    A relative ``run.out_dir`` is resolved against the current directory now, so ranks started
    elsewhere (another node's home, a Slurm job's cwd) still write to the same run directory.
    """
    _, load, kind = TASKS[task]
    plain_text("--config", str(config))
    for item in overrides:        # before the YAML reader sees them: one message for every control character
        plain_text("override", item)
    config = config_file(config, kind).resolve()
    cfg = load(config, overrides)
    plain_text("run.name", cfg.run.name)
    out_dir = Path(plain_text("run.out_dir", cfg.run.out_dir)).resolve()
    pinned = [item for item in overrides if not item.startswith("run.out_dir=")]
    pinned.append(f"run.out_dir={out_dir}")
    return LaunchTarget(config=config, out_dir=out_dir, name=cfg.run.name, overrides=tuple(pinned), task=task,
                        data_workers=getattr(cfg.data, "num_workers", 0))


def record_launch(out_dir: Path, launcher: str, args: argparse.Namespace) -> None:
    """Write which launcher started the run in ``out_dir``, with its parsed options and the working folder, so that
    ``distaff decay`` launches a branch of the run the same way (credentials are left out by the caller)."""
    path = out_dir / LAUNCH_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"launcher": launcher, "cwd": os.getcwd(), "args": vars(args)}, indent=1) + "\n")


def read_launch_record(out_dir: Path) -> dict[str, Any] | None:
    """The launch record of the run in ``out_dir`` (None: started some other way, or by an older distaff)."""
    path = out_dir / LAUNCH_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except ValueError:
        return None
    return record if isinstance(record, dict) and {"launcher", "cwd", "args"} <= set(record) else None
