"""``distaff decay RUN_DIR --from STEP --steps K``: a decay branch of a warmup-stable-decay run, launched as its parent was.

The branch continues the parent's checkpoint at STEP exactly as a resume would (weights, optimizer state, data
position, RNGs, counters) with the learning rate decaying over K steps (``--shape``, default the parent's
``optim.decay_shape``) to ``optim.min_lr_ratio``. STEP must be a checkpoint of the stable phase (after the warmup,
up to where the parent's own decay starts). Its config is the parent's, as that checkpoint saved it, with
``optim.decay_start=STEP``, ``optim.decay_steps=K``, ``train.max_steps=STEP+K`` and ``checkpoint.branch_from``
naming the parent's checkpoint: the run starts from it while it has no checkpoint of its own, and resumes from its
own after (``checkpoint.resume=auto``), so running the same command again resumes the branch.

Each branch has its own run directory (``--out``, default ``RUN_DIR/branches/decay-STEP-K``), so several branches
of one run coexist, each found from the parent (``branches/*/config.yaml``) and naming its parent and step (its
``checkpoint.branch_from``, in ``config.yaml`` and in every checkpoint's ``meta.json``), and its own W&B run, in
the parent's W&B group (the parent's ``run.name`` when the parent has none). It is launched with the launcher and
options that started the parent (``distaff launch`` or ``distaff slurm submit``, which record them in
``RUN_DIR/launch/command.json``), from the folder the parent was launched from, so relative paths resolve as they
did. ``--dry-run`` writes the branch's config and prints the launch without starting it (for a parent started by
torchrun, srun or python directly, how to start it). Remaining ``key=value`` arguments override the branch's
config (evaluation, checkpointing, W&B), not what defines the branch.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from distaff.launch.run_config import read_launch_record
from distaff.train.core.config_yaml import load_yaml
from distaff.train.core.errors import MAX_COUNT, ConfigError, command_main, document_ranges, int_arg
from distaff.train.core.files import check_apart
from distaff.train.run.checkpoint_files import META, checkpoint_problem, is_complete, read_meta, tag_for_step
from distaff.train.run.config import NOT_FINGERPRINTED, config_from_dict, parse_overrides
from distaff.train.run.schedule import DECAY_SHAPES, wsd_window

BRANCHES_DIR = "branches"


@dataclass(frozen=True)
class DecayBranch:
    parent: Path                # the parent's run directory
    step: int                   # the parent's checkpoint the branch starts from
    steps: int                  # the decay's length
    shape: str
    out_dir: Path
    values: dict[str, Any]      # the branch's run config (plain values)

    @property
    def checkpoint(self) -> Path:
        return self.parent / "checkpoints" / tag_for_step(self.step)


def branch_name(step: int, steps: int) -> str:
    return f"decay-{step}-{steps}"


def parent_checkpoint(parent: Path, step: int) -> tuple[Path, dict[str, Any]]:
    """The parent's complete, sound checkpoint at ``step`` and its meta, or a one-line error naming what is missing."""
    root = parent / "checkpoints"
    if not root.is_dir():
        raise ConfigError(f"{parent}: no checkpoints folder; name the run directory of a pretraining run")
    folder = root / tag_for_step(step)
    if not is_complete(folder):
        steps = sorted(int(p.name.removeprefix("step-")) for p in root.glob("step-*") if is_complete(p))
        raise ConfigError(f"--from {step}: {parent} has no complete checkpoint at step {step} (it has steps "
                          f"{', '.join(map(str, steps)) or 'none'}); branch from one of them, and keep more with "
                          "checkpoint.every and checkpoint.keep")
    problem = checkpoint_problem(folder)
    if problem:
        raise ConfigError(f"--from {step}: {folder} is damaged ({problem}); branch from another step")
    return folder, json.loads((folder / META).read_text())


def stable_phase(config: dict[str, Any], where: Path) -> tuple[int, int]:
    """(first, last) step a branch may start from: after the warmup, up to where the parent's decay starts."""
    optim, train = config.get("optim", {}), config.get("train", {})
    if "max_steps" not in train:
        raise ConfigError(f"{where}: not a pretraining checkpoint (its config has no train.max_steps)")
    if optim.get("schedule") != "wsd":
        raise ConfigError(f"{where}: optim.schedule={optim.get('schedule')}: its rate decays from the warmup on, so "
                          "it has no stable phase to branch from; decay branches are for optim.schedule=wsd runs")
    start, _ = wsd_window(train["max_steps"], optim.get("decay_start", 0), optim.get("decay_steps", 0))
    return optim.get("warmup_steps", 0), start


