"""The plan's memory against a measured step, as a table: the CPU allocator's own count of live bytes (torch.profiler
memory events) over a real forward + backward + optimizer step of DeepSpeed engines on 2 CPU ranks (gloo), beside
the plan's figure for the same CPU setting (the reference kernels, no communication overlap).

    python benchmarks/plan_memory.py                                    # tiny and deberta-v3-xsmall, every stage
    python benchmarks/plan_memory.py --presets deberta-v3-base --zero 0 2 --precisions fp32
    python benchmarks/plan_memory.py --json benchmarks/results/plan_memory.json
    python benchmarks/plan_memory.py --long-and-packed --json benchmarks/results/plan_memory_long_packed.json

The test suite checks tiny (tests/plan/test_plan_memory.py); the larger models take minutes and GBs of host
memory per rank. Every setting of a preset runs in the same two processes, one engine after another.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from distaff.train.plan.measure import measure_peaks
from distaff.train.plan.memory import step_peak
from distaff.train.plan.planner import cpu_run_setting
from distaff.train.run.config import config_from_dict

MIB = 1024 ** 2
SIZES = {"tiny": (4, 64), "deberta-v3-xsmall": (2, 64), "deberta-v3-base": (2, 64)}


# activations most of the peak, where the plan erred low before issue 50: packed batches, and long sequences in
# half precision (tiny with 512 positions); (zero, micro-batch, seq_len, precision, packing)
LONG_AND_PACKED = [(0, 16, 128, "fp32", "varlen"), (0, 16, 128, "bf16", "varlen"), (0, 16, 512, "bf16", "padded"),
                   (0, 16, 512, "fp32", "padded"), (2, 8, 512, "bf16", "varlen")]


def run_values(preset: str, zero: int, batch: int, precision: str, packing: str = "padded",
               positions: int | None = None) -> dict:
    model = {"preset": preset, **({"max_position_embeddings": positions} if positions else {})}
    return {"model": model, "data": {"dir": "unused", "batch_size": batch, "packing": packing},
            "train": {"precision": precision}, "zero": {"stage": zero}, "run": {"seed": 3}}


def measure_preset(preset: str, zeros: list[int], precisions: list[str], work: Path) -> list[dict]:
    batch, seq_len = SIZES[preset]
    return measure_settings([(run_values(preset, zero, batch, precision), seq_len) for zero in zeros
                             for precision in precisions], work / preset)


def measure_settings(settings: list[tuple[dict, int]], work: Path) -> list[dict]:
    started = time.perf_counter()
    measured = measure_peaks(settings, work)
    wall = time.perf_counter() - started
    found = []
    for (values, seq_len), ranks in zip(settings, measured):
        plan = step_peak(cpu_run_setting(config_from_dict(values), 2, seq_len))
        found.append({"preset": values["model"]["preset"], "zero": values["zero"]["stage"],
                      "precision": values["train"]["precision"], "batch": values["data"]["batch_size"],
                      "seq_len": seq_len, "packing": values["data"]["packing"],
                      "positions": values["model"].get("max_position_embeddings"),
                      "measured_peak": [r["peak"] for r in ranks],
                      "measured_phases": [r["phases"] for r in ranks],
                      "measured_unseen_frees": [r["unseen_frees"] for r in ranks], "plan_peak": plan.peak,
                      "plan_phases": plan.phases, "wall_s_all_settings": wall, "load": os.getloadavg()[0]})
    return found


def table_lines(results: list[dict]) -> list[str]:
    lines = ["| model | ZeRO | precision | micro-batch x seq | measured peak MiB (rank 0, rank 1) | plan MiB | "
             "plan / measured |", "|---|---|---|---|---|---|---|"]
    for r in results:
        ratios = [r["plan_peak"] / m for m in r["measured_peak"]]
        measured = ", ".join(f"{m / MIB:,.1f}" for m in r["measured_peak"])
        shape = f"{r['batch']} x {r['seq_len']}" + (" packed" if r.get("packing") == "varlen" else "")
        lines.append(f"| {r['preset']} | {r['zero']} | {r['precision']} | {shape} | {measured} | "
                     f"{r['plan_peak'] / MIB:,.1f} | {min(ratios):.3f}-{max(ratios):.3f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "deberta-v3-xsmall"], choices=sorted(SIZES))
    parser.add_argument("--zero", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--long-and-packed", action="store_true", help="tiny's packed and long-sequence settings "
                                                                         "(LONG_AND_PACKED) instead")
    parser.add_argument("--json", type=Path, help="write the measurements here (docs/plan.md's table reads them)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.long_and_packed:
            results = measure_settings([(run_values("tiny", zero, batch, precision, packing, 512), seq_len)
                                        for zero, batch, seq_len, precision, packing in LONG_AND_PACKED],
                                       Path(tmp) / "long")
        for preset in [] if args.long_and_packed else args.presets:
            results += measure_preset(preset, args.zero, args.precisions, Path(tmp))
            print(f"{preset}: measured (load {results[-1]['load']:.1f})", file=sys.stderr, flush=True)
    print("\n".join(table_lines(results)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
