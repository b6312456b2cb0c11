"""The epoch plan behind the resumable stream: which sample every rank and worker reads for every batch.

*Epoch order.* Each epoch orders all samples of a split from ``(seed, epoch)``: the shards are
permuted, cut into groups of ``group_shards`` consecutive shards, and the samples of each group are
permuted together (samples from several shards mix in every batch while a reader only ever holds
one group in memory). A *position* is an index into this order.

*Plan.* A plan deals a list of pending positions (``[0, T)`` at the start of an epoch) to
``world_size`` ranks: it drops the tail that does not fill ``world_size * batch_size`` - so every
rank gets exactly ``batches`` batches whatever the shard sizes - and gives each rank a contiguous
range. Inside a rank, batch ``j`` belongs to worker slot ``j % slots``, and each slot reads a
contiguous stretch of the rank's range, so a DataLoader worker streams its shards front to back.

*Token budget (packed batches).* With ``token_budget > 0`` a batch is not ``batch_size`` samples but
as many whole samples, consecutive in the pending order, as fit in ``token_budget`` tokens (a new batch
starts when the next sample would not fit). The cuts are made once over all pending positions from
the samples' lengths, which every rank knows, so the ranks still get equal numbers of batches (the
last ``< world_size`` batches are left out) and the plan remains a pure function of its inputs.

*Resume.* The stream's position is ``(epoch, plan, batch)``. The same plan resumes exactly. A
different world size, worker count or batch size re-plans: the positions every rank consumed are
removed and the rest of the epoch is dealt again - no sample of the epoch is repeated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Iterator, Sequence

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from distaff.train.data.errors import DataError, length_problem
from distaff.train.data.manifest import ShardInfo, data_url, open_data_file
from distaff.train.data.shards import read_shard

Intervals = list[tuple[int, int]]  # half-open [start, stop) ranges of epoch positions, in order


class EpochOrder:
    """Sample order of one epoch: position -> (shard, member)."""

    def __init__(self, shard_samples: Sequence[int], seed: int, epoch: int, group_shards: int, shuffle: bool = True):
        self.shard_samples = np.asarray(shard_samples, dtype=np.int64)
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        shards = np.random.default_rng([seed, epoch]).permutation(len(shard_samples)) if shuffle \
            else np.arange(len(shard_samples))
        self.groups = [shards[i:i + group_shards] for i in range(0, len(shards), group_shards)]
        sizes = [int(self.shard_samples[g].sum()) for g in self.groups]
        self.group_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    @property
    def total(self) -> int:
        return int(self.group_starts[-1])

    def group_of(self, position: int) -> int:
        return int(np.searchsorted(self.group_starts, position, side="right")) - 1

    def lengths(self, shard_lengths: Sequence[np.ndarray]) -> np.ndarray:
        """Token count of every position of the epoch, from each shard's sample lengths."""
        flat = np.concatenate([np.asarray(x, np.int32) for x in shard_lengths] + [np.zeros(0, np.int32)])
        shard_start = np.concatenate([[0], np.cumsum(self.shard_samples)])
        parts = [np.zeros(0, np.int32)]
        for group in range(len(self.groups)):
            shard_of, member_of = self.group_members(group)
            parts.append(flat[shard_start[shard_of] + member_of])
        return np.concatenate(parts)

    def group_members(self, group: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard, member) arrays for the group's positions, in epoch order."""
        shards = self.groups[group]
        shard_of = np.repeat(shards, self.shard_samples[shards])
        member_of = np.concatenate([np.arange(self.shard_samples[s]) for s in shards])
        if self.shuffle:
            perm = np.random.default_rng([self.seed, self.epoch, group]).permutation(len(shard_of))
            shard_of, member_of = shard_of[perm], member_of[perm]
        return shard_of, member_of


def token_budget_cuts(lengths: np.ndarray, budget: int) -> np.ndarray:
    """Start of every batch (and the end): consecutive samples while their lengths fit in ``budget``."""
    if lengths.size and int(lengths.max()) > budget:
        raise DataError(f"a sample of {int(lengths.max())} tokens does not fit the token budget of {budget}")
    ends = np.cumsum(lengths, dtype=np.int64)
    cuts, start = [0], 0
    while start < len(lengths):
        # the first sample whose end passes the budget opens the next batch
        start = int(np.searchsorted(ends, (ends[start - 1] if start else 0) + budget, side="right"))
        cuts.append(start)
    return np.asarray(cuts, dtype=np.int64)


