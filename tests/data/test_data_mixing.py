"""Several sources in one stream (``MixedLoader``) on real shards, in process: the interleaving by weight, a phase that
changes the micro-batch of a source it keeps, and a resume on more ranks; no sample of an epoch read twice or
skipped, every real token counted once."""

from __future__ import annotations

from pathlib import Path

import pytest

from data_fixtures import copy_data_dir
from pretrain_fixtures import assert_redealt

from distaff.train.data.loader import MixedLoader, open_sources

pytestmark = pytest.mark.unit


def _read(loader: MixedLoader, stream, batches: int, tokens: dict[str, int]) -> list[str]:
    """The source of each of the next ``batches`` batches; their real tokens added to ``tokens``."""
    order = []
    for _ in range(batches):
        before = list(loader.slots)
        batch = next(stream)
        (source,) = [d for d, a, b in zip(loader.dirs, before, loader.slots) if b > a]
        tokens[source] += int(batch["attention_mask"].sum())
        order.append("AB"[loader.dirs.index(source)])
    return order


def test_weights_interleave_a_phase_rebatches_and_a_resume_on_more_ranks_reads_the_rest(data_dir: Path,
                                                                                          tmp_path: Path):
    other = copy_data_dir(data_dir, tmp_path / "copy")       # the same text as a second source, in its own order
    opened = open_sources([str(data_dir), str(other)])
    weights, tokens = {str(data_dir): 3.0, str(other): 1.0}, {str(data_dir): 0, str(other): 0}

    def loader(rank: int, world: int) -> MixedLoader:
        return MixedLoader(opened, rank=rank, world_size=world, num_workers=0, seed=5, masking=None)

    one = loader(0, 1)
    one.set_phase(0, weights, batch_size=4, token_budget=0, masking=None)
    assert one.seq_len == 128       # the phase's sources' (what the plan check compares a step against)
    stream = iter(one)
    assert "".join(_read(one, stream, 8, tokens)) == "AABAAABA" and one.slots == [6 * 4 * 128, 2 * 4 * 128]
    before = one.loaders[0].state_dict()
    one.set_phase(1, weights, batch_size=2, token_budget=0, masking=None)    # the same sources, micro-batch 2
    assert "".join(_read(one, stream, 4, tokens)) == "AABA" and one.slots == [3 * 2 * 128, 2 * 128]
    assert_redealt(before, one.loaders[0].state_dict())     # re-dealt in the new micro-batch: nothing twice
    assert one.tokens_by_source() == tokens
    saved = one.state_dict()

    two = [loader(rank, 2) for rank in (0, 1)]
    streams = [iter(r) for r in two]
    for rank_loader in two:
        rank_loader.load_resized_state_dict([saved])
        rank_loader.set_phase(1, weights, batch_size=2, token_budget=0, masking=None)
    orders = [_read(r, s, 4, tokens) for r, s in zip(two, streams)]
    assert orders == [list("AABA")] * 2                     # the shares go on in slots over both ranks: still 3:1
    assert two[0].slots == two[1].slots == [3 * 2 * 128 + 3 * 2 * 2 * 128, 2 * 128 + 2 * 2 * 128]
    for source in (0, 1):
        assert_redealt(saved["sources"][source], two[0].loaders[source].state_dict())
        assert two[0].loaders[source].state_dict()["plan"] == two[1].loaders[source].state_dict()["plan"]
    by_rank = [r.tokens_by_source() for r in two]                       # rank 0 took over the old rank's count
    assert {d: by_rank[0][d] + by_rank[1][d] for d in weights} == tokens
