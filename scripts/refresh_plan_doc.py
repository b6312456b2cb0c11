"""Write every table and figure of docs/plan.md from the tool's output and the committed measurements.

A span is ``<!-- measured: plan.NAME -->...<!-- /measured -->`` (the syntax of refresh_doc_numbers.py). Computed
spans (the anchors, DeepSpeed's estimators, the worked example) are the plan's output now; measured spans are
rendered from ``benchmarks/results/plan_memory.json`` (benchmarks/plan_memory.py) and
``benchmarks/results/plan_time_cpu.json`` (benchmarks/plan_time.py), their plan columns computed now by the tool
(the CPU plan from the probe recorded with the measurements). ``tests/test_plan_doc.py`` renders them again and
fails when docs/plan.md differs.

    python scripts/refresh_plan_doc.py docs/plan.md          # bash scripts/refresh-doc-numbers.sh plan-tables
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MIB = 1024 ** 2


def _script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def memory_table(name: str = "plan_memory.json") -> str:
    from distaff.train.plan.memory import step_peak
    from distaff.train.plan.planner import cpu_run_setting
    from distaff.train.run.config import config_from_dict

    bench = _script(REPO / "benchmarks" / "plan_memory.py")
    results = json.loads((RESULTS / name).read_text())
    for r in results:
        values = bench.run_values(r["preset"], r["zero"], r["batch"], r["precision"], r.get("packing", "padded"),
                                  r.get("positions"))
        r["plan_peak"] = step_peak(cpu_run_setting(config_from_dict(values), 2, r["seq_len"])).peak
    return "\n" + "\n".join(bench.table_lines(results)) + "\n"


def estimators_table() -> str:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from distaff.train.plan.memory import model_states_bytes
    from distaff.train.plan.planner import base_setting
    from distaff.train.run.config import load_config

    lines = ["| model | GPUs | ZeRO | plan's model states GB | DeepSpeed's estimator GB | plan / DeepSpeed |",
             "|---|---|---|---|---|---|"]
    for preset in ("deberta-v3-base", "deberta-v3-large"):
        cfg = load_config("deberta-v3-base", [f"model.preset={preset}"])
        for gpus, nodes in ((8, 1), (8, 4), (1, 1)):
            for zero in (2, 3):
                s = base_setting(cfg, gpus * nodes, 512, None, zero, False)
                theirs = (estimate_zero2_model_states_mem_needs(s.params, gpus, nodes, cpu_offload=False)[1]
                          if zero == 2 else estimate_zero3_model_states_mem_needs(
                              s.params, s.largest_param, gpus, nodes, cpu_offload=False, cpu_offload_params=False)[1])
                ours = model_states_bytes(s)
                lines.append(f"| {preset} | {nodes}x{gpus} | {zero} | {ours / 1e9:.2f} | {theirs / 1e9:.2f} | "
                             f"{ours / theirs:.3f} |")
    return "\n" + "\n".join(lines) + "\n"


def anchors_table() -> str:
    from distaff.train.plan.anchors import anchor_lines

    return "\n" + "\n".join(anchor_lines()[2:]) + "\n"


def explain_table() -> str:
    """``distaff plan --config deberta-v3-base --gpus 8xH100-SXM --explain``'s table: the run preset on every kind."""
    from distaff.train.plan.cli import explain_lines
    from distaff.train.plan.gpus import KINDS
    from distaff.train.plan.planner import make_plan
    from distaff.train.run.config import load_config

    cfg = load_config("deberta-v3-base")
    lines = explain_lines({name: make_plan(cfg, f"8x{name}") for name in KINDS})
    return "\n" + "\n".join(lines[2:-2]) + "\n"


def clusters_table() -> str:
    bench = _script(REPO / "benchmarks" / "plan_clusters.py")
    return "\n" + "\n".join(bench.table_lines()) + "\n"


STEP_BOUND, STAGE_BOUND = 1.3, 1.5        # issue 39's bounds: each step, each stage, plan against CPU time
CHECKED_STAGES = ("forward", "backward", "gradient communication", "optimizer")


