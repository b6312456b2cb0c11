"""Atomic, resumable checkpoints: DeepSpeed state + per-rank data stream and RNG states + run metadata.

Layout under ``<run.out_dir>/checkpoints``::

    step-00000100/            a complete checkpoint (DeepSpeed files, then ours)
        distaff/rank-00000.json   per rank: step, data stream position, RNG states
        distaff/meta.json         written last: step, world size, configs, W&B run id, counters
        tokenizer/                copy of the tokenizer, so a checkpoint exports on its own
    latest                    text file naming the newest complete checkpoint
    .partial-step-00000200/   a save in progress (or interrupted by a crash)

A save writes everything into ``.partial-<tag>``, and only when every rank has finished does
rank 0 write ``meta.json``, rename the folder to ``<tag>`` and atomically replace ``latest``. A
crash at any point before the rename leaves the previous checkpoint complete and named by
``latest``. Our state is JSON; nothing here is unpickled. (DeepSpeed's own files are loaded by
DeepSpeed, which unpickles them: only resume from checkpoints you wrote.)
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

LATEST = "latest"
PARTIAL_PREFIX = ".partial-"
STALE_PREFIX = ".stale-"
META = Path("distaff") / "meta.json"
FORMAT_VERSION = 1
# Test-only fault injection: when set to a step number, every rank dies in the middle of that
# step's save (after DeepSpeed wrote its files, before publishing), as a crash would.
CRASH_DURING_SAVE_ENV = "DISTAFF_TEST_CRASH_DURING_SAVE"
CRASH_EXIT_CODE = 86


def tag_for_step(step: int) -> str:
    return f"step-{step:08d}"


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so readers see the old or the new content, never a torn file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- RNG states as JSON

def _tensor_to_b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _b64_to_byte_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU and CUDA) generator states, JSON-serialisable."""
    version, internal, gauss = random.getstate()
    algo, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [algo, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _tensor_to_b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = _tensor_to_b64(torch.cuda.get_rng_state())
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    algo, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((algo, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_b64_to_byte_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_b64_to_byte_tensor(state["cuda"]))


# ---------------------------------------------------------------- the manager

@dataclass
class LoadedCheckpoint:
    path: Path
    meta: dict[str, Any]          # rank 0's run metadata
    rank_state: dict[str, Any]    # this rank's data stream position and RNG states


class CheckpointManager:
    """Saves, publishes, finds and loads checkpoints under ``root`` (one per run)."""

    def __init__(self, root: str | Path, *, keep: int, rank: int, world_size: int, barrier: Callable[[], None]):
        self.root = Path(root)
        self.keep = keep
        self.rank = rank
        self.world_size = world_size
        self.barrier = barrier

    # ---- finding
    def complete(self, path: Path) -> bool:
        return (path / META).is_file()

    def latest(self) -> Path | None:
        """The checkpoint named by ``latest``, or the highest complete ``step-*`` if the marker is unusable."""
        marker = self.root / LATEST
        if marker.is_file():
            candidate = self.root / marker.read_text().strip()
            if candidate.name.startswith("step-") and self.complete(candidate):
                return candidate
        complete = [p for p in self.root.glob("step-*") if self.complete(p)]
        return max(complete, key=lambda p: p.name) if complete else None

    def resolve(self, resume: str) -> Path | None:
        """``auto``: the latest complete checkpoint or None; ``none``: None; else a checkpoint folder."""
        if resume == "none":
            return None
        if resume == "auto":
            return self.latest() if self.root.is_dir() else None
        path = Path(resume)
        if not self.complete(path):
            raise FileNotFoundError(f"checkpoint.resume={resume!r}: not a complete checkpoint (no {META} in it)")
        return path

    # ---- saving
    def remove_partial(self) -> None:
        """Rank 0 deletes leftovers of interrupted saves (call before the first save)."""
        if self.rank == 0 and self.root.is_dir():
            for leftover in [*self.root.glob(PARTIAL_PREFIX + "*"), *self.root.glob(STALE_PREFIX + "*")]:
                shutil.rmtree(leftover, ignore_errors=True)
        self.barrier()

    def save(self, engine, step: int, rank_state: dict[str, Any], meta: dict[str, Any],
             tokenizer_dir: str | Path | None = None) -> Path:
        """Collective: every rank calls it at the same step. Returns the published folder."""
        tag = tag_for_step(step)
        partial_tag = PARTIAL_PREFIX + tag
        partial = self.root / partial_tag
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
        self.barrier()
        engine.save_checkpoint(str(self.root), tag=partial_tag, save_latest=False)
        own = partial / "distaff" / f"rank-{self.rank:05d}.json"
        own.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(own, json.dumps({"step": step, **rank_state}))
        if os.environ.get(CRASH_DURING_SAVE_ENV) == str(step):
            os._exit(CRASH_EXIT_CODE)
        self.barrier()
        final = self.root / tag
        if self.rank == 0:
            if tokenizer_dir is not None:
                shutil.copytree(tokenizer_dir, partial / "tokenizer")
            atomic_write_text(partial / META, json.dumps({"format": FORMAT_VERSION, "step": step,
                                                          "world_size": self.world_size, **meta}, indent=1))
            self._publish(partial, final)
            self._prune()
        self.barrier()
        return final

    def _publish(self, partial: Path, final: Path) -> None:
        if final.exists():  # re-saving a step (e.g. after resuming from an older checkpoint)
            stale = final.with_name(STALE_PREFIX + final.name)
            os.replace(final, stale)
            os.replace(partial, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.replace(partial, final)
        _fsync_dir(self.root)
        atomic_write_text(self.root / LATEST, final.name + "\n")

    def _prune(self) -> None:
        complete = sorted((p for p in self.root.glob("step-*") if self.complete(p)), key=lambda p: p.name)
        for old in complete[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    # ---- loading
    def load(self, engine, path: Path) -> LoadedCheckpoint:
        """Collective: restores the DeepSpeed engine from ``path``; returns our metadata and this rank's state."""
        meta = json.loads((path / META).read_text())
        if meta["world_size"] != self.world_size:
            raise RuntimeError(f"{path} was written by {meta['world_size']} ranks; resuming exactly needs the same "
                               f"world size (data stream positions are per rank), this job has {self.world_size}")
        own = path / "distaff" / f"rank-{self.rank:05d}.json"
        if not own.is_file():
            raise FileNotFoundError(f"{own}: this rank's state is missing from the checkpoint")
        rank_state = json.loads(own.read_text())
        loaded, _ = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                           load_lr_scheduler_states=False)
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {path}")
        return LoadedCheckpoint(path=path, meta=meta, rank_state=rank_state)
