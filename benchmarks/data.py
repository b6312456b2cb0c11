"""Data pipeline throughput on the shared corpora (CPU): prepare MB/s per core, loader tokens/s per worker.

    .venv/bin/python benchmarks/data.py [--corpus-dir ../shared/data/corpus] [--work DIR]

Prints two tables. "prepare" is raw text MB/s (decompress + read + tokenize + pack + write shards) for
1 and 2 tokenizer worker processes, per wall second and per CPU second summed over all processes (the
per-core figure, robust when other jobs share the cores). "loader" is non-padding tokens/s of read +
decode + mask + collate over one whole epoch, in one process (num_workers=0: what one DataLoader worker
does) and end to end through 1 DataLoader worker.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import tempfile
import time
from pathlib import Path

from distaff.train.data.collator import MaskingConfig
from distaff.train.data.loader import build_train_loader
from distaff.train.data.prepare import STATE_FILE, PrepareConfig, prepare
from distaff.train.data.tokenizer import train_tokenizer

CORPORA = ("austen", "shakespeare", "python-docs", "linux-docs")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def bench_prepare(inputs: list[Path], tokenizer: Path, work: Path, workers: int, seq_len: int) -> tuple[float, float]:
    """(raw text MB per wall second, raw text MB per CPU second of all processes involved)."""
    out = work / f"prepare-w{workers}"
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    prepare(PrepareConfig(inputs=tuple(map(str, inputs)), tokenizer_dir=str(tokenizer), seq_len=seq_len,
                          out_dir=str(out), pack_documents=True, shard_mb=4.0, workers=workers, progress=False))
    elapsed, cpu = time.perf_counter() - start, _cpu_seconds() - cpu_start
    blocks = json.loads((out / STATE_FILE).read_text())["blocks"].values()
    raw_mb = sum(b["bytes"] for b in blocks) / 1e6
    return raw_mb / elapsed, raw_mb / cpu


def bench_loader(data_dir: Path, num_workers: int, batch_size: int) -> float:
    """Non-padding tokens/s over one whole epoch (every shard read once)."""
    loader = build_train_loader(data_dir, batch_size=batch_size, rank=0, world_size=1, num_workers=num_workers,
                                seed=0, masking=MaskingConfig())
    stream = iter(loader)
    tokens, start = 0, time.perf_counter()
    for _ in range(loader.batches_per_epoch):
        tokens += int(next(stream)["attention_mask"].sum())
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus-dir", default=str(Path(__file__).resolve().parents[2] / "shared/data/corpus"))
    parser.add_argument("--work", default=None)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="distaff-bench-"))
    inputs = [Path(args.corpus_dir) / f"{name}.txt.gz" for name in CORPORA]
    cores = os.cpu_count() or 1
    print(f"machine: {cores} cores, {cpu_model()}")
    tokenizer = train_tokenizer(inputs, 8000, work / "tok", max_input_bytes=3_000_000).path

    print("\n| prepare workers | raw text MB/s (wall) | MB per CPU-second (= MB/s per busy core) |\n|---|---|---|")
    for workers in (1, 2):
        wall, per_cpu = bench_prepare(inputs, tokenizer, work, workers, args.seq_len)
        print(f"| {workers} | {wall:.1f} | {per_cpu:.1f} |")

    data_dir = work / "prepare-w2"
    print(f"\n| loader (B={args.batch_size}, N={args.seq_len}, packed) | tokens/s |\n|---|---|")
    for label, workers in (("in-process (one worker's work)", 0), ("1 DataLoader worker, end to end", 1)):
        print(f"| {label} | {bench_loader(data_dir, workers, args.batch_size) / 1e6:.2f}M |")


if __name__ == "__main__":
    main()
