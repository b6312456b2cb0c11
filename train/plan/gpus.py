"""GPU kinds the plan knows: memory, dense bf16/fp16 peak, HBM bandwidth, links; ``--gpus 8xA100-80GB``.

Figures are vendor datasheet values (dense, no sparsity); memory is what ``nvidia-smi`` reports (MiB).
Links are per GPU and per direction: ``intra`` between GPUs of a node (NVLink, or PCIe for cards without
it), ``inter`` between nodes (the InfiniBand NIC per GPU of the usual system: HDR 200 Gb/s for A100 systems,
NDR 400 Gb/s for H100/H200/B200, 100 Gb/s Ethernet/RoCE for PCIe workstation cards).
``arch`` is the compute capability the attention table is read at; kinds with no table of their own say
which one they are scaled from (by the dense peak ratio) in ``attention_from``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from distaff.train.core.errors import MAX_PROCESSES, ConfigError, finite_float, shown, whole_number

MIB = 1024 ** 2


@dataclass(frozen=True)
class GpuKind:
    name: str
    memory_bytes: float
    tflops: float            # dense bf16/fp16 tensor peak, TFLOP/s
    fp32_tflops: float       # fp32 (non-tensor) peak, TFLOP/s
    hbm_tb_s: float          # device memory bandwidth, TB/s
    intra_gb_s: float        # GPU-GPU in a node, GB/s per direction
    inter_gb_s: float        # node-node per GPU, GB/s per direction
    arch: int                # compute capability (80, 89, 90, 100); 0: CPU ranks (train/plan/cpu.py)
    cores: int = 0           # CPU kinds: the machine's cores
    threads: int = 0         # CPU kinds: threads per rank
    gemm_curve: tuple = ()   # CPU kinds: (inner size, fp32 GFLOP/s, bf16 GFLOP/s) per core or rank

    @property
    def is_cpu(self) -> bool:
        return self.arch == 0

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / 1024 ** 3


KINDS = {k.name: k for k in (
    GpuKind("A100-40GB", 40960 * MIB, 312, 19.5, 1.555, 300, 25, 80),
    GpuKind("A100-80GB", 81920 * MIB, 312, 19.5, 2.039, 300, 25, 80),
    GpuKind("H100-SXM", 81559 * MIB, 989, 67, 3.35, 450, 50, 90),
    GpuKind("H100-PCIe", 81559 * MIB, 756, 51, 2.0, 64, 50, 90),
    GpuKind("H200", 143771 * MIB, 989, 67, 4.8, 450, 50, 90),
    GpuKind("L40S", 46068 * MIB, 362, 91.6, 0.864, 32, 12.5, 89),
    GpuKind("RTX-4090", 24564 * MIB, 165, 82.6, 1.008, 32, 12.5, 89),
    GpuKind("B200", 183359 * MIB, 2250, 80, 8.0, 900, 50, 100),
    # DGX-2's V100 (SXM3 32 GB): NVSwitch, 6 NVLink-2 links of 25 GB/s each way; 8 EDR NICs for 16 GPUs
    GpuKind("V100-32GB", 32510 * MIB, 125, 15.7, 0.9, 150, 6.25, 70),
)}
ALIASES = {"A100": "A100-80GB", "H100": "H100-SXM", "H100-80GB": "H100-SXM", "4090": "RTX-4090", "RTX4090": "RTX-4090", "V100": "V100-32GB"}


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def kind(name: str) -> GpuKind:
    """The kind named (case, dashes and spaces ignored; ``A100`` = A100-80GB, ``H100`` = H100-SXM)."""
    wanted = _key(ALIASES.get(name, name))
    for known in KINDS.values():
        if _key(known.name) == wanted:
            return known
    for alias, target in ALIASES.items():
        if _key(alias) == wanted:
            return KINDS[target]
    raise ConfigError(f"--gpus: unknown GPU kind {shown(name)}; known kinds: {', '.join(KINDS)} "
                      "(or describe it with --gpu-spec)")


def split_gpus(text: str) -> tuple[int, str]:
    """``8xA100-80GB`` -> (8, "A100-80GB"): the count per node and the kind's name as written."""
    match = re.fullmatch(r"\s*([0-9]+)\s*[x*]\s*(.+?)\s*", text)
    if not match or not 1 <= int(match.group(1)) <= MAX_PROCESSES:
        raise ConfigError(f"--gpus: expected COUNTxKIND per node (e.g. 8xA100-80GB), a COUNT of 1 to "
                          f"{MAX_PROCESSES:,}, got {shown(text)}")
    return int(match.group(1)), match.group(2)


