"""What the launchers write: hostfile and ``.deepspeed_env`` from a Slurm node list, the sbatch script,
and the dry-run output of ``distaff launch`` / ``distaff slurm submit``. (Running them for real, on a
real Slurm, is tests/launch/test_slurm_e2e.py.)"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distaff.launch import cli
from distaff.launch.launcher import format_deepspeed_env, hosts_from_environment, node_environment, plan_launch
from distaff.launch.run_config import resolve_launch_target
from distaff.launch.script_values import NODE_SCRIPT_END
from distaff.launch.slurm import EXIT_PREEMPTED, EXIT_STALLED, SlurmJobSpec, render_sbatch_script

pytestmark = pytest.mark.unit

NODE_ENV = {
    "NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "ib0,eth0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "WANDB_MODE": "offline", "WANDB_PROJECT": "distaff", "WANDB_API_KEY": "secret-key",
    "HF_HOME": "/shared/cache/hf", "TORCH_EXTENSIONS_DIR": "/shared/cache/torch_ext",
    "PYTHONPATH": "/shared/code", "OMP_NUM_THREADS": "4",
    "HOME": "/home/me", "SLURM_JOB_ID": "77", "TERM": "xterm",
}


@pytest.fixture()
def run_config(tmp_path: Path) -> Path:
    config = tmp_path / "run.yaml"
    config.write_text("run:\n  out_dir: out/run1\n  name: run1\ndata:\n  dir: data/austen\ntrain:\n  max_steps: 10\n")
    return config


@pytest.fixture()
def target(run_config: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(run_config.parent)
    return resolve_launch_target(run_config, ["optim.lr=3e-4"])


def test_target_pins_an_absolute_run_dir(target, run_config: Path) -> None:
    assert target.out_dir == run_config.parent / "out" / "run1"
    assert target.trainer_args() == ["--config", str(run_config), "optim.lr=3e-4", f"run.out_dir={target.out_dir}"]


def test_hostfile_and_deepspeed_env_from_slurm_nodelist(target) -> None:
    env = {**NODE_ENV, "SLURM_JOB_NODELIST": "gpu[01-03,07]", "SLURM_GPUS_ON_NODE": "4"}
    hosts = hosts_from_environment(None, env)
    plan = plan_launch(target, hosts=hosts, gpus_per_node=None, master_port=29600, env=env)
    hostfile, env_file = target.out_dir / "launch" / "hostfile", target.out_dir / "launch" / ".deepspeed_env"
    assert plan.files[hostfile] == "gpu01 slots=4\ngpu02 slots=4\ngpu03 slots=4\ngpu07 slots=4\n"
    assert plan.files[env_file] == (
        "HF_HOME=/shared/cache/hf\nNCCL_DEBUG=INFO\nNCCL_SOCKET_IFNAME=ib0,eth0\nOMP_NUM_THREADS=4\n"
        "PYTHONPATH=/shared/code\nTORCH_EXTENSIONS_DIR=/shared/cache/torch_ext\nTORCH_NCCL_ASYNC_ERROR_HANDLING=1\n"
        "WANDB_MODE=offline\nWANDB_PROJECT=distaff\n")
    assert plan.env["DS_ENV_FILE"] == str(env_file)
    assert plan.command[:3] == [sys.executable, "-m", "deepspeed.launcher.runner"]
    assert plan.command[3:] == [
        "--hostfile", str(hostfile), "--master_addr", "gpu01", "--num_gpus", "4", "--master_port", "29600",
        "--log_level", "critical", "--no_local_rank", "--module", "distaff.train.pretrain", *target.trainer_args()]


def test_deepspeed_reads_our_hostfile(target) -> None:
    from deepspeed.launcher.runner import _parse_hostfile  # the parser `deepspeed --hostfile` uses

    plan = plan_launch(target, hosts=["gpu01", "gpu02", "gpu03", "gpu07"], gpus_per_node=8, master_port=1, env={})
    text = plan.files[target.out_dir / "launch" / "hostfile"]
    assert dict(_parse_hostfile(text.splitlines())) == {"gpu01": 8, "gpu02": 8, "gpu03": 8, "gpu07": 8}


def test_deepspeed_env_lines_survive_deepspeeds_parsing() -> None:
    variables = {"WANDB_TAGS": "a,b", "NCCL_IB_HCA": "mlx5_0:1", "HF_HOME": "/a b/c"}
    lines = format_deepspeed_env(variables).splitlines(keepends=True)
    # deepspeed: key, val = line.split('=', maxsplit=1); val is stripped before `export key=val`
    assert {line.split("=", maxsplit=1)[0]: line.split("=", maxsplit=1)[1].strip() for line in lines} == variables


@pytest.mark.parametrize("value, bad", [("a\nb", "\\n"), ('say "hi"', '"'), ("$HOME/x", "$"), ("`id`", "`")])
def test_deepspeed_env_refuses_values_a_remote_shell_would_change(value: str, bad: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"value of NCCL_X contains ['{bad}'")):
        format_deepspeed_env({"NCCL_X": value})


def test_secrets_never_reach_the_run_dir() -> None:
    chosen = node_environment(NODE_ENV)
    assert "WANDB_API_KEY" not in chosen and "HOME" not in chosen and "SLURM_JOB_ID" not in chosen
    assert chosen["WANDB_MODE"] == "offline"


@pytest.mark.parametrize("name", ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_TOKEN", "WANDB_API_KEY",
                                  "WANDB_ACCESS_TOKEN", "HF_MIRROR_PASSWORD", "NCCL_SECRET", "TRANSFORMERS_AUTH"])
def test_every_credential_like_name_stays_out_of_deepspeed_env(name: str) -> None:
    assert name not in node_environment({**NODE_ENV, name: "credential"})
    assert node_environment({**NODE_ENV, "HF_HOME": "/x"})["HF_HOME"] == "/x"  # families still travel


def test_explicit_env_variables_reach_every_node_and_a_credential_is_refused_by_name(target, capsys) -> None:
    """An explicit --env FOO=bar always travels (not only the listed families); an explicit credential on several
    nodes is refused with what to do instead of being dropped silently; on one node it stays in the environment."""
    assert cli.main(["launch", "--config", str(target.config), "--hosts", "gpu[01-02]", "--dry-run",
                     "--env", "MY_SETTING=1", "--env", "NCCL_DEBUG=INFO"]) == 0
    out = capsys.readouterr().out
    assert "MY_SETTING=1\n" in out and "NCCL_DEBUG=INFO\n" in out
    assert cli.main(["launch", "--config", str(target.config), "--hosts", "gpu[01-02]", "--dry-run",
                     "--env", "EXTRA_API_KEY=s3cret"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("distaff launch: --env EXTRA_API_KEY: a credential (by its name) is never written to "
                          f"{target.out_dir}/launch/.deepspeed_env") and "s3cret" not in err
    single = plan_launch(target, hosts=[], gpus_per_node=1, master_port=1, env={}, extra={"EXTRA_API_KEY": "s3cret"})
    assert single.env["EXTRA_API_KEY"] == "s3cret" and single.files == {}


def test_single_node_needs_no_hostfile(target) -> None:
    plan = plan_launch(target, hosts=[], gpus_per_node=2, master_port=29500, env=NODE_ENV)
    assert plan.files == {} and "DS_ENV_FILE" not in plan.env
    assert plan.command[3:] == ["--num_gpus", "2", "--master_port", "29500", "--log_level", "critical",
                                "--no_local_rank", "--module", "distaff.train.pretrain", *target.trainer_args()]


def test_launch_dry_run_prints_files_and_command_and_writes_nothing(target, capsys, monkeypatch) -> None:
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    assert cli.main(["launch", "--config", str(target.config), "--hosts", "gpu[01-02]", "--gpus-per-node", "8",
                     "--master-port", "29999", "--dry-run", "optim.lr=3e-4"]) == 0
    out = capsys.readouterr().out
    assert f"# {target.out_dir}/launch/hostfile\ngpu01 slots=8\ngpu02 slots=8\n" in out
    assert f"# {target.out_dir}/launch/.deepspeed_env\n" in out and "NCCL_DEBUG=WARN\n" in out
    assert f"DS_ENV_FILE={target.out_dir}/launch/.deepspeed_env " in out
    assert "--hostfile" in out and "--master_addr gpu01 --num_gpus 8 --master_port 29999" in out
    assert not target.out_dir.exists()


def test_launch_rejects_bad_input_with_a_clear_message(run_config: Path, capsys) -> None:
    assert cli.main(["launch", "--config", str(run_config), "--hosts", "gpu[1-", "--dry-run"]) == 2
    assert "hostlist 'gpu[1-'" in capsys.readouterr().err
    assert cli.main(["launch", "--config", str(run_config), "--dry-run", "optim.lrr=1"]) == 2
    assert "optim.lrr" in capsys.readouterr().err


# ---------------------------------------------------------------- sbatch script

def _sbatch_options(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def _srun_command(script: str) -> str:
    """The srun line of the script, its continuation lines joined."""
    return re.search(r"^srun (.*)$", script.replace("\\\n", ""), re.M).group(1)


def test_sbatch_script_for_gpu_nodes(target) -> None:
    spec = SlurmJobSpec(target=target, nodes=4, ranks_per_node=8, partition="gpu", account="proj42",
                        time="2-00:00:00", signal_lead_s=240, sbatch_lines=("--qos=high", "--exclusive"),
                        workdir=Path("/work/dir"), python="/venv/bin/python")
    script = render_sbatch_script(spec)
    log_dir = target.out_dir / "slurm"
    assert _sbatch_options(script) == [
        "--job-name=run1", "--nodes=4", "--ntasks-per-node=1", "--cpus-per-task=8", "--mem-per-cpu=4G",
        f"--output={log_dir}/%x-%j.out", "--open-mode=append", "--requeue", "--signal=USR1@240",
        "--chdir=/work/dir", "--gpus-per-node=8", "--partition=gpu", "--account=proj42", "--time=2-00:00:00",
        "--qos=high", "--exclusive"]
    assert script.startswith("#!/bin/bash\n")
    assert 'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"' in script
    assert "export MASTER_PORT=$((10000 + SLURM_JOB_ID % 20000))" in script
    assert 'export WANDB_RUN_ID="${WANDB_RUN_ID:-${SLURM_CLUSTER_NAME:-slurm}-$SLURM_JOB_ID}"' in script
    assert "restart_count=${SLURM_RESTART_COUNT:-0}" in script
    assert "DS_ACCELERATOR" not in script
    srun = _srun_command(script)
    assert "--ntasks-per-node=1" in srun and f"--output={log_dir}/%x-%j-node%n.out" in srun
    assert "--open-mode=append" in srun
    assert "--kill-on-bad-exit=1" in srun          # a node whose ranks fail ends the step on every node
    torchrun = next(line for line in script.splitlines() if "distaff.launch.node_ranks" in line)
    assert ("/venv/bin/python -m distaff.launch.node_ranks --nproc-per-node=8 --max-restarts=0 --rdzv-backend=c10d "
            "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT") in torchrun
    assert '--rdzv-id="$SLURM_JOB_ID" --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"' in torchrun
    assert f"--module distaff.train.pretrain --config {target.config} optim.lr=3e-4 run.out_dir={target.out_dir}" in torchrun
    assert 'resume=(checkpoint.resume=auto)' in script and '"${resume[@]}"' in torchrun
    # exit 75 on SIGUSR1 (a signal's checkpoint) or 76 (a stall, bounded by --max-requeues) -> the job requeues
    # itself; on SIGTERM Slurm requeues it (or not: a cancel)
    assert re.search(r'elif \[ "\$status" -eq 75 \]; then\n(.*\n){3}\s+scontrol requeue "\$SLURM_JOB_ID"', script)
    assert re.search(r'if \[ "\$status" -eq 76 \] .*; then\n(.*\n){8}\s+scontrol requeue "\$SLURM_JOB_ID"', script)
    assert "trap on_term TERM\n" in script
    assert "max_requeues=3\n" in script and 'if [ "$failed" -le "$max_requeues" ]; then' in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # valid bash


def test_requeue_exit_codes_are_the_trainers() -> None:
    from distaff.train.core.watchdog import EXIT_STALLED as WATCHDOG_EXIT_STALLED
    from distaff.train.pretrain.trainer import EXIT_PREEMPTED as TRAINER_EXIT_PREEMPTED

    assert EXIT_PREEMPTED == TRAINER_EXIT_PREEMPTED == 75 and EXIT_STALLED == WATCHDOG_EXIT_STALLED == 76


def test_cli_and_exit_codes_import_without_torch() -> None:
    """The ``distaff`` entry point imports a subcommand's module only when it runs."""
    check = "import sys, distaff.launch.cli, distaff.train.core.exit_codes; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], check=True)


