"""The plan's memory against a measured step, as a table: the live-tensor peak of a real forward + backward +
optimizer step (2 CPU ranks, DeepSpeed over gloo, fp32, reference kernels) next to the plan's figure.

    python benchmarks/plan_memory.py                                   # deberta-v3-base, ZeRO 0 and 2
    python benchmarks/plan_memory.py --presets tiny deberta-v3-xsmall --batch 2 --seq-len 64

The test suite checks the small models (tests/plan/test_plan_memory.py); the base model is here because
it takes minutes and several GB of host memory per rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from distaff.train.plan.measure import measure_peak
from distaff.train.plan.memory import step_peak
from distaff.train.plan.planner import cpu_run_setting
from distaff.train.run.config import config_from_dict

MIB = 1024 ** 2


def run_values(preset: str, zero: int, batch: int) -> dict:
    return {"model": {"preset": preset}, "data": {"dir": "unused", "batch_size": batch},
            "train": {"precision": "fp32"}, "zero": {"stage": zero}, "run": {"seed": 3}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["deberta-v3-base"])
    parser.add_argument("--zero", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print("| model | ZeRO | micro-batch x seq | measured peak MiB (rank 0) | plan MiB | plan / measured | "
          "wall s |\n|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            for zero in args.zero:
                values = run_values(preset, zero, args.batch)
                start = time.perf_counter()
                measured = measure_peak(values, args.seq_len, Path(tmp) / f"{preset}-{zero}")[0]["peak"]
                planned = step_peak(cpu_run_setting(config_from_dict(values), 2, args.seq_len)).peak
                print(f"| {preset} | {zero} | {args.batch} x {args.seq_len} | {measured / MIB:,.1f} | "
                      f"{planned / MIB:,.1f} | {planned / measured:.3f} | {time.perf_counter() - start:.0f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
