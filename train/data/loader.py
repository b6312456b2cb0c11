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

from distaff.train.data.collator import MaskingConfig, MLMCollator, batch_counts
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


# ---------------------------------------------------------------- several sources

MIXED_FORMAT = "distaff-mixed-stream/1"


def source_seed(seed: int, index: int) -> int:
    """Source 0 reads with the run's seed (so one source reads as the plain stream would); the others with seeds
    drawn from it, so that no two sources share an order or masks."""
    return seed if index == 0 else int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


def open_sources(dirs: list[str]) -> dict[str, tuple[Manifest, TokenizerInfo]]:
    """Every dir's manifest and tokenizer; all must have been prepared with one tokenizer."""
    opened = {d: open_data_dir(d) for d in dirs}
    prints = {d: manifest.tokenizer_fingerprint for d, (manifest, _) in opened.items()}
    first = dirs[0]
    for d in dirs[1:]:
        if prints[d] != prints[first]:
            raise DataError(f"data sources {first} and {d} were prepared with different tokenizers (fingerprints "
                            f"{prints[first][:12]} and {prints[d][:12]}); prepare every source with one tokenizer "
                            "folder")
    return opened


def continues(saved: list[dict] | dict, sources: list[dict] | dict) -> bool:
    """Whether a stream of ``sources`` (:meth:`MixedLoader.identity`) can continue one saved with ``saved``: the same
    sources in the same order, and perhaps more after them (phases added since the save); a single stream's
    identity (a dict: a run that reads ``data.dir`` alone) is its first source."""
    saved = [saved] if isinstance(saved, dict) else saved
    sources = [sources] if isinstance(sources, dict) else sources
    return 0 < len(saved) <= len(sources) and sources[:len(saved)] == saved


