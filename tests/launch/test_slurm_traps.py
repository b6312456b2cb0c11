"""The small traps of a Slurm job, closed, on the suite's real local Slurm (tests/support/slurm_cluster.py):
``distaff slurm submit`` runs the run's own ``--check`` before it queues anything (a run the check refuses exits 2
with the check's line and leaves no job and no script; ``--no-check`` queues it unchecked), and one name follows
rank 0's lines to the node log that holds them. Skipped, with the reason, where Slurm cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretrain_fixtures import prepare_data, write_config
from slurm_cluster import SlurmCluster

from distaff.launch import cli

pytestmark = pytest.mark.integration


def _submit_env(cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))      # sbatch exports our environment to the job
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-home"))
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)


def _jobs(cluster: SlurmCluster, name: str) -> list[str]:
    return cluster.run("squeue", "--noheader", "--name", name, "--format", "%i").stdout.split()


@pytest.mark.timeout(300)
def test_a_run_its_check_refuses_is_not_queued_and_no_check_queues_it(slurm: SlurmCluster, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    _submit_env(slurm, tmp_path, monkeypatch)
    config = tmp_path / "run.yaml"
    config.write_text("run: {out_dir: out, name: checked-first}\ndata: {dir: no-such-shards}\n"
                      "train: {max_steps: 5}\nwandb: {mode: disabled}\n")
    submit = ["slurm", "submit", "--config", str(config), "--nodes", "1", "--gpus-per-node", "1", "--cpu",
              "--mem-per-cpu=1G", "--time", "1"]
    assert cli.main(submit) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith("distaff slurm: the run's --check refused it, nothing submitted: ") and \
        "no-such-shards" in err and err.endswith("; fix it, or give --no-check to submit without the check\n")
    assert _jobs(slurm, "checked-first") == [] and not (tmp_path / "out" / "slurm" / "pretrain.sbatch").exists()

    assert cli.main([*submit, "--no-check"]) == 0
    job_id = capsys.readouterr().out.strip()
    try:
        assert job_id.isdigit() and job_id in _jobs(slurm, "checked-first")
    finally:
        slurm.run("scancel", job_id, check=False)


@pytest.mark.timeout(600)
def test_the_batch_log_names_the_link_that_follows_rank_0s_lines(slurm: SlurmCluster, sample_data: Path,
                                                                  tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys) -> None:
    data = prepare_data(tmp_path / "data", sample_data)
    config = write_config(tmp_path / "run.yaml", data, tmp_path / "rank0-log", train={"max_steps": 3},
                          wandb={"mode": "offline"}, logging={"every": 1, "progress_bar": False})
    _submit_env(slurm, tmp_path, monkeypatch)
    assert cli.main(["slurm", "submit", "--config", str(config), "--nodes", "2", "--gpus-per-node", "1", "--cpu",
                     "--mem-per-cpu=1G"]) == 0
    job_id = capsys.readouterr().out.strip()
    logs = tmp_path / "rank0-log" / "slurm"
    assert slurm.wait_for(job_id, {"COMPLETED"}, timeout=500) == "COMPLETED", \
        "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(logs.glob("*.out")))
    link = logs / f"rank0-log-{job_id}-rank0.out"
    assert f"distaff: rank 0's lines: {link} (a link to the node log" in (logs / f"rank0-log-{job_id}.out").read_text()
    holder = link.readlink()
    assert holder.name in {f"rank0-log-{job_id}-node0.out", f"rank0-log-{job_id}-node1.out"}
    assert "step 3/3" in link.read_text()                     # rank 0's step lines, whichever node it ran on
    other = ({f"rank0-log-{job_id}-node0.out", f"rank0-log-{job_id}-node1.out"} - {holder.name}).pop()
    assert "step 3/3" not in (logs / other).read_text()
