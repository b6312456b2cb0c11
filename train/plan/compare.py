"""A run beside its plan: the stage times a run measured (train/run/metrics.py StageClock) against the plan's for its
config and hardware, the stage furthest off, and what to change.

The trainer prints :func:`check_line` once, at its first evaluation, and records the plan it compared with in
``RUN_DIR/plan.json``; ``distaff plan --compare RUN_DIR`` prints :func:`compare_lines`, the whole table, from
that record and the run's ``metrics.jsonl``. The furthest stage is the one whose measured time exceeds the
plan's by the most seconds per step (what costs the run the most), not by the largest ratio (a 1 ms stage
planned at 0 would win every time).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from distaff.train.core.errors import ConfigError
from distaff.train.core.threads import local_world_size
from distaff.train.plan.gpus import KINDS
from distaff.train.plan.planner import Plan, make_plan

PLAN_RECORD = "plan.json"
# the run's stage keys (metrics.jsonl, W&B perf/) -> the plan's stage names (train/plan/step_time.py STAGES)
STAGES = {"data_wait": "data wait", "forward": "forward", "backward": "backward",
          "grad_comm": "gradient communication", "optimizer": "optimizer", "other": "other", "checkpoint": "checkpoint"}
COMPUTE = ("compute is slower than planned: is the device shared or throttled (nvidia-smi; on CPUs, more ranks "
           "than cores, or other processes on them)? are the fused kernels on (model.attention_impl and "
           "kernel_impl: auto)?")
ADVICE = {
    "data wait": "raise data.num_workers, or move the shards to local disk",
    "compute (forward + backward)": COMPUTE,
    "gradient communication": ("the gradients' reduction is slower than the link allows: check the interconnect "
                               "(NCCL_DEBUG=INFO names the transport); raise train.grad_accum to reduce less often"),
    "optimizer": ("the optimizer step is slower than planned: zero.offload_optimizer steps on the host (turn it "
                  "off if memory allows); at ZeRO 1-2 it includes the new weights' all-gather"),
    "other": ("the step's loss all-reduce waits for the slowest rank: one rank is slower than the others (its "
              "data, its device, its neighbours)"),
    "checkpoint": "raise checkpoint.every, or write checkpoints to faster storage",
}
# torch.cuda.get_device_name() fragments -> the plan's GPU kind (more specific first)
DEVICE_KINDS = (("A100", "80GB", "A100-80GB"), ("A100", "", "A100-40GB"), ("H100", "PCIe", "H100-PCIe"),
                ("GH200", "", "H200"), ("H200", "", "H200"), ("H100", "", "H100-SXM"), ("L40S", "", "L40S"),
                ("4090", "", "RTX-4090"), ("B200", "", "B200"), ("V100", "", "V100-32GB"))


@dataclass(frozen=True)
class Row:
    stage: str
    plan_s: float
    measured_s: float

    @property
    def over_s(self) -> float:
        return self.measured_s - self.plan_s


def device_kind(device_name: str | None) -> str:
    """The plan's kind for a CUDA device name, ``cpu`` for CPU ranks; a ConfigError for a GPU it does not know."""
    if device_name is None:
        return "cpu"
    for fragment, variant, name in DEVICE_KINDS:
        if fragment in device_name and variant in device_name:
            return name
    raise ConfigError(f"no plan for {device_name!r}: not a GPU kind the plan knows ({', '.join(KINDS)}); "
                      "compare by hand with distaff plan --gpu-spec")


