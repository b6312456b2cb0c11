"""Shared helpers for the pretraining tests: real data prepared once, multi-rank launches, W&B run files.

Prepared data and finished runs are cached under pytest's session base temp folder, so test
modules that need the same run share it (each module imports these helpers itself).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from distaff.train.core.distributed import free_port
from distaff.train.data.stream import Plan

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
TORCHRUN = str(Path(PYTHON).with_name("torchrun"))

# A model small enough for 2 CPU ranks to take a step in well under a second.
TEST_MODEL = {"preset": "tiny", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "intermediate_size": 128, "max_position_embeddings": 64, "position_buckets": 16}
SEQ_LEN = 64


def rank_env(tmp: Path) -> dict[str, str]:
    """Environment for rank processes: CPU DeepSpeed, one thread each, W&B offline into ``tmp``."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", WANDB_MODE="offline", WANDB_SILENT="true",
               WANDB_DIR=str(tmp), WANDB_CACHE_DIR=str(tmp / "wandb-cache"), WANDB_CONFIG_DIR=str(tmp / "wandb-config"),
               WANDB_DATA_DIR=str(tmp / "wandb-data"), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)  # the reference kernels are the CPU path; the interpreter is much slower
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "WANDB_RUN_ID"):
        env.pop(key, None)
    return env


def prepare_data(base: Path, sample_data: Path, pack_documents: bool = True) -> Path:
    """Tokenizer + shards (train and held-out) from 400 KB of real Shakespeare (bundled); cached per session.
    Without ``pack_documents`` every sequence is one paragraph (short, uneven: what packed batches are for)."""
    data_dir = base / ("pretrain-data" if pack_documents else "pretrain-data-docs")
    if (data_dir / "manifest.json").is_file():
        return data_dir
    base.mkdir(parents=True, exist_ok=True)
    text = base / "shakespeare-sample.txt"
    env = rank_env(base)
    cli = [PYTHON, "-m", "distaff.launch.cli"]
    if not (base / "tokenizer" / "spm.model").is_file():
        with gzip.open(sample_data / "shakespeare.txt.gz", "rt") as handle:
            text.write_text(handle.read(400_000))
        subprocess.run(cli + ["tokenizer", "train", "--input", str(text), "--vocab-size", "1000", "--out",
                              str(base / "tokenizer")], check=True, env=env, capture_output=True)
    subprocess.run(cli + ["data", "prepare", "--input", str(text), "--tokenizer", str(base / "tokenizer"),
                          "--seq-len", str(SEQ_LEN), "--out", str(data_dir), "--heldout-fraction", "0.05",
                          "--shard-mb", "0.05", "--workers", "1", "--no-progress"]
                   + (["--pack-documents"] if pack_documents else []), check=True, env=env, capture_output=True)
    return data_dir


def prepare_source(base: Path, sample_data: Path, corpus: str = "austen-emma-pride.txt.gz", seq_len: int = SEQ_LEN,
                   chars: int = 300_000) -> Path:
    """Another data dir with :func:`prepare_data`'s tokenizer (documents packed), from another bundled text and/or at
    another length: a second source to mix, or a phase's; cached per session."""
    prepare_data(base, sample_data)                                    # the shared tokenizer
    data_dir = base / f"source-{corpus.split('.')[0]}-{seq_len}"
    if (data_dir / "manifest.json").is_file():
        return data_dir
    text = base / f"{corpus.split('.')[0]}-{chars}.txt"
    if not text.is_file():
        with gzip.open(sample_data / corpus, "rt") as handle:
            text.write_text(handle.read(chars))
    subprocess.run([PYTHON, "-m", "distaff.launch.cli", "data", "prepare", "--input", str(text), "--tokenizer",
                    str(base / "tokenizer"), "--seq-len", str(seq_len), "--out", str(data_dir), "--heldout-fraction",
                    "0.05", "--shard-mb", "0.05", "--workers", "1", "--no-progress", "--pack-documents"],
                   check=True, env=rank_env(base), capture_output=True)
    return data_dir


