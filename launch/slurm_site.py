"""What a site adds to a ``distaff slurm submit`` job: set-up lines run on every node before the launch
(``--setup "module load cuda/12.4"``, repeatable, and ``--setup-file FILE``), a container for the ranks (pyxis/enroot:
``--container-image`` with ``--container-mounts``; Apptainer: ``--apptainer IMAGE``), and the GPU request as
``--gres`` instead of ``--gpus-per-node``.

Set-up lines are shell code by design: they are written verbatim into the per-node script (the dry run shows them
as they will run), one line each. Every other value passes :func:`distaff.launch.script_values.site_word`: no
shell metacharacter, so nothing a value holds can run as a command.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distaff.launch.script_values import sbatch_option, setup_line, site_word
from distaff.train.core.errors import ConfigError, shown
from distaff.train.core.files import read_text

_DIGITS = re.compile(r"[0-9]+")     # ASCII digits: str.isdigit() also takes '²', which int() refuses

CONTAINER_PYTHON = "python"     # the interpreter the nodes run inside a container, unless --python says otherwise


@dataclass(frozen=True)
class SiteOptions:
    setup_lines: tuple[str, ...] = ()    # shell lines run on every node before the launch, in this order
    container_image: str | None = None   # pyxis/enroot image: srun --container-image
    container_mounts: str | None = None  # SRC:DST[:FLAGS][,...]: pyxis --container-mounts, Apptainer --bind
    apptainer: str | None = None         # Apptainer image (.sif, docker://...): apptainer exec
    gres: str | None = None              # the GPU request as generic resources, e.g. gpu:a100:8

    @property
    def container(self) -> str | None:
        return self.container_image or self.apptainer

    def validate(self, ranks_per_node: int, cpu: bool) -> None:
        for line in self.setup_lines:
            setup_line("--setup", line)
        for what, value in (("--container-image", self.container_image), ("--container-mounts", self.container_mounts),
                            ("--apptainer", self.apptainer), ("--gres", self.gres)):
            if value is not None:
                site_word(what, value)
        if self.container_image and self.apptainer:
            raise ConfigError("--container-image (pyxis) and --apptainer exclude each other: give one")
        if self.container_mounts and not self.container:
            raise ConfigError("--container-mounts: there is no container to mount into; give --container-image or "
                              "--apptainer")
        if self.gres is not None and cpu and _gres_gpus(self.gres):
            raise ConfigError(f"--gres {shown(self.gres)} with --cpu: a job of CPU ranks requests no GPU; leave the "
                              "gpu entry out of --gres (or --cpu out, to run on the GPUs)")
        if self.gres is not None and not cpu:
            _check_gres_gpus(self.gres, ranks_per_node)

    def gpu_option(self, ranks_per_node: int) -> str:
        """The job's GPU request: ``--gres`` when given, else ``--gpus-per-node`` (a step gets the job's GPUs)."""
        return sbatch_option("gres", self.gres) if self.gres else sbatch_option("gpus-per-node", ranks_per_node)

    def srun_options(self, workdir: Path) -> str:
        """pyxis options of the per-node step (shell text; empty without ``--container-image``). The container
        starts in the submit directory, so relative paths of the config resolve as they do without one."""
        if not self.container_image:
            return ""
        words = [f"--container-image={self.container_image}", f"--container-workdir={workdir}"]
        if self.container_mounts:
            words.append(f"--container-mounts={self.container_mounts}")
        return shlex.join(words) + " "

    def command_prefix(self, cpu: bool) -> str:
        """What runs a node's python inside the Apptainer image (shell text; empty without ``--apptainer``)."""
        if not self.apptainer:
            return ""
        words = ["apptainer", "exec", *([] if cpu else ["--nv"])]
        if self.container_mounts:
            words += ["--bind", self.container_mounts]
        return shlex.join([*words, self.apptainer]) + " "

    def setup_block(self) -> str:
        """The set-up lines for the per-node script, verbatim; the first that fails stops the node."""
        if not self.setup_lines:
            return ""
        return ("# Set-up lines (--setup-file, then --setup), verbatim; the first that fails stops this node.\n"
                "set -e\n"
                """trap 'echo "distaff: node $SLURM_NODEID: a set-up line failed with status $?" >&2' ERR\n"""
                + "".join(line + "\n" for line in self.setup_lines)
                + "trap - ERR\nset +e\n")


