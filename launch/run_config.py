"""What a launcher needs from a run config: where the run lives and what it is called.

The config is loaded and validated by the trainer's own loader, so a bad key or value fails at
submit time on the login node instead of minutes later on the compute nodes; every text a launcher
writes (the run's name and folder, the config path, the overrides) holds no control character. Before a
job is queued the trainer's own ``--check`` runs on it (:func:`check_target`), so a run it would refuse costs
no queue trip.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distaff.launch.script_values import plain_text
from distaff.train.core.errors import MAX_COUNT, ConfigError, RunFailure, int_arg
from distaff.train.core.files import is_remote
from distaff.train.core.exit_codes import EXIT_BAD_CONFIG
from distaff.train.core.threads import MOST_GPUS_PER_NODE, RANKS_FLAG
from distaff.train.finetune.config import load_finetune_config
from distaff.train.run.config import config_file, load_config, source_dirs

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
    inputs: tuple[tuple[str, str], ...] = ()   # (config key, path) of each local file or folder the ranks read

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
                        data_workers=getattr(cfg.data, "num_workers", 0), inputs=_local_inputs(cfg, task))


def _local_inputs(cfg: Any, task: str) -> tuple[tuple[str, str], ...]:
    """(key, path) of what the ranks read from a filesystem: the data, a tokenizer, the model they start from;
    a remote data dir (``pipe:``, a URL) is read by a command, not through a mount, and is left out."""
    if task == "pretrain":
        named = {**source_dirs(cfg), "model.init_from": cfg.model.init_from}
    else:
        named = {"data.train": cfg.data.train, "data.dev": cfg.data.dev, "data.tokenizer": cfg.data.tokenizer,
                 "model.init_from": cfg.model.init_from}
    return tuple((key, path) for key, path in named.items() if path and not is_remote(path))


CHECK_TIMEOUT_S = 600   # --check reads a manifest and a tokenizer, never a remote data dir: minutes mean a hang


def check_target(target: LaunchTarget, world_size: int, cpu: bool) -> str:
    """Run the trainer's own ``--check`` on ``target`` as rank 0 of ``world_size`` (so that what depends on the
    number of ranks is checked too), with this python; its summary line. A run it refuses is a ConfigError
    carrying its lines (nothing is queued); a check that crashes or hangs is a RunFailure."""
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size),
           **({"DS_ACCELERATOR": "cpu"} if cpu else {})}
    command = [sys.executable, "-m", target.module, *target.trainer_args(), "--check"]
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RunFailure(f"the run's --check did not finish in {CHECK_TIMEOUT_S} s; nothing submitted; run "
                         f"`{target.module.replace('.', ' ', 1)} --check` by hand, or give --no-check") from None
    said = [line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    if proc.returncode == EXIT_BAD_CONFIG:
        raise ConfigError(f"the run's --check refused it, nothing submitted: {'; '.join(said)}; fix it, or give "
                          "--no-check to submit without the check")
    if proc.returncode != 0:
        raise RunFailure(f"the run's --check failed with status {proc.returncode}, nothing submitted: "
                         f"{'; '.join(said[-3:])}")
    return said[-1] if said else ""


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
