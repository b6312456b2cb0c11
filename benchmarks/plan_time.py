"""The plan's step time on CPU ranks against real runs on this machine, as a table (docs/plan.md).

    python benchmarks/plan_time.py                       # every run, twice; 15-30 minutes on 2 cores
    python benchmarks/plan_time.py --runs tiny-z2 --repeat 1
    python benchmarks/plan_time.py --json benchmarks/results/plan_time_cpu.json
    python benchmarks/plan_time.py --out-of-sample --repeat 1 --json benchmarks/results/plan_time_oos.json
    python benchmarks/plan_time.py --runs tiny-z2-8x128 --update --json benchmarks/results/plan_time_cpu.json

Each run is a real ``distaff pretrain`` on 1 or 2 CPU ranks (torchrun, gloo; one thread each, OMP_NUM_THREADS=1)
over the bundled text, with its stages timed by the trainer (train/run/metrics.py StageClock, metrics.jsonl). The
plan is ``distaff plan --gpus Nxcpu`` for the same config and the threads the run used, on this machine as probed
around the run: the mean of a probe just before it and one just after (:func:`bracketing_probe`). This machine's
speed drifts with its neighbours (one thread's GEMMs at 66-118 GFLOP/s, its copies at 21-59 GB/s within two days,
issue 50), so one probe for a quarter hour of runs plans the later ones for a machine they did not run on; each
row carries its own probe, which also lets ``--update`` remeasure some rows of a committed result and keep the
others. ``--out-of-sample`` runs :data:`OUT_OF_SAMPLE` instead: shapes none of the CPU model's
tables were measured at and none of :data:`RUNS` (1 and 2 ranks, micro-batches 4-32, sequences 64-512, MLM and
RTD, padded and packed, fp32 and bf16), each a few steps. The load average of the machine is
recorded before and after each run: the machine may be shared, and a busy machine runs slower than planned.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from distaff.train.core.distributed import free_port
from distaff.train.plan.compare import measured_means, rows
from distaff.train.plan.cpu import core_kind, probe as probe_machine, probed
from distaff.train.plan.planner import make_plan
from distaff.train.run.config import load_config
from distaff.train.run.metrics import numbers, read_metrics

REPO = Path(__file__).resolve().parents[1]
SAMPLE = [REPO / "data" / "austen-emma-pride.txt.gz", REPO / "data" / "movie-unlabelled.txt.gz"]
# name: (run preset, overrides, seq_len, steps); every run: 2 CPU ranks, fp32, logging every 2 steps
RUNS = {
    "tiny-z2-8x128": ("tiny-cpu", ["zero.stage=2", "data.batch_size=8"], 128, 24),
    "tiny-z0-16x64": ("tiny-cpu", ["zero.stage=0", "data.batch_size=16"], 64, 24),
    "tiny-z1-packed-8x128": ("tiny-cpu", ["zero.stage=1", "data.batch_size=8", "data.packing=varlen"], 128, 24),
    "tiny-rtd-z2-8x128": ("tiny-rtd-cpu", ["zero.stage=2", "data.batch_size=8"], 128, 24),
    "tiny-z2-dropout-4x128": ("tiny-cpu", ["zero.stage=2", "data.batch_size=4", "model.hidden_dropout_prob=0.1",
                                           "model.attention_probs_dropout_prob=0.1"], 128, 24),
    "xsmall-z1-4x128": ("tiny-cpu", ["model.preset=deberta-v3-xsmall", "zero.stage=1", "data.batch_size=4"], 128, 12),
    "xsmall-z0-2x64": ("tiny-cpu", ["model.preset=deberta-v3-xsmall", "zero.stage=0", "data.batch_size=2"], 64, 12),
    "xsmall-rtd-z2-2x128": ("tiny-rtd-cpu", ["model.preset=deberta-v3-xsmall", "zero.stage=2", "data.batch_size=2"],
                            128, 12),
    "base-z2-2x64": ("tiny-cpu", ["model.preset=deberta-v3-base", "zero.stage=2", "data.batch_size=2"], 64, 8),
}
LONG = "model.max_position_embeddings=512"       # tiny has 128 positions (EMD): longer sequences need more
# name: (run preset, overrides, seq_len, steps, ranks): shapes the CPU model was not built on (issue 50)
OUT_OF_SAMPLE = {
    "oos-1rank-z0-16x128": ("tiny-cpu", ["zero.stage=0", "data.batch_size=16"], 128, 10, 1),
    "oos-z2-32x64": ("tiny-cpu", ["zero.stage=2", "data.batch_size=32"], 64, 10, 2),
    "oos-bf16-z1-4x512": ("tiny-cpu", ["zero.stage=1", "data.batch_size=4", "train.precision=bf16", LONG], 512, 10, 2),
    "oos-rtd-packed-z2-8x256": ("tiny-rtd-cpu", ["zero.stage=2", "data.batch_size=8", "data.packing=varlen", LONG,
                                                 "rtd.generator.max_position_embeddings=512"], 256, 10, 2),
    "oos-1rank-bf16-packed-z0-8x256": ("tiny-cpu", ["zero.stage=0", "data.batch_size=8", "data.packing=varlen",
                                                    "train.precision=bf16", LONG], 256, 10, 1),
    "oos-rtd-bf16-z0-4x64": ("tiny-rtd-cpu", ["zero.stage=0", "data.batch_size=4", "train.precision=bf16"], 64, 10,
                             2),
}
THREADS = 1        # OMP_NUM_THREADS of every run: one thread per rank, as CPU time is compared


def prepare(work: Path, seq_len: int, env: dict) -> Path:
    """Tokenizer (4000 pieces) and shards of ``seq_len`` tokens from the bundled text, once per length."""
    data = work / f"data-{seq_len}"
    if (data / "manifest.json").is_file():
        return data
    cli = [sys.executable, "-m", "distaff.launch.cli"]
    if not (work / "tokenizer" / "spm.model").is_file():
        subprocess.run(cli + ["tokenizer", "train", "--input", *map(str, SAMPLE), "--vocab-size", "4000", "--out",
                              str(work / "tokenizer")], check=True, env=env, capture_output=True)
    subprocess.run(cli + ["data", "prepare", "--input", *map(str, SAMPLE), "--tokenizer", str(work / "tokenizer"),
                          "--seq-len", str(seq_len), "--pack-documents", "--shard-mb", "0.5", "--out", str(data),
                          "--no-progress"], check=True, env=env, capture_output=True)
    return data


def train(preset: str, overrides: list[str], data: Path, steps: int, out: Path, env: dict,
          ranks: int = 2) -> tuple[float, str]:
    """One run of ``ranks`` ranks; the wall seconds it took and the plan check it printed."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = [torchrun, "--nproc_per_node", str(ranks), "--master_port", str(free_port()), "-m", "distaff.train.pretrain",
           "--config", preset, f"run.out_dir={out}", f"data.dir={data}", f"train.max_steps={steps}",
           "logging.every=2", "logging.progress_bar=false", "logging.plot=false", "eval.every=0", "eval.batches=1",
           "checkpoint.every=0", "checkpoint.resume=none", "wandb.mode=disabled", "data.num_workers=0", *overrides]
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    check = [line for line in done.stdout.splitlines() if line.startswith("distaff: plan check:")]
    return time.perf_counter() - started, check[0] if check else ""


