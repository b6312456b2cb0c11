"""Hardened runs (issue 15) on real CPU ranks: a non-finite loss, a check before the first step, the
final checkpoint before the final evaluation, a stalled rank caught by the watchdog, ranks that
die with their launcher, and a run directory two runs cannot share."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain_fixtures import (TORCHRUN, metrics, namespaces_permitted, prepare_data, rank_env, spawn_ranks,
                               wait_all, wait_for_step, write_config)

from distaff.train.core.distributed import free_port
from distaff.train.core.exit_codes import EXIT_BAD_CONFIG, EXIT_FAILURE, EXIT_STALLED
from distaff.train.core.runlock import LOCK_FILE
from distaff.train.run.checkpoint import latest_checkpoint
from distaff.train.run.weights import fp32_state_dict

pytestmark = pytest.mark.integration


def _log(tmp: Path, ranks: int = 2) -> str:
    return "\n".join(f"--- rank{r}.log\n" + (tmp / f"rank{r}.log").read_text()[-4000:] for r in range(ranks))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [0, 2, 3])     # the skip reaches the optimizer under every ZeRO wrapper
def test_non_finite_loss_skips_steps_then_stops_without_saving_nan_weights(stage, sample_data, tmp_path_factory,
                                                                           tmp_path):
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    run_dir = tmp_path / "run"
    # a finite but absurd learning rate: the first step blows the weights up, every later loss is NaN;
    # had a skipped step been applied, its NaN gradients would have made the weights NaN
    config = write_config(tmp_path / "run.yaml", data, run_dir, train={"max_steps": 50, "max_nonfinite_steps": 3},
                          optim={"lr": 1e30, "warmup_steps": 0}, checkpoint={"every": 1, "keep": 2},
                          zero={"stage": stage})
    assert wait_all(spawn_ranks(config, tmp_path), timeout=180) == [EXIT_FAILURE] * 2, _log(tmp_path)
    log = (tmp_path / "rank0.log").read_text()
    assert "the loss was not finite for 3 steps in a row" in log, log
    assert "Traceback" not in log and [line for line in log.splitlines() if "not finite for" in line][0].startswith(
        "distaff pretrain: rank 0: "), log       # one line, no traceback
    records = [r for r in metrics(run_dir) if "loss" in r]
    assert records[-1]["nonfinite_steps"] == 3 and records[-1]["step"] == records[0]["step"] + 3
    latest = latest_checkpoint(run_dir / "checkpoints")
    assert latest is not None and latest.name == f"step-{records[-1]['step'] - 1:08d}"   # never the failing step
    weights = fp32_state_dict(latest)
    assert weights and all(t.isfinite().all() for t in weights.values())


@pytest.mark.timeout(120)
def test_sequences_longer_than_the_position_table_fail_before_the_first_step(sample_data, tmp_path_factory,
                                                                              tmp_path):
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)     # seq_len 64
    config = write_config(tmp_path / "run.yaml", data, tmp_path / "run", model={"max_position_embeddings": 32})
    procs = spawn_ranks(config, tmp_path, world_size=1)
    assert wait_all(procs, timeout=100) == [EXIT_BAD_CONFIG], _log(tmp_path, 1)
    log = (tmp_path / "rank0.log").read_text()
    assert "model.max_position_embeddings: 32" in log and "seq_len 64" in log and "model.emd" in log
    assert not metrics(tmp_path / "run")


@pytest.mark.timeout(240)
def test_a_failing_final_evaluation_keeps_the_final_checkpoint(sample_data, tmp_path_factory, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(prepare_data(tmp_path_factory.getbasetemp(), sample_data), data)
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", data, run_dir, train={"max_steps": 25})
    procs = spawn_ranks(config, tmp_path)
    wait_for_step(run_dir, 2, procs)
    shutil.rmtree(data / "heldout")             # the final evaluation will find its shards gone: bad input, exit 2
    assert wait_all(procs, timeout=180) == [EXIT_BAD_CONFIG] * 2, _log(tmp_path)
    assert "heldout/shard-000000.tar: file not found" in (tmp_path / "rank0.log").read_text()
    assert latest_checkpoint(run_dir / "checkpoints").name == "step-00000025", _log(tmp_path)


@pytest.mark.serial
@pytest.mark.timeout(120)
def test_a_stalled_rank_is_caught_by_the_watchdog(sample_data, tmp_path_factory, tmp_path):
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    watchdog_s = 10
    # the collective timeout is longer than the watchdog's: the exit below is the watchdog's doing
    config = write_config(tmp_path / "run.yaml", data, tmp_path / "run", train={"max_steps": 100000},
                          distributed={"timeout_s": 120, "watchdog_s": watchdog_s})
    procs = spawn_ranks(config, tmp_path)
    try:
        wait_for_step(tmp_path / "run", 2, procs)
        procs[1].send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        code = procs[0].wait(timeout=watchdog_s + 30)
        elapsed = time.monotonic() - stopped_at
    finally:
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
    log = (tmp_path / "rank0.log").read_text()
    assert code == EXIT_STALLED, log
    assert elapsed < watchdog_s + 15, f"rank 0 took {elapsed:.0f} s"
    assert "no step progress for 10 s" in log
    stacks = (tmp_path / "run" / "stacks-rank0.txt").read_text()
    assert "Thread" in stacks and "most recent call first" in stacks, stacks


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"         # a zombie has exited; only its parent's wait is missing


@pytest.mark.serial
@pytest.mark.timeout(150)
def test_ranks_exit_when_their_launcher_is_killed(sample_data, tmp_path_factory, tmp_path):
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", data, run_dir, train={"max_steps": 100000})
    launcher = subprocess.Popen([TORCHRUN, "--nproc_per_node", "2", "--master_port", str(free_port()), "-m",
                                 "distaff.train.pretrain", "--config", str(config)], env=rank_env(tmp_path),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    ranks: list[int] = []
    try:
        wait_for_step(run_dir, 2, [launcher])
        ranks = [int(pid) for pid in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()]
        assert len(ranks) == 2
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 20
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in ranks), "ranks outlived their launcher"
    finally:
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(200)
def test_a_second_run_into_a_live_run_directory_is_refused(sample_data, tmp_path_factory, tmp_path):
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", data, run_dir, train={"max_steps": 100000})
    first = spawn_ranks(config, tmp_path)
    try:
        wait_for_step(run_dir, 1, first)
        second_dir = tmp_path / "second"
        second_dir.mkdir()
        second = spawn_ranks(config, second_dir)
        assert wait_all(second, timeout=100) == [EXIT_BAD_CONFIG] * 2, _log(second_dir)
        log = (second_dir / "rank0.log").read_text()
        assert f"is in use by pid {first[0].pid} on {socket.gethostname()}" in log, log
        assert "run.out_dir" in log and "started 20" in log
    finally:
        for proc in first:
            proc.kill()
            proc.wait()
    third = spawn_ranks(config, tmp_path, "train.max_steps=3")   # the dead holder's lock is taken over
    assert wait_all(third, timeout=150) == [0, 0], _log(tmp_path)


@pytest.mark.timeout(150)
def test_a_second_data_prepare_into_the_same_folder_is_refused(sample_data, tmp_path_factory, tmp_path):
    base = tmp_path_factory.getbasetemp()
    prepare_data(base, sample_data)                     # the tokenizer and text it was made from
    out = tmp_path / "data"
    cmd = [sys.executable, "-m", "distaff.launch.cli", "data", "prepare", "--input",
           str(base / "shakespeare-sample.txt"), "--tokenizer", str(base / "tokenizer"), "--seq-len", "64",
           "--out", str(out), "--workers", "1", "--no-progress"]
    first = subprocess.Popen(cmd, env=rank_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lock = out / LOCK_FILE
    deadline = time.monotonic() + 60
    while not (lock.is_file() and lock.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.01)
    first.send_signal(signal.SIGSTOP)                   # holding the lock, mid-prepare
    try:
        second = subprocess.run(cmd, env=rank_env(tmp_path), capture_output=True, text=True, timeout=60, check=False)
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == EXIT_BAD_CONFIG, second.stderr
    assert f"--out: {out} is in use by pid {first.pid} on {socket.gethostname()}" in second.stderr
    assert first.wait(timeout=90) == 0, first.stderr.read()


@pytest.mark.timeout(200)
@pytest.mark.skipif(not namespaces_permitted(), reason="unshare -rm (user + mount namespace) is not permitted here, "
                    "so no read-only filesystem can be mounted; tests/run/test_runlock.py covers unwritable folders")
def test_a_run_dir_on_a_read_only_filesystem_is_one_line_on_every_rank(sample_data, tmp_path_factory, tmp_path):
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    config = write_config(tmp_path / "run.yaml", data, readonly / "run")
    # two ranks in a mount namespace where the run's parent folder is a read-only filesystem
    script = ('mount -t tmpfs -o ro,size=1m tmpfs "$RO" || exit 99; for r in 0 1; do RANK=$r LOCAL_RANK=$r '
              'WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 "$PY" -m distaff.train.pretrain --config "$CFG" '
              '>"$LOGS/rank$r.log" 2>&1 & eval "p$r=$!"; done; wait $p0; c0=$?; wait $p1; echo "$c0 $?"')
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=180,
                          cwd=tmp_path, env={**rank_env(tmp_path), "RO": str(readonly), "PY": sys.executable,
                                             "MASTER_PORT": str(free_port()), "CFG": str(config), "LOGS": str(tmp_path)})
    assert proc.stdout.split() == ["2", "2"], proc.stdout + proc.stderr + _log(tmp_path)
    for rank in (0, 1):
        log = (tmp_path / f"rank{rank}.log").read_text()
        assert "Traceback" not in log and log.strip().splitlines()[-1] == (
            f"distaff pretrain: rank {rank}: run.out_dir: {readonly / 'run'} cannot be written (read-only file "
            "system); choose a folder this user can write"), log[-3000:]
