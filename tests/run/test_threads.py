"""CPU threads per rank: the cores of the process's affinity shared by the ranks of its node, unless the user set
``OMP_NUM_THREADS``; and a rank started by ``distaff launch`` really runs with that many."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from distaff.train.core.distributed import free_port
from distaff.train.core.threads import configure_threads, local_world_size, planned_threads, threads_per_rank
from pretrain_fixtures import PYTHON, prepare_data, rank_env, run_log, write_config


@pytest.mark.unit
@pytest.mark.parametrize("env, ranks", [
    ({}, 1),
    ({"LOCAL_WORLD_SIZE": "4"}, 4),                              # torchrun
    ({"LOCAL_SIZE": "2"}, 2),                                    # the deepspeed launcher
    ({"SLURM_NTASKS_PER_NODE": "8"}, 8),                         # srun --ntasks-per-node
    ({"LOCAL_WORLD_SIZE": "2", "SLURM_NTASKS_PER_NODE": "1"}, 2),  # torchrun inside a one-task-per-node job
    ({"LOCAL_WORLD_SIZE": "", "LOCAL_SIZE": "0", "SLURM_NTASKS_PER_NODE": "2(x3)"}, 1),  # unusable values
])
def test_local_world_size_comes_from_the_launcher(env, ranks):
    assert local_world_size(env) == ranks


@pytest.mark.unit
@pytest.mark.parametrize("cores, ranks, threads", [(2, 2, 1), (2, 1, 2), (16, 8, 2), (16, 3, 5), (1, 4, 1), (4, 0, 4)])
def test_threads_per_rank_is_an_even_share_and_at_least_one(cores, ranks, threads):
    assert threads_per_rank(cores, ranks) == threads


@pytest.mark.unit
def test_planned_threads_divide_the_affinity_unless_the_user_chose():
    assert planned_threads({"LOCAL_WORLD_SIZE": "2"}, affinity={0, 1, 2, 3, 4, 5}) == 3
    assert planned_threads({}, affinity={3, 7}) == 2
    assert planned_threads({"OMP_NUM_THREADS": "5", "LOCAL_WORLD_SIZE": "2"}, affinity={0, 1, 2, 3}) is None
    assert planned_threads({}) == len(os.sched_getaffinity(0))


@pytest.mark.unit
def test_configure_threads_sets_torch_and_exports_the_count():
    before = torch.get_num_threads()
    try:
        env = {"LOCAL_SIZE": "2"}
        assert configure_threads(env, affinity={0, 1, 2, 3, 4, 5, 6, 7}) == 4
        assert torch.get_num_threads() == 4 and env["OMP_NUM_THREADS"] == "4"
        torch.set_num_threads(3)
        chosen = {"OMP_NUM_THREADS": "3", "LOCAL_SIZE": "2"}
        assert configure_threads(chosen, affinity={0, 1, 2, 3, 4, 5, 6, 7}) == 3     # left as the user set it
        assert chosen["OMP_NUM_THREADS"] == "3"
    finally:
        torch.set_num_threads(before)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_launched_ranks_run_with_their_share_of_the_cores_and_warn_once(sample_data, tmp_path_factory, tmp_path):
    """As a user starts it: no OMP_NUM_THREADS, no DS_ACCELERATOR, Python's warnings on."""
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    config = write_config(tmp_path / "run.yaml", data, tmp_path / "run", train={"max_steps": 2})
    env = rank_env(tmp_path)
    for name in ("OMP_NUM_THREADS", "DS_ACCELERATOR", "PYTHONWARNINGS"):
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
    assert output.count("FutureWarning") <= 1, run_log(proc)  # torch's, from DeepSpeed's collectives: rank 0 only
