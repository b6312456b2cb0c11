"""What the trainer calls: an endless, resumable training loader and a finite held-out loader.

Guarantees (see docs/data.md): every rank yields ``batches_per_epoch`` batches per epoch; a fresh
loader given ``state_dict()`` of another (same world size, workers and batch size) yields exactly the
batches, masks included, that the original would have yielded next; with a different world size,
worker count or batch size it continues the epoch with the samples nobody has consumed yet.

``token_budget > 0`` gives packed batches (``MLMCollator.packed``: 1-D tokens and ``cu_seqlens``) of
whole samples up to that many tokens instead of ``batch_size`` padded rows; the guarantees hold alike.
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
from distaff.train.data.tokenizer import TokenizerInfo

STATE_FORMAT = "distaff-stream/1"
EVAL_STREAM = 1 << 30  # separates the held-out masking seeds from every training epoch's
WORKER_TIMEOUT_S = 600  # a worker stuck on a stalled URL raises instead of hanging the job
WORKER_SIGTERM_GRACE_S = 20  # launchers (deepspeed, Slurm) kill 30 s after SIGTERM


def _survive_preemption_signals(worker_id: int) -> None:
    """Launchers and terminals signal every process of a job, DataLoader workers included, but only the
    trainer acts on SIGUSR1/SIGTERM/Ctrl-C: it finishes its step (which may need more batches) and
    checkpoints. Workers ignore SIGUSR1 and SIGINT and outlive SIGTERM by a grace period, then exit; so a
    parent that terminates its workers is never kept waiting for long (and one that dies takes them along)."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # a handler inherited from the parent must not catch it
    signal.signal(signal.SIGTERM, lambda *_: signal.alarm(WORKER_SIGTERM_GRACE_S))  # SIGALRM ends the worker


def _check_fits(split: str, plan: Plan, data_dir: str) -> None:
    if plan.batches == 0:
        need = (f"world_size = {plan.world_size} batches of token budget {plan.token_budget}" if plan.token_budget
                else f"world_size x batch_size = {plan.world_size} x {plan.batch_size}")
        raise DataError(f"{data_dir}: the {split} split has {plan.total} samples, fewer than {need}; "
                        "every rank needs at least one batch")


def _batch_maker(collator: MLMCollator, token_budget: int):
    return collator.packed if token_budget else collator


def _check_budget(token_budget: int, seq_len: int, data_dir: str) -> None:
    if 0 < token_budget < seq_len:
        raise DataError(f"{data_dir}: token budget {token_budget} is below the data's seq_len {seq_len}: "
                        "a full-length sample would fit no batch")