def write_config(path: Path, data_dir: Path, out_dir: Path, **sections) -> Path:
    """A small run config; ``sections`` (e.g. ``train={"max_steps": 5}``) update the defaults."""
    values = {
        "run": {"out_dir": str(out_dir), "name": out_dir.name, "seed": 7},
        "model": dict(TEST_MODEL),
        "data": {"dir": str(data_dir), "batch_size": 4},
        "train": {"max_steps": 12, "precision": "fp32"},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "eval": {"every": 0, "batches": 4},
    }
    return write_sections(path, values, sections)


# What every test run config shares: ZeRO-2, a log line per step, offline W&B, no periodic checkpoint.
RUN_DEFAULTS = {
    "zero": {"stage": 2},
    "logging": {"every": 1, "progress_bar": False},
    "wandb": {"mode": "offline", "project": "distaff-tests"},
    "checkpoint": {"every": 0, "keep": 2},
    "distributed": {"timeout_s": 60},
}


def write_sections(path: Path, values: dict, sections: dict) -> Path:
    """``RUN_DEFAULTS``, then ``values``, each section updated by ``sections`` (a list, ``phases``, replaced), written
    as YAML to ``path``."""
    merged = {**RUN_DEFAULTS, **values}
    for name, update in sections.items():
        merged[name] = update if isinstance(update, list) else {**merged.get(name, {}), **update}
    path.write_text(yaml.safe_dump(merged))
    return path


def torchrun(config: Path, tmp: Path, *overrides: str, timeout: float = 240, env: dict[str, str] | None = None,
             module: str = "distaff.train.pretrain", ranks: int = 2) -> subprocess.CompletedProcess:
    """``ranks`` (2) CPU ranks of ``module`` under torchrun; returns the finished process (stdout and stderr
    captured)."""
    cmd = [TORCHRUN, "--nproc_per_node", str(ranks), "--master_port", str(free_port()), "-m", module,
           "--config", str(config), *overrides]
    return subprocess.run(cmd, env={**rank_env(tmp), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout, cwd=tmp)


def spawn_ranks(config: Path, tmp: Path, *overrides: str, world_size: int = 2, env: dict[str, str] | None = None,
                program: tuple[str, ...] = ("-m", "distaff.train.pretrain")) -> list[subprocess.Popen]:
    """One process per rank with the rank variables set, as ``srun`` starts them (no supervising agent);
    ``program`` is what python runs (the trainer, or a test's wrapper around it)."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_vars = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        log = open(tmp / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([PYTHON, *program, "--config", str(config), *overrides],
                                      env={**rank_env(tmp), **(env or {}), **rank_vars}, stdout=log,
                                      stderr=subprocess.STDOUT, cwd=tmp))
    return procs


def run_probe(config: Path, tmp: Path, world_size: int, probe: Path, *overrides: str, stop_at: int = 0,
              state: bool = True, timeout: float = 240) -> tuple[list[int], str]:
    """The trainer under ``engine_probe.py`` on ``world_size`` ranks, writing into ``probe``; the exit codes
    and the ranks' logs. ``stop_at``: every rank checkpoints and exits 75 there; ``state``: dump the
    weights and optimizer moments."""
    probe.mkdir()
    procs = spawn_ranks(config, tmp, *overrides, world_size=world_size,
                        program=(str(Path(__file__).with_name("engine_probe.py")),),
                        env={"PROBE_DIR": str(probe), "PROBE_STOP_AT": str(stop_at), "PROBE_STATE": str(int(state))})
    codes = wait_all(procs, timeout=timeout)
    return codes, "\n".join((tmp / f"rank{r}.log").read_text()[-3000:] for r in range(world_size))


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    return codes


# ---------------------------------------------------------------- the data stream across a resize

def stream_plan(state: dict, lengths: np.ndarray | None = None) -> Plan:
    """The epoch plan of a loader state (``PretrainLoader.state_dict()``, as a checkpoint holds it per rank); a
    packed one (token budget) needs the epoch's sample lengths to say who read what."""
    plan = state["plan"]
    return Plan(tuple(tuple(p) for p in plan["pending"]), plan["world_size"], plan["slots"], plan["batch_size"],
                plan.get("token_budget", 0), lengths)


def positions_read(plan: Plan, batches: int) -> list[int]:
    """Epoch positions every rank of ``plan`` read in its first ``batches`` batches."""
    return [int(p) for r in range(plan.world_size) for b in range(batches) for p in plan.positions(r, b)]


def interval_positions(intervals) -> set[int]:
    return {p for a, b in intervals for p in range(a, b)}


def assert_redealt(saved: dict, later: dict, lengths: np.ndarray | None = None) -> None:
    """``later`` (a loader state of a run resumed from ``saved`` on another world size, in the same epoch) reads
    from a plan that holds exactly the positions of ``saved``'s plan nobody had read: no sample of the epoch
    is read twice or skipped."""
    old, new = stream_plan(saved, lengths), stream_plan(later, lengths)
    read_before = positions_read(old, saved["batch_in_plan"])
    assert len(read_before) == len(set(read_before))
    assert later["epoch"] == saved["epoch"] and later["plan_index"] == saved["plan_index"] + 1
    pending = interval_positions(new.pending)
    assert not pending & set(read_before)                                       # nothing read twice
    assert pending | set(read_before) == interval_positions(old.pending)        # nothing skipped
    read_after = positions_read(new, later["batch_in_plan"])
    assert set(read_after) <= pending and len(read_after) == len(set(read_after))


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}


