"""Ctrl-C on a real 2-rank run under ``distaff launch`` (the deepspeed launcher), pressed as a terminal does
(SIGINT to the foreground process group): the first press checkpoints at the step boundary, prints one line
and exits 75, and the resumed run's per-step losses equal an uninterrupted run's; a second press ends the
run at once. Neither prints a traceback, and the launcher adds no line of its own to an expected exit (no
"Unable to find hostfile", no "exits with return code = 75"). A stalled rank's status (76) comes through too."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import psutil

from distaff.launch.watcher import runs_module
from distaff.train.core.distributed import free_port
from distaff.train.core.exit_codes import EXIT_PREEMPTED, EXIT_STALLED
from distaff.train.run.checkpoint import is_complete
from pretrain_fixtures import (PYTHON, prepare_data, rank_env, read_wandb_records, train_losses, wait_for_step,
                               write_config)

pytestmark = [pytest.mark.integration, pytest.mark.serial]   # signals and watchdogs within bounded times

STEPS = 40
SECTIONS = dict(train={"max_steps": STEPS}, model={"emd": True},   # dropout and EMD on: RNG state matters
                checkpoint={"every": 0, "keep": 2}, eval={"every": 0, "batches": 2})


def launch(config: Path, tmp: Path, log: str, ranks: int = 2) -> subprocess.Popen:
    """``distaff launch`` with 2 CPU ranks as a terminal's foreground job: its own process group, SIGINT at
    its default disposition (as a shell leaves it)."""
    command = [PYTHON, "-m", "distaff.launch.cli", "launch", "--config", str(config), "--gpus-per-node", str(ranks),
               "--master-port", str(free_port())]
    return subprocess.Popen(command, env=rank_env(tmp), cwd=tmp, stdout=open(tmp / log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def ctrl_c(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)


def finished(proc: subprocess.Popen, tmp: Path, log: str, timeout: float = 240) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return code, (tmp / log).read_text()


def library_lines(out: str) -> list[str]:
    """The lines a library logged as a warning or an error (DeepSpeed's launcher: ``[WARNING]``, ``[ERROR]``)."""
    return [line for line in out.splitlines() if "[WARNING]" in line or "[ERROR]" in line]


@pytest.mark.timeout(600)
def test_ctrl_c_checkpoints_exits_75_and_the_resumed_run_loses_no_step(sample_data, tmp_path_factory):
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    full_dir = tmp_path_factory.mktemp("uninterrupted")
    code, out = finished(launch(write_config(full_dir / "run.yaml", data, full_dir / "run", **SECTIONS), full_dir,
                                "launch.log"), full_dir, "launch.log")
    assert code == 0, out[-4000:]
    assert library_lines(out) == [], out[-4000:]
    expected = train_losses(full_dir / "run")
    assert sorted(expected) == list(range(1, STEPS + 1))

    tmp = tmp_path_factory.mktemp("interrupted")
    run_dir = tmp / "run"
    config = write_config(tmp / "run.yaml", data, run_dir, **SECTIONS)
    proc = launch(config, tmp, "first.log")
    wait_for_step(run_dir, 3, [proc])
    ctrl_c(proc)
    code, out = finished(proc, tmp, "first.log")
    assert code == EXIT_PREEMPTED, out[-4000:]
    stopped_at = max(train_losses(run_dir))
    assert 3 <= stopped_at < STEPS
    assert out.count("interrupted (Ctrl-C)") == 1
    assert f"interrupted (Ctrl-C); checkpoint saved at step {stopped_at}; exiting with 75" in out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
    assert library_lines(out) == [], out[-4000:]
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == f"step-{stopped_at:08d}"
    # W&B's service outlived the signal: the offline run was closed with the run's exit code
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/*.wandb")
    exits = [r.exit.exit_code for r in read_wandb_records(run_file) if r.WhichOneof("record_type") == "exit"]
    assert exits == [EXIT_PREEMPTED]

    code, out = finished(launch(config, tmp, "resumed.log"), tmp, "resumed.log")
    assert code == 0, out[-4000:]
    assert f"resuming from {checkpoints / f'step-{stopped_at:08d}'}" in out
    assert train_losses(run_dir) == expected            # every step, bit-exact: none lost, none repeated


@pytest.mark.timeout(300)
def test_a_second_ctrl_c_ends_the_run_at_once(sample_data, tmp_path_factory):
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    tmp = tmp_path_factory.mktemp("aborted")
    run_dir = tmp / "run"
    proc = launch(write_config(tmp / "run.yaml", data, run_dir, **{**SECTIONS, "train": {"max_steps": 100_000}}),
                  tmp, "launch.log")
    wait_for_step(run_dir, 3, [proc])
    ctrl_c(proc)
    time.sleep(0.05)
    ctrl_c(proc)
    pressed = time.monotonic()
    code, out = finished(proc, tmp, "launch.log", timeout=60)
    assert time.monotonic() - pressed < 30             # not the 30 s deepspeed waits before SIGKILL
    assert code not in (0, EXIT_PREEMPTED), out[-4000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
    # the abort may land after the first press's checkpoint was written (steps take milliseconds): then it is
    # whole; never a partial one marked latest
    latest = run_dir / "checkpoints" / "latest"
    if latest.exists():
        assert is_complete(run_dir / "checkpoints" / latest.read_text().strip())


@pytest.mark.timeout(200)
def test_a_stalled_rank_ends_distaff_launch_with_exit_76_and_its_stacks(sample_data, tmp_path_factory):
    """The rank's reads stop coming back (its DataLoader worker is stopped): its watchdog dumps the stacks, ends the
    worker (a worker left behind is an orphan, and one caught mid-handover prints a traceback into the log) and
    exits 76, which the deepspeed launcher and ``distaff launch`` pass on, quietly."""
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    tmp = tmp_path_factory.mktemp("stalled")
    run_dir = tmp / "run"
    config = write_config(tmp / "run.yaml", data, run_dir, train={"max_steps": 100_000},
                          data={"dir": str(data), "batch_size": 4, "num_workers": 1},
                          distributed={"timeout_s": 60, "watchdog_s": 4})
    proc = launch(config, tmp, "launch.log", ranks=1)
    worker = None
    try:
        wait_for_step(run_dir, 2, [proc])
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if runs_module(p.cmdline(), "distaff.train.pretrain")]
        (worker,) = [p for p in ranks if p.ppid() in {rank.pid for rank in ranks}]
        worker.suspend()
        deadline = time.monotonic() + 60
        while not (run_dir / "stacks-rank0.txt").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        code, out = finished(proc, tmp, "launch.log", timeout=60)
        left_behind = worker.is_running()
    finally:
        if worker is not None and worker.is_running():
            worker.kill()
    assert not left_behind, f"the stalled rank left its DataLoader worker {worker.pid} running"
    assert code == EXIT_STALLED, out[-4000:]
    assert out.count("distaff: rank 0: stalled: no step progress for 4 s") == 1, out[-4000:]
    assert "Traceback" not in out and library_lines(out) == [], out[-4000:]
    assert "most recent call first" in (run_dir / "stacks-rank0.txt").read_text()