class PretrainLoader:
    """Infinite stream of masked batches for one rank (see module docstring for the guarantees)."""

    def __init__(self, data_dir: str | Path, manifest: Manifest, tokenizer: TokenizerInfo, *, batch_size: int,
                 rank: int, world_size: int, num_workers: int, seed: int, masking: MaskingConfig | None,
                 group_shards: int = 4, token_budget: int = 0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        split = manifest.splits["train"]
        _check_budget(token_budget, manifest.seq_len, str(data_dir))
        self.data_dir, self.manifest, self.tokenizer = str(data_dir), manifest, tokenizer
        self.seq_len = manifest.seq_len
        # a packed plan cuts by tokens only: batch_size is no part of it
        self.batch_size = 0 if token_budget else batch_size
        self.rank, self.world_size, self.token_budget = rank, world_size, token_budget
        self.num_workers, self.seed, self.group_shards = num_workers, seed, group_shards
        self.collator = MLMCollator(tokenizer, masking, manifest.seq_len)
        self.reader = GroupReader(self.data_dir, split.shards, np.dtype(manifest.dtype), manifest.seq_len)
        self._shard_samples = [s.samples for s in split.shards]
        self._shard_lengths: list[np.ndarray] | None = None  # read on first need (packed plans only)
        self._start_epoch(0)
        _check_fits("train", self.plan, self.data_dir)
        self.batches_per_epoch = self.plan.batches  # epoch 0's; packed epochs may differ by a batch or two

    def _order(self, epoch: int) -> EpochOrder:
        return EpochOrder(self._shard_samples, self.seed, epoch, self.group_shards)

    def _epoch_lengths(self, epoch: int) -> np.ndarray:
        if self._shard_lengths is None:
            self._shard_lengths = self.reader.shard_lengths()
        return self._order(epoch).lengths(self._shard_lengths)

    def _new_plan(self, pending: list[tuple[int, int]]) -> Plan:
        lengths = self._epoch_lengths(self.epoch) if self.token_budget else None
        return Plan(tuple(pending), self.world_size, max(1, self.num_workers), self.batch_size, self.token_budget,
                    lengths)

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
            stream = PlanStream(self.reader, self._order(self.epoch), self.plan, self.rank, self.batch_in_plan,
                                _batch_maker(self.collator, self.token_budget), [self.seed, self.epoch, self.plan_index])
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
                     "batch_size": self.plan.batch_size, "token_budget": self.plan.token_budget,
                     "pending": [list(p) for p in self.plan.pending]},
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
        self.epoch, self.plan_index, self.batch_in_plan = state["epoch"], state["plan_index"], state["batch_in_plan"]
        plan = state["plan"]
        saved = Plan(tuple(tuple(p) for p in plan["pending"]), plan["world_size"], plan["slots"], plan["batch_size"],
                     plan.get("token_budget", 0), self._epoch_lengths(self.epoch) if plan.get("token_budget") else None)
        if (saved.world_size, saved.slots, saved.batch_size, saved.token_budget) == (
                self.world_size, max(1, self.num_workers), self.batch_size, self.token_budget):
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
                 rank: int, world_size: int, seed: int, masking: MaskingConfig | None, token_budget: int = 0):
        split = manifest.splits["heldout"]
        if split.samples == 0:
            raise DataError(f"{data_dir}: the held-out split is empty (prepare with --heldout-fraction > 0)")
        _check_budget(token_budget, manifest.seq_len, str(data_dir))
        self.data_dir, self.tokenizer, self.seq_len = str(data_dir), tokenizer, manifest.seq_len
        self.rank, self.seed, self.token_budget = rank, seed, token_budget
        self.collator = MLMCollator(tokenizer, masking, manifest.seq_len)
        shard_samples = [s.samples for s in split.shards]
        self.order = EpochOrder(shard_samples, seed, 0, group_shards=1, shuffle=False)
        self._reader_args = (self.data_dir, split.shards, np.dtype(manifest.dtype), manifest.seq_len)
        lengths = self.order.lengths(GroupReader(*self._reader_args).shard_lengths()) if token_budget else None
        self.plan = self._filled_plan(split.samples, world_size, batch_size, lengths)

    def _filled_plan(self, total: int, world_size: int, batch_size: int, lengths: np.ndarray | None) -> Plan:
        """The split once, or repeated as often as it takes to give every rank one batch."""
        for copies in range(1, world_size * max(batch_size, 1) + 2):
            plan = Plan(((0, total),) * copies, world_size, 1, 0 if lengths is not None else batch_size,
                        self.token_budget, None if lengths is None else np.tile(lengths, copies))
            if plan.batches:
                return plan
        raise AssertionError("unreachable: world_size x batch_size copies fill a batch per rank")

    def __len__(self) -> int:
        return self.plan.batches

    def __iter__(self) -> Iterator[dict]:
        stream = PlanStream(GroupReader(*self._reader_args), self.order, self.plan, self.rank, 0,
                            _batch_maker(self.collator, self.token_budget), [self.seed, EVAL_STREAM, 0])
        return iter(stream)


def open_data_dir(data_dir: str | Path) -> tuple[Manifest, TokenizerInfo]:
    """The data dir's manifest and its tokenizer (checked against the manifest)."""
    manifest = read_manifest(data_dir)
    return manifest, load_data_tokenizer(data_dir, manifest)


def build_train_loader(data_dir: str | Path, *, batch_size: int, rank: int, world_size: int, num_workers: int,
                       seed: int, masking: MaskingConfig | None, token_budget: int = 0) -> PretrainLoader:
    manifest, tokenizer = open_data_dir(data_dir)
    return PretrainLoader(data_dir, manifest, tokenizer, batch_size=batch_size, rank=rank, world_size=world_size,
                          num_workers=num_workers, seed=seed, masking=masking, token_budget=token_budget)


def build_eval_loader(data_dir: str | Path, *, batch_size: int, rank: int, world_size: int, seed: int,
                      masking: MaskingConfig | None, token_budget: int = 0) -> EvalLoader:
    manifest, tokenizer = open_data_dir(data_dir)
    return EvalLoader(data_dir, manifest, tokenizer, batch_size=batch_size, rank=rank, world_size=world_size,
                      seed=seed, masking=masking, token_budget=token_budget)