def test_sbatch_script_for_cpu_nodes(target) -> None:
    script = render_sbatch_script(SlurmJobSpec(target=target, nodes=2, ranks_per_node=1, cpu=True))
    assert not any(option.startswith("--gpus") for option in _sbatch_options(script))
    assert "export DS_ACCELERATOR=cpu\n" in script
    assert "--nproc-per-node=1" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


@pytest.mark.parametrize("workers, ranks, cpus", [(0, 1, 1), (4, 8, 40), (2, 3, 9)])
def test_the_job_and_its_step_request_a_cpu_per_rank_and_per_data_worker(
        run_config: Path, monkeypatch, workers: int, ranks: int, cpus: int) -> None:
    monkeypatch.chdir(run_config.parent)
    target = resolve_launch_target(run_config, [f"data.num_workers={workers}"])
    assert target.data_workers == workers
    script = render_sbatch_script(SlurmJobSpec(target=target, nodes=2, ranks_per_node=ranks))
    options = _sbatch_options(script)
    assert f"--cpus-per-task={cpus}" in options and "--mem-per-cpu=4G" in options
    assert not any(option.startswith(("--mem=", "--exclusive")) for option in options)
    # Slurm >= 22.05: srun does not inherit --cpus-per-task from sbatch
    srun = _srun_command(script)
    assert f"--cpus-per-task={cpus}" in srun
    assert '--nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1' in srun
    assert "os.sched_getaffinity(0)" in script  # each node logs the CPUs its ranks may use