def _misses(ratios: list[tuple[str, float]], bound: float) -> str:
    missed = [f"{name} {ratio:.2f}" for name, ratio in ratios if not 1 / bound <= ratio <= bound]
    return f"{len(ratios) - len(missed)} of {len(ratios)} within {bound}x" + (
        f" (missed: {', '.join(missed)})" if missed else "")


def cpu_time_summary(runs: list[dict]) -> str:
    """How many steps and stages of the CPU time table the plan holds within the bounds, the misses named."""
    from distaff.train.plan.compare import rows

    steps = [(r["run"], r["plan_step_s"] / r["measured_cpu_step_s"]) for r in runs]
    stages = [(f"{r['run']} {row.stage}", row.plan_s / row.measured_s) for r in runs
              for row in rows(r["plan_stages_s"], r["measured_cpu_stages_s"])
              if row.stage in CHECKED_STAGES and row.measured_s > 0]
    return f"steps: {_misses(steps, STEP_BOUND)}; stages: {_misses(stages, STAGE_BOUND)}"


def _probe_line(probe: dict) -> str:
    gemm = ", ".join(f"{k}: {fp32:.0f}/{bf16:.0f}" for k, fp32, bf16 in probe["gemm_gflops"])
    return (f"{probe['date']}, {probe['machine']}, load average {probe['load_average']:.1f}: GEMM GFLOP/s per core "
            f"fp32/bf16 by inner size {gemm}; copy {probe['copy_gb_s']:.1f} GB/s")


def _probes_line(probe: dict, runs: list[dict]) -> str:
    """The result's probe, and each row's own where it has one (probed around its run)."""
    own = [f"{r['run']} {r['probe']['gemm_gflops'][0][1]:.0f} GFLOP/s, {r['probe']['copy_gb_s']:.1f} GB/s"
           for r in runs if "probe" in r]
    return _probe_line(probe) + ("" if not own else "; rows probed around their run (the mean of a probe before "
                                 "and one after; fp32 GEMMs of inner size 128, copy): " + "; ".join(own))


def _timed_runs(name: str):
    """The runs of a committed plan_time result with their plan computed now (from the probe recorded with them:
    their own, probed around the run, where they have one)."""
    bench = _script(REPO / "benchmarks" / "plan_time.py")
    recorded = json.loads((RESULTS / name).read_text())
    for run in recorded["runs"]:
        plan = bench.cpu_plan(run, run.get("probe", recorded["probe"]))
        run["plan_step_s"], run["plan_stages_s"] = plan.time.total, plan.time.stages
    return bench, recorded["probe"], recorded["runs"]


def out_of_sample_values() -> dict[str, str]:
    bench, probe, runs = _timed_runs("plan_time_oos.json")
    return {"plan.cpu_time_oos": "\n" + "\n".join([bench.HEADER, *map(bench.row_line, runs)]) + "\n",
            "plan.cpu_time_oos_summary": cpu_time_summary(runs), "plan.cpu_probe_oos": _probes_line(probe, runs),
            "plan.memory_long_packed": memory_table("plan_memory_long_packed.json")}


def cpu_time_values() -> dict[str, str]:
    bench, probe, runs = _timed_runs("plan_time_cpu.json")
    return {"plan.cpu_time": "\n" + "\n".join([bench.HEADER, *map(bench.row_line, runs)]) + "\n",
            "plan.check_example": f"\n```\n{runs[0]['check_line']}\n```\n",
            "plan.cpu_time_summary": cpu_time_summary(runs),
            "plan.cpu_probe": _probes_line(probe, runs)}


def values() -> dict[str, str]:
    return {"plan.memory": memory_table(), "plan.estimators": estimators_table(), "plan.anchors": anchors_table(),
            "plan.clusters": clusters_table(), "plan.explain": explain_table(), **cpu_time_values(),
            **out_of_sample_values()}


def main(argv: list[str]) -> int:
    refresh = _script(REPO / "scripts" / "refresh_doc_numbers.py")
    path = Path(argv[0]) if argv else REPO / "docs" / "plan.md"
    path.write_text(refresh.rewrite(path.read_text(), values()))
    print(f"{path}: rewrote {len(refresh.SPAN.findall(path.read_text()))} span(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
