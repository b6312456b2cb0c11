"""The output-directory lock: one holder at a time, a refusal that names it, a lock freed with its holder."""

from __future__ import annotations

import os
import socket

import pytest

from distaff.train.config import ConfigError
from distaff.train.runlock import LOCK_FILE, DirLock

pytestmark = pytest.mark.unit


def test_a_held_directory_is_refused_naming_the_holder_and_freed_after(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with DirLock(tmp_path / "out", "run.out_dir"):
        assert (tmp_path / "out" / LOCK_FILE).is_file()
        with pytest.raises(ConfigError, match=f"run.out_dir: .* is in use by pid {os.getpid()} on "
                                              f"{socket.gethostname()}, Slurm job 4242, started 20"):
            DirLock(tmp_path / "out", "run.out_dir")
    with DirLock(tmp_path / "out", "run.out_dir"):       # released: the next holder takes it over
        pass