@pytest.mark.parametrize("change, expected, absent", [
    ({"cpus_per_task": 16, "mem": "200G"}, ["--cpus-per-task=16", "--mem=200G"], "--mem-per-cpu"),
    ({"mem_per_cpu": "6000"}, ["--cpus-per-task=1", "--mem-per-cpu=6000"], "--mem="),
    ({"exclusive": True}, ["--mem=0", "--exclusive"], "--mem-per-cpu"),
    ({"exclusive": True, "mem_per_cpu": "8G"}, ["--mem-per-cpu=8G", "--exclusive"], "--mem="),
])
def test_explicit_cpu_memory_and_exclusive_requests(target, change: dict, expected: list[str], absent: str) -> None:
    script = render_sbatch_script(SlurmJobSpec(**{"target": target, "nodes": 1, "ranks_per_node": 1, **change}))
    options = _sbatch_options(script)
    assert set(expected) <= set(options), options
    assert not any(option.startswith(absent) for option in options), options
    assert f"--cpus-per-task={change.get('cpus_per_task', 1)}" in _srun_command(script)


def test_overrides_are_shell_quoted(run_config: Path, monkeypatch) -> None:
    monkeypatch.chdir(run_config.parent)
    target = resolve_launch_target(run_config, ["wandb.tags=[a, $HOME]"])
    script = render_sbatch_script(SlurmJobSpec(target=target, nodes=1, ranks_per_node=1))
    assert "'wandb.tags=[a, $HOME]'" in script