def cpu_plan(result: dict, probe: dict):
    """The plan of a measured run (its config, sequence length and vocabulary) on its CPU ranks of the probed
    machine, with the threads each rank ran (``ranks x threads`` cores for the plan to share): what this script
    printed, and what docs/plan.md's tables are checked against."""
    cfg = load_config(result["preset"], [*result["overrides"], f"model.vocab_size={result['vocab_size']}"])
    ranks, threads = result.get("ranks", 2), result.get("threads", THREADS)
    cores = replace(core_kind(probe), cores=ranks * threads)
    return make_plan(cfg, f"{ranks}xcpu", seq_len=result["seq_len"], gpu_spec=cores)


def bracketing_probe(before: dict, after: dict) -> dict:
    """The machine over a run: the mean of its figures probed just before and just after (each GEMM rate, the copy
    bandwidth, the load), with the rest (cores, memory, version) of the later probe."""
    curve = [(k, (fp32 + fp32_after) / 2, (bf16 + bf16_after) / 2)
             for (k, fp32, bf16), (_, fp32_after, bf16_after) in zip(before["gemm_gflops"], after["gemm_gflops"])]
    return {**after, "gemm_gflops": curve, "copy_gb_s": (before["copy_gb_s"] + after["copy_gb_s"]) / 2,
            "load_average": (before["load_average"] + after["load_average"]) / 2, "date": before["date"],
            "bracketed": True}


