"""``distaff launch`` and ``distaff slurm submit`` command lines: options anywhere, counts refused when they
cannot be right, an existing deepspeed hostfile used as it is, a warning for a venv the nodes cannot see."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from distaff.launch import cli
from distaff.launch.launcher import plan_launch, read_hostfile
from distaff.launch.run_config import resolve_launch_target
from distaff.launch.slurm import node_local_reason
from distaff.train.core.errors import ConfigError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("count", ["0", "-2"])
def test_zero_or_negative_ranks_per_node_are_refused(config: Path, capsys, count: str) -> None:
    """The red-team case: --gpus-per-node 0 ran one rank."""
    assert cli.main(["launch", "--config", str(config), "--gpus-per-node", count, "--dry-run"]) == 2
    assert capsys.readouterr().err == (f"distaff launch: --gpus-per-node: expected a whole number >= 1 and <= "
                                       f"1,000,000,000, got '{count}'\n")


@pytest.mark.parametrize("port", ["0", "70000"])
def test_a_port_out_of_range_is_refused(config: Path, capsys, port: str) -> None:
    assert cli.main(["launch", "--config", str(config), "--master-port", port, "--dry-run"]) == 2
    assert f"--master-port: expected a whole number >= 1 and <= 65,535, got '{port}'" in capsys.readouterr().err


def test_options_may_follow_the_overrides(config: Path, capsys) -> None:
    """The red-team case: options after the overrides gave "unrecognized arguments"."""
    assert cli.main(["launch", "--config", str(config), "optim.lr=1e-3", "--gpus-per-node", "3", "train.max_steps=5",
                     "--max-ranks-per-node", "3", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--num_gpus 3" in out and "optim.lr=1e-3 train.max_steps=5 run.out_dir=" in out
    assert cli.main(["slurm", "submit", "optim.lr=1e-3", "--config", str(config), "--nodes", "1", "train.max_steps=5",
                     "--gpus-per-node", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --gpus-per-node=2\n" in out and "optim.lr=1e-3 train.max_steps=5 run.out_dir=" in out


def test_slurm_without_a_subcommand_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["slurm"])
    assert info.value.code == 2


# ---------------------------------------------------------------- --hostfile

HOSTFILE = """# our nodes
gpu01 slots=8

