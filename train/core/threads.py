"""CPU threads per process: the cores this process may run on, shared by the ranks of its node.

torch gives every process one intra-op thread per core of the machine, so N ranks on a node run
N x cores threads, and their OpenMP workers spin against each other (and against anything else on the
machine) at every parallel region: 2 CPU ranks on 2 cores with the default ran several times slower
than with one thread each (README). Unless the user set ``OMP_NUM_THREADS``, an entry point calls
:func:`configure_threads` before any work: torch gets ``affinity // ranks per node`` threads (at least
1), and ``OMP_NUM_THREADS`` is exported with that value for the processes it starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# Ranks on this node, as each launcher tells its ranks: torchrun, the deepspeed launcher, srun
# (``--ntasks-per-node``); the first one set wins.
LOCAL_WORLD_SIZE_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def local_world_size(env: Mapping[str, str]) -> int:
    """The number of ranks on this node (1 for a process no launcher started)."""
    for name in LOCAL_WORLD_SIZE_VARS:
        value = env.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def threads_per_rank(cores: int, ranks: int) -> int:
    """An even share of ``cores`` for each of ``ranks`` processes, at least one."""
    return max(1, cores // max(1, ranks))


def planned_threads(env: Mapping[str, str], affinity: set[int] | None = None) -> int | None:
    """The intra-op threads for this process, or None when the user chose (``OMP_NUM_THREADS`` set)."""
    if env.get("OMP_NUM_THREADS"):
        return None
    cores = len(os.sched_getaffinity(0) if affinity is None else affinity)
    return threads_per_rank(cores, local_world_size(env))


def configure_threads(env: dict[str, str] | os._Environ = os.environ, affinity: set[int] | None = None) -> int:
    """Apply :func:`planned_threads` to torch and export it in ``env``; returns torch's thread count."""
    import torch

    threads = planned_threads(env, affinity)
    if threads is not None:
        torch.set_num_threads(threads)
        env["OMP_NUM_THREADS"] = str(threads)
    return torch.get_num_threads()
