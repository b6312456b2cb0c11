"""What a real training step holds in memory: a live-tensor tracker and the 2-rank step it measures.

:class:`LiveTensors` is a ``TorchDispatchMode`` that sees every tensor an op returns, counts the bytes of
each storage it has not seen (by the storage's identity) and, through a weakref finalizer on that storage,
subtracts them when the storage dies. Its peak plus the census of what was alive before (parameters,
gradients, optimizer states, DeepSpeed's flat buffers: every tensor the garbage collector knows) is the
step's peak of live tensor bytes. It measures what the plan's memory model predicts, on any device.

``python -m distaff.train.plan.measure`` is one rank of that measurement (started by :func:`measure_peak`
once per rank): a real DeepSpeed engine (gloo on CPU), a synthetic masked batch, one step to create
the optimizer states, then the tracked step (forward, backward, optimizer).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensors(TorchDispatchMode):
    """Bytes of live tensor storage from the moment it is entered: ``current``, ``peak`` (above ``base``)."""

    def __init__(self, known: dict[int, int] | None = None):
        super().__init__()
        self.live: dict[int, int] = {}       # storage data_ptr -> bytes, for storages born or counted here
        self.base = 0
        self.current = self.peak = 0
        for ptr, storage in (known or {}).items():
            self._count(ptr, storage, born=False)

    def _count(self, ptr: int, storage: torch.UntypedStorage, born: bool = True) -> None:
        nbytes = storage.nbytes()
        if nbytes == 0 or ptr in self.live:
            return
        self.live[ptr] = nbytes
        if born:
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        else:
            self.base += nbytes
        weakref.finalize(storage, self._free, ptr, nbytes, born)

    def _free(self, ptr: int, nbytes: int, born: bool) -> None:
        if self.live.get(ptr) == nbytes:
            del self.live[ptr]
        self.current -= nbytes   # a census storage freed during the step lowers the level below base

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and value.device.type != "meta":
                storage = value.untyped_storage()
                self._count(storage.data_ptr(), storage)
        return out


def live_storages(extra: list[torch.Tensor] = ()) -> dict[int, torch.UntypedStorage]:
    """Every tensor storage alive now that Python can reach (the garbage collector's tensors plus ``extra``)."""
    found: dict[int, torch.UntypedStorage] = {}
    with warnings.catch_warnings():   # isinstance() on every object touches deprecated torch module attributes
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)] + list(extra)
    for tensor in tensors:
        if tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes():
            found.setdefault(storage.data_ptr(), storage)
    return found


def _batch(vocab: int, batch: int, seq: int, pad: int) -> dict[str, torch.Tensor]:
    """A full (unpadded) masked batch: random tokens, every 1/0.15-th position labelled."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(pad + 1, vocab, (batch, seq), generator=gen)
    labels = torch.full_like(ids, -100)
    step = round(1 / 0.15)
    labels[:, ::step] = ids[:, ::step]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _engine_tensors(engine) -> list[torch.Tensor]:
    """Tensors the engine holds that Python objects may not expose: gradients and optimizer states."""
    found = [p.grad for p in engine.module.parameters() if p.grad is not None]
    for optimizer in (engine.optimizer, getattr(engine.optimizer, "optimizer", None)):
        for state in getattr(optimizer, "state", {}).values():
            found += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return found


def _step(engine, batch: dict[str, torch.Tensor]) -> None:
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()


def rank_main(argv: list[str]) -> int:
    """One rank: build the engine for the run config's values, step once, track the second step."""
    from distaff.train.core.distributed import init_distributed
    from distaff.train.model.deberta import DebertaForMaskedLM
    from distaff.train.run import engine as engines
    from distaff.train.run.config import config_from_dict

    parser = argparse.ArgumentParser(prog="distaff.train.plan.measure")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    cfg = config_from_dict(json.loads(args.config_json))
    layout = init_distributed(cfg.distributed.timeout_s)
    torch.manual_seed(cfg.run.seed)
    model_cfg = cfg.model_config()
    engine = engines.initialize(DebertaForMaskedLM(model_cfg), cfg, layout.world_size)
    batch = _batch(model_cfg.vocab_size, cfg.data.batch_size, args.seq_len, model_cfg.pad_token_id)
    _step(engine, batch)
    gc.collect()
    known = live_storages(_engine_tensors(engine))
    with LiveTensors(known) as tracker:
        _step(engine, batch)
    result = {"rank": layout.rank, "base": tracker.base, "peak_above_base": tracker.peak,
              "peak": tracker.base + tracker.peak}
    Path(f"{args.out}.rank{layout.rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    return 0


def measure_peak(run_values: dict[str, Any], seq_len: int, out: Path, world_size: int = 2,
                 timeout: float = 600) -> list[dict[str, int]]:
    """The measured live-tensor peak of each rank for the run config ``run_values`` (plain values), on
    ``world_size`` CPU ranks started as processes; rank results are written next to ``out``."""
    from distaff.train.core.distributed import free_port

    port, procs = free_port(), []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size), "WANDB_MODE": "disabled"}
    command = [sys.executable, "-m", "distaff.train.plan.measure", "--config-json", json.dumps(run_values),
               "--seq-len", str(seq_len), "--out", str(out)]
    for rank in range(world_size):
        procs.append(subprocess.Popen(command, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    for proc, log in zip(procs, logs):
        if proc.returncode != 0:
            raise RuntimeError(f"measurement rank exited {proc.returncode}:\n{log[-3000:]}")
    return [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(world_size)]


if __name__ == "__main__":
    from distaff.train.core.distributed import exit_process

    exit_process(rank_main(sys.argv[1:]))
