"""The ``cpu`` device kind: this machine's CPU ranks, from a probe of a few seconds (cached), or ``--gpu-spec``.

``distaff plan --gpus 2xcpu`` plans 2 CPU ranks on this machine, each with the threads a run gives it
(``train/core/threads.py``): ``OMP_NUM_THREADS`` when set (the user's choice, and what a running rank exported for
itself), at most an even share of the cores, else that even share. The probe measures, on one thread and in CPU time (so a busy machine
does not make it slower): the dense GEMM rate (fp32 and bf16) at the inner sizes encoder layers use and the
memory bandwidth of a large copy; and counts the cores and the memory. The plan is then an idle machine's: a run that shares its cores
with other processes is slower by their share. It runs
once per machine and torch version and is cached in ``$XDG_CACHE_HOME/distaff/cpu-probe.json`` (else
``~/.cache``); ``--reprobe`` measures again. ``--gpu-spec name=cpu,fp32_tflops=..,tflops=..,hbm_tb_s=..,cores=..`` gives
the per-core figures instead (no probe).

The time model reads a CPU kind as it reads a GPU (train/plan/step_time.py), with the reference kernels' costs
measured on this machine (``cpu_table.json``, by ``python benchmarks/cpu_table.py``) scaled by the ratio of
the probed rates to the rates the table was measured at.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import replace
from pathlib import Path

import torch

from distaff.train.core.threads import threads_per_rank
from distaff.train.plan.gpus import GpuKind

PROBE_VERSION = 4      # 2: CPU time (thread_time); 3: no loopback figure; 4: the least of 5 rounds
GEMM_SIZES = (128, 256, 512, 1024)       # inner sizes of the probe's GEMMs ([1024, k] x [k, k])
CPU_ARCH = 0                              # GpuKind.arch of a CPU kind


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "distaff" / "cpu-probe.json"


def machine_key() -> str:
    """What a cached probe must match: the CPU model, the cores this process may use, torch's version."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} | {usable_cores()} cores | torch {torch.__version__}"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:       # macOS
        return os.cpu_count() or 1


def _seconds(fn, repeat: int, tries: int = 5) -> float:
    """CPU seconds of this thread per call (``time.thread_time``: what the work costs a core, whatever else the
    machine runs meanwhile), the least of ``tries`` rounds of ``repeat`` calls: neighbours on a shared machine
    (its caches, its clock) only ever slow a round, as benchmarks/cpu_table.py takes its least times too."""
    fn()
    rounds = []
    for _ in range(tries):
        started = time.thread_time()
        for _ in range(repeat):
            fn()
        rounds.append((time.thread_time() - started) / repeat)
    return min(rounds)


def gemm_gflops(k: int, dtype: torch.dtype, m: int = 1024) -> float:
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, k, dtype=dtype)
    flops = 2 * m * k * k
    return flops / _seconds(lambda: a @ b, max(2, int(1e8 / flops))) / 1e9


def copy_gb_s(megabytes: int = 128) -> float:
    """Read + write bytes per second of one large copy."""
    src = torch.empty(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _seconds(lambda: dst.copy_(src), 2) / 1e9


def memory_bytes() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * 1024 ** 3


def probe() -> dict:
    """The per-core figures of this machine (one thread), and how busy it was while measured."""
    started, threads = time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        curve = [(k, gemm_gflops(k, torch.float32), gemm_gflops(k, torch.bfloat16)) for k in GEMM_SIZES]
        found = {"version": PROBE_VERSION, "machine": machine_key(), "gemm_gflops": curve,
                 "copy_gb_s": copy_gb_s(), "cores": usable_cores(),
                 "memory_bytes": memory_bytes(), "load_average": os.getloadavg()[0],
                 "date": time.strftime("%Y-%m-%d %H:%M")}
    finally:
        torch.set_num_threads(threads)
    found["seconds"] = time.perf_counter() - started
    return found


def probed(refresh: bool = False) -> dict:
    """The cached probe of this machine, measured now when missing, stale or ``refresh``."""
    path = cache_path()
    if not refresh and path.is_file():
        try:
            cached = json.loads(path.read_text())
            if cached.get("version") == PROBE_VERSION and cached.get("machine") == machine_key():
                return cached
        except (OSError, ValueError):
            pass
    found = probe()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(found, indent=1))
    tmp.replace(path)
    return found


def core_kind(figures: dict) -> GpuKind:
    """One core of the probed machine as a kind: GEMM rates at the largest probed size, its copy bandwidth."""
    _, fp32, bf16 = figures["gemm_gflops"][-1]
    return GpuKind("cpu", figures["memory_bytes"], bf16 / 1e3, fp32 / 1e3, figures["copy_gb_s"] / 1e3, 0.0, 0.0,
                   CPU_ARCH, cores=figures["cores"],
                   gemm_curve=tuple(tuple(point) for point in figures["gemm_gflops"]))


def run_threads(cores: int, ranks: int) -> int:
    """Threads per rank as a run takes them: ``OMP_NUM_THREADS`` when set (a run then uses no other number; a
    running rank exports the number it chose), else an even share of the cores; never more than that share, as
    threads beyond it only wait for a core."""
    share = threads_per_rank(cores, ranks)
    chosen = os.environ.get("OMP_NUM_THREADS", "").strip()
    return min(share, int(chosen)) if chosen.isdigit() and int(chosen) > 0 else share


def cpu_kind(ranks: int, per_core: GpuKind | None = None, refresh: bool = False) -> GpuKind:
    """``ranks`` CPU ranks of this machine as a kind per rank: each with the threads a run gives it
    (:func:`run_threads`) and the memory's share; ``per_core`` (``--gpu-spec name=cpu,...``) replaces the probe."""
    core = per_core or core_kind(probed(refresh))
    threads = run_threads(core.cores, ranks)
    curve = tuple((k, fp32 * threads, bf16 * threads) for k, fp32, bf16 in core.gemm_curve)
    return replace(core, memory_bytes=core.memory_bytes / ranks, tflops=core.tflops * threads,
                   fp32_tflops=core.fp32_tflops * threads, hbm_tb_s=core.hbm_tb_s * threads, threads=threads,
                   gemm_curve=curve)
