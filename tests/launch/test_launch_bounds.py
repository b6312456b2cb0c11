"""Counts and numbers a launch is given, refused with one line through every entry point that reads them (issue 41):

- ranks per node (cause 2): ``--gpus-per-node 1000000`` or ``slots=1000000`` became ``deepspeed --num_gpus
  1000000``, a fork bomb on a CPU node; one bound (``train/core/threads.py``) for launch, slurm and ablate;
- hostfile slots that are not ASCII digits and hostfiles that are not UTF-8 (cause 6);
- launcher variables (cause 7): ``RANK=abc``, ``MASTER_PORT=abc`` gave bare tracebacks naming no variable;
- ``plan --gpu-spec`` values (cause 8): nan and inf were accepted ("8.3 of nan GiB").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distaff.launch import cli
from distaff.train.core.threads import MOST_GPUS_PER_NODE, this_node
from distaff.train.finetune.trainer import main as finetune_main
from distaff.train.pretrain.trainer import main as pretrain_main
from distaff.train.tools.ablate import main as ablate_main

pytestmark = pytest.mark.unit


def _one_line(capsys, prog: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------- cause 2: ranks per node


def test_ranks_per_node_are_bounded_on_every_path_that_starts_them(config: Path, tmp_path: Path, capsys) -> None:
    here, far = this_node().limit + 1, MOST_GPUS_PER_NODE + 1
    one_host, two_hosts = tmp_path / "one", tmp_path / "two"
    one_host.write_text(f"localhost slots={here}\n")
    two_hosts.write_text(f"gpu01 slots=2\ngpu02 slots={far}\n")
    launch = ["launch", "--config", str(config), "--dry-run"]
    cases = [
        (launch + ["--gpus-per-node", str(here)], f"--gpus-per-node {here}: {here} ranks per node, more than the"),
        (launch + ["--gpus-per-node", "1000000"], "1,000,000 ranks per node, more than the"),
        (launch + ["--hostfile", str(one_host)], f"slots={here} of localhost: {here} ranks per node"),
        (launch + ["--hostfile", str(two_hosts)], f"slots={far} of gpu02: {far} ranks per node, more than 16"),
        (launch + ["--hosts", "a,b", "--gpus-per-node", str(far)], f"--gpus-per-node {far}: {far} ranks per node"),
        (["slurm", "submit", "--config", str(config), "--nodes", "2", "--gpus-per-node", "1000000", "--dry-run"],
         "--gpus-per-node 1000000: 1,000,000 ranks per node, more than 16"),
        (["slurm", "submit", "--config", str(config), "--nodes", "1", "--gpus-per-node", "4", "--cpu",
          "--cpus-per-task", "2", "--dry-run"], "more ranks than the node's --cpus-per-task 2"),
    ]
    for argv, message in cases:
        assert cli.main(argv) == 2, argv
        err = _one_line(capsys, f"distaff {argv[0]}")
        assert message in err, err
        assert "--max-ranks-per-node" in err or "--cpus-per-task" in err
    assert not (tmp_path / "out").exists()                       # nothing written, nothing started


def test_the_stated_flag_allows_more_ranks(config: Path, tmp_path: Path, capsys) -> None:
    hosts = tmp_path / "two"
    hosts.write_text("gpu01 slots=32\ngpu02 slots=32\n")
    assert cli.main(["launch", "--config", str(config), "--hostfile", str(hosts), "--max-ranks-per-node", "32",
                     "--dry-run"]) == 0
    assert "gpu01 slots=32\ngpu02 slots=32\n" in capsys.readouterr().out
    assert cli.main(["slurm", "submit", "--config", str(config), "--nodes", "2", "--gpus-per-node", "32", "--cpu",
                     "--max-ranks-per-node", "32", "--dry-run"]) == 0
    assert "--nproc-per-node=32" in capsys.readouterr().out


def test_slurm_gpus_on_node_is_bounded_and_named(config: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    for value, message in (("1000000", "slots=1000000 of n1: 1,000,000 ranks per node"),
                           ("abc", "environment variable SLURM_GPUS_ON_NODE: expected a whole number >= 1, got 'abc'"),
                           ("\u00b2", "SLURM_GPUS_ON_NODE: expected a whole number >= 1, got '\u00b2'")):
        monkeypatch.setenv("SLURM_GPUS_ON_NODE", value)
        assert cli.main(["launch", "--config", str(config), "--dry-run"]) == 2
        assert message in _one_line(capsys, "distaff launch")


def test_ablate_bounds_its_ranks_times_parallel_runs(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    base = tmp_path / "base.yaml"
    base.write_text("run:\n  out_dir: out/base\ndata:\n  dir: data\n")
    ablation = tmp_path / "ablation.yaml"
    ablation.write_text(f"name: a\nbase: {base}\nout_dir: {tmp_path / 'abl'}\ntokens: 1000\nranks: 1000000\n"
                        "variants:\n  - name: v\n    overrides: {}\n")
    assert ablate_main(["--config", str(ablation), "--dry-run"]) == 2
    assert "ranks 1000000 x parallel 1: 1,000,000 ranks per node" in _one_line(capsys, "distaff ablate")


# ---------------------------------------------------------------- cause 6: hostfiles


@pytest.mark.parametrize("raw, message", [
    ("gpu01 slots=\u00b2\n".encode(), "line 1: slots of gpu01: expected a whole number >= 1, got '\u00b2'"),
    ("gpu01 slots=\u0663\n".encode(), "slots of gpu01: expected a whole number >= 1, got '\u0663'"),   # Arabic 3
    (b"gpu01 slots=2\ngpu\xe902 slots=2\n", "line 2, byte 4: byte 0xe9 is not UTF-8"),
    (b"gpu01 slots=2\x00\n", "line 1, byte 14: a NUL byte"),
])
def test_a_hostfile_that_is_not_ascii_digits_or_not_utf8_is_one_line(config: Path, tmp_path: Path, capsys, raw: bytes,
                                                                       message: str) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_bytes(raw)
    assert cli.main(["launch", "--config", str(config), "--hostfile", str(hostfile), "--dry-run"]) == 2
    err = _one_line(capsys, "distaff launch")
    assert f"--hostfile {hostfile}" in err and message in err, err


# ---------------------------------------------------------------- cause 7: launcher variables


@pytest.mark.parametrize("env, name", [
    ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK"), ({"RANK": "0", "WORLD_SIZE": "\u00b2"}, "WORLD_SIZE"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK"), ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "x"}, "LOCAL_RANK"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE"), ({"MASTER_PORT": "abc"}, "MASTER_PORT"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT"), ({"SLURM_PROCID": "-1", "SLURM_NTASKS": "2"}, "SLURM_PROCID"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "two"}, "SLURM_NTASKS"),
])
def test_a_bad_launcher_variable_is_named_by_the_run_and_by_check(config: Path, capsys, monkeypatch, env: dict,
                                                                  name: str) -> None:
    """Both trainers, the run (which refuses before any process group or output folder) and ``--check``."""
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "MASTER_PORT"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in {"OMP_NUM_THREADS": "1", **env}.items():
        monkeypatch.setenv(variable, value)
    for main, prog in ((pretrain_main, "distaff pretrain"), (finetune_main, "distaff finetune")):
        for extra in ([], ["--check"]):
            assert main(["--config", str(config), *extra]) == 2
            err = _one_line(capsys, prog)
            assert f"environment variable {name}: expected a whole number" in err, err
    assert not (config.parent / "out").exists()


# ---------------------------------------------------------------- cause 8: plan --gpu-spec and float options


@pytest.mark.parametrize("spec, message", [
    ("memory_gib=nan", "--gpu-spec memory_gib: expected a finite number > 0, got 'nan'"),
    ("tflops=inf", "--gpu-spec tflops: expected a finite number > 0, got 'inf'"),
    ("hbm_tb_s=-1.6", "--gpu-spec hbm_tb_s: expected a finite number > 0, got '-1.6'"),
    ("intra_gb_s=0", "--gpu-spec intra_gb_s: expected a finite number > 0, got '0'"),
    ("arch=nan", "--gpu-spec arch: expected a whole number >= 1, got 'nan'"),
    ("arch=8.5", "--gpu-spec arch: expected a whole number >= 1, got '8.5'"),
    ("fp32_tflops=1e400", "--gpu-spec fp32_tflops: expected a finite number > 0, got '1e400'"),
])
@pytest.mark.parametrize("json_out", [False, True])
def test_plan_gpu_spec_refuses_nan_inf_and_negatives(capsys, spec: str, message: str, json_out: bool) -> None:
    argv = ["plan", "--config", "tiny-cpu", "--gpus", "2xMI", "--gpu-spec", f"name=MI,{spec}"]
    assert cli.main(argv + (["--json"] if json_out else [])) == 2
    assert message in _one_line(capsys, "distaff plan")


def test_float_options_refuse_nan_in_one_line(capsys) -> None:
    for argv in (["plan", "--config", "tiny-cpu", "--gpus", "2xA100-80GB", "--gemm-efficiency", "nan"],
                 ["data", "prepare", "--input", "x.txt", "--tokenizer", "t", "--seq-len", "64", "--out", "o",
                  "--shard-mb", "inf"],
                 ["tokenizer", "train", "--input", "x.txt", "--vocab-size", "100", "--out", "o",
                  "--character-coverage", "nan"]):
        assert cli.main(argv) == 2
        prog = "distaff data prepare" if argv[0] == "data" else f"distaff {argv[0]}"
        assert "expected a finite number" in _one_line(capsys, prog)


def test_a_good_gpu_spec_still_plans(capsys) -> None:
    assert cli.main(["plan", "--config", "tiny-cpu", "--gpus", "2xMI", "--json", "--gpu-spec",
                     "name=MI,memory_gib=64,tflops=181,arch=90"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["gpu"]["name"] == "MI" and plan["gpu"]["arch"] == 90 and plan["gpu"]["memory_bytes"] == 64 * 1024 ** 3
