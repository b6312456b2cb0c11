"""The worked example of docs/plan.md: `distaff plan` for deberta-v3-base and -large on common clusters.

    python benchmarks/plan_clusters.py            # the run preset deberta-v3-base (bf16, ZeRO 1, 32 x 512, 4 accumulation steps)

Every time, throughput and GPU-hour figure is the plan's ESTIMATE (no GPU ran); memory is the plan's model.
"""

from __future__ import annotations

import sys

from distaff.train.plan.memory import GIB
from distaff.train.plan.planner import make_plan
from distaff.train.run.config import load_config

CLUSTERS = (("8xRTX-4090", 1), ("8xL40S", 1), ("8xA100-40GB", 1), ("8xA100-80GB", 1), ("8xH100-SXM", 1),
            ("8xH100-SXM", 4), ("8xH200", 1))
MODELS = ("deberta-v3-base", "deberta-v3-large")


def table_lines() -> list[str]:
    lines = ["| model | cluster | ZeRO | GiB/GPU at 32 x 512 | fits | largest micro-batch | tokens/s | MFU | "
             "attention share | hours to 500k steps | GPU-hours |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for model in MODELS:
        cfg = load_config("deberta-v3-base", [f"model.preset={model}"])
        for gpus, nodes in CLUSTERS:
            for zero in (1, 3):
                p = make_plan(cfg, gpus, nodes, zero=zero)
                lines.append(f"| {model} | {nodes}x{gpus} | {zero} | {p.memory.total / GIB:.1f} | "
                             f"{'yes' if p.fits else 'no'} | {p.largest_micro_batch} | {p.tokens_per_s:,.0f} | "
                             f"{p.mfu:.0%} | {p.time.attention_share:.0%} | {p.hours:,.0f} | {p.gpu_hours:,.0f} |")
    return lines


def main() -> int:
    print("\n".join(table_lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
