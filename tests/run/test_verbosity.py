"""Normal output is distaff's own: the libraries' INFO lines, progress bars and repeated warnings only with
``--verbose`` (anywhere on a command line; inherited by the processes a command starts)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
from tqdm import tqdm

from distaff.launch import launcher
from distaff.launch.run_config import resolve_launch_target
from distaff.train.core import verbosity
from distaff.train.core.verbosity import VERBOSE_ENV, library_chatter_hidden, take_verbose_flag
from distaff.train.run.weights import fp32_state_dict

pytestmark = pytest.mark.unit

CHECKPOINT = Path(__file__).parent / "fixtures" / "checkpoint-bda9efe" / "run" / "checkpoints" / "step-00000004"


@pytest.fixture
def quiet(monkeypatch):
    monkeypatch.delenv(VERBOSE_ENV, raising=False)


def _chatter() -> None:
    print("Processing zero checkpoint ...")
    for _ in tqdm(range(3), desc="Loading checkpoint shards"):
        pass


def test_the_flag_is_taken_from_anywhere_and_passed_to_child_processes(quiet):
    assert take_verbose_flag(["--config", "x", "--verbose", "a=1"]) == ["--config", "x", "a=1"]
    assert os.environ[VERBOSE_ENV] == "1" and verbosity.verbose()
    del os.environ[VERBOSE_ENV]
    assert take_verbose_flag(["--config", "x"]) == ["--config", "x"] and not verbosity.verbose()


def test_library_prints_and_bars_are_hidden_unless_verbose(quiet, capfd, monkeypatch):
    with library_chatter_hidden():
        _chatter()
    assert capfd.readouterr() == ("", "")
    monkeypatch.setenv(VERBOSE_ENV, "1")
    with library_chatter_hidden():
        _chatter()
    shown = capfd.readouterr()
    assert "Processing zero checkpoint" in shown.out and "Loading checkpoint shards" in shown.err


def test_hidden_output_is_shown_when_the_block_fails(quiet, capfd):
    with pytest.raises(RuntimeError), library_chatter_hidden():
        print("the reason it failed")
        raise RuntimeError("boom")
    assert "the reason it failed" in capfd.readouterr().err


def test_weights_from_a_zero_checkpoint_load_without_deepspeeds_prints(quiet, capfd):
    state = fp32_state_dict(CHECKPOINT)
    assert state and all(t.dtype.is_floating_point for t in state.values())
    assert capfd.readouterr() == ("", "")


def test_torch_futurewarnings_from_torch_distributed_are_hidden_unless_verbose(quiet, monkeypatch):
    def warn() -> list:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            verbosity.quiet_torch_warnings()
            warnings.warn_explicit("`all_gather_into_tensor` is deprecated", FutureWarning, "c10d_logger.py", 83,
                                   module="torch.distributed.c10d_logger")
            warnings.warn_explicit("a user's own", FutureWarning, "mine.py", 1, module="mine")
        return [str(w.message) for w in caught]

    assert warn() == ["a user's own"]
    monkeypatch.setenv(VERBOSE_ENV, "1")
    assert len(warn()) == 2


def test_the_deepspeed_launcher_logs_nothing_of_its_own_unless_verbose(quiet, monkeypatch, tmp_path):
    """No "[WARNING] Unable to find hostfile" on a local launch, no "[ERROR] ... exits with return code = 75" after
    a clean Ctrl-C (tests/run/test_interrupt.py runs both); a rank a signal killed is named by ``distaff launch``."""
    monkeypatch.chdir(tmp_path)
    target = resolve_launch_target("tiny-cpu", [])
    quiet_cmd = launcher.deepspeed_command(target, gpus_per_node=2, master_port=29500)
    assert quiet_cmd[quiet_cmd.index("--log_level") + 1] == "critical"
    assert launcher.signal_of(247) == "SIGKILL" and launcher.signal_of(256 - 6) == "SIGABRT"
    assert [launcher.signal_of(code) for code in (0, 1, 2, 75, 76, 137)] == [None] * 6
    monkeypatch.setenv(VERBOSE_ENV, "1")
    loud = launcher.deepspeed_command(target, gpus_per_node=2, master_port=29500)
    assert loud[loud.index("--log_level") + 1] == "info"
