"""Packed (token-budget) batches: whole samples within the budget, equal batches per rank, exact resume."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from distaff.train.data.collator import IGNORE_INDEX, MaskingConfig
from distaff.train.data.errors import DataError
from distaff.train.data.loader import build_eval_loader, build_train_loader
from distaff.train.data.manifest import read_manifest
from test_data_stream import _all_samples, _take

pytestmark = pytest.mark.integration

BUDGET = 1024  # 8 rows of the fixture's seq_len 128


def _sequences(batch: dict) -> list[tuple[int, ...]]:
    """The unmasked samples of a packed batch."""
    ids = torch.where(batch["labels"] != IGNORE_INDEX, batch["labels"], batch["input_ids"])
    bounds = batch["cu_seqlens"].tolist()
    return [tuple(ids[a:b].tolist()) for a, b in zip(bounds[:-1], bounds[1:])]


def _loader(data_dir: Path, rank: int, world_size: int, num_workers: int = 0, budget: int = BUDGET):
    return build_train_loader(data_dir, batch_size=4, rank=rank, world_size=world_size, num_workers=num_workers,
                              seed=5, masking=MaskingConfig(), token_budget=budget)


def _check_layout(batch: dict, budget: int) -> None:
    bounds = batch["cu_seqlens"]
    lengths = (bounds[1:] - bounds[:-1]).tolist()
    assert bounds.dtype == torch.int32 and bounds[0] == 0 and bounds[-1] == len(batch["input_ids"]) <= budget
    assert batch["max_seqlen"] == max(lengths) and min(lengths) >= 2
    # positions restart in every sample
    expected = torch.cat([torch.arange(n) for n in lengths])
    assert torch.equal(batch["position_ids"], expected)
    assert batch["labels"].shape == batch["input_ids"].shape == batch["position_ids"].shape


@pytest.mark.timeout(240)
def test_two_ranks_get_equal_packed_batches_of_whole_disjoint_samples(data_dir: Path) -> None:
    loaders = [_loader(data_dir, rank, 2, num_workers=2) for rank in range(2)]
    per_epoch = loaders[0].batches_per_epoch
    assert per_epoch == loaders[1].batches_per_epoch > 0
    epoch = [_take(loader, per_epoch) for loader in loaders]
    assert all(loader.batches_left_in_epoch == 0 for loader in loaders)
    seen: Counter = Counter()
    tokens = 0
    for batches in epoch:
        for batch in batches:
            _check_layout(batch, BUDGET)
            tokens += len(batch["input_ids"])
            seen.update(_sequences(batch))
    train = _all_samples(data_dir)
    assert not seen - train, "a batch holds a sequence that is not a train sample"
    # disjoint: no sample appears more often than it exists in the split
    assert all(count <= train[sample] for sample, count in seen.items())
    # whole samples fill the budget well: the next sample (at most seq_len) did not fit
    assert tokens / (2 * per_epoch * BUDGET) > 0.85
    manifest = read_manifest(data_dir)
    assert manifest.splits["train"].tokens - tokens < 2 * BUDGET + manifest.seq_len  # < 2 batches left out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_packed_resume_is_exact_across_an_epoch_boundary(data_dir: Path, num_workers: int) -> None:
    straight = _loader(data_dir, 1, 2, num_workers)
    stop = straight.batches_per_epoch - 2
    expected = _take(straight, stop + 5)
    first = _loader(data_dir, 1, 2, num_workers)
    _take(first, stop)
    resumed = _loader(data_dir, 1, 2, num_workers)
    resumed.load_state_dict(first.state_dict())
    for want, got in zip(expected[stop:], _take(resumed, 5)):
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(torch.as_tensor(want[key]), torch.as_tensor(got[key])), key


@pytest.mark.timeout(240)
def test_packed_resume_on_one_rank_repeats_no_sample_of_the_epoch(data_dir: Path) -> None:
    two = [_loader(data_dir, rank, 2) for rank in range(2)]
    done = [_take(loader, 3) for loader in two]
    one = _loader(data_dir, 0, 1, num_workers=1)
    one.load_state_dict(two[0].state_dict())
    rest = _take(one, one.batches_left_in_epoch)
    seen = Counter(s for batches in done + [rest] for batch in batches for s in _sequences(batch))
    train = _all_samples(data_dir)
    assert all(count <= train[sample] for sample, count in seen.items())
    for batch in rest:
        _check_layout(batch, BUDGET)


@pytest.mark.timeout(120)
def test_packed_eval_gives_every_rank_the_same_batches(data_dir: Path) -> None:
    loaders = [build_eval_loader(data_dir, batch_size=4, rank=r, world_size=3, seed=3, masking=MaskingConfig(),
                                 token_budget=512) for r in range(3)]
    assert len(loaders[0]) == len(loaders[1]) == len(loaders[2]) > 0
    for loader in loaders:
        batches = list(loader)
        assert len(batches) == len(loader)
        for batch in batches:
            _check_layout(batch, 512)
    assert not Counter(s for b in loaders[0] for s in _sequences(b)) - _all_samples(data_dir, "heldout")
    # fixed masks: two passes give the same batches
    assert all(torch.equal(a["labels"], b["labels"]) for a, b in zip(loaders[1], loaders[1]))


@pytest.mark.timeout(60)
def test_a_budget_below_seq_len_is_a_clear_error(data_dir: Path) -> None:
    with pytest.raises(DataError, match="token budget 100 is below the data's seq_len 128"):
        _loader(data_dir, 0, 1, budget=100)
    with pytest.raises(DataError, match="fewer than world_size = 64 batches of token budget"):
        _loader(data_dir, 0, 64, budget=read_manifest(data_dir).splits["train"].tokens // 32)
