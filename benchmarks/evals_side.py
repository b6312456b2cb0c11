"""What evaluations beside training (``evals.mode: side``) cost the training: step time with and without them.

Prepares the bundled Austen text (the demo's tokenizer size and sequence length), then runs the real trainer
(``python -m distaff.train.pretrain`` under torchrun, the ``tiny-cpu`` preset, DeepSpeed ZeRO-2) twice on the same
data, seed and steps, checkpointing every ``--every`` steps:

- ``none``: no evaluations;
- ``side``: a word-order probe (``distaff probe``'s bshift, ``--seeds`` seeds, on the bundled movie sentences) of
  every checkpoint, in a process beside the ranks at the lowest priority (nice 19) with one thread.

The table gives each run's training time per step (``train_time_s / steps`` from ``summary.json``: the steps
alone, checkpoint saves excluded), the median and the slowest logged window of ``step_time_s`` (every
``logging.every`` steps, saves included), real tokens/s, and for ``side`` how long its evaluation processes
worked (the records' seconds) against the run's wall time. The machine's cores and load averages before and after
are printed with it: beside training, an evaluation takes cores the ranks would otherwise have. Then
``distaff evals SIDE_RUN --table``: the probe's accuracy at each checkpoint, the spread over its seeds.

``--json FILE`` also writes the figures (tables, ratio, machine, load, date); ``scripts/refresh_doc_numbers.py
--evals-side docs/pretraining.md FILE`` puts them into docs/pretraining.md's measured spans.

    python benchmarks/evals_side.py [--steps 400] [--every 50] [--seeds 1 2 3] [--ranks 2] [--repeats 2]
                                    [--work-dir DIR] [--json benchmarks/results/evals_side.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from distaff.train.run.metrics import numbers, read_metrics
from distaff.train.tools.evals import records

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
MOVIES = REPO / "data" / "movie-snippets.tsv.gz"


def _run(cmd: list[str], env: dict[str, str]) -> None:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def prepare(work: Path, env: dict[str, str]) -> Path:
    """Tokenizer (4000 pieces) and 128-token shards of the bundled Austen; reused when present."""
    data = work / "data"
    if (data / "manifest.json").is_file():
        return data
    text = REPO / "data" / "austen-emma-pride.txt.gz"
    cli = [PYTHON, "-m", "distaff.launch.cli"]
    _run(cli + ["tokenizer", "train", "--input", str(text), "--vocab-size", "4000", "--out", str(work / "tok")], env)
    _run(cli + ["data", "prepare", "--input", str(text), "--tokenizer", str(work / "tok"), "--seq-len", "128",
                "--pack-documents", "--shard-mb", "0.2", "--out", str(data), "--no-progress"], env)
    return data


def train(mode: str, data: Path, work: Path, args: argparse.Namespace, env: dict[str, str], repeat: int) -> dict:
    """One run of ``mode`` (none | side); its summary, logged windows, evaluation seconds and wall time."""
    out = work / f"{mode}-{repeat}"
    overrides = [f"run.out_dir={out}", f"data.dir={data}", f"train.max_steps={args.steps}", "logging.every=10",
                 "logging.progress_bar=false", "logging.plot=false", "wandb.mode=disabled", "eval.every=0",
                 f"checkpoint.every={args.every}", "checkpoint.keep=2"]
    if mode == "side":
        probe = {"name": "wordorder", "kind": "probe", "text": str(MOVIES), "text_column": "1",
                 "probe_tasks": ["bshift"], "seeds": args.seeds, "max_sentences": args.sentences}
        overrides += [f"evals.every={args.every}", "evals.mode=side", f"evals.tasks={json.dumps([probe])}"]
    started = time.monotonic()
    _run([str(Path(PYTHON).with_name("torchrun")), "--nproc_per_node", str(args.ranks), "--master_port",
          str(_free_port()), "-m", "distaff.train.pretrain", "--config", "tiny-cpu", *overrides], env)
    wall = time.monotonic() - started
    summary = json.loads((out / "summary.json").read_text())
    windows = [r["step_time_s"] for r in read_metrics(out / "metrics.jsonl") if numbers(r, "step_time_s")]
    evaluated = records.read(out / records.EVALS_FILE)
    return {"summary": summary, "windows": windows, "wall_s": wall, "eval_s": sum(r["seconds"] for r in evaluated),
            "records": len(evaluated)}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def per_step_ratio(results: list[tuple[str, dict]]) -> float:
    """Mean training time per step of the side runs over that of the runs without evaluations."""
    per_step = {m: statistics.mean(r["summary"]["train_time_s"] / r["summary"]["steps"] for mode, r in results
                                   if mode == m) for m in ("none", "side")}
    return per_step["side"] / per_step["none"]


def table(results: list[tuple[str, dict]], args: argparse.Namespace) -> str:
    lines = [f"{args.steps} steps of tiny-cpu on {args.ranks} CPU rank(s), a checkpoint every {args.every} steps; "
             f"side: bshift probe, seeds {args.seeds}, {args.sentences} sentences, of every checkpoint", "",
             "| run | s/step (steps alone) | median window s/step | slowest window s/step | tokens/s | "
             "evaluation s (records) | wall s |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for mode, r in results:
        s = r["summary"]
        lines.append(f"| {mode} | {s['train_time_s'] / s['steps']:.4f} | {statistics.median(r['windows']):.4f} | "
                     f"{max(r['windows']):.4f} | {s['tokens_per_s']:,.0f} | "
                     f"{r['eval_s']:.0f} ({r['records']}) | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def evals_table(run: Path, env: dict[str, str]) -> str:
    """``distaff evals RUN --table``'s table of the side run (its probe at each checkpoint)."""
    proc = subprocess.run([PYTHON, "-m", "distaff.launch.cli", "evals", str(run), "--table"], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"distaff evals {run} --table failed ({proc.returncode}): {proc.stderr[-3000:]}")
    text = proc.stdout
    return text[text.index("== evaluations of"):].split("\nplot:")[0].strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--sentences", type=int, default=1500, help="held-out sentences the probe uses")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="pairs of runs, alternating which goes first")
    parser.add_argument("--work-dir", type=Path, help="default: a temporary folder")
    parser.add_argument("--json", type=Path, help="also write the figures here (for scripts/refresh_doc_numbers.py)")
    args = parser.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="distaff-evals-side-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
           "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
    data = prepare(work, env)
    load_before = os.getloadavg()
    order = [modes for i in range(args.repeats) for modes in ((("none", "side"), ("side", "none"))[i % 2],)]
    results = [(mode, train(mode, data, work, args, env, i)) for i, modes in enumerate(order) for mode in modes]
    load_after = os.getloadavg()
    ratio = per_step_ratio(results)
    machine = (f"{os.cpu_count()}-core {platform.machine()} machine; load average {load_before[0]:.2f} before, "
               f"{load_after[0]:.2f} after (1 min)")
    side_runs = [work / f"side-{i}" for i, modes in enumerate(order) if "side" in modes]
    evals = evals_table(side_runs[-1], env)
    print(table(results, args))
    print(f"side / none, mean time per step over {args.repeats} run(s) each: {ratio:.3f}")
    print(f"machine: {machine}; work dir {work}")
    print(evals)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "command": " ".join(["python", "benchmarks/evals_side.py", *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d"),
            "machine": machine, "table": table(results, args), "ratio": round(ratio, 3),
            "evals_table": evals.split("\n", 1)[1]}, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
