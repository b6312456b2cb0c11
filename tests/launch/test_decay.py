"""``distaff decay``'s plan without training: the branch's config from its parent's checkpoint, one-line refusals of a
step that is no stable-phase checkpoint, a parent without WSD, a key the branch sets itself or a folder holding
another branch, and the launch as recorded (``distaff launch`` or ``distaff slurm submit``) printed by --dry-run."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import yaml

from distaff.launch.cli import main as distaff_main
from distaff.launch.decay import plan_branch
from distaff.launch.run_config import record_launch
from distaff.train.core.errors import UserError
from distaff.train.run.checkpoint import FORMAT_VERSION, META, tag_for_step
from distaff.train.run.checkpoint_files import write_file_list
from distaff.train.run.config import ConfigError, config_to_dict, load_config

pytestmark = pytest.mark.unit

WSD = ["optim.schedule=wsd", "optim.warmup_steps=10", "optim.decay_start=80", "train.max_steps=100",
       "wandb.group=", "run.name=parent"]


def parent_run(tmp_path: Path, overrides=WSD, steps=(5, 20, 40, 80, 90)) -> Path:
    """A run directory whose checkpoints hold only what the plan reads (their meta and its file list)."""
    run = tmp_path / "parent"
    cfg = load_config(None, ["data.dir=data", f"run.out_dir={run}", *overrides])
    for step in steps:
        folder = run / "checkpoints" / tag_for_step(step) / META
        folder.parent.mkdir(parents=True)
        folder.write_text(json.dumps({"format": FORMAT_VERSION, "step": step, "world_size": 1,
                                      "config": config_to_dict(cfg)}))
        write_file_list(run / "checkpoints" / tag_for_step(step))
    return run


def one_line_error(tmp_path: Path, *args, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        plan_branch(*args)
    assert "\n" not in str(err.value)


def test_a_branch_is_its_parents_config_decaying_from_the_step(tmp_path):
    run = parent_run(tmp_path)
    branch = plan_branch(run, 40, 30, "", None, ["eval.every=5"])
    assert branch.out_dir == run.resolve() / "branches" / "decay-40-30"
    values = branch.values
    assert values["optim"] | {"schedule": "wsd", "decay_start": 40, "decay_steps": 30,
                              "decay_shape": "1-sqrt"} == values["optim"]
    assert values["train"]["max_steps"] == 70 and values["eval"]["every"] == 5
    assert values["checkpoint"]["branch_from"] == str(run.resolve() / "checkpoints" / tag_for_step(40))
    assert values["checkpoint"]["resume"] == "auto"
    assert (values["run"]["name"], values["wandb"]["group"], values["wandb"]["name"]) == \
        ("parent-decay-40-30", "parent", "")
    assert values["data"]["dir"] == "data"                         # relative: resolved from the parent's launch folder
    other = plan_branch(run, 80, 20, "cosine", tmp_path / "mine")   # the last stable step; its own folder
    assert other.out_dir == (tmp_path / "mine").resolve() and other.values["optim"]["decay_shape"] == "cosine"
    grouped = plan_branch(parent_run(tmp_path / "g", WSD + ["wandb.group=sweep"]), 40, 10)
    assert grouped.values["wandb"]["group"] == "sweep"


@pytest.mark.parametrize("step, steps, message", [
    (30, 10, r"^--from 30: .* has no complete checkpoint at step 30 \(it has steps 5, 20, 40, 80, 90\)"),
    (5, 10, r"^--from 5: outside .*'s stable phase \(steps 10 to 80"),
    (90, 5, r"^--from 90: outside .*'s stable phase \(steps 10 to 80"),
    (40, 0, r"^--steps 0: a decay takes at least one step"),
])
def test_a_step_outside_the_stable_phase_or_without_a_checkpoint_is_one_line(tmp_path, step, steps, message):
    one_line_error(tmp_path, parent_run(tmp_path), step, steps, match=message)


def test_a_parent_without_wsd_a_branch_key_or_a_folder_of_another_branch_is_one_line(tmp_path):
    linear = parent_run(tmp_path / "linear", ["train.max_steps=100", "optim.warmup_steps=10"])
    one_line_error(tmp_path, linear, 40, 10, match=r"optim\.schedule=linear: .* no stable phase to branch from")
    run = parent_run(tmp_path)
    one_line_error(tmp_path, run, 40, 10, "", None, ["train.max_steps=60"],
                   match=r"^train\.max_steps: set by the branch itself; use --steps")
    one_line_error(tmp_path, run, 40, 10, "", None, ["eval.every=-1"],
                   match=r"^the branch's config: eval\.every: must be >= 0")
    (run / "branches" / "decay-40-10").mkdir(parents=True)
    (run / "branches" / "decay-40-10" / "config.yaml").write_text(yaml.safe_dump(plan_branch(run, 40, 20).values))
    assert distaff_main(["decay", str(run), "--from", "40", "--steps", "10", "--dry-run"]) == 2


def test_without_a_launch_record_the_branch_is_refused_unless_dry_run(tmp_path, capsys):
    run = parent_run(tmp_path)
    assert distaff_main(["decay", str(run), "--from", "40", "--steps", "10"]) == 2
    assert "no launch record (launch/command.json)" in capsys.readouterr().err
    assert distaff_main(["decay", str(run), "--from", "40", "--steps", "10", "--dry-run"]) == 0
    config = run / "branches" / "decay-40-10" / "config.yaml"
    assert f"--config {config}" in capsys.readouterr().out
    assert yaml.safe_load(config.read_text())["optim"]["decay_start"] == 40


def test_dry_run_prints_the_parents_launcher_with_the_branch_config(tmp_path, capsys, monkeypatch):
    run = parent_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    record_launch(run, "slurm", argparse.Namespace(
        command="submit", config="parent.yaml", task="pretrain", nodes=2, gpus_per_node=4, cpu=True,
        cpus_per_task=None, mem=None, mem_per_cpu=None, exclusive=False, partition="long", account=None,
        time="2:00:00", job_name=None, signal_lead=300, sbatch=[], gpu_kind=None, dry_run=False,
        overrides=["optim.lr=1e-3"]))
    assert distaff_main(["decay", str(run), "--from", "20", "--steps", "10", "--dry-run"]) == 0
    script = capsys.readouterr().out
    branch = run.resolve() / "branches" / "decay-20-10"
    assert "#SBATCH --nodes=2" in script and "#SBATCH --partition=long" in script
    assert f"--config {branch / 'config.yaml'}" in script and "optim.lr" not in script
    record_launch(run, "launch", argparse.Namespace(
        config="parent.yaml", task="pretrain", hosts=None, hostfile=None, gpus_per_node=2, master_port=29511,
        env=[], gpu_kind=None, dry_run=False, overrides=[]))
    assert distaff_main(["decay", str(run), "--from", "20", "--steps", "10", "--dry-run"]) == 0
    command = capsys.readouterr().out
    assert "--num_gpus 2 --master_port 29511" in command and f"--config {branch / 'config.yaml'}" in command


def branch_checkpoint(run: Path, step: int, values: dict) -> Path:
    """A checkpoint of the branch whose config is ``values`` (its meta and file list), at ``step``."""
    folder = Path(values["run"]["out_dir"]) / "checkpoints" / tag_for_step(step)
    (folder / META).parent.mkdir(parents=True)
    (folder / META).write_text(json.dumps({"format": FORMAT_VERSION, "step": step, "world_size": 1, "config": values}))
    write_file_list(folder)
    return folder


def test_a_branch_resumes_from_its_own_checkpoint_once_its_parents_is_gone(tmp_path, capsys):
    run = parent_run(tmp_path)
    branch = plan_branch(run, 40, 30, "cosine", None, ["eval.every=5"])
    branch_checkpoint(run, 50, branch.values)
    shutil.rmtree(branch.checkpoint)        # the parent rotated it away (checkpoint.keep)
    argv = ["decay", str(run), "--from", "40", "--steps", "30", "--dry-run", "checkpoint.every=7"]
    assert distaff_main(argv) == 0
    out = capsys.readouterr()
    assert f"resuming branch {branch.out_dir} (its own checkpoint at step 50)" in out.err
    saved = yaml.safe_load((branch.out_dir / "config.yaml").read_text())
    assert (saved["optim"]["decay_shape"], saved["eval"]["every"], saved["checkpoint"]["every"]) == ("cosine", 5, 7)
    assert saved["checkpoint"]["branch_from"] == str(branch.checkpoint)
    # another branch's folder is refused even without its parent's checkpoint: its step count differs
    assert distaff_main(["decay", str(run), "--from", "40", "--steps", "20", "--out", str(branch.out_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds another run (optim.decay_steps: 30 there, 20 now" in err and "\n" not in err


def test_rerunning_a_finished_branch_says_so_in_one_line(tmp_path, capsys):
    run = parent_run(tmp_path)
    branch = plan_branch(run, 40, 30)
    branch_checkpoint(run, 70, branch.values)
    assert distaff_main(["decay", str(run), "--from", "40", "--steps", "30"]) == 0    # no launch record needed
    out = capsys.readouterr().out.strip()
    assert out == (f"distaff decay: branch {branch.out_dir} is finished (its checkpoint at step 70 is its last; its "
                   f"summary: {branch.out_dir / 'summary.json'}); nothing to run")


@pytest.mark.parametrize("override", ["model.hidden_size=64", "optim.lr=1e-3", "data.dir=other", "run.seed=7",
                                      "train.grad_accum=2", "phases=[]"])
def test_overrides_the_docs_do_not_list_are_refused_in_one_line(tmp_path, override):
    one_line_error(tmp_path, parent_run(tmp_path), 40, 10, "", None, [override],
                   match=rf"^{override.split('=')[0]}: a decay branch continues its parent's checkpoint exactly, so "
                         r"only its evaluation, checkpointing, logging and W&B settings change")


def test_a_section_holding_what_the_branch_sets_is_refused_whole(tmp_path):
    one_line_error(tmp_path, parent_run(tmp_path), 40, 10, "", None, ["checkpoint={every: 5}"],
                   match=r"^checkpoint: holds checkpoint\.branch_from, checkpoint\.resume, which the branch sets")


def test_overrides_of_evaluation_checkpointing_logging_and_wandb_are_taken(tmp_path):
    values = plan_branch(parent_run(tmp_path), 40, 10, "", None, [
        "eval.batches=3", "checkpoint.keep=5", "logging.every=2", "wandb.mode=disabled", "run.name=mine",
        "distributed.timeout_s=60"]).values
    assert (values["eval"]["batches"], values["checkpoint"]["keep"], values["logging"]["every"],
            values["wandb"]["mode"], values["run"]["name"], values["distributed"]["timeout_s"]) == \
        (3, 5, 2, "disabled", "mine", 60)


def test_a_branch_folder_over_its_parent_is_refused_in_one_line(tmp_path):
    run = parent_run(tmp_path)
    for out, relation in [(run, "is the parent's run directory"), (tmp_path, "contains the parent's run directory"),
                          (run / "checkpoints" / "x", "lies inside the parent's checkpoints folder"),
                          (run / "x" / ".." / "checkpoints", "is the parent's checkpoints folder")]:
        with pytest.raises(UserError, match=f": {relation}") as err:
            plan_branch(run, 40, 10, "", out)
        assert "\n" not in str(err.value)


def test_a_parents_phases_after_the_branch_ends_are_left_out(tmp_path):
    run = parent_run(tmp_path, WSD + ["phases=[{at_step: 30, mask_rate: 0.2}, {at_step: 60, mask_rate: 0.1}]"])
    assert [p["at_step"] for p in plan_branch(run, 40, 10).values["phases"]] == [30]
    assert [p["at_step"] for p in plan_branch(run, 40, 30).values["phases"]] == [30, 60]
