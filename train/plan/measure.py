"""What a real training step holds in memory, read from the allocator's own counters on 2 CPU ranks.

The measurement shares none of the memory model's assumptions: each rank runs ``torch.profiler`` with
``profile_memory=True`` from before its model is built, so every allocation and free of the CPU allocator
is an event with its byte count (``c10::ProfiledCPUMemoryReporter``); their running sum is the allocator's
count of live bytes, whatever made them (weights, DeepSpeed's buckets and flat buffers, autograd's saved
tensors, the optimizer's temporaries). The rank builds a real DeepSpeed engine (gloo), steps once (the
optimizer states are born), lets that step's buffers go (:func:`settle`), then marks the second step's
forward, backward and optimizer step; the peak of the running sum inside each is what the plan's figure is
compared with. One correction: the profiler sees only the frees of the threads it profiles, and gloo's
worker threads sometimes drop the last reference to a collective's buffer (a race with the caller): such a
block from the first step stays in the running sum forever. The bytes alive before the measured step are
therefore also counted directly (every tensor storage Python can reach, :func:`live_bytes`), and what the
running sum holds beyond them then (``unseen_frees`` in the result) is taken off the step's levels. The correction
can only lower a level to what is really alive: bytes allocated before profiling started count in the direct
count but not in the running sum, so a block's missed free is at worst under-corrected (the measured peak stays
high, never low); a first-step buffer freed unseen during the measured step itself is not corrected.

``python -m distaff.train.plan.measure`` is one rank of that measurement (started by :func:`measure_peaks`
once per rank); it measures several settings in one process, one engine after another.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

PHASES = ("forward", "backward", "optimizer step")


def allocation_levels(prof) -> list[tuple[int, int]]:
    """(time ns, live bytes) after each CPU allocator event of ``prof``, in time order: the running sum of the
    events' signed byte counts (frees of blocks allocated before profiling started are not reported)."""
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
    events.sort(key=lambda e: e.start_ns())
    levels, level = [], 0
    for event in events:
        level += event.nbytes()
        levels.append((event.start_ns(), level))
    return levels


def phase_windows(prof) -> dict[str, tuple[int, int]]:
    """The (start, end) ns of each marked phase of the measured step."""
    found = {}
    for event in prof.profiler.kineto_results.events():
        if event.name() in PHASES:
            found[event.name()] = (event.start_ns(), event.end_ns())
    return found


def phase_peaks(levels: list[tuple[int, int]], windows: dict[str, tuple[int, int]]) -> dict[str, int]:
    """The highest live-bytes level inside each window (the level on entry counts: it is live there too)."""
    peaks = {}
    for name, (start, end) in windows.items():
        before = [level for t, level in levels if t < start]
        inside = [level for t, level in levels if start <= t <= end]
        peaks[name] = max(inside + before[-1:]) if inside or before else 0
    return peaks