def names_cpu(name: str) -> bool:
    """Whether ``--gpus``' kind is ``cpu`` (CPU ranks of this machine, planned by train/plan/cpu.py)."""
    return _key(name) == "cpu"


def parse_gpus(text: str, extra: GpuKind | None = None) -> tuple[int, GpuKind]:
    """``8xA100-80GB`` -> (8, the kind); ``extra`` (from ``--gpu-spec``) answers to its own name. GPU kinds only:
    ``Nxcpu`` is the planner's (train/plan/planner.py devices), which probes this machine."""
    count, name = split_gpus(text)
    if extra is not None and _key(name) == _key(extra.name):
        return count, extra
    return count, kind(name)


SPEC_KEYS = {"memory_gib": "memory_bytes", "tflops": "tflops", "fp32_tflops": "fp32_tflops",
             "hbm_tb_s": "hbm_tb_s", "intra_gb_s": "intra_gb_s", "inter_gb_s": "inter_gb_s", "arch": "arch",
             "cores": "cores"}
# a CPU's per-core figures when --gpu-spec names it cpu (no `like`): what the probe would have measured
CPU_SPEC_REQUIRED = ("tflops", "fp32_tflops", "hbm_tb_s", "cores")


def parse_spec(text: str) -> GpuKind:
    """``--gpu-spec name=MI250,memory_gib=64,tflops=181,hbm_tb_s=1.6,intra_gb_s=100,inter_gb_s=25[,like=A100-80GB]``:
    a kind not in the table; unset fields come from ``like`` (default A100-80GB)."""
    values = dict(item.split("=", 1) for item in text.split(",") if "=" in item)
    bad = [item for item in text.split(",") if "=" not in item]
    unknown = sorted(set(values) - set(SPEC_KEYS) - {"name", "like"})
    if bad or unknown or "name" not in values:
        raise ConfigError(f"--gpu-spec: expected name=NAME,KEY=VALUE,... with keys {', '.join(SPEC_KEYS)} (and "
                          f"like=KIND for the rest), got {shown(text)}")
    name = values.pop("name")
    if _key(name) == "cpu":
        missing = [key for key in CPU_SPEC_REQUIRED if key not in values]
        if missing:
            raise ConfigError(f"--gpu-spec name=cpu: give the per-core figures {', '.join(missing)} (what the probe of "
                              f"`--gpus Nxcpu` measures), e.g. name=cpu,tflops=0.2,fp32_tflops=0.08,hbm_tb_s=0.01,cores=2")
        base = GpuKind("cpu", 16 * 1024 ** 3, 0, 0, 0, 1.0, 1.0, 0)
    else:
        base = kind(values.pop("like", "A100-80GB"))
    changes: dict = {"name": name}
    for key, value in values.items():
        if key in ("arch", "cores"):
            changes[SPEC_KEYS[key]] = whole_number(value, f"--gpu-spec {key}", low=1)
            continue
        number = finite_float(value, f"--gpu-spec {key}", low=0, low_open=True)
        changes[SPEC_KEYS[key]] = number * 1024 ** 3 if key == "memory_gib" else number
    found = replace(base, **changes)
    if found.is_cpu:        # one GEMM rate for every size
        found = replace(found, gemm_curve=((1, found.fp32_tflops * 1e3, found.tflops * 1e3),))
    return found


def table_rows() -> list[str]:
    """The kinds as a markdown table (for the docs and ``distaff plan --list-gpus``)."""
    lines = ["| kind | memory GiB | bf16 TFLOP/s (dense) | HBM TB/s | intra-node GB/s | inter-node GB/s | sm |",
             "|---|---|---|---|---|---|---|"]
    for k in KINDS.values():
        lines.append(f"| {k.name} | {k.memory_gib:.1f} | {k.tflops:g} | {k.hbm_tb_s:g} | {k.intra_gb_s:g} | "
                     f"{k.inter_gb_s:g} | {k.arch} |")
    return lines


__all__ = ["GpuKind", "KINDS", "kind", "names_cpu", "parse_gpus", "parse_spec", "split_gpus", "table_rows"]
