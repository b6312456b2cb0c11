"""``distaff launch``: run pretraining (``--task finetune``: fine-tuning) under the ``deepspeed`` launcher, on one or many nodes.

One node (no hosts given, a single host, or a one-node Slurm allocation): ``deepspeed --num_gpus G``
starts the ranks locally. Several nodes: the hosts come from ``--hosts`` (a Slurm hostlist expression such
as ``gpu[01-03,07]`` or ``a,b,c``) or from the Slurm allocation we run in (``SLURM_JOB_NODELIST``);
a hostfile and a ``.deepspeed_env`` are written into ``<run.out_dir>/launch/`` and deepspeed
starts the ranks over ssh (pdsh). ``.deepspeed_env`` carries the variables every node needs
(NCCL, W&B, caches, PYTHONPATH) because ssh sessions do not inherit our environment.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from distaff.launch.hostlist import expand_hostlist
from distaff.launch.run_config import LaunchTarget, add_task_argument, resolve_launch_target
from distaff.train.core import presets
from distaff.train.core.verbosity import verbose
from distaff.train.core.errors import command_main
from distaff.train.core.errors import ConfigError

DEFAULT_MASTER_PORT = 29500

# Variables copied into .deepspeed_env when set: exact names, and whole families by prefix.
NODE_ENV_NAMES = (
    "PYTHONPATH", "OMP_NUM_THREADS", "DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR",
    "XDG_CACHE_HOME", "TOKENIZERS_PARALLELISM",
)
NODE_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "WANDB_", "HF_", "TRANSFORMERS_")
# Never written to a file in the run directory: any name with one of these words is a credential
# (WANDB_API_KEY, HF_TOKEN, HUGGING_FACE_HUB_TOKEN, a *_SECRET or *_PASSWORD of a user's own); nodes
# read credentials from their own environment or ~/.netrc instead.
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")


def is_secret(name: str) -> bool:
    return any(word in name.upper() for word in SECRET_WORDS)


def node_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that every node needs (see NODE_ENV_NAMES / NODE_ENV_PREFIXES), sorted,
    credentials left out."""
    return {
        name: env[name] for name in sorted(env)
        if (name in NODE_ENV_NAMES or name.startswith(NODE_ENV_PREFIXES)) and not is_secret(name)
    }


def format_deepspeed_env(variables: Mapping[str, str]) -> str:
    """``.deepspeed_env`` text: one ``NAME=value`` per line, nothing else.

    deepspeed splits every line on its first ``=`` (a blank or comment line crashes it) and pastes
    the value into ``export NAME="value"`` on each node, so values that a double-quoted shell
    string would change or that span lines are refused here rather than corrupted there.
    """
    lines = []
    for name, value in variables.items():
        if not name.isidentifier():
            raise ConfigError(f".deepspeed_env: {name!r} is not a valid variable name")
        bad = sorted({char for char in value if char in '\n\r"$`\\'})
        if bad:
            raise ConfigError(f".deepspeed_env: value of {name} contains {bad}, which cannot be passed to other nodes")
        lines.append(f"{name}={value}\n")
    return "".join(lines)


def format_hostfile(hosts: list[str], slots: int) -> str:
    """A deepspeed (MPI-style) hostfile: ``host slots=N`` per line."""
    if len(set(hosts)) != len(hosts):
        raise ConfigError(f"hostfile: duplicate hosts in {hosts}")
    if slots < 1:
        raise ConfigError(f"hostfile: slots per host must be >= 1, got {slots}")
    return "".join(f"{host} slots={slots}\n" for host in hosts)


def hosts_from_environment(hosts_arg: str | None, env: Mapping[str, str]) -> list[str]:
    """Hosts from ``--hosts``, else from the Slurm allocation, else none (single node)."""
    spec = hosts_arg or env.get("SLURM_JOB_NODELIST", "")
    return expand_hostlist(spec) if spec else []


def deepspeed_command(target: LaunchTarget, *, gpus_per_node: int | None, master_port: int,
                      hostfile: Path | None = None, master_addr: str | None = None) -> list[str]:
    """The ``deepspeed`` command line (run through this interpreter, so the venv is the same)."""
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner"]
    if hostfile is not None:
        cmd += ["--hostfile", str(hostfile), "--master_addr", str(master_addr)]
    if gpus_per_node is not None:
        cmd += ["--num_gpus", str(gpus_per_node)]
    # The trainer reads LOCAL_RANK from the environment; deepspeed would also append --local_rank. The
    # runner's own INFO lines (the command it runs, the world info) only with --verbose.
    cmd += ["--master_port", str(master_port), "--log_level", "info" if verbose() else "warning",
            "--no_local_rank", "--module", target.module]
    return cmd + target.trainer_args()


def _parse_env_pairs(pairs: list[str]) -> dict[str, str]:
    extra = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ConfigError(f"--env {pair!r}: expected NAME=VALUE")
        extra[name] = value
    return extra


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distaff launch", description="Run pretraining or fine-tuning under the deepspeed launcher.",
        epilog="Remaining key=value arguments are config overrides, e.g. optim.lr=3e-4.")
    parser.add_argument("--config", required=True, help=f"run config: {presets.CONFIG_HELP}")
    add_task_argument(parser)
    parser.add_argument("--hosts", help="hostlist, e.g. 'gpu[01-03,07]' or 'a,b' (default: the Slurm "
                        "allocation, else this node only)")
    parser.add_argument("--gpus-per-node", type=int, help="ranks per node (default: every local GPU; "
                        "for several hosts: $SLURM_GPUS_ON_NODE, else 1)")
    parser.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra variable for every node (repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="print the files and the command, run nothing")
    parser.add_argument("overrides", nargs="*", help="config overrides dotted.key=value")
    return parser