def plan_branch(parent: Path, step: int, steps: int, shape: str = "", out: Path | None = None,
                overrides: list[str] = ()) -> DecayBranch:
    """The decay branch of run directory ``parent`` from its checkpoint at ``step`` over ``steps`` steps (``shape``:
    the parent's decay shape when empty), into ``out`` (default ``parent/branches/decay-STEP-STEPS``), its config
    validated; ``overrides`` (``key=value``) apply last (evaluation, checkpointing, W&B...)."""
    parent = parent.resolve()
    if steps < 1:
        raise ConfigError(f"--steps {steps}: a decay takes at least one step")
    if shape and shape not in DECAY_SHAPES:
        raise ConfigError(f"--shape {shape}: must be one of {list(DECAY_SHAPES)}")
    folder, meta = parent_checkpoint(parent, step)
    config = meta.get("config", {})
    first, last = stable_phase(config, folder)
    if not first <= step <= last:
        raise ConfigError(f"--from {step}: outside {parent}'s stable phase (steps {first} to {last}: its warmup ends "
                          f"at {first}, its decay starts at {last}); branch from a checkpoint in between")
    out = branch_out(parent, step, steps, out)
    values = branch_values(config, folder, step, steps, shape or config["optim"].get("decay_shape", "1-sqrt"), out)
    return _branch(parent, step, steps, out, values, overrides)


def _branch(parent: Path, step: int, steps: int, out: Path, values: dict[str, Any],
            overrides: list[str]) -> DecayBranch:
    """The branch of ``values`` with ``overrides`` applied, its config validated."""
    apply_overrides(values, overrides)
    try:
        config_from_dict(copy.deepcopy(values))
    except ConfigError as err:
        raise ConfigError(f"the branch's config: {err}") from None
    return DecayBranch(parent, step, steps, values["optim"]["decay_shape"], out, values)


def branch_out(parent: Path, step: int, steps: int, out: Path | None) -> Path:
    """The branch's run directory (default ``parent/branches/decay-STEP-STEPS``), resolved; refused when it is, lies
    inside or contains the parent's checkpoints, or is or contains the parent's run directory (a branch writes and
    rotates checkpoints there, so the parent's would be overwritten or deleted)."""
    out = (out or parent / BRANCHES_DIR / branch_name(step, steps)).resolve()
    check_apart(("--out", out), [("parent's checkpoints folder", parent / "checkpoints")],
                holders=[("parent's run directory", parent)])
    return out


def own_checkpoint(out: Path) -> tuple[Path, dict[str, Any]] | None:
    """The branch's newest sound checkpoint of its own and its meta; None while it has none."""
    for folder in sorted((out / "checkpoints").glob("step-*"), key=lambda p: p.name, reverse=True):
        if is_complete(folder) and checkpoint_problem(folder) is None:
            return folder, read_meta(folder)
    return None


def resumed_branch(parent: Path, step: int, steps: int, shape: str = "", out: Path | None = None,
                   overrides: list[str] = ()) -> tuple[DecayBranch, int] | None:
    """The branch in ``out`` (default as :func:`plan_branch`) as its own newest checkpoint saved it, and that
    checkpoint's step, when it has one: it resumes from there, so the parent's checkpoint may be gone by now. A
    branch folder of another branch (parent checkpoint, decay, shape) is refused; None when it has no checkpoint."""
    out = branch_out(parent.resolve(), step, steps, out)
    found = own_checkpoint(out)
    if found is None:
        return None
    _, meta = found
    values = copy.deepcopy(meta.get("config", {}))
    refuse_another_branch(out, values, branch_identity(parent.resolve(), step, steps, shape))
    values.setdefault("run", {})["out_dir"] = str(out)
    return _branch(parent.resolve(), step, steps, out, values, overrides), int(meta.get("step", 0))


