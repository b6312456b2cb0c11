"""Test-suite environment: CPU-only defaults that must be set before torch/triton/wandb import."""

from __future__ import annotations

import os
from collections.abc import Iterator
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
# One CPU thread per process: the suite's pytest-xdist workers and the ranks they start share the cores, and a rank's
# "other processes keep N cores busy" notice would otherwise depend on what the other worker runs. The thread
# planning's own tests remove it (tests/run/test_threads.py, tests/test_first_run.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (after the environment above)
from helpers import selected_device  # noqa: E402

# Session fixtures shared by several test modules (tests/ is on sys.path via setup.cfg).
pytest_plugins = ["data_fixtures", "slurm_cluster"]

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE_DATA = REPO_ROOT / "data"
KINDS = ("unit", "integration")
# Fixtures from these support modules make a test timing-sensitive wherever it uses them: such tests are marked
# `serial` here, so a new Slurm test cannot land in scripts/test.sh's parallel phase by forgetting the marker.
SERIAL_FIXTURE_MODULES = ("slurm_cluster",)


@pytest.fixture(scope="session")
def sample_data() -> Path:
    """The real text bundled with the repository (``data/``, provenance in its README)."""
    return SAMPLE_DATA


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device kernel tests put their tensors on: CPU, or CUDA with ``DISTAFF_TEST_GPU=1``."""
    return selected_device()


@pytest.fixture(autouse=True)
def environment_restored() -> Iterator[None]:
    """Each test starts from the environment the session set: code run in-process (a trainer exporting
    ``OMP_NUM_THREADS``) must not change what a later test on the same pytest-xdist worker reads."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session", autouse=True)
def gpu_compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One compile cache for the whole session, so a clean clone compiles each GPU kernel once: the judge, the
    compile check and any other test compiling for sm_80/90/100 (in subprocesses, which inherit the environment)
    read what an earlier one compiled. Under pytest-xdist every worker shares the run's folder. A cache the
    contributor names (``DISTAFF_COMPILE_CACHE``, ``TRITON_CACHE_DIR``) is kept: their next run reuses it."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # popen-gwN/.. : the run's own folder, one per session
    cache = base / "gpu-compile-cache"
    os.environ.setdefault("DISTAFF_COMPILE_CACHE", str(cache / "compile-check"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
    return cache


def _uses_fixture_from(item: pytest.Item, modules: tuple[str, ...]) -> bool:
    fixture_info = getattr(item, "_fixtureinfo", None)
    definitions = fixture_info.name2fixturedefs.values() if fixture_info else ()
    return any(d.func.__module__.rsplit(".", 1)[-1] in modules for defs in definitions for d in defs)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the serial marks added here must count
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # `pytest -m unit` is the fast loop only if no test escapes the split.
    unmarked = [item.nodeid for item in items if sum(item.get_closest_marker(k) is not None for k in KINDS) != 1]
    if unmarked:
        raise pytest.UsageError("each test needs exactly one of the markers unit/integration:\n  "
                                + "\n  ".join(unmarked))
    for item in items:
        if _uses_fixture_from(item, SERIAL_FIXTURE_MODULES):
            item.add_marker(pytest.mark.serial)
    # A serial unit test would leave the fast loop's process for nothing: serial means a timing-sensitive integration.
    serial_units = [item.nodeid for item in items
                    if item.get_closest_marker("serial") and item.get_closest_marker("unit")]
    if serial_units:
        raise pytest.UsageError("the serial marker is for integration tests only:\n  " + "\n  ".join(serial_units))