def measure(name: str, work: Path, env: dict) -> dict:
    preset, overrides, seq_len, steps, ranks = (*RUNS[name], 2) if name in RUNS else OUT_OF_SAMPLE[name]
    data = prepare(work, seq_len, env)
    out = work / f"run-{name}"
    shutil.rmtree(out, ignore_errors=True)
    load_before, probe_before = os.getloadavg()[0], probe_machine()
    wall, check = train(preset, overrides, data, steps, out, env, ranks)
    machine = bracketing_probe(probe_before, probe_machine())
    measured, records = measured_means(out / "metrics.jsonl")
    measured_cpu, _ = measured_means(out / "metrics.jsonl", "_cpu")
    step_times = [r["step_time_s"] for r in read_metrics(out / "metrics.jsonl") if numbers(r, "step_time_s")][1:]
    result = {"run": name, "preset": preset, "overrides": overrides, "seq_len": seq_len, "steps": steps,
              "ranks": ranks, "threads": THREADS,
              "vocab_size": json.loads((data / "manifest.json").read_text())["vocab_size"],
              "measured_step_s": sum(step_times) / len(step_times), "measured_stages_s": measured,
              "measured_cpu_step_s": sum(measured_cpu.values()), "measured_cpu_stages_s": measured_cpu,
              "load_before": load_before, "load_after": os.getloadavg()[0], "wall_s": wall, "check_line": check,
              "probe": machine}
    plan = cpu_plan(result, machine)
    return {**result, "plan_step_s": plan.time.total, "plan_stages_s": plan.time.stages}


def row_line(result: dict) -> str:
    """A table row: the plan's step against the measured wall clock and CPU time, and each stage's plan against
    its CPU time (the plan is an idle machine's: where others share the cores, the wall clock is longer)."""
    found = {row.stage: row for row in rows(result["plan_stages_s"], result["measured_cpu_stages_s"])}
    cells = []
    for stage in ("forward", "backward", "gradient communication", "optimizer"):
        row = found[stage]
        ratio = f"{row.plan_s / row.measured_s:.2f}" if row.measured_s > 0 else "-"     # 1 rank: no reduction
        cells.append(f"{row.plan_s * 1e3:,.0f} / {row.measured_s * 1e3:,.0f} ({ratio})")
    plan, wall, cpu = result["plan_step_s"], result["measured_step_s"], result["measured_cpu_step_s"]
    return (f"| {result['run']} | {plan * 1e3:,.0f} | {wall * 1e3:,.0f} | {plan / wall:.2f} | {cpu * 1e3:,.0f} | "
            f"{plan / cpu:.2f} | {' | '.join(cells)} | {result['load_before']:.1f}-{result['load_after']:.1f} |")


HEADER = ("| run | plan step ms | measured step ms (wall) | plan / wall | measured CPU ms per step | plan / CPU | "
          "forward ms: plan / CPU (ratio) | backward | gradient communication | optimizer | load average |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", choices=sorted({**RUNS, **OUT_OF_SAMPLE}), help="default: every run")
    parser.add_argument("--out-of-sample", action="store_true", help="the shapes the CPU model was not built on")
    parser.add_argument("--repeat", type=int, default=2, help="measure each run this many times (the median kept)")
    parser.add_argument("--json", type=Path, help="write every measurement here")
    parser.add_argument("--update", action="store_true",
                        help="replace only the measured runs in --json's committed result, keep its other rows")
    parser.add_argument("--work", type=Path, help="keep the data and runs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.update and not (args.json and args.json.is_file()):
        parser.error(f"--update needs --json naming a committed result, got {args.json}")
    runs = args.runs or list(OUT_OF_SAMPLE if args.out_of_sample else RUNS)
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)
    probe = probed(refresh=True)
    print(f"probe: {probe['gemm_gflops']} GFLOP/s per core, copy {probe['copy_gb_s']:.1f} GB/s, load "
          f"{probe['load_average']:.1f}", flush=True)
    print(HEADER, flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in runs:
            tries = sorted((measure(name, work, env) for _ in range(args.repeat)),
                           key=lambda r: r["measured_step_s"])
            kept = tries[len(tries) // 2]
            kept["repeats_step_s"] = [t["measured_step_s"] for t in tries]
            results.append(kept)
            print(row_line(kept), flush=True)
    if args.json:
        recorded = {"probe": probe, "runs": results}
        if args.update:
            recorded = merged(json.loads(args.json.read_text()), results)
        args.json.write_text(json.dumps(recorded, indent=1) + "\n")
    return 0


def merged(recorded: dict, results: list[dict]) -> dict:
    """``recorded`` (a committed result) with the rows of ``results`` in place of its rows of the same runs (new
    runs at its end); its probe stays the one of the rows that carry none of their own."""
    fresh = {r["run"]: r for r in results}
    runs = [fresh.pop(r["run"], r) for r in recorded["runs"]]
    return {**recorded, "runs": runs + list(fresh.values())}


if __name__ == "__main__":
    sys.exit(main())
