"""Process-group setup from the launcher's environment, with bounded collective timeouts.

Rank and world size come from ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (deepspeed launcher, torchrun)
or, when those are absent, ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` (srun). Every
collective runs under ``timeout_s``: if a rank dies, its peers fail (gloo notices the closed
connection at once, NCCL within the timeout) instead of waiting forever.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from distaff.train.core.errors import MAX_PORT, ConfigError, env_int
from distaff.train.core.exit_codes import leave_now
from distaff.train.core.verbosity import quiet_torch_warnings


_had_process_group = False       # set by init_distributed: see exit_process


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def port_in_use_message(what: str, host: str) -> str:
    """The one line for a rendezvous port (``what``: ``--master-port 29500``) that ``host`` already listens on."""
    return (f"{what}: already in use on {host} (another run, or a process that still holds it); give a free port: "
            "distaff launch --master-port N (torchrun: --master-port N)")


def port_is_free(port: int) -> bool:
    """Whether this host's TCP ``port`` can be listened on (the rendezvous of ranks started here listens on it). As
    the rendezvous does, with SO_REUSEADDR: a port a finished run's connections still hold (TIME_WAIT) is free."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# (rank, world size, local rank) variables of each launcher: torchrun and deepspeed's, else srun's
LAUNCHER_VARIABLES = (("RANK", "WORLD_SIZE", "LOCAL_RANK"), ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
# Set by `distaff slurm submit`'s script: the name rank 0 links to the log of its node (train/run/runtime.py), and
# the nodes' log, Slurm's %n standing for the node.
RANK0_LOG_VARIABLE = "DISTAFF_RANK0_LOG"
NODE_LOG_VARIABLE = "DISTAFF_NODE_LOG"
# what makes a process one of a run's ranks: the launchers' variables (torchrun's TORCHELASTIC_* among them: with
# TORCHELASTIC_USE_AGENT_STORE a process joins the agent's store instead of making its own), the rendezvous, the
# job's W&B run and the W&B service rank 0 started. A process a rank starts that is not a rank (an evaluation of a
# checkpoint, the fine-tuning it starts) goes without them: see without_rank_variables.
RANK_VARIABLES = tuple(name for names in LAUNCHER_VARIABLES for name in names) + (
    "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "CROSS_RANK",
    "CROSS_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "WANDB_RUN_ID", "WANDB_SERVICE")
RANK_VARIABLE_PREFIXES = ("TORCHELASTIC_",)


def without_rank_variables(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` less :data:`RANK_VARIABLES`: the environment of a process of its own, started by a rank."""
    return {name: value for name, value in env.items()
            if name not in RANK_VARIABLES and not name.startswith(RANK_VARIABLE_PREFIXES)}


def env_from_environ(env: Mapping[str, str] = os.environ) -> DistEnv:
    """Rank layout from torchrun/deepspeed variables, else Slurm's, else a single process; a variable that is not
    a whole number in range (``MASTER_PORT`` too, a TCP port) is a ConfigError naming it."""
    env_int(env, "MASTER_PORT", low=1, high=MAX_PORT)
    for rank_name, size_name, local_name in LAUNCHER_VARIABLES:
        if rank_name in env and size_name in env:
            world_size = env_int(env, size_name, low=1)
            rank = env_int(env, rank_name, high=world_size - 1)
            return DistEnv(rank, world_size, env_int(env, local_name, 0, high=world_size - 1))
    return DistEnv(0, 1, 0)


def _check_rendezvous(layout: DistEnv, env: Mapping[str, str]) -> None:
    """MASTER_ADDR and MASTER_PORT set for several processes; LOCAL_RANK one of this node's GPUs when it has any."""
    if layout.world_size > 1 and not ("MASTER_ADDR" in env and "MASTER_PORT" in env):
        raise ConfigError("MASTER_ADDR and MASTER_PORT must be set for a multi-process run "
                           "(the deepspeed launcher and torchrun set them; export them in an sbatch script)")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and layout.local_rank >= gpus:
        raise ConfigError(f"environment variable LOCAL_RANK: {layout.local_rank}, but this node has {gpus} GPU(s) "
                          f"(ranks 0 to {gpus - 1}); start at most {gpus} ranks per node")


def quiet_library_warnings(rank: int) -> None:
    """One copy of each library warning per run: rank 0 alone prints Python's warnings (N ranks would print N
    copies of e.g. torch's FutureWarnings from DeepSpeed's collectives), and those FutureWarnings not at all
    unless ``--verbose`` (:mod:`distaff.train.core.verbosity`). And no rank prints DeepSpeed's guess
    at its accelerator ("unable to detect" a GPU) on a machine without one: the CPU accelerator is named, as
    DeepSpeed would pick it. Call before DeepSpeed is imported."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if rank != 0:
        warnings.simplefilter("ignore")
    quiet_torch_warnings()


PR_SET_PDEATHSIG = 1


def die_with_launcher() -> None:
    """Get SIGTERM (checkpoint, exit 75) when the launcher that started this rank dies.

    torchrun and the deepspeed launcher start ranks in their own sessions, so a SIGKILLed launcher
    would leave them training, unsupervised, into a run directory a restarted job then shares.
    Only for launched ranks (rank variables set): a run started from a shell keeps running on its own.
    """
    if not sys.platform.startswith("linux") or not ("RANK" in os.environ or "SLURM_PROCID" in os.environ):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() == 1:           # the launcher died before the call above
        os.kill(os.getpid(), signal.SIGTERM)


def init_distributed(timeout_s: int) -> DistEnv:
    """Initialise torch.distributed (NCCL on GPUs, gloo on CPUs) for the launcher's layout."""
    layout = env_from_environ()
    _check_rendezvous(layout, os.environ)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    # DeepSpeed reads these names whichever launcher started us.
    os.environ.update(RANK=str(layout.rank), WORLD_SIZE=str(layout.world_size), LOCAL_RANK=str(layout.local_rank))
    if torch.cuda.is_available():
        torch.cuda.set_device(layout.local_rank)
        backend = "nccl"
    else:
        backend = "gloo"
    try:
        dist.init_process_group(backend, rank=layout.rank, world_size=layout.world_size,
                                timeout=timedelta(seconds=timeout_s))
    except dist.DistNetworkError as err:
        if "EADDRINUSE" not in str(err) and "address already in use" not in str(err).lower():
            raise
        raise ConfigError(port_in_use_message(f"MASTER_PORT {os.environ['MASTER_PORT']}",
                                              os.environ["MASTER_ADDR"])) from None
    global _had_process_group
    _had_process_group = True
    return layout


def device_for(layout: DistEnv) -> torch.device:
    return torch.device("cuda", layout.local_rank) if torch.cuda.is_available() else torch.device("cpu")


def barrier() -> None:
    dist.barrier()


def all_reduce_sum(values: torch.Tensor | list[float], device: torch.device) -> list[float]:
    """Element-wise sum over ranks of a few float64 scalars (one small collective; a tensor is
    reduced in place)."""
    t = torch.as_tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def broadcast_text(text: str, device: torch.device) -> str:
    """Rank 0's ``text`` on every rank (UTF-8 bytes in two small broadcasts, nothing pickled)."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(length, src=0)
    if dist.get_rank() != 0:
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=0)
    return bytes(data.tolist()).decode()


def torch_distributed_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def shutdown() -> None:
    """Destroy the process group once every rank is done with it (the barrier: no rank tears its
    connections down while a peer still uses them)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """Exit with ``code``; once this process has had a process group, without the interpreter's teardown.

    gloo's threads can abort that teardown even after a clean ``destroy_process_group`` ("terminate called
    without an active exception", exit -6: a finished run reported as a crash). Everything a run writes
    is closed before this point, so skipping the teardown loses nothing.
    """
    if _had_process_group:
        leave_now(code)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
