"""Every number on a ``distaff`` command line goes through one bounded parser (issue 48, cause 4): finite, within
its range, a one-line error naming the option and the value, exit 2; the range is in the option's ``--help`` line.
No command parses a number with argparse's bare ``int`` or ``float``, which take nan, inf and numbers too large for
the arithmetic they reach (a huge ``--max-requeues`` broke the batch script's shell arithmetic)."""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
from pathlib import Path

import pytest

from distaff.launch import cli
from distaff.launch.slurm import MAX_REQUEUES
from distaff.train.core.errors import NumberArg

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("train", "launch")       # what the distaff commands are made of (kernels/ holds no command)


def _bare_number_types(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            for keyword in node.keywords:
                if keyword.arg == "type" and isinstance(keyword.value, ast.Name) and keyword.value.id in ("int",
                                                                                                          "float"):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_no_option_is_parsed_by_a_bare_int_or_float():
    sources = sorted(p for root in SOURCES for p in (REPO / root).rglob("*.py"))
    assert sources
    assert [where for path in sources for where in _bare_number_types(path)] == []


def _number_options(command: str) -> list[argparse.Action]:
    """Every number option of ``distaff COMMAND``'s parsers (subcommands' included), as ``--help`` builds them."""
    made: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    argparse.ArgumentParser.__init__ = recording
    try:
        with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit):
            importlib.import_module(cli.COMMANDS[command][0]).main(["--help"])
    finally:
        argparse.ArgumentParser.__init__ = original
    return [action for parser in made for action in parser._actions if isinstance(action.type, NumberArg)]


@pytest.mark.parametrize("command", sorted(set(cli.COMMANDS) - {"presets"}))
def test_every_number_option_shows_its_range_in_its_help(command):
    options = _number_options(command)
    assert options or command == "export-hf"         # the one command without a number option
    for action in options:
        assert action.help == argparse.SUPPRESS or action.type.range in action.help, (command, action.option_strings)


BAD = [
    (["plan", "--config", "tiny-cpu", "--gpus", "2xA100-80GB", "--tokens", "inf"],
     "distaff plan: --tokens: expected a finite count of at least 1 token and at most 1e+18 (1M T), got 'inf'"),
    (["plan", "--config", "tiny-cpu", "--gpus", "2xA100-80GB", "--tokens", "nan"], "got 'nan'"),
    (["plan", "--config", "tiny-cpu", "--gpus", "2xA100-80GB", "--nodes", "1e9"],
     "distaff plan: --nodes: expected a whole number >= 1 and <= 100,000, got '1e9'"),
    (["plan", "--config", "tiny-cpu", "--gpus", "100000000000000000000xA100-80GB"],
     "distaff plan: --gpus: expected COUNTxKIND per node (e.g. 8xA100-80GB), a COUNT of 1 to 4,096, got "),
    (["plan", "--config", "tiny-cpu", "--gpus", "2xA100-80GB", "--zero", "4"],
     "distaff plan: --zero: expected a whole number >= 0 and <= 3, got '4'"),
    (["slurm", "submit", "--config", "tiny-cpu", "--nodes", "1", "--gpus-per-node", "1", "--dry-run",
      "--max-requeues", "99999999999999999999"],
     f"distaff slurm: --max-requeues: expected a whole number >= 0 and <= {MAX_REQUEUES:,}, got "
     "'99999999999999999999'"),
    (["slurm", "submit", "--config", "tiny-cpu", "--nodes", "1", "--gpus-per-node", "1", "--dry-run",
      "--signal-lead", "-5"], "distaff slurm: --signal-lead: expected a whole number >= 1 and <= 65,535, got '-5'"),
    (["launch", "--config", "tiny-cpu", "--master-port", "70000", "--dry-run"],
     "distaff launch: --master-port: expected a whole number >= 1 and <= 65,535, got '70000'"),
    (["decay", "run", "--from", "²", "--steps", "10"], "distaff decay: --from: expected a whole number >= 0"),
    (["data", "prepare", "--input", "x.txt", "--tokenizer", "t", "--seq-len", "64", "--out", "o",
      "--heldout-fraction", "1"], "distaff data prepare: --heldout-fraction: expected a finite number >= 0 and < 1, got '1'"),
    (["tokenizer", "train", "--input", "x.txt", "--vocab-size", "100", "--out", "o", "--threads", "0"],
     "distaff tokenizer: --threads: expected a whole number >= 1"),
    (["average", "ckpt", "--out", "o", "--ema", "inf"], "distaff average: --ema: expected a finite number >= 0 and < 1"),
    (["grow", "m", "o", "--hidden-size", str(10**12)], "distaff grow: --hidden-size: expected a whole number >= 1"),
    (["embed", "--model", "m", "--input", "i", "--out", "o", "--batch-size", "0"], "--batch-size: expected a whole"),
    (["probe", "--text", "t", "--model", "m", "--out", "o", "--finetune", "1"], "--finetune: expected a whole number"),
    (["evals", "run", "--nice", "20"], "distaff evals: --nice: expected a whole number >= 0 and <= 19, got '20'"),
    (["ablate", "--config", "a.yaml", "--max-ranks-per-node", "0"], "distaff ablate: --max-ranks-per-node: expected"),
    (["pretrain", "--config", "tiny-cpu", "--local_rank", "nan"], "distaff pretrain: --local_rank: expected a whole"),
]


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(argv[:1] + argv[-2:]) for argv, _ in BAD])
def test_a_bad_number_is_one_line_naming_the_option_and_value(capsys, argv, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "usage:" not in err, err
    assert message in err, err