class MixedLoader:
    """Several prepared datasets as one endless stream of micro-batches (docs/data.md, "Several sources").

    Each source is its own :class:`PretrainLoader` (its own epochs, plan and masks, seeded by :func:`source_seed`),
    and each micro-batch comes whole from one source. Every rank reads its next micro-batch from the same source:
    the one whose share of the phase lags most, the largest ``weight * (slots + round) - slots it had``, where
    slots are token slots (sequences x seq_len, or the token budget of packed batches) over all ranks and
    ``round`` is one micro-batch on every rank (weights normalised, ties to the earlier source). Counting slots
    over all ranks keeps the weights on a resume with another world size, whose rounds are larger or smaller. As
    every rank reads as many batches from each source, each source's plan stays aligned across ranks, and a
    resume - on this world size or another - continues every source as a single stream continues.
    :meth:`set_phase` sets the weights, micro-batch and masking; ``tokens`` counts the real tokens this rank read
    from each source.
    """

    def __init__(self, opened: dict[str, tuple[Manifest, TokenizerInfo]], *, rank: int, world_size: int,
                 num_workers: int, seed: int, masking: MaskingConfig | None):
        """``masking``: the run's; a phase may change its ``mlm_probability`` only."""
        self.dirs, self.opened, self.masking = list(opened), opened, masking
        self.rank, self.world_size, self.num_workers, self.seed = rank, world_size, num_workers, seed
        count = len(self.dirs)
        self.loaders: list[PretrainLoader | None] = [None] * count
        self.iterators: dict[int, Iterator[dict]] = {}
        self.phase, self.weights, self.slots, self.tokens = -1, [0.0] * count, [0] * count, [0] * count
        self.from_single_stream = False     # resumed from a single stream's state, which counts no tokens

    def _active(self) -> list[int]:
        return [i for i, weight in enumerate(self.weights) if weight > 0]

    @property
    def seq_len(self) -> int:
        """The current phase's sequence length (its sources are prepared at one); the first source's before any."""
        return self.opened[self.dirs[(self._active() or [0])[0]]][0].seq_len

    def set_phase(self, phase: int, weights: dict[str, float], *, batch_size: int, token_budget: int,
                  masking: MaskingConfig | None) -> None:
        """Read the sources of ``weights`` (dir -> weight) with these settings from the next batch on; a new
        ``phase`` starts counting its batches afresh, the same one keeps its count (a resumed phase)."""
        if phase != self.phase:
            self.phase, self.slots = phase, [0] * len(self.dirs)
        self.weights = [float(weights.get(d, 0.0)) for d in self.dirs]
        for i, weight in enumerate(self.weights):
            if weight > 0:
                self._configure(i, batch_size, token_budget, masking)
            else:
                self._stop(i)

    def _new_loader(self, i: int, batch_size: int, token_budget: int, masking: MaskingConfig | None) -> PretrainLoader:
        manifest, tokenizer = self.opened[self.dirs[i]]
        return PretrainLoader(self.dirs[i], manifest, tokenizer, batch_size=batch_size, rank=self.rank,
                              world_size=self.world_size, num_workers=self.num_workers,
                              seed=source_seed(self.seed, i), masking=masking, token_budget=token_budget)

    def _configure(self, i: int, batch_size: int, token_budget: int, masking: MaskingConfig | None) -> None:
        loader = self.loaders[i]
        if loader is None:
            self.loaders[i] = self._new_loader(i, batch_size, token_budget, masking)
            return
        if (loader.batch_size, loader.token_budget) != (0 if token_budget else batch_size, token_budget):
            self._stop(i)       # another micro-batch: the rest of the epoch is dealt again in the new size
            state = loader.state_dict()
            loader = self.loaders[i] = self._new_loader(i, batch_size, token_budget, masking)
            loader.load_state_dict(state)
        if loader.collator.masking != masking:
            self._stop(i)       # the workers hold the old collator
            loader.collator.masking = masking   # another mlm_probability: the collator's n-gram tables still hold

    def _stop(self, i: int) -> None:
        """Close source ``i``'s iterator (its workers exit); its position stays in its loader."""
        iterator = self.iterators.pop(i, None)
        if iterator is not None:
            iterator.close()

    def _round_slots(self, i: int) -> int:
        """Token slots of one micro-batch of source ``i`` on every rank (the same for every source of a phase)."""
        loader = self.loaders[i]
        return self.world_size * (loader.token_budget or loader.batch_size * loader.seq_len)

    def _next_source(self) -> int:
        active = self._active()
        if not active:
            raise RuntimeError("MixedLoader: set_phase() gives the sources to read before the first batch")
        total, after = sum(self.weights), sum(self.slots) + self._round_slots(active[0])
        return max(active, key=lambda i: (self.weights[i] / total * after - self.slots[i], -i))

    def __iter__(self) -> Iterator[dict]:
        while True:
            i = self._next_source()
            if i not in self.iterators:
                self.iterators[i] = iter(self.loaders[i])
            batch = next(self.iterators[i])
            self.slots[i] += self._round_slots(i)
            self.tokens[i] += batch_counts(batch)[0]
            yield batch

    def tokens_by_source(self) -> dict[str, int]:
        """This rank's real tokens from each source."""
        return dict(zip(self.dirs, self.tokens))

    def identity(self) -> list[dict]:
        """What the sources are, for the resume check: each one's shard sizes and tokenizer, not its path."""
        return [{"shard_samples": [s.samples for s in manifest.splits["train"].shards],
                 "fingerprint": manifest.tokenizer_fingerprint} for manifest, _ in self.opened.values()]

    def state_dict(self) -> dict:
        return {"format": MIXED_FORMAT, "seed": self.seed, "data": self.identity(), "phase": self.phase,
                "slots": list(self.slots), "tokens": list(self.tokens),
                "sources": [None if loader is None else loader.state_dict() for loader in self.loaders]}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (call :meth:`set_phase` before iterating)."""
        self._load([state], resized=False)

    def load_resized_state_dict(self, states: list[dict]) -> None:
        """Continue from the states of every rank of a run with another world size: each source continues as
        :meth:`PretrainLoader.load_resized_state_dict` does, and rank 0 takes over the real tokens every saved rank
        counted (so their sum over the ranks is kept)."""
        self._load(states, resized=True)

    def _load(self, states: list[dict], resized: bool) -> None:
        self.from_single_stream = states[0].get("format") == STATE_FORMAT
        if self.from_single_stream:     # a run that read data.dir alone, continued with phases
            states = [{"format": MIXED_FORMAT, "seed": s["seed"], "data": [s["data"]], "phase": 0, "slots": [0],
                       "tokens": [0], "sources": [s]} for s in states]
        first = states[0]
        if first.get("format") != MIXED_FORMAT:
            raise ValueError(f"not a {MIXED_FORMAT} state: format {first.get('format')!r}")
        if first["seed"] != self.seed or not continues(first["data"], self.identity()):
            raise ValueError("the saved stream's seed or sources differ from this loader's: the sample order would "
                             "differ")
        extra = [0] * (len(self.dirs) - len(first["data"]))     # sources of phases added since: never read
        self.phase, self.slots, self.tokens = first["phase"], first["slots"] + extra, first["tokens"] + extra
        if resized:
            self.tokens = [sum(s["tokens"][i] for s in states) if self.rank == 0 else 0
                           for i in range(len(first["data"]))] + extra
        for i in range(len(self.dirs)):
            self._stop(i)
            saved = [s["sources"][i] for s in states] if i < len(first["data"]) else [None]
            self.loaders[i] = None if saved[0] is None else self._resumed(i, saved, resized)

    def _resumed(self, i: int, saved: list[dict], resized: bool) -> PretrainLoader:
        """Source ``i``'s loader in the micro-batch it was saved with (so that its plan is kept as it was), at the
        saved position; :meth:`set_phase` then gives it its phase's settings."""
        plan = saved[0]["plan"]
        loader = self._new_loader(i, plan["batch_size"] or 1, plan.get("token_budget", 0), self.masking)
        if resized:
            loader.load_resized_state_dict(saved)
        else:
            loader.load_state_dict(saved[0])
        return loader
