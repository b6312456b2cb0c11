"""Decay branches of a warmup-stable-decay run, for real: a parent started by ``distaff launch`` (2 gloo ranks,
real shards, RTD on packed documents under ZeRO-2), then ``distaff decay`` twice from one stable-phase checkpoint:
one branch runs through, the other is interrupted (SIGTERM to ``distaff decay``) and, once the parent's checkpoint
it started from is gone, resumed by the same command from its own; the finished one run again says it is done.
The branches coexist, continue the parent exactly (its next two losses, whose rates are still the peak) and the
interrupted branch repeats every step of the uninterrupted one bit for bit."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from pretrain_fixtures import PYTHON, metrics, prepare_data, rank_env, train_losses, wait_for_step, write_config

from distaff.train.core.distributed import free_port
from distaff.train.core.exit_codes import EXIT_PREEMPTED
from distaff.train.run.checkpoint import META

pytestmark = pytest.mark.integration

PARENT_STEPS, BRANCH_AT, DECAY = 8, 4, 5
SECTIONS = dict(train={"max_steps": PARENT_STEPS, "objective": "rtd"},
                optim={"lr": 3e-3, "warmup_steps": 2, "schedule": "wsd", "decay_start": PARENT_STEPS,
                       "min_lr_ratio": 0.1},
                data={"packing": "varlen", "batch_size": 3}, checkpoint={"every": 2, "keep": 4},
                eval={"every": 0, "batches": 2}, wandb={"mode": "offline", "project": "distaff-tests", "group": ""})


def distaff(tmp: Path, *args: str, log: str) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, "-m", "distaff.launch.cli", *args], env=rank_env(tmp), cwd=tmp,
                            stdout=open(tmp / log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def finished(proc: subprocess.Popen, tmp: Path, log: str, code: int = 0, timeout: float = 300) -> None:
    assert proc.wait(timeout=timeout) == code, (tmp / log).read_text()[-5000:]


def by_step(run_dir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in metrics(run_dir) if key in r and "loss" in r}


@pytest.mark.timeout(900)
def test_a_decay_branch_continues_its_parent_exactly_and_resumes_bit_for_bit(sample_data, tmp_path_factory):
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data, pack_documents=False)
    tmp = tmp_path_factory.mktemp("decay")
    parent = tmp / "wsd"
    config = write_config(tmp / "wsd.yaml", data, parent, **SECTIONS)
    finished(distaff(tmp, "launch", "--config", str(config), "--gpus-per-node", "2", "--master-port",
                     str(free_port()), log="parent.log"), tmp, "parent.log")
    record = json.loads((parent / "launch" / "command.json").read_text())
    assert record["launcher"] == "launch" and record["args"]["gpus_per_node"] == 2

    full = tmp / "branch-full"
    decay = ["decay", str(parent), "--from", str(BRANCH_AT), "--steps", str(DECAY), "checkpoint.every=1"]
    finished(distaff(tmp, *decay, "--out", str(full), log="full.log"), tmp, "full.log")

    default = parent / "branches" / f"decay-{BRANCH_AT}-{DECAY}"
    proc = distaff(tmp, *decay, log="interrupted.log")
    wait_for_step(default, BRANCH_AT + 2, [proc], timeout=300)
    proc.send_signal(signal.SIGTERM)                # as Ctrl-C or a scheduler would: the ranks checkpoint
    finished(proc, tmp, "interrupted.log", code=EXIT_PREEMPTED)
    stopped_at = max(train_losses(default))
    assert BRANCH_AT + 2 <= stopped_at < BRANCH_AT + DECAY
    # the parent's checkpoint is gone (its checkpoint.keep rotated it away): the branch resumes from its own
    shutil.rmtree(parent / "checkpoints" / f"step-{BRANCH_AT:08d}")
    finished(distaff(tmp, *decay, log="resumed.log"), tmp, "resumed.log")
    assert f"resuming from {default / 'checkpoints'}" in (tmp / "resumed.log").read_text()
    # a finished branch run again says so in one line
    finished(distaff(tmp, *decay, "--out", str(full), log="again.log"), tmp, "again.log")
    assert (tmp / "again.log").read_text().strip().splitlines()[-1] == (
        f"distaff decay: branch {full} is finished (its checkpoint at step {BRANCH_AT + DECAY} is its last; its "
        f"summary: {full / 'summary.json'}); nothing to run")

    steps = list(range(BRANCH_AT + 1, BRANCH_AT + DECAY + 1))
    expected = train_losses(full)
    assert sorted(expected) == steps
    assert train_losses(default) == expected                         # every step, bit for bit, across the resume
    assert metrics(default)[-1]["eval_loss"] == metrics(full)[-1]["eval_loss"]
    # the branch continues the parent's weights, Adam moments, data position, RNGs and replacements: its first two
    # steps run at the peak rate as the parent's did, and give the parent's losses exactly
    parent_losses = train_losses(parent)
    assert [expected[s] for s in steps[:2]] == [parent_losses[s] for s in steps[:2]]
    lr, parent_lr = by_step(full, "lr"), by_step(parent, "lr")
    assert lr[steps[0]] == parent_lr[steps[0]] == 3e-3
    assert all(lr[a] > lr[b] for a, b in zip(steps[1:], steps[2:])) and lr[steps[-1]] > 3e-4

    saved = yaml.safe_load((default / "config.yaml").read_text())
    branch_from = str(parent / "checkpoints" / f"step-{BRANCH_AT:08d}")
    assert saved["checkpoint"]["branch_from"] == branch_from
    assert (saved["optim"]["decay_start"], saved["optim"]["decay_steps"], saved["train"]["max_steps"]) == \
        (BRANCH_AT, DECAY, BRANCH_AT + DECAY)
    assert saved["wandb"]["group"] == "wsd" and saved["run"]["name"] == f"wsd-decay-{BRANCH_AT}-{DECAY}"
    meta = json.loads((default / "checkpoints" / f"step-{BRANCH_AT + DECAY:08d}" / META).read_text())
    parent_meta = json.loads((parent / "checkpoints" / f"step-{PARENT_STEPS:08d}" / META).read_text())
    assert meta["config"]["checkpoint"]["branch_from"] == branch_from
    run_ids = {meta["train_state"]["wandb_run_id"], parent_meta["train_state"]["wandb_run_id"],
               json.loads((full / "checkpoints" / f"step-{BRANCH_AT + DECAY:08d}" / META).read_text())
               ["train_state"]["wandb_run_id"]}
    assert len(run_ids) == 3                          # three W&B runs: the parent and each branch
    assert sorted(train_losses(parent)) == list(range(1, PARENT_STEPS + 1))     # the parent untouched