@pytest.mark.parametrize("change, problem", [
    ({"nodes": 0}, "--nodes must be >= 1"), ({"ranks_per_node": 0}, "--gpus-per-node must be >= 1"),
    ({"sbatch_lines": ("qos=high",)}, "expected one sbatch option"),
    ({"sbatch_lines": ("--qos=a\n#SBATCH --x",)}, "contains a control character (U+000A, a newline)"),
    ({"cpus_per_task": 0}, "--cpus-per-task must be >= 1"),
    ({"mem": "64G", "mem_per_cpu": "4G"}, "--mem and --mem-per-cpu exclude each other"),
    ({"mem": "64 GB"}, "--mem '64 GB': expected a Slurm size such as 64G"),
    ({"mem_per_cpu": "-1"}, "--mem-per-cpu '-1': expected a Slurm size"),
    ({"sbatch_lines": ("--no-kill",)}, "fails instead of being requeued; leave it out"),
    ({"sbatch_lines": ("-k",)}, "fails instead of being requeued; leave it out"),
])
def test_bad_job_spec_is_refused(target, change: dict, problem: str) -> None:
    spec = SlurmJobSpec(**{"target": target, "nodes": 1, "ranks_per_node": 1, **change})
    with pytest.raises(ValueError, match=re.escape(problem)):
        render_sbatch_script(spec)