def wait_for_step(run_dir: Path, step: int, procs: list[subprocess.Popen], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r >= step for r in train_losses(run_dir)):
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a rank exited early: {[p.poll() for p in procs]}")
        time.sleep(0.05)
    raise TimeoutError(f"step {step} not logged in {run_dir} within {timeout} s")


def run_log(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"


# ---------------------------------------------------------------- W&B offline run files

_BLOCK = 32768
_HEADER = 7  # ":W&B", magic 0xBEE1 (u16), version (u8)


def read_wandb_records(path: Path) -> list:
    """The protobuf records of a ``.wandb`` file (LevelDB-log framing: 32 KiB blocks of chunks)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B run file")
    pos, pending, records = _HEADER, b"", []
    while pos + 7 <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < 7:           # block trailer padding
            pos += left_in_block
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:   # zero padding up to the block end
            pos += left_in_block
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk   # FULL, FIRST | MIDDLE, LAST
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_runs(run_dir: Path) -> list[tuple[str, dict[int, dict]]]:
    """(run id, {step: {metric: value}}) for each offline run under ``run_dir/wandb``, oldest first."""
    runs = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        run_id, history = None, {}
        for record in read_wandb_records(next(folder.glob("*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
            elif kind == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                history[int(items["_step"])] = items
        runs.append((run_id, history))
    return runs


def rank_logs(tmp: Path, ranks: int = 2) -> str:
    """The tail of each rank's log written by :func:`spawn_ranks` into ``tmp``."""
    return "\n".join(f"--- rank{r}.log\n" + (tmp / f"rank{r}.log").read_text()[-4000:] for r in range(ranks))


def preempted_run(config: Path, tmp: Path, run_dir: Path, *, after_step: int, signal_rank: int,
                  env: dict[str, str] | None = None) -> tuple[int, Path]:
    """2 ranks that get SIGUSR1 (on one rank) once ``after_step`` is logged, and must both exit with
    75; the step they stopped at and the checkpoint ``latest`` names."""
    import signal

    from distaff.train.core.exit_codes import EXIT_PREEMPTED

    procs = spawn_ranks(config, tmp, env=env)
    wait_for_step(run_dir, after_step, procs)
    procs[signal_rank].send_signal(signal.SIGUSR1)
    assert wait_all(procs, timeout=120) == [EXIT_PREEMPTED, EXIT_PREEMPTED], rank_logs(tmp)
    checkpoints = run_dir / "checkpoints"
    return max(train_losses(run_dir)), checkpoints / (checkpoints / "latest").read_text().strip()


def namespaces_permitted() -> bool:
    """Whether ``unshare -rm`` (user + mount namespace) works here, so a test can mount a private tmpfs."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    probe = subprocess.run([unshare, "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of every event file in ``folder``, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = [p for p in folder.iterdir() if p.name.startswith("events.out.tfevents")]
    reader = EventAccumulator(str(run), size_guidance={"scalars": 0})
    reader.Reload()
    return {tag: {event.step: event.value for event in reader.Scalars(tag)} for tag in reader.Tags()["scalars"]}
