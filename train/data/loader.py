"""What the trainer calls: an endless, resumable training loader and a finite held-out loader.

Guarantees (see docs/data.md): every rank yields ``batches_per_epoch`` batches per epoch; a fresh
loader given ``state_dict()`` of another (same world size, workers and batch size) yields exactly the
batches, masks included, that the original would have yielded next; with a different world size,
worker count or batch size it continues the epoch with the samples nobody has consumed yet.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader

from distaff.train.data.collator import MaskingConfig, MLMCollator
from distaff.train.data.errors import DataError
from distaff.train.data.manifest import Manifest, load_data_tokenizer, read_manifest
from distaff.train.data.stream import EpochOrder, GroupReader, Plan, PlanStream
from distaff.train.tokenizer import TokenizerInfo

STATE_FORMAT = "distaff-stream/1"
EVAL_STREAM = 1 << 30  # separates the held-out masking seeds from every training epoch's
WORKER_TIMEOUT_S = 600  # a worker stuck on a stalled URL raises instead of hanging the job
WORKER_SIGTERM_GRACE_S = 20  # launchers (deepspeed, Slurm) kill 30 s after SIGTERM


def _survive_preemption_signals(worker_id: int) -> None:
    """Launchers signal every process of a job, DataLoader workers included, but only the trainer
    acts on SIGUSR1/SIGTERM: it finishes its step (which may need more batches) and checkpoints.
    Workers ignore SIGUSR1 and outlive SIGTERM by a grace period, then exit; so a parent that
    terminates its workers is never kept waiting for long."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # a handler inherited from the parent must not catch it
    signal.signal(signal.SIGTERM, lambda *_: signal.alarm(WORKER_SIGTERM_GRACE_S))  # SIGALRM ends the worker


def _check_fits(split: str, samples: int, world_size: int, batch_size: int, data_dir: str) -> None:
    if samples < world_size * batch_size:
        raise DataError(f"{data_dir}: the {split} split has {samples} samples, fewer than world_size x batch_size "
                        f"= {world_size} x {batch_size}; every rank needs at least one batch")


class PretrainLoader:
    """Infinite stream of masked batches for one rank (see module docstring for the guarantees)."""

    def __init__(self, data_dir: str | Path, manifest: Manifest, tokenizer: TokenizerInfo, *, batch_size: int,
                 rank: int, world_size: int, num_workers: int, seed: int, masking: MaskingConfig,
                 group_shards: int = 4):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        split = manifest.splits["train"]
        _check_fits("train", split.samples, world_size, batch_size, str(data_dir))
        self.data_dir, self.manifest, self.tokenizer = str(data_dir), manifest, tokenizer
        self.seq_len = manifest.seq_len
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.num_workers, self.seed, self.group_shards = num_workers, seed, group_shards
        self.collator = MLMCollator(tokenizer, masking, manifest.seq_len)
        self.reader = GroupReader(self.data_dir, split.shards, np.dtype(manifest.dtype), manifest.seq_len)
        self._shard_samples = [s.samples for s in split.shards]
        self.batches_per_epoch = split.samples // (world_size * batch_size)
        self._start_epoch(0)

    def _new_plan(self, pending: list[tuple[int, int]]) -> Plan:
        return Plan(tuple(pending), self.world_size, max(1, self.num_workers), self.batch_size)

    def _start_epoch(self, epoch: int) -> None:
        self.epoch, self.plan_index, self.batch_in_plan = epoch, 0, 0
        self.plan = self._new_plan([(0, sum(self._shard_samples))])

    @property
    def batches_left_in_epoch(self) -> int:
        """Equals ``batches_per_epoch - batches done`` except after a resize-resume (a re-dealt epoch)."""
        return self.plan.batches - self.batch_in_plan

    def __iter__(self) -> Iterator[dict]:
        while True:
            if self.batch_in_plan >= self.plan.batches:
                self._start_epoch(self.epoch + 1)
                continue
            order = EpochOrder(self._shard_samples, self.seed, self.epoch, self.group_shards)
            stream = PlanStream(self.reader, order, self.plan, self.rank, self.batch_in_plan, self.collator,
                                [self.seed, self.epoch, self.plan_index])
            # A private generator: the DataLoader's base-seed draw must not advance the global torch
            # RNG, or dropout after a resume would differ from the uninterrupted run.
            loader = DataLoader(stream, batch_size=None, num_workers=self.num_workers,
                                timeout=WORKER_TIMEOUT_S if self.num_workers else 0,
                                generator=torch.Generator(), worker_init_fn=_survive_preemption_signals)
            batches = iter(loader)
            try:
                for batch in batches:
                    self.batch_in_plan += 1  # counted before the caller sees the batch: state_dict() is "after it"
                    yield batch
            finally:
                # Stop the workers now, not whenever the iterator is garbage collected: a traceback
                # that keeps this frame alive (an error re-raised by the caller) would keep them running.
                getattr(batches, "_shutdown_workers", lambda: None)()

    def state_dict(self) -> dict:
        return {
            "format": STATE_FORMAT, "seed": self.seed, "epoch": self.epoch, "plan_index": self.plan_index,
            "batch_in_plan": self.batch_in_plan, "group_shards": self.group_shards,
            "plan": {"world_size": self.plan.world_size, "slots": self.plan.slots,
                     "batch_size": self.plan.batch_size, "pending": [list(p) for p in self.plan.pending]},
            "data": {"shard_samples": self._shard_samples, "fingerprint": self.manifest.tokenizer_fingerprint},
            # Masking draws come from numpy's SeedSequence([seed, epoch, plan_index, rank, batch]): this
            # position is the whole RNG state.
            "mask_rng": {"seed": self.seed, "epoch": self.epoch, "plan_index": self.plan_index,
                         "next_batch": self.batch_in_plan},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; call before iterating (a running iterator keeps its old position)."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a {STATE_FORMAT} state: format {state.get('format')!r}")
        mine = {"seed": self.seed, "group_shards": self.group_shards,
                "data": {"shard_samples": self._shard_samples, "fingerprint": self.manifest.tokenizer_fingerprint}}
        for key, value in mine.items():
            if state[key] != value:
                raise ValueError(f"loader state {key} {state[key]!r} does not match this loader's {value!r}: "
                                 "the sample order would differ")
        saved = Plan(tuple(tuple(p) for p in state["plan"]["pending"]), state["plan"]["world_size"],
                     state["plan"]["slots"], state["plan"]["batch_size"])
        self.epoch, self.plan_index, self.batch_in_plan = state["epoch"], state["plan_index"], state["batch_in_plan"]
        if (saved.world_size, saved.slots, saved.batch_size) == (self.world_size, max(1, self.num_workers),
                                                                  self.batch_size):
            self.plan = saved
        else:  # re-deal what nobody has consumed yet in this epoch
            self.plan = self._new_plan(saved.remaining_after(self.batch_in_plan))
            self.plan_index, self.batch_in_plan = self.plan_index + 1, 0

    def load_resized_state_dict(self, states: list[dict]) -> None:
        """Continue from the states of all ranks of a run with another world size: they share one epoch
        position (every rank reads the same number of batches), which is re-dealt to this world size."""
        positions = {(s["epoch"], s["plan_index"], s["batch_in_plan"], json.dumps(s["plan"])) for s in states}
        if len(positions) != 1:
            raise ValueError(f"the {len(states)} saved ranks are at different stream positions "
                             f"{sorted(p[:3] for p in positions)}; they cannot be re-dealt")
        self.load_state_dict(states[0])