@dataclass(frozen=True)
class Plan:
    """Pending positions dealt to ``world_size`` ranks x ``slots`` worker slots in batches of ``batch_size``
    samples, or with ``token_budget > 0`` of whole samples up to that many tokens (``lengths``: the token
    count of every epoch position)."""

    pending: tuple[tuple[int, int], ...]
    world_size: int
    slots: int
    batch_size: int
    token_budget: int = 0
    lengths: np.ndarray | None = field(default=None, compare=False, repr=False)

    @cached_property
    def _cumulative(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum([b - a for a, b in self.pending])]).astype(np.int64)

    @cached_property
    def _budget_cuts(self) -> np.ndarray:
        """Token budget: the flat start of every batch dealt and the end of the last
        (``world_size * batches`` batches)."""
        pending_lengths = np.concatenate([self.lengths[a:b] for a, b in self.pending] + [np.zeros(0, np.int32)])
        cuts = token_budget_cuts(pending_lengths, self.token_budget)
        return cuts[:(len(cuts) - 1) // self.world_size * self.world_size + 1]

    def _cut(self, index: int) -> int:
        """Flat start of the plan's batch ``index`` (all ranks' batches in dealing order)."""
        return int(self._budget_cuts[index]) if self.token_budget else index * self.batch_size

    @property
    def total(self) -> int:
        return int(self._cumulative[-1])

    @property
    def batches(self) -> int:
        """Batches per rank - the same on every rank."""
        if self.token_budget:
            return (len(self._budget_cuts) - 1) // self.world_size
        return self.total // (self.world_size * self.batch_size)

    def _slot_offset(self, slot: int) -> int:
        """Batches owned by the slots before ``slot`` (slot s owns batches s, s+slots, ...)."""
        return sum(len(range(s, self.batches, self.slots)) for s in range(slot))

    def _dealt_index(self, rank: int, batch: int) -> int:
        """Index into the plan's batches (all ranks') of this rank's batch ``batch``."""
        slot = batch % self.slots
        return rank * self.batches + self._slot_offset(slot) + batch // self.slots

    def positions(self, rank: int, batch: int) -> np.ndarray:
        index = self._dealt_index(rank, batch)
        flat = np.arange(self._cut(index), self._cut(index + 1))
        interval = np.searchsorted(self._cumulative, flat, side="right") - 1
        starts = np.asarray([a for a, _ in self.pending], dtype=np.int64)
        return starts[interval] + (flat - self._cumulative[interval])

    def remaining_after(self, batches_done: int) -> Intervals:
        """Pending positions left once every rank has consumed its first ``batches_done`` batches."""
        consumed = []
        for rank in range(self.world_size):
            for slot in range(self.slots):
                done = len(range(slot, batches_done, self.slots))
                if done:
                    first = self._dealt_index(rank, slot)  # a slot's batches are consecutive in the deal
                    consumed.append((self._cut(first), self._cut(first + done)))
        kept, cursor = [], 0
        for start, stop in sorted(consumed) + [(self.total, self.total)]:
            if start > cursor:
                kept.append((cursor, start))
            cursor = max(cursor, stop)
        return [piece for a, b in kept for piece in self._flat_to_positions(a, b)]

    def _flat_to_positions(self, flat_start: int, flat_stop: int) -> Intervals:
        pieces = []
        for (a, b), c in zip(self.pending, self._cumulative[:-1]):
            lo, hi = max(flat_start, c), min(flat_stop, c + (b - a))
            if lo < hi:
                pieces.append((int(a + lo - c), int(a + hi - c)))
        return pieces


class GroupReader:
    """Fetches samples by epoch position, holding one shard group in memory at a time."""

    def __init__(self, data_dir: str, shards: Sequence[ShardInfo], dtype: np.dtype, seq_len: int):
        self.data_dir, self.shards, self.dtype, self.seq_len = data_dir, shards, dtype, seq_len
        self._group: tuple[int, int, int] | None = None  # (seed, epoch, group): orders differ per epoch
        self._samples: list[np.ndarray] = []

    def _read(self, shard: int) -> list[np.ndarray]:
        info = self.shards[shard]
        where = data_url(self.data_dir, info.path)
        with open_data_file(self.data_dir, info.path) as stream:
            samples = read_shard(stream, where, self.dtype, info.samples)
        for member, sample in enumerate(samples):
            problem = length_problem(len(sample), self.seq_len)
            if problem:
                raise DataError(f"{where}: member {member:08d}.npy: {problem}")
        return samples

    def shard_lengths(self) -> list[np.ndarray]:
        """Every shard's sample lengths: one pass over the split, which token-budget plans need."""
        return [np.asarray([len(x) for x in self._read(shard)], np.int32) for shard in range(len(self.shards))]

    def _load(self, order: EpochOrder, group: int) -> None:
        loaded = {shard: self._read(shard) for shard in order.groups[group]}
        shard_of, member_of = order.group_members(group)
        self._samples = [loaded[s][m] for s, m in zip(shard_of.tolist(), member_of.tolist())]
        self._group = (order.seed, order.epoch, group)

    def fetch(self, order: EpochOrder, positions: np.ndarray) -> list[np.ndarray]:
        out = []
        for position in positions.tolist():
            group = order.group_of(position)
            if (order.seed, order.epoch, group) != self._group:
                self._load(order, group)
            out.append(self._samples[position - int(order.group_starts[group])])
        return out


BatchMaker = Callable[[list[np.ndarray], np.random.Generator], dict]


class PlanStream(IterableDataset):
    """Batches ``start, start+1, ...`` of one rank's plan, spread over DataLoader workers.

    DataLoader returns worker outputs round robin starting at worker 0, so worker w yields batches
    ``start + w, start + w + num_workers, ...`` and the caller receives them in order.
    """

    def __init__(self, reader: GroupReader, order: EpochOrder, plan: Plan, rank: int, start: int,
                 make_batch: BatchMaker, rng_key: Sequence[int]):
        super().__init__()
        self.reader, self.order, self.plan, self.rank, self.start = reader, order, plan, rank, start
        self.make_batch, self.rng_key = make_batch, list(rng_key)

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for batch in range(self.start + worker, self.plan.batches, workers):
            samples = self.reader.fetch(self.order, self.plan.positions(self.rank, batch))
            # Masking randomness is a pure function of the batch's identity: resuming needs no RNG state.
            rng = np.random.default_rng(self.rng_key + [self.rank, batch])
            yield self.make_batch(samples, rng)

