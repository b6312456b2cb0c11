"""CPU threads per rank: the cores of the process's affinity shared by the ranks of its node, cut to the cores
other processes leave idle, unless the user set ``OMP_NUM_THREADS``; OpenMP waits passively; and a rank started
by ``distaff launch`` really runs with that many."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from distaff.train.core.distributed import free_port
from distaff.train.core import threads
from distaff.train.core.threads import (configure_threads, local_world_size, plan_threads, planned_threads,
                                           threads_per_rank)
from pretrain_fixtures import PYTHON, prepare_data, rank_env, run_log, write_config


@pytest.mark.unit
@pytest.mark.parametrize("env, ranks", [
    ({}, 1),
    ({"LOCAL_WORLD_SIZE": "4"}, 4),                              # torchrun
    ({"LOCAL_SIZE": "2"}, 2),                                    # the deepspeed launcher
    ({"SLURM_NTASKS_PER_NODE": "8"}, 8),                         # srun --ntasks-per-node
    ({"LOCAL_WORLD_SIZE": "2", "SLURM_NTASKS_PER_NODE": "1"}, 2),  # torchrun inside a one-task-per-node job
    ({"LOCAL_WORLD_SIZE": "", "LOCAL_SIZE": "0", "SLURM_NTASKS_PER_NODE": "2(x3)"}, 1),  # unusable values
    ({"LOCAL_WORLD_SIZE": "\u00b2"}, 1),                          # str.isdigit() says yes, int() says no
])
def test_local_world_size_comes_from_the_launcher(env, ranks):
    assert local_world_size(env) == ranks


@pytest.mark.unit
@pytest.mark.parametrize("cores, ranks, threads", [(2, 2, 1), (2, 1, 2), (16, 8, 2), (16, 3, 5), (1, 4, 1), (4, 0, 4)])
def test_threads_per_rank_is_an_even_share_and_at_least_one(cores, ranks, threads):
    assert threads_per_rank(cores, ranks) == threads


@pytest.mark.unit
def test_planned_threads_divide_the_affinity_unless_the_user_chose():
    assert planned_threads({"LOCAL_WORLD_SIZE": "2"}, affinity={0, 1, 2, 3, 4, 5}, busy=0.0).threads == 3
    assert planned_threads({}, affinity={3, 7}, busy=0.0).threads == 2
    assert planned_threads({"OMP_NUM_THREADS": "5", "LOCAL_WORLD_SIZE": "2"}, affinity={0, 1, 2, 3}) is None
    assert planned_threads({}, busy=0.0).threads == len(os.sched_getaffinity(0))


@pytest.mark.unit
@pytest.mark.parametrize("cores, ranks, busy, expected", [
    (2, 1, 0.0, 2), (2, 1, 0.4, 2),      # idle, or a little background: the whole share
    (2, 1, 0.6, 1), (2, 1, 3.0, 1),      # a core or more taken by others: one thread, never zero
    (16, 8, 7.0, 2),                     # the 7 other ranks of this node starting up are not "others"
    (16, 2, 8.0, 4),                     # 7 cores of others: (16 - 7) / 2 = 4.5 -> 4 or 5, not the share 8
    (2, 2, 5.0, 1),
])
def test_the_share_is_cut_to_the_cores_others_leave_idle(cores, ranks, busy, expected):
    plan = plan_threads(cores, ranks, busy)
    assert plan.threads == expected or (cores, ranks) == (16, 2) and plan.threads in (4, 5)
    assert plan.share == threads_per_rank(cores, ranks)


@pytest.mark.unit
def test_busy_cores_is_the_cpu_time_of_the_machine_while_this_process_sleeps(monkeypatch):
    samples = iter([(1000, 4000), (1300, 4400)])    # 300 of 400 jiffies busy on a 4-core machine: 3 cores
    monkeypatch.setattr(threads, "_cpu_times", lambda: next(samples))
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 4)
    assert threads.busy_cores(sample_s=0.0) == pytest.approx(3.0)
    monkeypatch.setattr(threads, "_cpu_times", lambda: None)           # no /proc/stat: the load average
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (2.5, 1.0, 1.0))
    assert threads.busy_cores(sample_s=0.0) == 2.5
    monkeypatch.undo()
    assert 0.0 <= threads.busy_cores(sample_s=0.05) <= (os.cpu_count() or 1) + 1e-6   # the real /proc/stat


@pytest.mark.unit
def test_configure_threads_sets_torch_and_exports_the_count(capsys):
    before = torch.get_num_threads()
    try:
        env = {"LOCAL_SIZE": "2"}
        assert configure_threads(env, affinity={0, 1, 2, 3, 4, 5, 6, 7}, busy=0.0) == 4
        assert torch.get_num_threads() == 4 and env["OMP_NUM_THREADS"] == "4"
        assert capsys.readouterr().err == ""                                   # nothing cut: nothing said
        torch.set_num_threads(3)
        chosen = {"OMP_NUM_THREADS": "3", "LOCAL_SIZE": "2"}
        assert configure_threads(chosen, affinity={0, 1, 2, 3, 4, 5, 6, 7}) == 3     # left as the user set it
        assert chosen["OMP_NUM_THREADS"] == "3"
    finally:
        torch.set_num_threads(before)


@pytest.mark.unit
def test_a_busy_machine_gets_fewer_threads_and_one_line_saying_so(capsys):
    before = torch.get_num_threads()
    try:
        env = {"LOCAL_RANK": "0"}
        assert configure_threads(env, affinity={0, 1}, busy=1.7) == 1 and env["OMP_NUM_THREADS"] == "1"
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "1.7 of the 2 cores busy" in err and "instead of 2" in err, err
        assert "OMP_NUM_THREADS" in err
        configure_threads({"LOCAL_RANK": "1"}, affinity={0, 1}, busy=1.7)     # the node's other ranks stay quiet
        assert capsys.readouterr().err == ""
    finally:
        torch.set_num_threads(before)


@pytest.mark.unit
@pytest.mark.parametrize("user, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_importing_distaff_train_makes_openmp_wait_passively_unless_the_user_chose(user, expected):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | ({"OMP_WAIT_POLICY": user} if user else {})
    code = "import os, distaff.train; print(os.environ['OMP_WAIT_POLICY'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == expected, out.stderr


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_launched_ranks_run_with_their_share_of_the_cores_and_print_no_library_chatter(sample_data, tmp_path_factory, tmp_path):
    """As a user starts it: no OMP_NUM_THREADS, no DS_ACCELERATOR, Python's warnings on."""
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    config = write_config(tmp_path / "run.yaml", data, tmp_path / "run", train={"max_steps": 2})
    env = rank_env(tmp_path)
    for name in ("OMP_NUM_THREADS", "DS_ACCELERATOR", "PYTHONWARNINGS", "DISTAFF_VERBOSE"):
        env.pop(name, None)
    proc = subprocess.run([PYTHON, "-m", "distaff.launch.cli", "launch", "--config", str(config), "--gpus-per-node",
                           "2", "--master-port", str(free_port())], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, run_log(proc)
    expected = max(1, len(os.sched_getaffinity(0)) // 2)
    # torch's own default would be one thread per core of the machine
    assert f"2 rank(s) x {expected} CPU thread(s)" in proc.stdout, run_log(proc)
    output = proc.stdout + proc.stderr
    assert "unable to detect" not in output, run_log(proc)   # DeepSpeed's accelerator guess, once per process
    assert "FutureWarning" not in output, run_log(proc)       # torch's, from DeepSpeed's collectives: --verbose only
    assert "[INFO]" not in output, run_log(proc)              # DeepSpeed's launcher: --verbose only
