"""Hostile values in every field that reaches a generated file or a remote command: the sbatch script (read
back the way sbatch and bash read it), the deepspeed hostfile, ``.deepspeed_env`` and the command line
deepspeed's pdsh runner sends to the other nodes (rebuilt with deepspeed's own code and run by bash).

A value with a newline (or any control character) is refused naming its field; a space and the shell's
metacharacters either round-trip unchanged or, where the reader cannot take them, are refused."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from distaff.launch import cli
from distaff.launch.launcher import format_deepspeed_env, plan_launch, read_hostfile
from distaff.launch.run_config import resolve_launch_target
from distaff.launch.script_values import sbatch_word, slurm_time
from distaff.launch.slurm import SlurmJobSpec, render_sbatch_script
from distaff.train.core.errors import ConfigError

pytestmark = pytest.mark.unit

# each must come back unchanged from sbatch's and bash's reading of the script
HOSTILE = ["two words", "a;touch INJECTED", "$(touch INJECTED)", "`touch INJECTED`", "it's", 'say "hi"',
           "back\\slash", "hash#tag", "50%x", "*", "[x]"]
NEWLINES = ["a\ntouch INJECTED", "a\r\nb", "nul\0byte", "tab\there", "line\u2028sep"]


def sbatch_arguments(script: str) -> list[str]:
    """The options sbatch reads from a script's ``#SBATCH`` lines: Slurm's ``_get_argument`` (src/sbatch/opt.c),
    ported: whitespace separates, ``"``/``'`` group, ``\\`` escapes, an unquoted ``#`` ends the line; the
    header ends at the first line that is not a comment."""
    arguments = []
    for line in script.splitlines()[1:]:
        if not line.lstrip().startswith("#"):
            break
        if not line.startswith("#SBATCH"):
            continue
        text, i = line[len("#SBATCH"):], 0
        while i < len(text):
            while i < len(text) and text[i].isspace():
                i += 1
            word, quote, escape, started = "", "", False, False
            while i < len(text) and (quote or not text[i].isspace()):
                char, i, started = text[i], i + 1, True
                if escape:
                    word, escape = word + char, False
                elif char == "\\":
                    escape = True
                elif quote:
                    quote, word = ("", word) if char == quote else (quote, word + char)
                elif char in "\"'":
                    quote = char
                elif char == "#":
                    i = len(text)
                    break
                else:
                    word += char
            assert not quote, f"unmatched quote in {line!r}"
            if started and word:
                arguments.append(word)
    return arguments


def _options(script: str) -> dict[str, str]:
    return dict(arg.removeprefix("--").partition("=")[::2] for arg in sbatch_arguments(script))


def torchrun_argv(script: str) -> list[str]:
    """The per-node torchrun command as bash splits it (the line after its subshell's traps, in the node heredoc)."""
    line = re.search(r"^trap '' USR1 TERM\n(.*)$", script, re.M).group(1)
    return shlex.split(line.replace('"${resume[@]}"', ""))


def _config(tmp: Path, name: str = "run1", out_dir: str = "out/run1") -> Path:
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump({"run": {"out_dir": out_dir, "name": name}, "data": {"dir": "data"},
                                    "train": {"max_steps": 10}}))
    return path


@pytest.fixture()
def target(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return resolve_launch_target(_config(tmp_path), ["optim.lr=3e-4"])


def _script(target, **change) -> str:
    script = render_sbatch_script(SlurmJobSpec(**{"target": target, "nodes": 2, "ranks_per_node": 4, **change}))
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)   # bash parses it
    return script


def test_sbatch_reader_port_matches_slurms_rules() -> None:
    assert sbatch_arguments('#!/bin/bash\n#SBATCH --a="x y" --b=\'p q\' --c=r\\ s --d=e#f\n#SBATCH --g\necho\n'
                            '#SBATCH --never') == ["--a=x y", "--b=p q", "--c=r", "s", "--d=e", "--g"]   # Slurm: "\ " does not join


@pytest.mark.parametrize("value", HOSTILE)
@pytest.mark.parametrize("field", ["partition", "account", "job_name"])
def test_option_values_round_trip_through_sbatch(target, field: str, value: str) -> None:
    clean = _options(_script(target))
    options = _options(_script(target, **{field: value}))
    name = field.replace("_", "-")
    assert options[name] == value
    assert set(options) == set(clean) | {name}          # every other #SBATCH line still read: none swallowed
    assert options["requeue"] == "" and options["signal"] == "USR1@300"


