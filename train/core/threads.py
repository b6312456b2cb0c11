"""CPU threads per process: the cores this process may run on, shared by the ranks of its node, fewer when
other processes keep those cores busy.

torch gives every process one intra-op thread per core of the machine, so N ranks on a node run
N x cores threads, and their OpenMP workers spin against each other (and against anything else on the
machine) at every parallel region: 2 CPU ranks on 2 cores with the default ran several times slower
than with one thread each, and one process with 2 threads on 2 cores that other jobs kept busy ran 8x
slower than with one (README, ``scripts/measure-threads.sh``). Unless the user set ``OMP_NUM_THREADS``, an
entry point calls :func:`configure_threads` before any work: torch gets ``affinity // ranks per node``
threads (at least 1), reduced to what the cores left idle by other processes allow (a short sample of the
machine's CPU time), with a one-line notice saying so; ``OMP_NUM_THREADS`` is exported with that value
for the processes it starts. Importing ``distaff.train`` sets ``OMP_WAIT_POLICY=PASSIVE`` (unless set), read
when torch loads its OpenMP runtime: idle OpenMP workers sleep instead of spinning, so a thread that waits
takes no CPU time from a neighbour.

The same cores bound how many ranks one node may run (:func:`check_ranks_per_node`), for every path that starts
ranks (``distaff launch``'s ``--gpus-per-node`` and hostfile ``slots=``, ``distaff slurm submit``, ``distaff
ablate``): each rank is a process with a GPU of its own, or a core of its own on a CPU node; more do not run (two
ranks on one GPU) or only fight for the cores, and a typo (``slots=1000000``) would start a million processes,
a fork bomb on the node. The bound is this node's GPUs (else its cores) when the ranks run here; the nodes of a
hostfile, a ``--hosts`` list or a Slurm job cannot be counted from here, so for them it is
:data:`MOST_GPUS_PER_NODE`. ``--max-ranks-per-node N`` (:data:`RANKS_FLAG`) sets it instead.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from distaff.train.core.errors import ConfigError

# Ranks on this node, as each launcher tells its ranks: torchrun, the deepspeed launcher, srun
# (``--ntasks-per-node``); the first one set wins.
LOCAL_WORLD_SIZE_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")
SAMPLE_S = 0.3   # how long the machine's CPU time is watched before choosing
RANKS_FLAG = "--max-ranks-per-node"
MOST_GPUS_PER_NODE = 16   # the most accelerators one node of any current system holds (HGX-2 class: 16)


def local_world_size(env: Mapping[str, str]) -> int:
    """The number of ranks on this node (1 for a process no launcher started). Only a hint for the threads: a value
    that is no positive number of ASCII digits (Slurm's ``2(x3)`` for uneven nodes, or ``²``) is passed over."""
    for name in LOCAL_WORLD_SIZE_VARS:
        value = env.get(name, "").strip()
        if re.fullmatch(r"[0-9]+", value) and int(value) > 0:
            return int(value)
    return 1


def threads_per_rank(cores: int, ranks: int) -> int:
    """An even share of ``cores`` for each of ``ranks`` processes, at least one."""
    return max(1, cores // max(1, ranks))


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, from ``/proc/stat``; None where there is none."""
    try:
        with open("/proc/stat", encoding="ascii") as handle:
            fields = [int(x) for x in handle.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)   # idle + iowait
    total = sum(fields[:8])                                    # guest time is already counted in user
    return total - idle, total


def busy_cores(sample_s: float = SAMPLE_S) -> float:
    """How many of the machine's cores other processes keep busy now: CPU time over ``sample_s`` seconds
    while this process sleeps (the 1-minute load average where ``/proc/stat`` is missing)."""
    before = _cpu_times()
    if before is None:
        return os.getloadavg()[0]
    time.sleep(sample_s)
    after = _cpu_times()
    busy, total = after[0] - before[0], after[1] - before[1]
    return (os.cpu_count() or 1) * busy / total if total > 0 else 0.0


@dataclass(frozen=True)
class ThreadPlan:
    threads: int   # intra-op threads for this process
    share: int     # the even share of the cores it would take on an idle machine
    cores: int     # the cores of its affinity
    busy: float    # cores other processes were keeping busy

    def notice(self) -> str:
        """The one line that says why fewer threads than the share were chosen."""
        return (f"distaff: other processes keep {self.busy:.1f} of the {self.cores} cores busy: {self.threads} CPU "
                f"thread(s) per rank instead of {self.share}; set OMP_NUM_THREADS to choose")


def plan_threads(cores: int, ranks: int, busy: float) -> ThreadPlan:
    """The share of ``cores`` each of ``ranks`` ranks takes, cut to the cores ``busy`` leaves idle (rounded:
    a core half used by someone else is left to them). The other ranks of this node may be busy starting up
    while the machine is watched, so up to ``ranks - 1`` busy cores are counted as theirs."""
    share = threads_per_rank(cores, ranks)
    others = max(0.0, busy - (ranks - 1))
    idle_per_rank = (cores - others) / max(1, ranks)
    return ThreadPlan(threads=max(1, min(share, int(idle_per_rank + 0.5))), share=share, cores=cores, busy=busy)


def planned_threads(env: Mapping[str, str], affinity: set[int] | None = None,
                    busy: float | None = None) -> ThreadPlan | None:
    """The threads for this process, or None when the user chose (``OMP_NUM_THREADS`` set). ``busy``: the
    cores other processes use (measured by :func:`busy_cores` when not given)."""
    if env.get("OMP_NUM_THREADS"):
        return None
    cores = len(os.sched_getaffinity(0) if affinity is None else affinity)
    ranks = local_world_size(env)
    if threads_per_rank(cores, ranks) == 1:       # nothing to cut: skip the sample
        return plan_threads(cores, ranks, 0.0)
    return plan_threads(cores, ranks, busy_cores() if busy is None else busy)


def configure_threads(env: dict[str, str] | os._Environ = os.environ, affinity: set[int] | None = None,
                      busy: float | None = None, *, announce: bool = True) -> int:
    """Apply :func:`planned_threads` to torch and export it in ``env``; returns torch's thread count. When the
    busy machine cut the share, the first rank of the node says so on stderr, if it ``announce``s: a command that
    trains does; one that converts or inspects (export, --check, --print-config) is over too soon to care."""
    import torch

    plan = planned_threads(env, affinity, busy)
    if plan is not None:
        torch.set_num_threads(plan.threads)
        env["OMP_NUM_THREADS"] = str(plan.threads)
        if announce and plan.threads < plan.share and env.get("LOCAL_RANK", "0") in ("", "0"):
            print(plan.notice(), file=sys.stderr, flush=True)
    return torch.get_num_threads()


# ---------------------------------------------------------------- ranks per node


@dataclass(frozen=True)
class RankBound:
    limit: int
    what: str       # what the limit is, for the error: "the 2 core(s) of this node (it has no GPU)"


def this_node() -> RankBound:
    """This node's GPUs, else the cores this process may run on."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        return RankBound(gpus, f"the {gpus} GPU(s) of this node")
    cores = len(os.sched_getaffinity(0))
    return RankBound(cores, f"the {cores} core(s) of this node (it has no GPU)")


def rank_bound(override: int | None, *, here: bool) -> RankBound:
    """The bound for ranks that run on this node (``here``) or on other nodes, or the user's ``override``."""
    if override is not None:
        if override < 1:
            raise ConfigError(f"{RANKS_FLAG} {override}: expected at least 1")
        return RankBound(override, f"{RANKS_FLAG} {override}")
    if here:
        return this_node()
    return RankBound(MOST_GPUS_PER_NODE, f"{MOST_GPUS_PER_NODE}, the most GPUs a node has (other nodes' GPUs cannot "
                                         "be counted from here)")


def check_ranks_per_node(count: int, what: str, bound: RankBound) -> None:
    """``count`` ranks per node, as ``what`` asks (``--gpus-per-node 8``, ``slots=8 of gpu01``), must be at least 1
    and at most ``bound``; a ConfigError naming ``what``, the bound and :data:`RANKS_FLAG` otherwise."""
    if count < 1:
        raise ConfigError(f"{what}: expected at least 1 rank per node")
    if count > bound.limit:
        raise ConfigError(f"{what}: {count:,} ranks per node, more than {bound.what}; each rank is a process with a "
                          f"GPU (or a core) of its own: ask for at most {bound.limit}, or pass {RANKS_FLAG} {count} "
                          "if the nodes really run that many")
