"""Fixtures of the launcher tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture()
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A minimal run config ``run.yaml`` in ``tmp_path``, which becomes the working directory."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "run.yaml"
    path.write_text("run:\n  out_dir: out/run1\n  name: run1\ndata:\n  dir: data\ntrain:\n  max_steps: 10\n")
    return path
