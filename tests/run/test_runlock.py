"""The output-directory lock: one holder at a time, a refusal that names it, a lock freed with its holder."""

from __future__ import annotations

import os
import socket

import pytest

from distaff.train.core.runlock import LOCK_FILE, DirLock
from distaff.train.run.config import ConfigError

pytestmark = pytest.mark.unit


def test_a_requeued_slurm_job_takes_over_the_lock_its_hung_earlier_attempt_still_holds(tmp_path, monkeypatch,
                                                                                      capsys):
    """A node that hangs keeps its rank's lock; the job's next attempt (same job id, higher restart count)
    replaces it. Another job, or the same attempt, is still refused."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    hung = DirLock(tmp_path / "out", "run.out_dir")                        # held and never released
    for job, attempt in (("4242", "0"), ("777", "1")):
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.setenv("SLURM_RESTART_COUNT", attempt)
        with pytest.raises(ConfigError, match="is in use by pid .* Slurm job 4242"):
            DirLock(tmp_path / "out", "run.out_dir")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with DirLock(tmp_path / "out", "run.out_dir"):
        assert "an earlier attempt of this job that Slurm has ended" in capsys.readouterr().err
        assert '"slurm_restart": 1' in (tmp_path / "out" / LOCK_FILE).read_text()
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [LOCK_FILE]
        monkeypatch.setenv("SLURM_JOB_ID", "777")                           # the new holder excludes the others
        with pytest.raises(ConfigError, match="is in use by pid .* Slurm job 4242"):
            DirLock(tmp_path / "out", "run.out_dir")
    del hung


def test_a_held_directory_is_refused_naming_the_holder_and_freed_after(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with DirLock(tmp_path / "out", "run.out_dir"):
        assert (tmp_path / "out" / LOCK_FILE).is_file()
        with pytest.raises(ConfigError, match=f"run.out_dir: .* is in use by pid {os.getpid()} on "
                                              f"{socket.gethostname()}, Slurm job 4242, started 20"):
            DirLock(tmp_path / "out", "run.out_dir")
    with DirLock(tmp_path / "out", "run.out_dir"):       # released: the next holder takes it over
        pass


@pytest.mark.parametrize("where", ["file", "sys"])
def test_a_folder_that_cannot_be_written_is_a_config_error_naming_it(tmp_path, where):
    """A path under a regular file, or in a filesystem that refuses even root (sysfs), is refused by name."""
    if where == "file":
        (tmp_path / "a-file").write_text("x")
        folder, reason = tmp_path / "a-file" / "run", "not a directory"
    else:
        folder, reason = __import__("pathlib").Path("/sys/distaff-test-run"), "operation not permitted"
    with pytest.raises(ConfigError, match=rf"run.out_dir: {folder} cannot be written \({reason}\); choose a folder "
                                          "this user can write"):
        DirLock(folder, "run.out_dir")
