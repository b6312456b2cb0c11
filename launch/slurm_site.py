"""What a site adds to a ``distaff slurm submit`` job: set-up lines run on every node before the launch
(``--setup "module load cuda/12.4"``, repeatable, and ``--setup-file FILE``), a container for the ranks (pyxis/enroot:
``--container-image`` with ``--container-mounts``; Apptainer: ``--apptainer IMAGE``), and the GPU request as
``--gres`` instead of ``--gpus-per-node``.

A container sees only what is mounted into it, and the job names host paths (the config, the run directory, the
data, the submit folder): :func:`check_container_paths` refuses a job whose paths are not mounted at the same
path, before anything is written or queued.

Set-up lines are shell code by design: they are written verbatim into the per-node script (the dry run shows them
as they will run), one line each. Every other value passes :func:`distaff.launch.script_values.site_word`: no
shell metacharacter, so nothing a value holds can run as a command.
"""

from __future__ import annotations

import argparse
import os
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


def _mounts(spec: str | None) -> list[tuple[Path, Path]]:
    """(source, destination) of each entry of a pyxis ``--container-mounts`` or Apptainer ``--bind`` list
    (``SRC[:DST][:FLAGS]``; a lone source, or one followed only by flags, is mounted at its own path)."""
    pairs = []
    for entry in filter(None, (spec or "").split(",")):
        fields = entry.split(":")
        destination = fields[1] if len(fields) > 1 and fields[1].startswith("/") else fields[0]
        pairs.append((Path(fields[0]), Path(destination)))
    return pairs


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_container_paths(site: SiteOptions, paths: list[tuple[str, Path]], workdir: Path, python: str) -> list[str]:
    """Refuse (a ConfigError naming each) host paths the job uses that the container does not see at the same path:
    ``paths`` as (what, absolute path), and for pyxis the submit folder it starts in. Apptainer mounts the home
    and the working folder by default; pyxis the home only where the site says so, so a path under it is a warning
    (returned). A ``--python`` outside the mounts is a warning too: it may be the image's own."""
    if not site.container:
        return []
    view = _ContainerView(site, workdir)
    if site.container_image:
        paths = [*paths, ("the submit folder (the container's working folder)", workdir)]
    refused, warnings = [], []
    for what, path in paths:
        seen_at = view.where(path)
        if seen_at == path:
            continue
        if seen_at is not None:
            refused.append(f"{what} {path} (mounted at {seen_at})")
        elif site.container_image and _inside(path, view.home):
            warnings.append(f"{what} {path} is under the home, which pyxis mounts only where the site's enroot "
                            "config does (--container-mount-home); to be sure, add it to --container-mounts")
        else:
            refused.append(f"{what} {path}")
    if refused:
        mounts = f"--container-mounts {site.container_mounts}" if site.container_mounts else "no --container-mounts"
        raise ConfigError(f"{_flag(site)}: the container does not see {'; '.join(refused)} at that path ({mounts}); "
                          "mount each at its own path, e.g. --container-mounts /shared (a folder that holds them), "
                          "or move them there")
    if python != CONTAINER_PYTHON and Path(python).is_absolute() and view.where(Path(python)) is None:
        warnings.append(f"--python {python} is not inside the container's mounts: it must be the image's own")
    return [f"{_flag(site)}: warning: {line}" for line in warnings]


class _ContainerView:
    """Where host paths appear in a job's container: its mounts, and for Apptainer the home and the working
    folder, which it mounts at their own paths by default."""

    def __init__(self, site: SiteOptions, workdir: Path):
        self.home = Path(os.environ.get("HOME", "/nonexistent-home"))
        self.mounts = _mounts(site.container_mounts)
        if site.apptainer:
            self.mounts += [(self.home, self.home), (workdir, workdir)]

    def where(self, path: Path) -> Path | None:
        """Where the host's ``path`` appears in the container: at its own path if any mount puts it there, else
        where the most specific mount holding it does; None when none does."""
        holding = sorted(((source, destination) for source, destination in self.mounts if _inside(path, source)),
                         key=lambda pair: len(pair[0].parts), reverse=True)
        seen = [destination / path.relative_to(source) for source, destination in holding]
        return path if path in seen else next(iter(seen), None)


def _flag(site: SiteOptions) -> str:
    return "--container-image" if site.container_image else "--apptainer"


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