def test_submit_dry_run_prints_script_and_command(target, capsys) -> None:
    argv = ["slurm", "submit", "--config", str(target.config), "--nodes", "2", "--gpus-per-node", "4",
            "--partition", "debug", "--time", "00:30:00", "--sbatch=--qos=low", "--dry-run", "optim.lr=3e-4"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    script_path = target.out_dir / "slurm" / "pretrain.sbatch"
    assert out.startswith(f"# {script_path}\n#!/bin/bash\n")
    assert "#SBATCH --nodes=2\n" in out and "#SBATCH --gpus-per-node=4\n" in out and "#SBATCH --qos=low\n" in out
    assert "#SBATCH --partition=debug\n" in out and "#SBATCH --time=00:30:00\n" in out
    assert out.rstrip().endswith(f"sbatch --parsable {script_path}")
    assert not target.out_dir.exists()  # nothing written, nothing submitted


def test_submit_dry_run_carries_cpu_and_memory_requests(target, capsys) -> None:
    argv = ["slurm", "submit", "--config", str(target.config), "--nodes", "2", "--gpus-per-node", "4",
            "--cpus-per-task", "24", "--mem", "128G", "--exclusive", "--dry-run"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --cpus-per-task=24\n#SBATCH --mem=128G\n" in out and "#SBATCH --exclusive\n" in out
    assert "--cpus-per-task=24 " in _srun_command(out)


def test_a_bad_request_is_one_line_and_exit_2(target, capsys) -> None:
    argv = ["slurm", "submit", "--config", str(target.config), "--nodes", "1", "--gpus-per-node", "1",
            "--mem-per-cpu", "4 GB", "--dry-run"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err == "distaff slurm: --mem-per-cpu '4 GB': expected a Slurm size such as 64G, 4000M or 4000 (MB)\n"
    with pytest.raises(SystemExit) as exit_info:  # argparse: the two memory options exclude each other
        cli.main(argv[:-3] + ["--mem", "1G", "--mem-per-cpu", "1G"])
    assert exit_info.value.code == 2


def test_submit_without_sbatch_says_so(target, capsys, monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert cli.main(["slurm", "submit", "--config", str(target.config), "--nodes", "1", "--gpus-per-node", "1"]) == 1
    assert "sbatch not found" in capsys.readouterr().err


def test_one_name_follows_rank_0s_log_to_whichever_node_holds_it(target, tmp_path: Path) -> None:
    """The batch script names the link and the nodes' logs; rank 0 (train/run/runtime.py) links the one to the
    log of its node, and again at an attempt that puts it on another node."""
    from distaff.train.run.runtime import link_rank0_log

    script = render_sbatch_script(SlurmJobSpec(target=target, nodes=2, ranks_per_node=1, cpu=True))
    lines = re.search(r"^export DISTAFF_RANK0_LOG=.*\nexport DISTAFF_NODE_LOG=.*\necho .*$", script, re.M).group(0)
    shown = subprocess.run(["bash", "-c", f"{lines}\nprintenv DISTAFF_RANK0_LOG DISTAFF_NODE_LOG"], text=True,
                           capture_output=True, check=True, env={"SLURM_JOB_NAME": "run1", "SLURM_JOB_ID": "42"})
    said, link, pattern = shown.stdout.splitlines()
    logs = target.out_dir / "slurm"
    assert (link, pattern) == (f"{logs}/run1-42-rank0.out", f"{logs}/run1-42-node%n.out")
    assert said == f"distaff: rank 0's lines: {link} (a link to the node log that holds them, once rank 0 starts)"
    logs.mkdir(parents=True)
    for node in ("1", "0"):
        (logs / f"run1-42-node{node}.out").write_text(f"step lines of node {node}\n")
        link_rank0_log({"DISTAFF_RANK0_LOG": link, "DISTAFF_NODE_LOG": pattern, "SLURM_NODEID": node})
        assert Path(link).read_text() == f"step lines of node {node}\n"
        assert Path(link).readlink() == Path(f"run1-42-node{node}.out")      # relative: the folder may move
    assert sorted(p.name for p in logs.iterdir()) == ["run1-42-node0.out", "run1-42-node1.out", "run1-42-rank0.out"]
    link_rank0_log({"SLURM_NODEID": "1"})                               # not under such a job: nothing
    assert Path(link).readlink() == Path("run1-42-node0.out")
SRUN_LINES = ("srun: error: n2: task 1: Exited with exit code {code}\n"
              "srun: launch/slurm: _step_signal: Terminating StepId=12.0\n"
              "srun: error: n1: task 0: Killed\n"
              "srun: error: Unable to create step for job 12: Invalid generic resource (gres) specification\n")


@pytest.mark.parametrize(("status", "verbose", "shown"), [
    (EXIT_STALLED, "", [3]), (EXIT_PREEMPTED, "", [3]), (2, "", [3]),    # what the ranks explained: srun's own error
    (EXIT_STALLED, "1", [0, 1, 2, 3]), (1, "", [0, 1, 2, 3])])          # --verbose, or a status nobody explained
def test_the_batch_log_leaves_out_srun_lines_that_restate_an_explained_status(
        target, tmp_path: Path, status: int, verbose: str, shown: list[int]) -> None:
    """The script's show_srun_lines, run by bash on a file of srun's lines."""
    script = render_sbatch_script(SlurmJobSpec(target=target, nodes=2, ranks_per_node=1, cpu=True))
    function = re.search(r"^show_srun_lines\(\) \{\n.*?^\}\n", script, re.M | re.S).group(0)
    lines_file = tmp_path / "srun-lines"
    lines = SRUN_LINES.format(code=status)
    lines_file.write_text(lines)
    shell = subprocess.run(["bash", "-c", f'{function}show_srun_lines "$0" "$1"', str(lines_file), str(status)],
                           env={"PATH": "/usr/bin:/bin", "DISTAFF_VERBOSE": verbose}, capture_output=True, text=True)
    assert shell.returncode == 0 and shell.stdout == ""
    assert shell.stderr.splitlines() == [lines.splitlines()[i] for i in shown]
    assert not lines_file.exists()      # a temporary file of this attempt


def test_a_verbose_submit_writes_verbose_into_the_script(target, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = SlurmJobSpec(target=target, nodes=2, ranks_per_node=1, cpu=True)
    monkeypatch.delenv("DISTAFF_VERBOSE", raising=False)
    assert "DISTAFF_VERBOSE=1" not in render_sbatch_script(spec)
    monkeypatch.setenv("DISTAFF_VERBOSE", "1")     # what `distaff --verbose` sets
    assert "\nexport DISTAFF_VERBOSE=1   # submitted with --verbose" in render_sbatch_script(spec)


def _node_script_with_ranks_exiting(target, tmp_path: Path, status: int, nodes: int = 2, delay: str = "0") -> str:
    """The node script of a ``nodes``-node job whose python is a stand-in: its ranks exit ``status`` after
    ``delay`` seconds (the affinity query answers 1)."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/bash\n[ "$1" = -c ] && {{ echo 1; exit 0; }}\nsleep {delay}\nexit {status}\n')
    python.chmod(0o755)
    script = render_sbatch_script(SlurmJobSpec(target=target, nodes=nodes, ranks_per_node=1, cpu=True,
                                               python=str(python)))
    return script.split(f"<<'{NODE_SCRIPT_END}'\n")[1].split(f"\n{NODE_SCRIPT_END}\n")[0]


# What a node's script finds in a step of job 42 on 2 nodes (plus SLURM_NODEID)
STEP_ENV = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "2", "SLURMD_NODENAME": "n1",
            "MASTER_ADDR": "n1", "MASTER_PORT": "10042"}


@pytest.mark.parametrize("ranks_status", [EXIT_PREEMPTED, EXIT_STALLED, 0])
def test_a_node_that_checkpointed_on_a_signal_leaves_the_others_to_finish_and_the_attempt_says_75(
        target, tmp_path: Path, ranks_status: int) -> None:
    """srun --kill-on-bad-exit ends the step on every node once one exits non-zero: a node whose ranks exited 75
    first used to get a slower node's ranks killed while they exited, and the attempt ended 255, not requeued (seen
    on the suite's local Slurm). Both nodes' scripts, run by bash with a stand-in for their python, exit 0 on 75
    once both have left their mark (node 1 a second after node 0); the batch script's lines after srun read a mark
    back as 75 whatever srun says, but for a stall's 76."""
    node_script = _node_script_with_ranks_exiting(target, tmp_path, ranks_status)
    logs = target.out_dir / "slurm"
    logs.mkdir(parents=True)
    nodes = [subprocess.Popen(["bash", "-c", f"{'sleep 1; ' * int(node)}{node_script}"], text=True,
                              env={**STEP_ENV, "SLURM_NODEID": node}, stdout=subprocess.PIPE) for node in ("0", "1")]
    for node, ran in enumerate(nodes):
        out, _ = ran.communicate(timeout=60)
        assert out.endswith(f"distaff: node {node} ranks exited with {ranks_status}\n"), out
        assert ran.returncode == (0 if ranks_status == EXIT_PREEMPTED else ranks_status)
    marks = sorted(p.name for p in logs.glob(".preempted-*"))
    assert marks == ([".preempted-42-0.node0", ".preempted-42-0.node1"] if ranks_status == EXIT_PREEMPTED else [])

    script = render_sbatch_script(SlurmJobSpec(target=target, nodes=2, ranks_per_node=1, cpu=True))
    marks_line = re.search(r"^preempted_marks=.*$", script, re.M).group(0)
    after_srun = re.search(r"^# A node whose ranks checkpointed.*?\nrm -f .*?\n", script, re.M | re.S).group(0)
    for srun_status in (0, 1, 143, EXIT_STALLED):   # srun's status: a node it ended after the checkpoint, a stall
        if ranks_status == EXIT_PREEMPTED:
            (logs / ".preempted-42-0.node1").touch()
        batch = subprocess.run(["bash", "-c", f'{marks_line}\nstatus={srun_status}\n{after_srun}echo "$status"'],
                               env=STEP_ENV, capture_output=True, text=True, check=True)
        preempted = ranks_status == EXIT_PREEMPTED and srun_status != EXIT_STALLED
        assert batch.stdout == f"{EXIT_PREEMPTED if preempted else srun_status}\n", batch.stderr
        assert not list(logs.glob(".preempted-*"))           # read once: the next attempt starts without them


def test_a_node_whose_peer_never_leaves_its_mark_ends_the_step_after_the_grace(
        target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank frozen after the checkpoint (its node never exits): the node whose ranks exited 75 waits the grace,
    then exits 75, so that srun ends the step there rather than the job waiting for its time limit."""
    monkeypatch.setattr("distaff.launch.slurm.PREEMPTED_GRACE_S", 1)
    node_script = _node_script_with_ranks_exiting(target, tmp_path, EXIT_PREEMPTED)
    (target.out_dir / "slurm").mkdir(parents=True)
    began = time.monotonic()
    ran = subprocess.run(["bash", "-c", node_script], env={**STEP_ENV, "SLURM_NODEID": "0"}, capture_output=True,
                         text=True, timeout=60)
    assert ran.returncode == EXIT_PREEMPTED and 1 <= time.monotonic() - began < 30, ran.stdout + ran.stderr


def test_the_node_reports_its_ranks_status_through_a_storm_of_signals(target, tmp_path: Path) -> None:
    """bash's ``wait`` returns 128 + N when a trapped signal N arrives as the waited command ends, not the command's
    status (a node whose ranks exited 75 as srun ended the step reported -1, the job failed instead of requeueing):
    the node script, under SIGTERM after SIGTERM while a stand-in for its ranks exits 76, still reports 76."""
    node_script = _node_script_with_ranks_exiting(target, tmp_path, EXIT_STALLED, nodes=1, delay="0.5")
    env = {**STEP_ENV, "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0"}
    for _ in range(5):
        node = subprocess.Popen(["bash", "-c", node_script], env=env, stdout=subprocess.PIPE, text=True)
        assert node.stdout.readline() == "distaff: node 0 (n1): 1 CPUs for its ranks\n"    # its traps are set
        signals = 0
        while node.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                node.send_signal(signal.SIGTERM)
            signals += 1
        assert node.stdout.read() == "distaff: node 0 ranks exited with 76\n" and node.returncode == 76, signals
        assert signals > 50       # the signals kept coming until the script had exited