def live_bytes(engine) -> int:
    """Bytes of every tensor storage alive now that Python can reach: the garbage collector's tensors and the
    engine's gradients and optimizer states (each storage once)."""
    found: dict[int, int] = {}
    with warnings.catch_warnings():    # isinstance() on every object touches deprecated torch module attributes
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    tensors += [p.grad for p in engine.module.parameters() if p.grad is not None]
    for optimizer in (engine.optimizer, getattr(engine.optimizer, "optimizer", None)):
        for state in getattr(optimizer, "state", {}).values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    for tensor in tensors:
        if isinstance(tensor, (FakeTensor, FunctionalTensor)) or tensor.layout != torch.strided \
                or tensor.device.type == "meta":
            continue  # a compiled graph's fake tensors, sparse or shapeless ones: no storage of their own to count
        if tensor.untyped_storage().nbytes():
            found.setdefault(tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
    return sum(found.values())


def _batch(vocab: int, batch: int, seq: int, pad: int, packed: bool = False) -> dict[str, Any]:
    """A full (unpadded) masked batch: random tokens, every 1/0.15-th position labelled; ``packed``, the same
    ``batch`` samples of ``seq`` tokens end to end as the collator packs them (``cu_seqlens``, ``position_ids``)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(pad + 1, vocab, (batch, seq), generator=gen)
    labels = torch.full_like(ids, -100)
    step = round(1 / 0.15)
    labels[:, ::step] = ids[:, ::step]
    if packed:
        return {"input_ids": ids.reshape(-1), "labels": labels.reshape(-1),
                "position_ids": torch.arange(seq).repeat(batch),
                "cu_seqlens": torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32), "max_seqlen": seq}
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _marked_step(engine, batch: dict[str, torch.Tensor]) -> None:
    with record_function("forward"):
        loss = engine(**batch).loss
    with record_function("backward"):
        engine.backward(loss)
    with record_function("optimizer step"):
        engine.step()


SETTLE_S = 0.5


def settle() -> None:
    """Let the first step's buffers go before the measured step (gloo frees a collective's tensors from its
    worker threads), then start the measured step on every rank together."""
    gc.collect()
    time.sleep(SETTLE_S)
    torch.distributed.barrier()


def measure_setting(run_values: dict[str, Any], seq_len: int, world_size: int) -> dict[str, Any]:
    """Build the engine of ``run_values`` under the profiler, step once, mark the second step; its peaks."""
    from distaff.train.model.deberta import DebertaForMaskedLM
    from distaff.train.run import engine as engines
    from distaff.train.run.config import config_from_dict

    cfg = config_from_dict(run_values)
    torch.manual_seed(cfg.run.seed)
    model_cfg = cfg.model_config()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine = engines.initialize(DebertaForMaskedLM(model_cfg), cfg, world_size)
        batch = _batch(model_cfg.vocab_size, cfg.data.batch_size, seq_len, model_cfg.pad_token_id,
                       cfg.data.packing == "varlen")
        _marked_step(engine, batch)
        settle()
        alive = live_bytes(engine)
        with record_function("measured step"):
            _marked_step(engine, batch)
    levels = allocation_levels(prof)
    windows = phase_windows(prof)
    unseen = max(0, _level_at(levels, windows["forward"][0]) - alive)
    peaks = {name: peak - unseen for name, peak in phase_peaks(levels, windows).items()}
    engine.destroy()
    del engine, prof
    gc.collect()
    return {"peak": max(peaks.values()), "phases": peaks, "unseen_frees": unseen}


def _level_at(levels: list[tuple[int, int]], t: int) -> int:
    """The running sum just before time ``t``."""
    before = [level for when, level in levels if when < t]
    return before[-1] if before else 0


def rank_main(argv: list[str]) -> int:
    """One rank: measure each setting of ``--settings-json`` (a list of [run values, seq_len])."""
    from distaff.train.core.distributed import init_distributed

    parser = argparse.ArgumentParser(prog="distaff.train.plan.measure")
    parser.add_argument("--settings-json", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    settings = json.loads(args.settings_json)
    layout = init_distributed(600)
    results = [measure_setting(values, seq_len, layout.world_size) for values, seq_len in settings]
    Path(f"{args.out}.rank{layout.rank}.json").write_text(json.dumps(results))
    torch.distributed.barrier()
    return 0


def measure_peaks(settings: list[tuple[dict[str, Any], int]], out: Path, world_size: int = 2,
                  timeout: float = 1800) -> list[list[dict[str, Any]]]:
    """For each (run config values, sequence length) of ``settings``, the measured peak of each rank (a list per
    setting); the settings run one after another in ``world_size`` CPU ranks started as processes."""
    from distaff.train.core.distributed import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world_size), "WANDB_MODE": "disabled"}
    command = [sys.executable, "-m", "distaff.train.plan.measure", "--settings-json", json.dumps(settings),
               "--out", str(out)]
    procs = [subprocess.Popen(command, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world_size)]
    logs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    for proc, log in zip(procs, logs):
        if proc.returncode != 0:
            raise RuntimeError(f"measurement rank exited {proc.returncode}:\n{log[-3000:]}")
    ranks = [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(world_size)]
    return [list(per_setting) for per_setting in zip(*ranks)]


if __name__ == "__main__":
    from distaff.train.core.distributed import exit_process

    exit_process(rank_main(sys.argv[1:]))