@pytest.mark.parametrize("value", HOSTILE)
def test_run_name_and_out_dir_from_the_config_round_trip(tmp_path, monkeypatch, value: str) -> None:
    monkeypatch.chdir(tmp_path)
    target = resolve_launch_target(_config(tmp_path, name=value, out_dir=f"runs/{value}"), [])
    script = _script(target, workdir=tmp_path / value)
    options = _options(script)
    assert options["job-name"] == value
    assert options["output"] == str(tmp_path / "runs" / value / "slurm").replace("%", "%%") + "/%x-%j.out"
    assert options["chdir"] == str(tmp_path / value)
    assert options["requeue"] == "" and options["signal"] == "USR1@300" and options["open-mode"] == "append"
    argv = torchrun_argv(script)
    assert argv[argv.index("--config"):] == target.trainer_args()      # the trainer gets its arguments unchanged


@pytest.mark.parametrize("value", HOSTILE)
def test_overrides_reach_the_trainer_unchanged(target, value: str) -> None:
    override = f"run.name={json.dumps(value)}"       # a YAML string whatever the value
    target = resolve_launch_target(target.config, [override])
    assert target.name == value
    assert torchrun_argv(_script(target))[-2] == override


@pytest.mark.parametrize("value", HOSTILE)
def test_extra_sbatch_option_values_are_quoted(target, value: str) -> None:
    assert _options(_script(target, sbatch_lines=(f"--comment={value}",)))["comment"] == value


@pytest.mark.parametrize("value", NEWLINES)
@pytest.mark.parametrize("field, what", [("partition", "--partition"), ("account", "--account"),
                                         ("job_name", "--job-name"), ("time", "--time"),
                                         ("workdir", "the submit directory"), ("python", "the python path")])
def test_control_characters_are_refused_in_every_job_field(target, field: str, what: str, value: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(what) + ".*(control character|not a Slurm time)"):
        render_sbatch_script(SlurmJobSpec(target=target, nodes=1, ranks_per_node=1,
                                          **{field: Path(value) if field == "workdir" else value}))


