"""Pretraining throughput with padded vs packed (varlen) batches, on real text prepared one document per sequence.

Prepares the bundled text WITHOUT ``--pack-documents`` (every sequence is one paragraph, or a piece
of a long one), then runs the real trainer (``python -m distaff.train.pretrain`` under torchrun,
DeepSpeed ZeRO-2) twice with the same model and about the same number of real tokens:

- ``padded``: ``data.batch_size`` rows of ``seq_len`` per micro-batch, padding included;
- ``varlen``: ``data.packing=varlen``, whole sequences packed up to the same ``batch_size x seq_len``
  tokens per micro-batch, attention per sequence.

The table gives real (non-padding) tokens/s from each run's ``summary.json``, the padding fraction
(computed positions that were padding) and the held-out figures: the MLM loss, or with ``--objective
rtd`` (DeBERTa-v3's replaced-token detection, ``configs/run/tiny-rtd-cpu.yaml``: generator and
discriminator both on the packed documents) the discriminator's accuracy beside the all-"original"
baseline, its replaced-token AUC and the generator's loss. The load averages of the machine before and
after are printed with the table. Runs on CPUs (the reference kernels) or GPUs (Triton).

    python benchmarks/packing.py [--text data/austen-emma-pride.txt.gz] [--seq-len 128]
                                 [--batch-size 8] [--tokens 200000] [--ranks 2] [--work-dir DIR]
                                 [--vocab-size 4000] [--objective mlm|rtd]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
MODES = ("padded", "varlen")
RUN_CONFIGS = {"mlm": "configs/run/tiny-cpu.yaml", "rtd": "configs/run/tiny-rtd-cpu.yaml"}


def _run(cmd: list[str], env: dict[str, str]) -> None:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def prepare(text: Path, work: Path, seq_len: int, vocab_size: int, env: dict[str, str]) -> Path:
    """Tokenizer and shards, one document per sequence (no --pack-documents); reused when present."""
    data = work / "data"
    if (data / "manifest.json").is_file():
        return data
    cli = [PYTHON, "-m", "distaff.launch.cli"]
    _run(cli + ["tokenizer", "train", "--input", str(text), "--vocab-size", str(vocab_size), "--out", str(work / "tok")], env)
    _run(cli + ["data", "prepare", "--input", str(text), "--tokenizer", str(work / "tok"), "--seq-len",
                str(seq_len), "--heldout-fraction", "0.02", "--shard-mb", "0.2", "--out", str(data), "--no-progress"],
         env)
    return data


def real_tokens_per_step(data: Path, mode: str, batch_size: int, ranks: int) -> float:
    """Mean real tokens per optimizer step of the first epoch: rows x mean length when padded,
    the token-budget plan's mean batch when packed (what ``distaff ablate``'s ``budget: real`` uses)."""
    from distaff.train.data.manifest import read_manifest
    from distaff.train.tools.ablate import real_tokens_per_batch

    budget = batch_size * read_manifest(data).seq_len if mode == "varlen" else 0
    return ranks * real_tokens_per_batch(data, batch_size, budget, 1234)


def train(data: Path, work: Path, mode: str, steps: int, args, env: dict[str, str]) -> dict:
    out = work / f"run-{args.objective}-{mode}"
    from distaff.train.core.distributed import free_port

    cmd = [str(Path(PYTHON).with_name("torchrun")), "--nproc_per_node", str(args.ranks), "--master_port",
           str(free_port()), "-m", "distaff.train.pretrain", "--config", str(REPO / RUN_CONFIGS[args.objective]),
           f"run.out_dir={out}", f"data.dir={data}", f"data.batch_size={args.batch_size}", f"data.packing={mode}",
           f"train.max_steps={steps}", "optim.warmup_steps=10", "eval.every=0", "eval.batches=20",
           "checkpoint.every=0", "checkpoint.resume=none", "logging.every=10", "logging.progress_bar=false",
           "logging.plot=false", "wandb.mode=disabled"]
    _run(cmd, env)
    return json.loads((out / "summary.json").read_text())


def held_out(summary: dict, objective: str) -> str:
    """The run's held-out figures as table cells."""
    if objective == "mlm":
        return f"{summary['eval_loss']:.3f}"
    return (f"{summary['eval_rtd_accuracy']:.4f} ({summary['eval_rtd_baseline_accuracy']:.4f}) | "
            f"{summary['eval_rtd_auc']:.3f} | {summary['eval_gen_loss']:.3f}")


def print_table(rows: list[tuple[str, int, dict]], args, work: Path, loads: list[tuple[float, ...]]) -> None:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    load = " -> ".join("/".join(f"{x:.1f}" for x in one) for one in loads)
    print(f"\n{args.objective}, tiny preset, seq_len {args.seq_len}, {args.ranks} rank(s) x {args.batch_size} x "
          f"{args.seq_len} token positions per micro-batch, ZeRO-2, fp32, {device}, load average (1/5/15 min) "
          f"{load} (before -> after); data: {Path(args.text).name} without --pack-documents ({work / 'data'})")
    figures = ("held-out loss |" if args.objective == "mlm" else
               "held-out disc. accuracy (all-original) | held-out AUC | held-out generator loss |")
    print(f"| packing | steps | real tokens | samples | padding | train s | real tokens/s | {figures}")
    print("|---|---:|---:|---:|---:|---:|---:|" + "---:|" * figures.count("|"))
    for mode, steps, s in rows:
        print(f"| {mode} | {steps} | {s['tokens']:,} | {s['samples']:,} | {100 * s['padding_fraction']:.1f}% "
              f"| {s['train_time_s']:.1f} | {s['tokens_per_s']:,.0f} | {held_out(s, args.objective)} |")
    print(f"varlen / padded real tokens/s: {rows[1][2]['tokens_per_s'] / rows[0][2]['tokens_per_s']:.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", default=str(REPO / "data/austen-emma-pride.txt.gz"))
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=200_000, help="real tokens each run trains on (about)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--work-dir", default="")
    parser.add_argument("--objective", choices=sorted(RUN_CONFIGS), default="mlm",
                        help="mlm (tiny-cpu.yaml) or rtd (tiny-rtd-cpu.yaml: generator and discriminator)")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="distaff-packing-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    import torch

    if not torch.cuda.is_available():
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        env.pop("TRITON_INTERPRET", None)  # the reference kernels are the CPU path
    data = prepare(Path(args.text), work, args.seq_len, args.vocab_size, env)
    loads, rows = [os.getloadavg()], []
    for mode in MODES:
        steps = math.ceil(args.tokens / real_tokens_per_step(data, mode, args.batch_size, args.ranks))
        rows.append((mode, steps, train(data, work, mode, steps, args, env)))
    loads.append(os.getloadavg())
    print_table(rows, args, work, loads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
