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

import torch  # noqa: E402  (after the environment above)
from helpers import selected_device  # noqa: E402

# Session fixtures shared by several test modules (tests/ is on sys.path via setup.cfg).
pytest_plugins = ["data_fixtures", "slurm_cluster"]

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE_DATA = REPO_ROOT / "data"
KINDS = ("unit", "integration")


@pytest.fixture(scope="session")
def sample_data() -> Path:
    """The real text bundled with the repository (``data/``, provenance in its README)."""
    return SAMPLE_DATA


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device kernel tests put their tensors on: CPU, or CUDA with ``DISTAFF_TEST_GPU=1``."""
    return selected_device()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # `pytest -m unit` is the fast loop only if no test escapes the split.
    unmarked = [item.nodeid for item in items if sum(item.get_closest_marker(k) is not None for k in KINDS) != 1]
    if unmarked:
        raise pytest.UsageError("each test needs exactly one of the markers unit/integration:\n  "
                                + "\n  ".join(unmarked))