def _gres_gpus(gres: str) -> list[int]:
    """The GPU count of each ``gpu[:type][:count]`` entry of ``--gres`` (1 without a count)."""
    counts = []
    for entry in gres.split(","):
        fields = entry.split(":")
        if fields[0] == "gpu":
            counts.append(int(fields[-1]) if len(fields) > 1 and _DIGITS.fullmatch(fields[-1]) else 1)
    return counts


def _check_gres_gpus(gres: str, ranks_per_node: int) -> None:
    """``--gres`` must give every rank of a node a GPU: a ``gpu[:type][:count]`` entry, count >= ranks per node."""
    counts = _gres_gpus(gres)
    if not counts:
        raise ConfigError(f"--gres {shown(gres)}: requests no GPU (no gpu[:TYPE]:COUNT entry); add "
                          f"gpu:{ranks_per_node}, or leave --gres out to request --gpus-per-node {ranks_per_node}")
    if sum(counts) < ranks_per_node:
        raise ConfigError(f"--gres {shown(gres)}: {sum(counts)} GPU(s) per node for --gpus-per-node {ranks_per_node} "
                          "ranks; each rank needs a GPU of its own: request as many GPUs as ranks")


def add_site_arguments(parser: argparse.ArgumentParser) -> None:
    site = parser.add_argument_group("site set-up, containers and GPU requests")
    site.add_argument("--setup", action="append", default=[], metavar="LINE",
                      help="a shell line run on every node before the launch, e.g. 'module load cuda/12.4' "
                           "(repeatable; --dry-run shows it verbatim)")
    site.add_argument("--setup-file", metavar="FILE", help="set-up lines from a file, run before the --setup lines")
    site.add_argument("--container-image", metavar="IMAGE", help="run the ranks in this pyxis/enroot image")
    site.add_argument("--apptainer", metavar="IMAGE",
                      help="run the ranks with `apptainer exec IMAGE` (.sif, docker://)")
    site.add_argument("--container-mounts", metavar="SRC:DST[,...]",
                      help="the container's mounts (pyxis --container-mounts, Apptainer --bind)")
    site.add_argument("--gres", metavar="SPEC", help="request GPUs as generic resources (gpu:a100:8) instead of "
                                                    "--gpus-per-node's request")
    site.add_argument("--python", help=f"the python the nodes run (default: this one; in a container: "
                                       f"{CONTAINER_PYTHON})")


def node_python(python: str | None, site: SiteOptions) -> str:
    """The python a job's nodes run: ``--python``, else the container's, else this one."""
    return python or (CONTAINER_PYTHON if site.container else sys.executable)


def recorded_site(record: dict[str, Any]) -> tuple[SiteOptions, str]:
    """The site options and node python of a recorded ``distaff slurm submit`` (launch/run_config.py's launch
    record), so that a later job of the run (an evaluation of its checkpoints) runs where its ranks ran. An option
    the record lacks (an older distaff) takes its default; a relative ``--setup-file`` is read from the folder the
    run was submitted from."""
    parser = argparse.ArgumentParser(add_help=False)
    add_site_arguments(parser)
    values = {action.dest: action.default for action in parser._actions}
    values.update((name, value) for name, value in record["args"].items() if name in values)
    if values["setup_file"]:
        values["setup_file"] = str(Path(record["cwd"]) / values["setup_file"])
    site = site_options(argparse.Namespace(**values))
    return site, node_python(values["python"], site)


def site_options(args: argparse.Namespace) -> SiteOptions:
    """The site options of a parsed command line; ``--setup-file``'s lines (each named by its line number when
    refused) come before the ``--setup`` lines."""
    lines: list[str] = []
    if args.setup_file:
        text = read_text(args.setup_file, error=ConfigError, what="--setup-file")
        lines = [setup_line(f"--setup-file {args.setup_file}, line {n}", line)
                 for n, line in enumerate(text.split("\n"), 1)]
        lines = lines[:-1] if lines and not lines[-1] else lines     # the file's final newline
    return SiteOptions(setup_lines=(*lines, *args.setup), container_image=args.container_image,
                       container_mounts=args.container_mounts, apptainer=args.apptainer, gres=args.gres)
