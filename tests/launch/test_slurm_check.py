"""``distaff slurm submit`` runs the run's own ``--check`` before it queues anything, on the suite's real local Slurm
(tests/support/slurm_cluster.py): a run the check refuses exits 2 with the check's line and leaves no job and no
script; ``--no-check`` queues it unchecked. Skipped, with the reason, where Slurm cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_cluster import SlurmCluster

from distaff.launch import cli

pytestmark = pytest.mark.integration


def _jobs(cluster: SlurmCluster, name: str) -> list[str]:
    return cluster.run("squeue", "--noheader", "--name", name, "--format", "%i").stdout.split()


@pytest.mark.timeout(300)
def test_a_run_its_check_refuses_is_not_queued_and_no_check_queues_it(slurm: SlurmCluster, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
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