@dataclass(frozen=True)
class LaunchPlan:
    command: list[str]
    env: dict[str, str]           # the deepspeed launcher's environment
    files: dict[Path, str]        # written before launching (hostfile, .deepspeed_env); empty on one node


def plan_launch(target: LaunchTarget, *, hosts: list[str], gpus_per_node: int | None, master_port: int,
                env: Mapping[str, str], extra: Mapping[str, str] | None = None) -> LaunchPlan:
    """The command, environment and files for a launch on ``hosts`` (none or one: this node); ``extra``, the
    user's ``--env`` variables, reach every rank: in the environment on one node, through ``.deepspeed_env``
    on several, where a credential is refused (it would be written into the run directory)."""
    env = {**env, **(extra or {})}
    if len(hosts) <= 1:  # this node only: deepspeed starts the ranks without ssh
        command = deepspeed_command(target, gpus_per_node=gpus_per_node, master_port=master_port)
        return LaunchPlan(command, env, {})
    slots = gpus_per_node or int(env.get("SLURM_GPUS_ON_NODE", "1"))
    launch_dir = target.out_dir / "launch"
    hostfile, env_file = launch_dir / "hostfile", launch_dir / ".deepspeed_env"
    for name in extra or {}:
        if is_secret(name):
            raise ConfigError(f"--env {name}: a credential (by its name) is never written to {env_file}, the file "
                              "that carries variables to the other nodes; set it in each node's own environment "
                              "(its shell profile) or ~/.netrc instead")
    files = {hostfile: format_hostfile(hosts, slots),
             env_file: format_deepspeed_env({**node_environment(env), **(extra or {})})}
    # deepspeed looks for .deepspeed_env in ~ and the cwd; an absolute DS_ENV_FILE points it at ours.
    env["DS_ENV_FILE"] = str(env_file)
    command = deepspeed_command(target, gpus_per_node=slots, master_port=master_port,
                                hostfile=hostfile, master_addr=hosts[0])
    return LaunchPlan(command, env, files)


def main(argv: list[str] | None = None) -> int:
    return command_main("distaff launch", _main, argv)


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    target = resolve_launch_target(args.config, args.overrides, args.task)
    extra = _parse_env_pairs(args.env)
    env = dict(os.environ)
    hosts = hosts_from_environment(args.hosts, {**env, **extra})
    if len(hosts) <= 1 and not torch.cuda.is_available():
        # this node's ranks run on CPU: named, deepspeed's launchers do not warn once each that they guessed
        env.setdefault("DS_ACCELERATOR", "cpu")
    plan = plan_launch(target, hosts=hosts, gpus_per_node=args.gpus_per_node, master_port=args.master_port,
                       env=env, extra=extra)
    shown = (f"DS_ENV_FILE={shlex.quote(plan.env['DS_ENV_FILE'])} " if plan.files else "") + shlex.join(plan.command)
    if args.dry_run:
        for path, text in plan.files.items():
            print(f"# {path}\n{text}")
        print(shown)
        return 0
    for path, text in plan.files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(f"distaff launch: {shown}", file=sys.stderr, flush=True)
    return run_forwarding_signals(plan.command, plan.env, target.module, to_ranks=not plan.files)


def runs_module(cmdline: list[str], module: str) -> bool:
    """Is ``cmdline`` ``python ... -m module ...``? (deepspeed's own processes name the module as an argument)"""
    return any(a == "-m" and b == module for a, b in zip(cmdline, cmdline[1:]))


def trainer_processes(launcher_pid: int, module: str) -> list:
    """This node's processes under ``launcher_pid`` that run ``module`` (the ranks, and their forked workers)."""
    import psutil

    found = []
    for proc in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if runs_module(proc.cmdline(), module):
                found.append(proc)
        except psutil.Error:       # gone since the listing
            pass
    return found


def run_forwarding_signals(command: list[str], env: dict[str, str], module: str, *, to_ranks: bool) -> int:
    """Run the deepspeed launcher in its own session and pass our Ctrl-C (SIGINT) and SIGTERM on; its exit code.

    A terminal's Ctrl-C would reach every process of the job: deepspeed's runner dies with a traceback and
    its per-node launcher SIGTERMs each rank's whole process tree (W&B's service included) and SIGKILLs it
    30 s later. Here only this process gets it, and on one node (``to_ranks``) hands the signal to the
    ranks alone: they checkpoint at the step boundary and exit 75, which deepspeed returns; a second
    Ctrl-C ends them at once. Before any rank has started, the launch is stopped. Several nodes: the
    signal goes to deepspeed's runner, whose pdsh handler signals every node."""
    import psutil

    proc = subprocess.Popen(command, env=env, start_new_session=True)

    def forward(signum: int, frame) -> None:
        if not to_ranks:
            proc.send_signal(signum)
            return
        ranks = trainer_processes(proc.pid, module)
        if not ranks:                  # none started yet: nothing to save, stop the whole launch
            os.killpg(proc.pid, signal.SIGTERM)
        for rank in ranks:
            try:
                rank.send_signal(signum)
            except psutil.Error:       # exited meanwhile
                pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
