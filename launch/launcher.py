"""``distaff launch``: run pretraining (``--task finetune``: fine-tuning) under the ``deepspeed`` launcher, on one or many nodes.

One node (no hosts given, a single host, or a one-node Slurm allocation): ``deepspeed --num_gpus G``
starts the ranks locally. Several nodes: the hosts come from ``--hosts`` (a Slurm hostlist expression such
as ``gpu[01-03,07]`` or ``a,b,c``), ``--hostfile`` (deepspeed's ``host slots=N`` format) or the Slurm
allocation we run in (``SLURM_JOB_NODELIST``); a hostfile and a ``.deepspeed_env`` are written into
``<run.out_dir>/launch/`` and deepspeed starts the ranks over ssh (pdsh). ``.deepspeed_env`` carries the
variables every node needs (NCCL, W&B, caches, PYTHONPATH) because ssh sessions do not inherit our
environment. Every value written there or sent to another node passes ``script_values``' checks first.
A :mod:`distaff.launch.watcher` process stops the ranks if this process dies (``kill -9``, the OOM killer).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from distaff.launch.hostlist import expand_hostlist
from distaff.launch.run_config import (LaunchTarget, add_ranks_flag, add_task_argument, record_launch,
                                       resolve_launch_target)
from distaff.launch.script_values import host_name, plain_text, remote_argument
from distaff.launch.watcher import signal_job, start_watcher
from distaff.train.core import presets
from distaff.train.core.distributed import port_in_use_message, port_is_free
from distaff.train.core.errors import (MAX_COUNT, MAX_PORT, ConfigError, command_main, document_ranges, env_int,
                                       int_arg, shown, whole_number)
from distaff.train.core.files import read_text
from distaff.train.core.threads import check_ranks_per_node, rank_bound
from distaff.train.core.verbosity import verbose

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
        plain_text(f".deepspeed_env: value of {name}", value)
        lines.append(f"{name}={value}\n")
    return "".join(lines)


def format_hostfile(slots: Mapping[str, int]) -> str:
    """A deepspeed (MPI-style) hostfile: ``host slots=N`` per line."""
    for host, count in slots.items():
        host_name(host, "hostfile: host")
        if count < 1:
            raise ConfigError(f"hostfile: slots of {host} must be >= 1, got {count}")
    return "".join(f"{host} slots={count}\n" for host, count in slots.items())


_HOSTFILE_LINE = re.compile(r"(\S+)\s+slots=(\S+)")


def read_hostfile(path: str | Path) -> dict[str, int]:
    """A deepspeed hostfile (``host slots=N`` lines; ``#`` comments and blank lines skipped): host -> slots,
    each host a valid name, each count a positive integer, no host twice."""
    slots: dict[str, int] = {}
    for number, raw in enumerate(read_text(path, error=ConfigError, what="--hostfile").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"--hostfile {path}, line {number}"
        match = _HOSTFILE_LINE.fullmatch(line)
        if not match:
            raise ConfigError(f"{where}: {shown(raw)} is not 'HOST slots=N'; write one host and its slot count per line")
        host, count = host_name(match.group(1), f"{where}: host"), match.group(2)
        if host in slots:
            raise ConfigError(f"{where}: {host} is listed twice; give each host one line")
        slots[host] = whole_number(count, f"{where}: slots of {host}", low=1)   # ASCII digits: '²' is refused
    if not slots:
        raise ConfigError(f"--hostfile {path}: no hosts in it; write 'HOST slots=N' lines")
    return slots


def hosts_from_environment(hosts_arg: str | None, env: Mapping[str, str]) -> list[str]:
    """Hosts from ``--hosts``, else from the Slurm allocation, else none (single node)."""
    spec = hosts_arg or env.get("SLURM_JOB_NODELIST", "")
    return expand_hostlist(spec) if spec else []


def host_slots(hosts: list[str] | Mapping[str, int], gpus_per_node: int | None,
               env: Mapping[str, str]) -> dict[str, int]:
    """Ranks per host: ``--gpus-per-node``, else a hostfile's counts, else ``$SLURM_GPUS_ON_NODE``, else 1."""
    if isinstance(hosts, Mapping):
        return {host: gpus_per_node or count for host, count in hosts.items()}
    slots = gpus_per_node or env_int(env, "SLURM_GPUS_ON_NODE", 1, low=1)
    if len(set(hosts)) != len(hosts):
        raise ConfigError(f"hosts {shown(hosts)}: a host is named twice; name each once")
    return {host: slots for host in hosts}


def deepspeed_command(target: LaunchTarget, *, gpus_per_node: int | None, master_port: int,
                      hostfile: Path | None = None, master_addr: str | None = None) -> list[str]:
    """The ``deepspeed`` command line (run through this interpreter, so the venv is the same)."""
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner"]
    if hostfile is not None:
        # deepspeed's pdsh runner pastes these into one remote shell command on every node
        for what, value in (("the python path", sys.executable), ("the working folder", os.getcwd()),
                            *(("a trainer argument", arg) for arg in target.trainer_args())):
            remote_argument(what, value)
        cmd += ["--hostfile", str(hostfile), "--master_addr", str(master_addr)]
    if gpus_per_node is not None:
        cmd += ["--num_gpus", str(gpus_per_node)]
    # The trainer reads LOCAL_RANK from the environment; deepspeed would also append --local_rank. The
    # runner's own lines only with --verbose: its INFO lines (the command it runs, the world info), its WARNING
    # on a local launch ("Unable to find hostfile") and its ERROR for a rank's non-zero exit ("exits with return
    # code = 75" after a clean Ctrl-C): the ranks say why they stopped, and `launch` names a signal that killed one.
    cmd += ["--master_port", str(master_port), "--log_level", "info" if verbose() else "critical",
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
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument("--hosts", help="hostlist, e.g. 'gpu[01-03,07]' or 'a,b' (default: the Slurm "
                       "allocation, else this node only)")
    hosts.add_argument("--hostfile", help="a deepspeed hostfile: 'HOST slots=N' per line ('#' comments)")
    parser.add_argument("--gpus-per-node", type=int_arg("--gpus-per-node", low=1, high=MAX_COUNT),
                        help="ranks per node (default: every local GPU; for several hosts: the hostfile's slots, "
                        "$SLURM_GPUS_ON_NODE, else 1)")
    add_ranks_flag(parser)
    parser.add_argument("--master-port", type=int_arg("--master-port", low=1, high=MAX_PORT),
                        default=DEFAULT_MASTER_PORT)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra variable for every node (repeatable)")
    parser.add_argument("--gpu-kind", help="GPU kind for the plan's line (distaff plan --list-gpus; default A100-80GB)")
    parser.add_argument("--dry-run", action="store_true", help="print the files and the command, run nothing")
    parser.add_argument("overrides", nargs="*", help="config overrides dotted.key=value")
    return document_ranges(parser)


@dataclass(frozen=True)
class LaunchPlan:
    command: list[str]
    env: dict[str, str]           # the deepspeed launcher's environment
    files: dict[Path, str]        # written before launching (hostfile, .deepspeed_env); empty on one node


def plan_launch(target: LaunchTarget, *, hosts: list[str] | Mapping[str, int], gpus_per_node: int | None,
                master_port: int, env: Mapping[str, str], extra: Mapping[str, str] | None = None,
                max_ranks_per_node: int | None = None) -> LaunchPlan:
    """The command, environment and files for a launch on ``hosts`` (none or one: this node; a mapping: a
    hostfile's slots per host); ``extra``, the user's ``--env`` variables, reach every rank: in the environment
    on one node, through ``.deepspeed_env`` on several, where a credential is refused (it would be written
    into the run directory). Ranks per node are bounded (:mod:`distaff.launch.ranks_per_node`;
    ``max_ranks_per_node`` is ``--max-ranks-per-node``)."""
    env = {**env, **(extra or {})}
    if gpus_per_node is not None and gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node {gpus_per_node}: expected at least 1 rank per node")
    if not 1 <= master_port <= 65535:
        raise ConfigError(f"--master-port {master_port}: expected a TCP port, 1 to 65535")
    if len(hosts) <= 1:  # this node only: deepspeed starts the ranks without ssh
        local = gpus_per_node or (next(iter(hosts.values())) if isinstance(hosts, Mapping) and hosts else None)
        if local is not None:
            what = f"--gpus-per-node {local}" if gpus_per_node else f"hostfile: slots={local} of {next(iter(hosts))}"
            check_ranks_per_node(local, what, rank_bound(max_ranks_per_node, here=True))
        command = deepspeed_command(target, gpus_per_node=local, master_port=master_port)
        return LaunchPlan(command, env, {})
    slots = host_slots(hosts, gpus_per_node, env)
    bound = rank_bound(max_ranks_per_node, here=False)
    for host, count in slots.items():
        check_ranks_per_node(count, f"--gpus-per-node {count}" if gpus_per_node else f"slots={count} of {host}", bound)
    launch_dir = target.out_dir / "launch"
    hostfile, env_file = launch_dir / "hostfile", launch_dir / ".deepspeed_env"
    for name in extra or {}:
        if is_secret(name):
            raise ConfigError(f"--env {name}: a credential (by its name) is never written to {env_file}, the file "
                              "that carries variables to the other nodes; set it in each node's own environment "
                              "(its shell profile) or ~/.netrc instead")
    files = {hostfile: format_hostfile(slots),
             env_file: format_deepspeed_env({**node_environment(env), **(extra or {})})}
    # deepspeed looks for .deepspeed_env in ~ and the cwd; an absolute DS_ENV_FILE points it at ours.
    env["DS_ENV_FILE"] = str(env_file)
    uniform = set(slots.values()).pop() if len(set(slots.values())) == 1 else None  # else the hostfile's counts
    command = deepspeed_command(target, gpus_per_node=uniform, master_port=master_port,
                                hostfile=hostfile, master_addr=next(iter(slots)))
    return LaunchPlan(command, env, files)


def main(argv: list[str] | None = None) -> int:
    return command_main("distaff launch", _main, argv)


def _main(argv: list[str]) -> int:
    return launch(_parser().parse_intermixed_args(argv))    # options may follow the overrides


def launch(args: argparse.Namespace) -> int:
    """``distaff launch`` with parsed options (``distaff decay`` passes a parent run's, recorded)."""
    target = resolve_launch_target(args.config, args.overrides, args.task)
    extra = _parse_env_pairs(args.env)
    env = dict(os.environ)
    hosts = read_hostfile(args.hostfile) if args.hostfile else hosts_from_environment(args.hosts, {**env, **extra})
    if len(hosts) <= 1 and not torch.cuda.is_available():
        # this node's ranks run on CPU: named, deepspeed's launchers do not warn once each that they guessed
        env.setdefault("DS_ACCELERATOR", "cpu")
    plan = plan_launch(target, hosts=hosts, gpus_per_node=args.gpus_per_node, master_port=args.master_port,
                       env=env, extra=extra, max_ranks_per_node=args.max_ranks_per_node)
    command = (f"DS_ENV_FILE={shlex.quote(plan.env['DS_ENV_FILE'])} " if plan.files else "") + shlex.join(plan.command)
    if args.dry_run:
        if torch.cuda.is_available() or args.gpu_kind:   # the plan's line for this job
            from distaff.train.plan.planner import print_launch_summary

            print_launch_summary(target, ranks_per_node(hosts, args.gpus_per_node), max(1, len(hosts)),
                                 args.gpu_kind, "distaff launch")
        for path, text in plan.files.items():
            print(f"# {path}\n{text}")
        print(command)
        return 0
    if len(hosts) <= 1 and not port_is_free(args.master_port):     # this node's ranks meet on it
        raise ConfigError(port_in_use_message(f"--master-port {args.master_port}", "this host"))
    for path, text in plan.files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    record_launch(target.out_dir, "launch", argparse.Namespace(**{
        **vars(args), "env": [pair for pair in args.env if not is_secret(pair.partition("=")[0])]}))
    print(f"distaff launch: {command}", file=sys.stderr, flush=True)
    code = run_forwarding_signals(plan.command, plan.env, target.module, to_ranks=not plan.files)
    killed = signal_of(code)
    if killed:
        print(f"distaff launch: a rank was killed by {killed} (exit status {code}); the ranks' own lines above say "
              "no more: SIGKILL is often the out-of-memory killer (see `dmesg` or the job's memory limit)",
              file=sys.stderr, flush=True)
    return code


def signal_of(code: int) -> str | None:
    """The signal that ended a rank, from the deepspeed launcher's exit status (it exits with the rank's negative
    return code, which the OS reports as 256 - signal), or None for an exit of the rank's own."""
    if 256 - 64 <= code <= 255:
        try:
            return signal.Signals(256 - code).name
        except ValueError:
            return f"signal {256 - code}"
    return None


def ranks_per_node(hosts: list[str] | Mapping[str, int], gpus_per_node: int | None) -> int:
    """Ranks per node as the launch starts them: ``--gpus-per-node``, else a hostfile's slots (their mean when
    hosts differ), else every local GPU."""
    if gpus_per_node:
        return gpus_per_node
    if isinstance(hosts, Mapping) and hosts:
        return max(1, round(sum(hosts.values()) / len(hosts)))
    return max(1, torch.cuda.device_count())


def run_forwarding_signals(command: list[str], env: dict[str, str], module: str, *, to_ranks: bool) -> int:
    """Run the deepspeed launcher in its own session and pass our Ctrl-C (SIGINT) and SIGTERM on; its exit code.

    A terminal's Ctrl-C would reach every process of the job: deepspeed's runner dies with a traceback and
    its per-node launcher SIGTERMs each rank's whole process tree (W&B's service included) and SIGKILLs it
    30 s later. Here only this process gets it, and on one node (``to_ranks``) hands the signal to the
    ranks alone: they checkpoint at the step boundary and exit 75, which deepspeed returns; a second
    Ctrl-C ends them at once. Before any rank has started, the launch is stopped. Several nodes: the
    signal goes to deepspeed's runner, whose pdsh handler signals every node. Should this process die
    without a word (SIGKILL), its watcher stops the job the same way (:mod:`distaff.launch.watcher`)."""
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    watcher = start_watcher(proc.pid, module, to_ranks=to_ranks)

    def forward(signum: int, frame) -> None:
        signal_job(proc.pid, module, signum, to_ranks=to_ranks)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        watcher.stdin.close()          # the job is over: the watcher finds nothing left and ends
        try:
            watcher.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
