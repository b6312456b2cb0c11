"""Test-suite environment: CPU-only defaults that must be set before torch/triton/wandb import."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Triton kernels run on CPU tensors through the interpreter; it must be on before any kernel is
# defined. On a machine with a GPU, leave it unset (the kernels then run on the GPU).
if os.environ.get("DISTAFF_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Session fixtures shared by several test modules (tests/ is on sys.path via setup.cfg).
pytest_plugins = ["data_fixtures", "slurm_cluster"]

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real corpora and labelled set that sit beside the checkout (``../shared/data``)."""
    if not (SHARED_DATA / "corpus").is_dir():
        raise FileNotFoundError(f"real test data not found at {SHARED_DATA}; tests need ../shared/data beside the repo")
    return SHARED_DATA