def branch_identity(parent: Path, step: int, steps: int, shape: str) -> dict[str, Any]:
    """The config values that make a branch this one (``shape`` "" : any)."""
    wanted = {"checkpoint.branch_from": str(parent / "checkpoints" / tag_for_step(step)), "optim.decay_start": step,
              "optim.decay_steps": steps, "train.max_steps": step + steps}
    return {**wanted, "optim.decay_shape": shape} if shape else wanted


def refuse_another_branch(out: Path, saved: Any, wanted: dict[str, Any]) -> None:
    """A one-line error when the config ``saved`` in the branch folder ``out`` is not the branch ``wanted``."""
    saved = saved if isinstance(saved, dict) else {}
    differ = [f"{key}: {_value(saved, key)!r} there, {want!r} now" for key, want in wanted.items()
              if _value(saved, key) != want]
    if differ:
        raise ConfigError(f"{out}: holds another run ({'; '.join(differ)}); name another --out, or delete {out}")


def _value(values: dict[str, Any], key: str) -> Any:
    section, _, name = key.partition(".")
    node = values.get(section)
    return node.get(name) if isinstance(node, dict) else None


# what makes a branch the branch it is: set by distaff decay's own options
BRANCH_KEYS = {"train.max_steps": "--steps", "optim.schedule": "--steps", "optim.decay_start": "--from",
               "optim.decay_steps": "--steps", "optim.decay_shape": "--shape", "run.out_dir": "--out",
               "checkpoint.branch_from": "--from", "checkpoint.resume": "--from"}


# what an override may change: how the branch evaluates, checkpoints, waits, logs and reports, never the numbers it
# computes (it continues its parent's checkpoint exactly: the parent's model, data, batch, seed and optimizer)
OVERRIDABLE = ("eval", *NOT_FINGERPRINTED)


def apply_overrides(values: dict[str, Any], overrides: list[str]) -> None:
    """``key=value`` overrides into ``values``; the keys that define the branch are refused, naming the option, and
    so is any key outside :data:`OVERRIDABLE`."""
    for keys, value in parse_overrides(list(overrides)):
        key = ".".join(keys)
        if key in BRANCH_KEYS:
            raise ConfigError(f"{key}: set by the branch itself; use {BRANCH_KEYS[key]}")
        inside = [name for name in BRANCH_KEYS if name.startswith(key + ".")]
        if inside:      # a whole section would replace what the branch sets in it
            raise ConfigError(f"{key}: holds {', '.join(inside)}, which the branch sets itself; override its other "
                              "keys one by one")
        if not any(key == allowed or key.startswith(allowed + ".") for allowed in OVERRIDABLE):
            raise ConfigError(f"{key}: a decay branch continues its parent's checkpoint exactly, so only its "
                              f"evaluation, checkpointing, logging and W&B settings change ({', '.join(OVERRIDABLE)}); "
                              "start a separate run to change it")
        node = values
        for part in keys[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key}: {part} is not a section")
        node[keys[-1]] = value


def branch_values(config: dict[str, Any], checkpoint: Path, step: int, steps: int, shape: str,
                  out: Path) -> dict[str, Any]:
    """The parent's config (as its checkpoint saved it) made into the branch's."""
    values = copy.deepcopy(config)
    run, wandb = values.setdefault("run", {}), values.setdefault("wandb", {})
    name = f"{run.get('name', 'distaff')}-{branch_name(step, steps)}"
    values["run"] = {**run, "out_dir": str(out), "name": name}
    values["wandb"] = {**wandb, "group": wandb.get("group") or run.get("name", "distaff"), "name": ""}
    values["train"] = {**values["train"], "max_steps": step + steps}
    # the parent's phases from the branch's end on are never entered by the branch (a config refuses them)
    values["phases"] = [phase for phase in values.get("phases") or [] if phase.get("at_step", 0) < step + steps]
    values["optim"] = {**values["optim"], "schedule": "wsd", "decay_start": step, "decay_steps": steps,
                       "decay_shape": shape}
    values["checkpoint"] = {**values.get("checkpoint", {}), "resume": "auto", "branch_from": str(checkpoint)}
    return values


