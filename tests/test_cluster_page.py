"""docs/cluster.md stays true: every ``distaff`` command in its bash blocks runs here, on a slice of the bundled
text, and prints the lines the page shows after it (``...`` there stands for any text, ``$WORK`` for the folder
the page works in). Run as the page has them, but: the tokenizer with a vocabulary the slice can fill,
``slurm submit`` with ``--dry-run`` (only its plan line is compared: the rest is the real job's), ``export-hf``
on a bundled checkpoint standing in for the trained run. The other commands (git, squeue, wandb ...) are the
cluster's: only their names are checked, so a new ``distaff`` command cannot hide among them."""

from __future__ import annotations

import glob
import gzip
import os
import re
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from distaff.launch import cli

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "cluster.md"
FIXTURE_RUN = REPO / "tests" / "run" / "fixtures" / "checkpoint-bda9efe" / "run"
OTHER_COMMANDS = {"cd", "git", "bash", "source", "export", "aws", "squeue", "tail", "tensorboard", "wandb"}
EVERY_LINE: Callable[[str], bool] = lambda line: True


def page_commands(text: str) -> list[tuple[str, list[str]]]:
    """(command, the output lines shown after it) for each ``$ `` line of the page's bash blocks; a line ending in
    ``\\`` goes on on the next."""
    commands: list[tuple[str, list[str]]] = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines = iter(block.splitlines())
        for line in lines:
            if line.startswith("$ "):
                command = line[2:]
                while command.endswith("\\"):
                    command = command[:-1].rstrip() + " " + next(lines).strip()
                commands.append((command, []))
            else:
                assert commands, f"output before any command in {block!r}"
                commands[-1][1].append(line)
    return commands


def shown(expected: str, work: Path) -> re.Pattern:
    """A line the page shows, as a pattern: ``...`` matches any text."""
    line = expected.replace("$WORK", str(work))
    return re.compile(".*".join(re.escape(part) for part in line.split("...")))


def as_run_here(argv: list[str]) -> tuple[list[str], Callable[[str], bool]]:
    """The command as this test runs it, and which of the page's lines after it it must print."""
    if argv[1:3] == ["tokenizer", "train"]:
        return [*argv, "--vocab-size", "1000"], EVERY_LINE        # the slice cannot fill 128,000 pieces
    if argv[1:3] == ["slurm", "submit"]:
        return [*argv, "--dry-run"], lambda line: line.startswith("distaff slurm: plan: ")
    if argv[1] == "export-hf":       # the trained run: a bundled one stands in
        shutil.copytree(FIXTURE_RUN, argv[2])
    return argv, EVERY_LINE


def _words(command: str) -> list[str]:
    argv = shlex.split(os.path.expandvars(command))
    return [found for arg in argv for found in (sorted(glob.glob(arg)) if "*" in arg else [arg])]


def test_every_distaff_command_of_the_cluster_page_runs_and_prints_what_the_page_shows(
        sample_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd) -> None:
    work = tmp_path / "work"
    (work / "text").mkdir(parents=True)
    with gzip.open(sample_data / "austen-emma-pride.txt.gz", "rt") as source, \
            gzip.open(work / "text" / "austen.txt.gz", "wt") as slice_:
        slice_.write(source.read(300_000))
    monkeypatch.setenv("WORK", str(work))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(work)
    ran = []
    for command, expected in page_commands(PAGE.read_text()):
        segments = [segment.split()[0] for segment in command.split("&&")]
        if segments[0] != "distaff":
            assert set(segments) <= OTHER_COMMANDS, f"{command}: say in this test how to run it"
            if segments == ["export"]:     # the page's variables, for the commands after it
                for pair in _words(command)[1:]:
                    monkeypatch.setenv(*pair.split("=", 1))
            continue
        argv, compared = as_run_here(_words(command))
        code = cli.main(argv[1:])
        out, err = capfd.readouterr()
        printed = (out + err).splitlines()
        assert code == 0, f"{command}\n{out}{err}"
        for line in filter(compared, expected):
            assert any(shown(line, work).fullmatch(got) for got in printed), f"{command}: no line {line!r}\n{out}{err}"
        ran.append(argv[1])
    assert set(ran) == {"presets", "tokenizer", "data", "plan", "pretrain", "slurm", "export-hf"}, ran
