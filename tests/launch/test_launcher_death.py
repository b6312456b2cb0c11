"""``kill -9`` of ``distaff launch`` (or the OOM killer taking it) leaves nothing running: its watcher stops the
job as a Ctrl-C would (the ranks checkpoint and exit 75, deepspeed's runner and per-node launcher follow), the
run lock is free and the next launch into the same folder resumes. Before the watcher, the runner, its
launcher and both ranks were reparented to init and trained on to the last step, holding the lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from distaff.train.core.distributed import free_port
from distaff.train.run.checkpoint import is_complete
from pretrain_fixtures import PYTHON, prepare_data, rank_env, train_losses, wait_for_step, write_config

pytestmark = [pytest.mark.integration, pytest.mark.serial]   # deaths noticed within bounded times


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in procs:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_gone(procs: list[psutil.Process], timeout: float) -> float:
    """Seconds until none of ``procs`` is alive; fails naming the ones left after ``timeout``."""
    start = time.monotonic()
    while _alive(procs) and time.monotonic() - start < timeout:
        time.sleep(0.1)
    left = _alive(procs)
    for proc in left:                      # leave nothing behind, then fail
        proc.kill()
    assert not left, [" ".join(p.cmdline()[:6]) for p in left]
    return time.monotonic() - start


def _job_once_started(shell: psutil.Process, size: int, timeout: float) -> list[psutil.Process]:
    """The shell and its children once all ``size`` exist: on a loaded machine ``sh`` forks its second child
    well after it started (CI once saw only two)."""
    deadline = time.monotonic() + timeout
    while True:
        job = [shell, *shell.children(recursive=True)]
        if len(job) == size or time.monotonic() > deadline:
            assert len(job) == size, job
            return job
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_the_watcher_ends_the_job_of_a_sigkilled_parent(tmp_path: Path) -> None:
    """The mechanism alone, in a second: a stand-in launcher starts a job (its own session, as deepspeed's runner
    is started) and the watcher; SIGKILL of the stand-in ends the job's whole process group."""
    program = ("import subprocess, sys, time\n"
               "from distaff.launch.watcher import start_watcher\n"
               "job = subprocess.Popen(['sh', '-c', 'sleep 300 & sleep 300; wait'], start_new_session=True)\n"
               "start_watcher(job.pid, 'distaff.train.pretrain', to_ranks=True)\n"
               "print(job.pid, flush=True)\n"
               "time.sleep(300)\n")
    launcher = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    job_pid = int(launcher.stdout.readline())
    job = _job_once_started(psutil.Process(job_pid), size=3, timeout=20)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    assert _wait_gone(job, timeout=10) < 5


@pytest.mark.timeout(600)
def test_sigkill_of_distaff_launch_stops_every_rank_and_frees_the_run(sample_data, tmp_path_factory):
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    tmp = tmp_path_factory.mktemp("launcher-killed")
    run_dir = tmp / "run"
    config = write_config(tmp / "run.yaml", data, run_dir, train={"max_steps": 100_000})
    command = [PYTHON, "-m", "distaff.launch.cli", "launch", "--config", str(config), "--gpus-per-node", "2",
               "--master-port", str(free_port())]
    launcher = subprocess.Popen(command, env=rank_env(tmp), cwd=tmp, stdout=open(tmp / "first.log", "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_step(run_dir, 3, [launcher], timeout=240)
    except BaseException:
        os.killpg(launcher.pid, signal.SIGKILL)
        raise
    job = psutil.Process(launcher.pid).children(recursive=True)   # runner, its launcher, 2 ranks, the watcher
    ranks = [p for p in job if "distaff.train.pretrain" in p.cmdline() and "deepspeed.launcher.launch" not in
             " ".join(p.cmdline()) and "--module" not in p.cmdline()]
    assert len(ranks) >= 2, [p.cmdline() for p in job]
    os.kill(launcher.pid, signal.SIGKILL)                # only the launcher, as the OOM killer would
    launcher.wait()
    gone_after = _wait_gone(job, timeout=60)
    print(f"every process of the job gone {gone_after:.1f} s after the SIGKILL")
    assert gone_after < 30, gone_after
    log = (tmp / "first.log").read_text()
    assert "the launcher is gone: stopping its job" in log, log[-3000:]
    # the ranks got SIGTERM: they checkpointed at the step boundary, as on any SIGTERM
    latest = run_dir / "checkpoints" / "latest"
    assert latest.is_file(), log[-3000:]
    stopped_at = int(latest.read_text().strip().removeprefix("step-"))
    assert is_complete(run_dir / "checkpoints" / latest.read_text().strip())

    # the lock is free: the same command into the same folder resumes there and finishes
    again = subprocess.run(command[:-1] + [str(free_port()), f"train.max_steps={stopped_at + 2}"], env=rank_env(tmp),
                           cwd=tmp, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert f"resuming from {run_dir / 'checkpoints'}" in again.stdout + again.stderr
    assert max(train_losses(run_dir)) == stopped_at + 2
