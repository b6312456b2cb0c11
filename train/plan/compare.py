"""A run beside its plan: the stage times a run measured (train/run/metrics.py StageClock) against the plan's for its
config and hardware, the stage furthest off, and what to change.

The trainer prints :func:`check_line` once, at its first evaluation, and records the plan it compared with in
``RUN_DIR/plan.json``; ``distaff plan --compare RUN_DIR`` prints :func:`compare_lines`, the whole table, from
that record and the run's ``metrics.jsonl``. The furthest stage is the one whose measured time exceeds the
plan's by the most seconds per step (what costs the run the most), not by the largest ratio (a 1 ms stage
planned at 0 would win every time). On a CPU rank whose cores other processes share (its wall clock well above
its CPU time), the wall time of a stage that waits for the other ranks beyond its own CPU work and its plan is a
wait for peers the shared cores descheduled: it is charged to compute (:func:`charge_peer_waits`), not to the network.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from distaff.train.core.errors import ConfigError
from distaff.train.core.files import read_json
from distaff.train.core.threads import local_world_size
from distaff.train.run.metrics import numbers, read_metrics
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
# a CPU rank's wall clock over its CPU time beyond which other processes (or more ranks than cores) share its cores
SHARED_CORES = 1.5
# the stages that wait for the other ranks: the gradients' reduction, the optimizer step (at ZeRO 1-2 it ends in
# the new weights' all-gather) and the rest of the step (the loss all-reduce)
PEER_STAGES = ("gradient communication", "optimizer", "other")
PEER_WAIT = "waiting for descheduled peers"
COMPUTE_STAGES = ("forward", "backward", PEER_WAIT)
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


def shares_cores(wall_s: float, cpu_s: float | None) -> bool:
    """Whether a CPU rank's step took well more wall time than CPU time (``cpu_s`` None: a GPU rank, never)."""
    return cpu_s is not None and wall_s > SHARED_CORES * cpu_s


def charge_peer_waits(found: list[Row], cpu: dict[str, float] | None) -> list[Row]:
    """On a CPU rank whose cores are shared (``cpu``: its CPU seconds per step by stage, keyed as the run logs
    them), each stage that waits for the other ranks (:data:`PEER_STAGES`) keeps the larger of its own CPU
    seconds and its plan; the rest of its wall time waited for peers that the shared cores kept off a core, which is their compute stretched, not the
    network. That rest becomes the row :data:`PEER_WAIT`, which :func:`furthest` counts as compute. Unshared cores
    or a GPU rank (``cpu`` None): the rows as they are (a wait there is the link's, or a slower device's)."""
    if not cpu or not shares_cores(sum(row.measured_s for row in found), sum(cpu.values())):
        return found
    keys = {name: key for key, name in STAGES.items()}
    kept, waited = [], 0.0
    for row in found:
        own = max(cpu.get(keys.get(row.stage, ""), 0.0), row.plan_s)
        wait = max(0.0, row.measured_s - own) if row.stage in PEER_STAGES else 0.0
        kept.append(Row(row.stage, row.plan_s, row.measured_s - wait))
        waited += wait
    return kept + [Row(PEER_WAIT, 0.0, waited)]


def furthest(found: list[Row]) -> Row:
    """The stage whose measured time exceeds the plan's by the most seconds; the forward and backward count as
    one, compute (their advice is the same, and a slow device slows both), with any wait for descheduled peers."""
    in_compute = [row for row in found if row.stage in COMPUTE_STAGES]
    compute = Row("compute (forward + backward)", sum(row.plan_s for row in in_compute),
                  sum(row.measured_s for row in in_compute))
    grouped = [compute] + [row for row in found if row.stage not in COMPUTE_STAGES]
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
    waited = sum(row.measured_s for row in found if row.stage == PEER_WAIT)
    if worst.stage.startswith("compute") and waited > 0:
        plan_text += f"; {_ms(waited)} of it waiting in communication for descheduled peers"
    return (f"{head}; furthest off: {worst.stage} {_ms(worst.measured_s)}, plan {plan_text}: "
            f"{ADVICE[worst.stage]}")


def first_check(cfg, seq_len: int, world_size: int, device_name: str | None, measured: dict[str, float],
                out_dir: Path, cpu: dict[str, float] | None = None) -> str:
    """The trainer's line at its first evaluation, and ``plan.json`` for ``distaff plan --compare``; a plan that
    cannot be made is said in the line, never raised (the run goes on). ``cpu``: a CPU rank's CPU seconds per step
    by stage; their sum is said beside the wall clock when other processes took a good part of the cores, and the
    stages' waits for descheduled peers are then compute (:func:`charge_peer_waits`)."""
    try:
        plan, gpus, nodes = plan_for_run(cfg, seq_len, world_size, device_name)
    except Exception as err:  # noqa: BLE001 - a plan check never stops a run
        return f"distaff: plan check: no plan for this run ({err})"
    stages = plan.time.stages
    record = {"gpus": gpus, "nodes": nodes, "seq_len": seq_len, "plan_stage_seconds": stages,
              "plan_step_total_s": plan.time.total, "gpu": plan.gpu.name, "threads_per_rank": plan.gpu.threads}
    (out_dir / PLAN_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    line = check_line(plan.time.total, gpus, nodes, charge_peer_waits(rows(stages, measured), cpu))
    wall, cpu_s = sum(measured.values()), None if cpu is None else sum(cpu.values())
    if shares_cores(wall, cpu_s):
        line += (f" (the step took {wall:.3f} s but {cpu_s:.3f} s of this rank's CPU: other processes, or more "
                 "ranks than cores, share its cores)")
    return line


def measured_means(metrics_path: Path, clock: str = "") -> tuple[dict[str, float], int]:
    """Stage seconds per step averaged over the run's logged training records, the first (warm-up) left out
    when there are others, and how many records they are; ``clock="_cpu"``: CPU ranks' CPU seconds."""
    stage_keys = [f"{key}{clock}_s" for key in STAGES]
    train = [r for r in read_metrics(metrics_path) if numbers(r, "forward_s") and
             all(numbers(r, key) for key in stage_keys if key in r)]
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
    record = read_json(record_path, error=ConfigError)
    if not (isinstance(record, dict) and isinstance(record.get("plan_stage_seconds"), dict)
            and numbers(record, "plan_step_total_s") and {"nodes", "gpus"} <= set(record)):
        raise ConfigError(f"--compare: {record_path}: not a plan record (plan_stage_seconds, plan_step_total_s, nodes, "
                          "gpus); the run writes it at its first evaluation: delete it and resume the run to have it "
                          "again")
    measured, records = measured_means(metrics_path)
    cpu = measured_means(metrics_path, "_cpu")[0]       # all 0 where no CPU time was logged (GPU ranks)
    cpu = cpu if any(cpu.values()) else None
    found = charge_peer_waits(rows(record["plan_stage_seconds"], measured), cpu)
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