class EvalLoader:
    """Finite held-out batches in a fixed order with fixed masks; the same number of batches on every rank.

    The samples are split into ``world_size`` equal contiguous parts; the last few samples that do not
    fill a batch on every rank are left out, unless the split is smaller than one batch per rank, in
    which case it is repeated to fill exactly one.
    """

    def __init__(self, data_dir: str | Path, manifest: Manifest, tokenizer: TokenizerInfo, *, batch_size: int,
                 rank: int, world_size: int, seed: int, masking: MaskingConfig):
        split = manifest.splits["heldout"]
        if split.samples == 0:
            raise DataError(f"{data_dir}: the held-out split is empty (prepare with --heldout-fraction > 0)")
        self.data_dir, self.tokenizer, self.seq_len = str(data_dir), tokenizer, manifest.seq_len
        self.rank, self.seed = rank, seed
        self.collator = MLMCollator(tokenizer, masking, manifest.seq_len)
        shard_samples = [s.samples for s in split.shards]
        self.order = EpochOrder(shard_samples, seed, 0, group_shards=1, shuffle=False)
        total, needed = split.samples, world_size * batch_size
        pending = [(0, total)] * (needed // total + 1) if total < needed else [(0, total)]
        self.plan = Plan(tuple(pending), world_size, 1, batch_size)
        self._reader_args = (self.data_dir, split.shards, np.dtype(manifest.dtype), manifest.seq_len)

    def __len__(self) -> int:
        return self.plan.batches

    def __iter__(self) -> Iterator[dict]:
        stream = PlanStream(GroupReader(*self._reader_args), self.order, self.plan, self.rank, 0, self.collator,
                            [self.seed, EVAL_STREAM, 0])
        return iter(stream)


def open_data_dir(data_dir: str | Path) -> tuple[Manifest, TokenizerInfo]:
    """The data dir's manifest and its tokenizer (checked against the manifest)."""
    manifest = read_manifest(data_dir)
    return manifest, load_data_tokenizer(data_dir, manifest)


def build_train_loader(data_dir: str | Path, *, batch_size: int, rank: int, world_size: int, num_workers: int,
                       seed: int, masking: MaskingConfig) -> PretrainLoader:
    manifest, tokenizer = open_data_dir(data_dir)
    return PretrainLoader(data_dir, manifest, tokenizer, batch_size=batch_size, rank=rank, world_size=world_size,
                          num_workers=num_workers, seed=seed, masking=masking)


def build_eval_loader(data_dir: str | Path, *, batch_size: int, rank: int, world_size: int, seed: int,
                      masking: MaskingConfig) -> EvalLoader:
    manifest, tokenizer = open_data_dir(data_dir)
    return EvalLoader(data_dir, manifest, tokenizer, batch_size=batch_size, rank=rank, world_size=world_size,
                      seed=seed, masking=masking)