@pytest.mark.parametrize("value", NEWLINES)
@pytest.mark.parametrize("where", ["run.name", "run.out_dir", "override"])
def test_control_characters_are_refused_in_the_run_config(tmp_path, monkeypatch, capsys, where: str,
                                                          value: str) -> None:
    """The red-team repro: a newline in run.name, from the config file alone, ran the next line on the node."""
    monkeypatch.chdir(tmp_path)
    config = _config(tmp_path, **({"name": value} if where == "run.name" else
                                  {"out_dir": value} if where == "run.out_dir" else {}))
    overrides = [f"run.name={value}"] if where == "override" else []
    for command in (["slurm", "submit", "--nodes", "1", "--gpus-per-node", "1"], ["launch"]):
        assert cli.main([*command, "--config", str(config), "--dry-run", *overrides]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "control character" in err and where in err, err
    assert not (tmp_path / "INJECTED").exists()


@pytest.mark.parametrize("option", ["--partition", "--account", "--time", "--job-name"])
def test_a_newline_on_the_command_line_is_one_line_and_exit_2(target, capsys, option: str) -> None:
    argv = ["slurm", "submit", "--config", str(target.config), "--nodes", "1", "--gpus-per-node", "1",
            option, "x\ntouch INJECTED", "--dry-run"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"distaff slurm: {option} 'x\\ntouch INJECTED': ") and err.count("\n") == 1


@pytest.mark.parametrize("value", ["5", "90", "10:30", "01:02:03", "2-00", "2-12:30", "1-00:00:00", "infinite",
                                   "UNLIMITED", "0"])
def test_slurm_time_formats_are_accepted(value: str) -> None:
    assert slurm_time(value) == value


@pytest.mark.parametrize("value", ["yesterday", "1h", "1:2:3:4", "-5", "1-", "1--2", "1.5", "", "10:30 "])
def test_other_times_are_refused(target, capsys, value: str) -> None:
    argv = ["slurm", "submit", "--config", str(target.config), "--nodes", "1", "--gpus-per-node", "1",
            "--time", value, "--dry-run"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"distaff slurm: --time {value!r}") and "D-HH:MM:SS" in err or "whitespace" in err


def test_a_word_sbatch_needs_no_quotes_for_stays_as_it_is() -> None:
    assert sbatch_word("x", "gpu[01-02],a100:2") == "gpu[01-02],a100:2"
    assert sbatch_word("x", 'a "b" \\c') == '"a \\"b\\" \\\\c"'


# ---------------------------------------------------------------- deepspeed: hostfile, .deepspeed_env, pdsh

@pytest.mark.parametrize("host", ["a;touch INJECTED", "$(id)", "`id`", "a b", "-oProxyCommand=x", "a'b", 'a"b',
                                  "a\nb", "", "a/b"])
def test_hostile_host_names_are_refused_everywhere(target, tmp_path, capsys, host: str) -> None:
    assert cli.main(["launch", "--config", str(target.config), f"--hosts={host},gpu02", "--dry-run"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{host} slots=2\ngpu02 slots=2\n")
    with pytest.raises(ConfigError):
        read_hostfile(hostfile)


def _deepspeed_remote_argv(plan, tmp_path: Path) -> list[str]:
    """What the other nodes' shell passes to the trainer: deepspeed's own pdsh command (its parse_args and
    PDSHRunner, as `deepspeed --hostfile` builds it), the remote part run by bash with `printf` for python."""
    from deepspeed.launcher.multinode_runner import PDSHRunner
    from deepspeed.launcher.runner import parse_args

    args = parse_args(plan.command[3:])
    remote = PDSHRunner(args, "WORLD").get_cmd({}, {"gpu01": [0], "gpu02": [0]})[0]
    text = " ".join(remote[remote.index("-w") + 2:])
    text = text.replace(f"{sys.executable} -u -m deepspeed.launcher.launch", "printf '%s\\n'")
    out = subprocess.run(["bash", "-c", text], capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert not (tmp_path / "INJECTED").exists()
    return out.splitlines()


@pytest.mark.parametrize("override", ["run.name=a b;touch INJECTED", "run.name=two words", "run.name=it's here",
                                      "wandb.tags=[a, b]", "run.name=x#y z", "run.name=a*b ?c", "run.name=plain"])
def test_multi_node_arguments_reach_the_other_nodes_unchanged(target, tmp_path, override: str) -> None:
    target = resolve_launch_target(target.config, [override])
    plan = plan_launch(target, hosts=["gpu01", "gpu02"], gpus_per_node=1, master_port=29500, env={})
    argv = _deepspeed_remote_argv(plan, tmp_path)
    assert argv[argv.index("--config"):] == target.trainer_args()


@pytest.mark.parametrize("value", ["a;touch", "$(touch INJECTED)", "a`touch INJECTED`", 'say "hi" now',
                                   "$HOME x", "a|b", "a&&b", "a{b,c}", "a!x y", "a\\b c"])
def test_multi_node_arguments_a_remote_shell_would_change_are_refused(target, capsys, value: str) -> None:
    argv = ["launch", "--config", str(target.config), "--hosts", "gpu[01-02]", "--dry-run", f"run.name={value}"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "a trainer argument" in err and "pdsh" in err and err.count("\n") == 1, err
    assert cli.main(argv[:3] + argv[5:]) == 0            # on one node nothing goes through a shell: fine
    capsys.readouterr()


@pytest.mark.parametrize("value", ["two words", "a;b c", "it's", "[x]", "50%"])
def test_deepspeed_env_values_round_trip_through_the_remote_export(value: str) -> None:
    from deepspeed.launcher.multinode_runner import PDSHRunner
    from deepspeed.launcher.runner import parse_args

    runner = PDSHRunner(parse_args(["--module", "m"]), "WORLD")
    (line,) = format_deepspeed_env({"NCCL_X": value}).splitlines()
    runner.add_export(*line.split("=", 1))            # as deepspeed reads the file
    export = f"export NCCL_X={runner.exports['NCCL_X']}; printf %s \"$NCCL_X\""
    assert subprocess.run(["bash", "-c", export], capture_output=True, text=True, check=True).stdout == value


@pytest.mark.parametrize("value", NEWLINES + [" lead", "trail "])
def test_deepspeed_env_refuses_control_characters_and_edge_whitespace(value: str) -> None:
    with pytest.raises(ConfigError, match="NCCL_X"):
        format_deepspeed_env({"NCCL_X": value})