gpu02   slots=4   # the small one
"""


def test_a_deepspeed_hostfile_is_read_and_its_slots_kept(config: Path, tmp_path: Path, capsys) -> None:
    from deepspeed.launcher.runner import _parse_hostfile

    hostfile = tmp_path / "hostfile"
    hostfile.write_text(HOSTFILE)
    assert read_hostfile(hostfile) == dict(_parse_hostfile(HOSTFILE.splitlines())) == {"gpu01": 8, "gpu02": 4}
    assert cli.main(["launch", "--config", str(config), "--hostfile", str(hostfile), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "/launch/hostfile\ngpu01 slots=8\ngpu02 slots=4\n" in out
    assert "--master_addr gpu01 --master_port" in out and "--num_gpus" not in out   # deepspeed takes each count
    assert cli.main(["launch", "--config", str(config), "--hostfile", str(hostfile), "--gpus-per-node", "2",
                     "--dry-run"]) == 0
    assert "gpu01 slots=2\ngpu02 slots=2\n" in capsys.readouterr().out


def test_the_plan_line_counts_the_hostfiles_gpus(config: Path, tmp_path: Path, capsys) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("gpu01 slots=8\ngpu02 slots=8\n")
    assert cli.main(["launch", "--config", str(config), "--hostfile", str(hostfile), "--gpu-kind", "A100-80GB",
                     "--dry-run"]) == 0
    assert "distaff launch: plan: 2x8xA100-80GB" in capsys.readouterr().err     # 16 GPUs, as launched


def test_a_one_host_hostfile_runs_here_with_its_slots(config: Path, tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=3\n")
    target = resolve_launch_target(config, [])
    plan = plan_launch(target, hosts=read_hostfile(hostfile), gpus_per_node=None, master_port=29500, env={},
                       max_ranks_per_node=3)
    assert plan.files == {} and plan.command[3:5] == ["--num_gpus", "3"]


@pytest.mark.parametrize("text, problem", [
    ("gpu01 slots=8\ngpu01 slots=8\n", "line 2: gpu01 is listed twice"),
    ("gpu01 slots=0\n", "line 1: slots of gpu01: expected a whole number >= 1, got '0'"),
    ("gpu01 slots=-1\n", "slots of gpu01: expected a whole number >= 1, got '-1'"),
    ("gpu01 slots=two\n", "slots of gpu01: expected a whole number >= 1, got 'two'"),
    ("gpu01 slots=\u00b2\n", "slots of gpu01: expected a whole number >= 1, got '\u00b2'"),
    ("gpu01\n", "line 1: 'gpu01' is not 'HOST slots=N'"),
    ("gpu01 slots=2 extra\n", "is not 'HOST slots=N'"),
    ("gpu;01 slots=2\n", "line 1: host 'gpu;01': not a host name"),
    ("# nothing\n\n", "no hosts in it"),
])
def test_a_bad_hostfile_is_one_line_naming_the_line(config: Path, tmp_path: Path, capsys, text: str,
                                                   problem: str) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(problem)):
        read_hostfile(hostfile)
    assert cli.main(["launch", "--config", str(config), "--hostfile", str(hostfile), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"distaff launch: --hostfile {hostfile}") and err.count("\n") == 1


def test_hostfile_and_hosts_exclude_each_other(config: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["launch", "--config", str(config), "--hostfile", "x", "--hosts", "a,b", "--dry-run"])
    assert info.value.code == 2


def test_a_missing_hostfile_is_one_line(config: Path, capsys) -> None:
    assert cli.main(["launch", "--config", str(config), "--hostfile", "nope", "--dry-run"]) == 2
    assert "nope" in capsys.readouterr().err


# ---------------------------------------------------------------- the venv every node runs

@pytest.mark.parametrize("python, local", [
    ("/tmp/venv/bin/python", "under /tmp"), ("/dev/shm/v/bin/python", "under /dev/shm"),
    ("/var/tmp/x/bin/python", "under /var/tmp"), ("/scratch-on-node/v/bin/python", "under /scratch-on-node"),
    ("/home/me/venv/bin/python", None), ("/shared/proj/.venv/bin/python", None),
])
def test_a_node_local_venv_is_named(python: str, local: str | None) -> None:
    reason = node_local_reason(python, {"TMPDIR": "/scratch-on-node"})
    assert (reason is None) if local is None else (local in reason)


def test_submit_warns_about_a_venv_under_tmp_and_says_where_it_must_live(config: Path, capsys,
                                                                        monkeypatch) -> None:
    import distaff.launch.slurm as slurm

    monkeypatch.setattr(slurm.sys, "executable", "/tmp/venv/bin/python")
    assert cli.main(["slurm", "submit", "--config", str(config), "--nodes", "2", "--gpus-per-node", "1",
                     "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert "warning: every node runs /tmp/venv/bin/python, but it is under /tmp" in captured.err
    assert ("# Every node runs /tmp/venv/bin/python: its venv must be on a filesystem all nodes mount at that same "
            "path.") in captured.out


def test_a_busy_master_port_is_one_line_naming_it(config: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 48: a port another process listens on was a traceback from the ranks; the launcher names it before it
    starts them, and a rank started otherwise (torchrun, a Slurm job) names it too."""
    import socket

    from distaff.train.core import distributed

    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert cli.main(["launch", "--config", str(config), "--master-port", str(port)]) == 2
        assert capsys.readouterr().err == (f"distaff launch: --master-port {port}: already in use on this host "
                                           "(another run, or a process that still holds it); give a free port: "
                                           "distaff launch --master-port N (torchrun: --master-port N)\n")
        assert not (config.parent / "out").exists() or not any((config.parent / "out").rglob("*.json"))
        for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                                LOCAL_RANK="0").items():
            monkeypatch.setenv(name, value)
        with pytest.raises(ConfigError, match=f"^MASTER_PORT {port}: already in use on 127.0.0.1 "):
            distributed.init_distributed(10)


def test_a_port_a_finished_run_left_in_time_wait_is_free() -> None:
    """The rendezvous listens with SO_REUSEADDR, so a port whose last connections wait out TIME_WAIT (a run that
    just ended; ``distaff decay`` relaunching with its parent's recorded port) is free, not "in use"."""
    import socket

    from distaff.train.core.distributed import port_is_free

    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()                  # the listening side closes first: its port holds a TIME_WAIT connection
        client.close()
    assert port_is_free(port)