def check_same_branch(out: Path, branch: DecayBranch) -> None:
    """A branch folder that already holds a branch (its ``config.yaml``) must hold this one: the same parent
    checkpoint, decay and step count; it then resumes."""
    path = out / "config.yaml"
    if not path.is_file():
        return
    refuse_another_branch(out, load_yaml(path.read_text(), str(path)),
                          branch_identity(branch.parent, branch.step, branch.steps, branch.shape))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distaff decay", description=__doc__.splitlines()[0],
                                     epilog="Remaining key=value arguments override the branch's config.")
    parser.add_argument("run_dir", help="the WSD run's directory (the parent)")
    parser.add_argument("--from", dest="step", type=int_arg("--from", high=MAX_COUNT), required=True,
                        help="the parent's checkpoint step to branch from (in its stable phase)")
    parser.add_argument("--steps", type=int_arg("--steps", low=1, high=MAX_COUNT),
                        required=True, help="the decay's length in optimizer steps")
    parser.add_argument("--shape", choices=DECAY_SHAPES, default="",
                        help="the decay's shape (default: the parent's optim.decay_shape)")
    parser.add_argument("--out", help="the branch's run directory (default RUN_DIR/branches/decay-STEP-STEPS)")
    parser.add_argument("--dry-run", action="store_true",
                        help="write the branch's config and print how it is launched; start nothing")
    parser.add_argument("overrides", nargs="*", help="config overrides dotted.key=value")
    return document_ranges(parser)


def main(argv: list[str] | None = None) -> int:
    return command_main("distaff decay", _main, argv)


def _main(argv: list[str]) -> int:
    args = _parser().parse_intermixed_args(argv)
    parent, out = Path(args.run_dir), Path(args.out) if args.out else None
    resumed = resumed_branch(parent, args.step, args.steps, args.shape, out, args.overrides)
    if resumed is None:
        branch, since = plan_branch(parent, args.step, args.steps, args.shape, out, args.overrides), ""
        check_same_branch(branch.out_dir, branch)
    else:
        branch, at = resumed
        if at >= branch.values["train"]["max_steps"]:
            print(f"distaff decay: branch {branch.out_dir} is finished (its checkpoint at step {at} is its last; "
                  f"its summary: {branch.out_dir / 'summary.json'}); nothing to run")
            return 0
        since = f" (its own checkpoint at step {at})"
    record = read_launch_record(branch.parent)
    if record is None and not args.dry_run:
        raise ConfigError(f"{parent}: no launch record (launch/command.json): the run was not started by `distaff "
                          "launch` or `distaff slurm submit`; pass --dry-run to write the branch's config and start "
                          "it the way its parent was started")
    config = write_config(branch)
    print(f"distaff decay: {'resuming' if since else 'starting'} branch {branch.out_dir}{since}: from "
          f"{branch.checkpoint}, {branch.steps} steps of {branch.shape} decay (W&B group "
          f"{branch.values['wandb']['group']!r})", file=sys.stderr, flush=True)
    if record is None:
        print(f"# start the branch as its parent was started, with its config:\n"
              f"torchrun --nproc_per_node N -m distaff.train.pretrain --config {shlex.quote(str(config))}")
        return 0
    return relaunch(record, config, args.dry_run)


def write_config(branch: DecayBranch) -> Path:
    """The branch's run config, written into its run directory as ``config.yaml``."""
    branch.out_dir.mkdir(parents=True, exist_ok=True)
    path = branch.out_dir / "config.yaml"
    path.write_text(yaml.safe_dump(branch.values, sort_keys=False))
    return path


def relaunch(record: dict, config: Path, dry_run: bool) -> int:
    """The parent's launcher with its recorded options, the branch's config instead of the parent's, from the
    folder the parent was launched from (its relative paths, the data's included, resolve as they did)."""
    from distaff.launch import launcher, slurm

    # the launcher's defaults first: a record written before an option existed still gives every option a value
    parser = slurm._parser()[1] if record["launcher"] == "slurm" else launcher._parser()
    defaults = {action.dest: action.default for action in parser._actions if action.dest != "help"}
    launched = argparse.Namespace(**{**defaults, **record["args"], "config": str(config), "overrides": [],
                                     "dry_run": dry_run})
    if not Path(record["cwd"]).is_dir():
        raise ConfigError(f"the parent was launched from {record['cwd']}, which is not a folder here; run distaff "
                          "decay where that folder exists, or start the branch yourself (--dry-run)")
    os.chdir(record["cwd"])
    if record["launcher"] == "slurm":
        return slurm.submit_job(launched)
    return launcher.launch(launched)
