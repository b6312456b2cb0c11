"""The training stream: equal batches per rank over uneven shards, disjoint samples, exact resume."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from distaff.train.data.collator import IGNORE_INDEX, MaskingConfig
from distaff.train.data.loader import build_eval_loader, build_train_loader
from distaff.train.data.manifest import read_manifest
from distaff.train.data.shards import iter_shard

pytestmark = pytest.mark.integration

BATCH = 16


def _originals(batch: dict) -> list[tuple[int, ...]]:
    """Unmasked token sequences of a batch (labels hold the original id wherever a token was changed)."""
    ids = torch.where(batch["labels"] != IGNORE_INDEX, batch["labels"], batch["input_ids"])
    return [tuple(row[mask.bool()].tolist()) for row, mask in zip(ids, batch["attention_mask"])]


def _all_samples(data_dir: Path, split: str = "train") -> Counter:
    manifest = read_manifest(data_dir)
    counts: Counter = Counter()
    for shard in manifest.splits[split].shards:
        with open(data_dir / shard.path, "rb") as f:
            counts.update(tuple(a.tolist()) for _, a in iter_shard(f, shard.path, np.dtype(manifest.dtype)))
    return counts


def _take(loader, count: int) -> list[dict]:
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == count:
            break
    return batches


def _loader(data_dir: Path, rank: int, world_size: int, num_workers: int, seed: int = 7):
    return build_train_loader(data_dir, batch_size=BATCH, rank=rank, world_size=world_size, num_workers=num_workers,
                              seed=seed, masking=MaskingConfig())


@pytest.mark.timeout(180)
def test_two_ranks_two_workers_uneven_shards_equal_batches_disjoint_samples(data_dir: Path) -> None:
    manifest = read_manifest(data_dir)
    shard_sizes = [s.samples for s in manifest.splits["train"].shards]
    assert max(shard_sizes) > 10 * min(shard_sizes)  # deliberately uneven
    loaders = [_loader(data_dir, rank, 2, num_workers=2) for rank in range(2)]
    per_epoch = loaders[0].batches_per_epoch
    assert per_epoch == loaders[1].batches_per_epoch == manifest.splits["train"].samples // (2 * BATCH)
    seen: Counter = Counter()
    for loader in loaders:
        batches = _take(loader, per_epoch)
        assert loader.epoch == 0 and loader.batches_left_in_epoch == 0
        assert all(b["input_ids"].shape == (BATCH, manifest.seq_len) for b in batches)
        seen.update(s for b in batches for s in _originals(b))
    available = _all_samples(data_dir)
    assert sum(seen.values()) == 2 * per_epoch * BATCH
    assert not seen - available  # no sample served more often than it exists: ranks are disjoint
    assert sum((available - seen).values()) < 2 * BATCH  # only the remainder that fills no batch is left out
    # The next epoch starts on its own, reshuffled.
    next_epoch = _take(loaders[0], 1)[0]
    assert loaders[0].epoch == 1
    assert _originals(next_epoch) != _originals(_take(_loader(data_dir, 0, 2, 0), 1)[0])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_at_random_step_reproduces_the_stream(data_dir: Path, num_workers: int) -> None:
    rng = random.Random(num_workers)
    reference = _loader(data_dir, 1, 2, num_workers)
    per_epoch = reference.batches_per_epoch
    step = rng.randrange(per_epoch - 20, per_epoch - 2)  # resume late so the check crosses an epoch boundary
    follow = 25
    expected = _take(reference, step + follow)[step:]
    first = _loader(data_dir, 1, 2, num_workers)
    _take(first, step)
    state = json.loads(json.dumps(first.state_dict()))  # must survive a JSON checkpoint
    resumed = _loader(data_dir, 1, 2, num_workers)
    resumed.load_state_dict(state)
    got = _take(resumed, follow)
    assert resumed.epoch == 1
    for a, b in zip(expected, got, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("input_ids", "attention_mask", "labels"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("new_world", [1, 3])
def test_resume_with_another_world_size_never_repeats_a_sample(data_dir: Path, new_world: int) -> None:
    old = [_loader(data_dir, rank, 2, num_workers=0) for rank in range(2)]
    step = 37
    seen: Counter = Counter()
    for loader in old:
        seen.update(s for b in _take(loader, step) for s in _originals(b))
    state = old[0].state_dict()
    assert state == old[1].state_dict()  # the position is global, any rank's copy will do
    new = [_loader(data_dir, rank, new_world, num_workers=0) for rank in range(new_world)]
    for loader in new:
        loader.load_state_dict(state)
    left = {loader.batches_left_in_epoch for loader in new}
    assert len(left) == 1 and left.pop() > 0
    for loader in new:
        seen.update(s for b in _take(loader, loader.batches_left_in_epoch) for s in _originals(b))
        assert loader.epoch == 0
    available = _all_samples(data_dir)
    assert not seen - available  # nothing repeated within the epoch
    assert sum((available - seen).values()) < 2 * BATCH + new_world * BATCH


@pytest.mark.timeout(120)
def test_a_resized_resume_needs_all_saved_ranks_at_one_position(data_dir: Path) -> None:
    old = [_loader(data_dir, rank, 2, num_workers=0) for rank in range(2)]
    _take(old[0], 3), _take(old[1], 3)
    states = [loader.state_dict() for loader in old]
    new = _loader(data_dir, 0, 1, num_workers=0)
    new.load_resized_state_dict(states)
    assert new.plan.world_size == 1 and new.plan.total == old[0].plan.total - 2 * 3 * BATCH   # both ranks' 3 batches
    _take(old[1], 1)
    with pytest.raises(ValueError, match="the 2 saved ranks are at different stream positions"):
        _loader(data_dir, 0, 1, num_workers=0).load_resized_state_dict([states[0], old[1].state_dict()])


@pytest.mark.timeout(120)
def test_pipe_url_reads_the_same_batches(data_dir: Path) -> None:
    local = _take(_loader(data_dir, 0, 1, 0), 3)
    remote = build_train_loader(f"pipe:cat {data_dir}/{{path}}", batch_size=BATCH, rank=0, world_size=1,
                                num_workers=0, seed=7, masking=MaskingConfig())
    for a, b in zip(local, _take(remote, 3), strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


@pytest.mark.timeout(120)
def test_eval_loader_equal_batches_fixed_masks(data_dir: Path) -> None:
    loaders = [build_eval_loader(data_dir, batch_size=8, rank=r, world_size=3, seed=3, masking=MaskingConfig())
               for r in range(3)]
    assert len({len(loader) for loader in loaders}) == 1 and len(loaders[0]) > 0
    seen: Counter = Counter()
    for loader in loaders:
        first, second = list(loader), list(loader)
        assert len(first) == len(loader)
        assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, second))
        seen.update(s for b in first for s in _originals(b))
    assert not seen - _all_samples(data_dir, "heldout")


@pytest.mark.timeout(60)
def test_too_little_data_for_the_world_is_a_clear_error(data_dir: Path) -> None:
    with pytest.raises(ValueError, match="fewer than world_size x batch_size"):
        build_train_loader(data_dir, batch_size=4096, rank=0, world_size=8, num_workers=0, seed=0,
                           masking=MaskingConfig())


@pytest.mark.timeout(60)
def test_workers_survive_preemption_signals_for_a_grace_period(data_dir: Path, monkeypatch) -> None:
    """Launchers signal a rank's DataLoader workers too; the trainer still needs batches to finish
    its step and checkpoint. Workers ignore SIGUSR1 and outlive SIGTERM by the grace period."""
    import multiprocessing
    import os
    import signal
    import time

    from distaff.train.data import loader as loader_module

    monkeypatch.setattr(loader_module, "WORKER_SIGTERM_GRACE_S", 2)   # read by the forked workers
    loader = build_train_loader(data_dir, batch_size=2, rank=0, world_size=1, num_workers=1, seed=0,
                                masking=MaskingConfig())
    batches = iter(loader)
    next(batches)
    (worker,) = multiprocessing.active_children()
    os.kill(worker.pid, signal.SIGUSR1)
    os.kill(worker.pid, signal.SIGTERM)
    time.sleep(0.5)
    assert worker.is_alive()
    next(batches)                     # still serving within the grace period
    with pytest.raises(RuntimeError, match="killed by signal: Alarm clock"):
        time.sleep(10)                # the DataLoader reports its worker's end (SIGCHLD) ...
    worker.join(timeout=10)           # ... which came from the grace period's alarm
    assert worker.exitcode == -signal.SIGALRM
    batches.close()
