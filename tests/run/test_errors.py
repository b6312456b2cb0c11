"""One error style for every ``distaff`` command: bad input is one line ``distaff <command>: ...`` and exit 2
without a traceback (``--debug`` adds it), a run failure one line and exit 1, a bug its traceback and exit 1."""

from __future__ import annotations

import errno
import subprocess
import sys
import time

import pytest

from distaff.launch import cli
from distaff.train.core.errors import DEBUG_ENV, MAX_MESSAGE_CHARS, RunFailure, command_main, shown
from distaff.train.data.errors import DataError
from distaff.train.run.config import ConfigError

@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.setenv(DEBUG_ENV, "0")    # restored after the test, whatever --debug set


def _raising(err: BaseException):
    def body(argv: list[str]) -> int:
        raise err
    return body


@pytest.mark.unit
@pytest.mark.parametrize("err,code,line", [
    (ConfigError("optim.lr: must be positive, got -1"), 2, "distaff x: optim.lr: must be positive, got -1"),
    (DataError("a.tsv:3: empty label"), 2, "distaff x: a.tsv:3: empty label"),
    (PermissionError(errno.EACCES, "Permission denied", "/runs/r"), 2, "distaff x: /runs/r: permission denied"),
    (OSError(errno.EROFS, "Read-only file system", "/ro/run"), 2, "distaff x: /ro/run: read-only file system"),
    (RunFailure("no space left on /runs; step 2 is intact"), 1, "distaff x: no space left on /runs; step 2 is intact"),
    (ZeroDivisionError("division by zero"), 1, "distaff x: failed: ZeroDivisionError: division by zero"),
    # issue 41: a write refused by the file-size limit (or a full disk) says so, in one line, without a traceback
    (OSError(errno.EFBIG, "File too large", "/runs/s.tar"), 1,
     "distaff x: /runs/s.tar: a file reached the file-size limit (`ulimit -f`; raise it, e.g. ulimit -f unlimited)"),
    (OSError(errno.ENOSPC, "No space left on device", "/runs/s.tar"), 1, "distaff x: /runs/s.tar: no space left"),
])
def test_each_kind_of_error_is_one_line_with_its_exit_status(err, code, line, capsys):
    assert command_main("distaff x", _raising(err), []) == code
    err_text = capsys.readouterr().err
    assert err_text.splitlines()[-1] == line
    assert ("Traceback" in err_text) == (code == 1 and not isinstance(err, (RunFailure, OSError)))


@pytest.mark.unit
def test_debug_anywhere_prints_the_traceback_of_bad_input_too(capsys):
    seen = []
    assert command_main("distaff x", lambda argv: seen.append(argv) or 0, ["a", "--debug", "b"]) == 0
    assert seen == [["a", "b"]]                                    # the flag is not the command's
    assert command_main("distaff x", _raising(ConfigError("k: bad")), ["--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.splitlines()[-1] == "distaff x: k: bad"


@pytest.mark.unit
def test_a_huge_value_is_never_formatted_whole():
    bomb: list = ["x"]
    for _ in range(40):                                            # 2^40 leaves if expanded
        bomb = [bomb, bomb]
    started = time.process_time()                                  # CPU time: the machine's load does not count
    text = shown(bomb)
    assert time.process_time() - started < 0.5 and len(text) < 200
    assert len(shown("y" * 10_000_000)) < 100


@pytest.mark.unit
def test_a_long_message_is_cut_in_the_middle(capsys):
    command_main("distaff x", _raising(ConfigError("start " + "z" * 50_000 + " end; do this")), [])
    line = capsys.readouterr().err.strip()
    assert len(line) < MAX_MESSAGE_CHARS + 100
    assert line.startswith("distaff x: start zzz") and line.endswith("end; do this") and "characters ...]" in line


@pytest.mark.unit
def test_a_multi_line_message_of_bad_input_is_one_line(capsys):
    command_main("distaff x", _raising(DataError("a.yaml: not valid YAML:\n  line 3\n  column 2")), [])
    assert capsys.readouterr().err == "distaff x: a.yaml: not valid YAML: line 3 column 2\n"


@pytest.mark.unit
@pytest.mark.parametrize("argv,prefix", [
    (["export-hf", "{tmp}/none", "{tmp}/out"], "distaff export-hf: "),
    (["grow", "{tmp}/none", "{tmp}/out", "--num-layers", "4"], "distaff grow: "),
    (["embed", "--model", "{tmp}/none", "--input", "{tmp}/in.txt", "--out", "{tmp}/out"], "distaff embed: "),
    (["ablate", "--config", "{tmp}/none.yaml"], "distaff ablate: "),
    (["tokenizer", "train", "--input", "{tmp}/none.txt", "--vocab-size", "100", "--out", "{tmp}/tok"],
     "distaff tokenizer: "),
    (["data", "prepare", "--input", "{tmp}/none.txt", "--tokenizer", "{tmp}/tok", "--seq-len", "64",
      "--out", "{tmp}/d"], "distaff data prepare: "),
    (["pretrain", "--config", "{tmp}/none.yaml"], "distaff pretrain: "),
    (["finetune", "--config", "{tmp}/none.yaml"], "distaff finetune: "),
    (["launch", "--config", "{tmp}/none.yaml"], "distaff launch: "),
    (["slurm", "submit", "--config", "{tmp}/none.yaml", "--nodes", "1", "--gpus-per-node", "1"], "distaff slurm: "),
])
def test_every_command_reports_bad_input_in_the_one_style(argv, prefix, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("a text\n")
    try:
        code = cli.main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    except SystemExit as exit_:                                    # distaff slurm leaves through SystemExit
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(prefix) and "Traceback" not in err, err
    assert str(tmp_path) in err                                    # it names the path it could not use


@pytest.mark.integration
def test_the_installed_entry_point_exits_2_and_debug_adds_the_traceback(tmp_path):
    command = [sys.executable, "-m", "distaff.launch.cli", "export-hf", str(tmp_path / "none"), str(tmp_path / "o")]
    plain = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 2 and plain.stderr.startswith("distaff export-hf: ") and "Traceback" not in plain.stderr
    debug = subprocess.run([*command[:3], "--debug", *command[3:]], capture_output=True, text=True, timeout=120)
    assert debug.returncode == 2 and "Traceback" in debug.stderr
    assert debug.stderr.splitlines()[-1] == plain.stderr.strip()