def plan_for_run(cfg, seq_len: int, world_size: int, device_name: str | None) -> tuple[Plan, str, int]:
    """The plan of a running ``cfg`` on its hardware: ranks per node from the launcher's variables."""
    per_node = min(world_size, local_world_size(os.environ))
    nodes = max(1, world_size // per_node)
    gpus = f"{per_node}x{device_kind(device_name)}"
    return make_plan(cfg, gpus, nodes, seq_len=seq_len), gpus, nodes


def rows(plan_stages: dict[str, float], measured: dict[str, float]) -> list[Row]:
    """Each stage's planned and measured seconds per step (``measured`` keyed as the run logs them)."""
    return [Row(name, plan_stages.get(name, 0.0), measured.get(key, 0.0)) for key, name in STAGES.items()]


def furthest(found: list[Row]) -> Row:
    """The stage whose measured time exceeds the plan's by the most seconds; the forward and backward count as
    one, compute (their advice is the same, and a slow device slows both)."""
    by_name = {row.stage: row for row in found}
    forward, backward = by_name["forward"], by_name["backward"]
    compute = Row("compute (forward + backward)", forward.plan_s + backward.plan_s,
                  forward.measured_s + backward.measured_s)
    grouped = [compute] + [row for row in found if row.stage not in ("forward", "backward")]
    return max(grouped, key=lambda row: row.over_s)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms" if seconds >= 0.0005 or seconds == 0 else f"{seconds * 1e3:.2f} ms"


def check_line(plan_total: float, gpus: str, nodes: int, found: list[Row]) -> str:
    """One line: measured step time vs the plan, the stage furthest off and what to change."""
    measured = sum(row.measured_s for row in found)
    worst = furthest(found)
    where = f"{nodes} x {gpus}" if nodes > 1 else gpus
    head = (f"distaff: plan check: step {measured:.3f} s measured vs {plan_total:.3f} s planned for {where} "
            f"({measured / plan_total:.2f}x)")
    if worst.over_s <= 0:
        return head + "; no stage is slower than planned"
    plan_text = "0" if worst.plan_s == 0 else _ms(worst.plan_s)
    return (f"{head}; furthest off: {worst.stage} {_ms(worst.measured_s)}, plan {plan_text}: "
            f"{ADVICE[worst.stage]}")


def first_check(cfg, seq_len: int, world_size: int, device_name: str | None, measured: dict[str, float],
                out_dir: Path, cpu_seconds: float | None = None) -> str:
    """The trainer's line at its first evaluation, and ``plan.json`` for ``distaff plan --compare``; a plan that
    cannot be made is said in the line, never raised (the run goes on). ``cpu_seconds``: a CPU rank's CPU time per
    step, said beside the wall clock when other processes took a good part of the cores."""
    try:
        plan, gpus, nodes = plan_for_run(cfg, seq_len, world_size, device_name)
    except Exception as err:  # noqa: BLE001 - a plan check never stops a run
        return f"distaff: plan check: no plan for this run ({err})"
    stages = plan.time.stages
    record = {"gpus": gpus, "nodes": nodes, "seq_len": seq_len, "plan_stage_seconds": stages,
              "plan_step_total_s": plan.time.total, "gpu": plan.gpu.name, "threads_per_rank": plan.gpu.threads}
    (out_dir / PLAN_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    line = check_line(plan.time.total, gpus, nodes, rows(stages, measured))
    wall = sum(measured.values())
    if cpu_seconds is not None and wall > 1.5 * cpu_seconds:
        line += (f" (the step took {wall:.3f} s but {cpu_seconds:.3f} s of this rank's CPU: other processes, or more "
                 "ranks than cores, share its cores)")
    return line


def measured_means(metrics_path: Path, clock: str = "") -> tuple[dict[str, float], int]:
    """Stage seconds per step averaged over the run's logged training records, the first (warm-up) left out
    when there are others, and how many records they are; ``clock="_cpu"``: CPU ranks' CPU seconds."""
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [r for r in records if "forward_s" in r]
    if not train:
        raise ConfigError(f"{metrics_path}: no stage times logged (forward_s, ...); was the run made by a "
                          "distaff that times its stages?")
    kept = train[1:] if len(train) > 1 else train
    return {key: sum(r.get(f"{key}{clock}_s", 0.0) for r in kept) / len(kept) for key in STAGES}, len(kept)


def compare_lines(run_dir: Path) -> list[str]:
    """``distaff plan --compare RUN_DIR``: every stage, planned and measured, and the check line."""
    record_path, metrics_path = run_dir / PLAN_RECORD, run_dir / "metrics.jsonl"
    for path in (record_path, metrics_path):
        if not path.is_file():
            raise ConfigError(f"--compare: {path} not found; a run writes it at its first evaluation (eval.every)")
    record = json.loads(record_path.read_text())
    measured, records = measured_means(metrics_path)
    found = rows(record["plan_stage_seconds"], measured)
    lines = [f"{run_dir}: {records} logged record(s) against the plan for {record['nodes']} x {record['gpus']} "
             f"(seconds per step; the plan's are ESTIMATES)",
             "| stage | plan ms | measured ms | measured / plan |", "|---|---|---|---|"]
    for row in found:
        ratio = f"{row.measured_s / row.plan_s:.2f}" if row.plan_s else "-"
        lines.append(f"| {row.stage} | {row.plan_s * 1e3:,.1f} | {row.measured_s * 1e3:,.1f} | {ratio} |")
    total = sum(row.measured_s for row in found)
    lines.append(f"| total | {record['plan_step_total_s'] * 1e3:,.1f} | {total * 1e3:,.1f} | "
                 f"{total / record['plan_step_total_s']:.2f} |")
    return lines + [check_line(record["plan_step_total_s"], record["gpus"], record["nodes"], found)]
