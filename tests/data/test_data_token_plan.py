"""Token-budget plans: whole samples within the budget, equal batches per rank, re-dealing without repeats."""

from __future__ import annotations

import numpy as np
import pytest

from distaff.train.data.errors import DataError
from distaff.train.data.stream import Plan, token_budget_cuts

pytestmark = pytest.mark.unit


def test_token_budget_cuts_keep_whole_samples_within_the_budget() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 65, size=500)
    cuts = token_budget_cuts(lengths, 100)
    assert cuts[0] == 0 and cuts[-1] == len(lengths)
    sums = np.add.reduceat(lengths, cuts[:-1])
    assert (sums <= 100).all()
    # greedy: each batch but the last was closed because the next sample did not fit
    assert (sums[:-1] + lengths[cuts[1:-1]] > 100).all()
    with pytest.raises(DataError, match="65 tokens does not fit the token budget of 64"):
        token_budget_cuts(np.array([10, 65, 3]), 64)


@pytest.mark.parametrize("world_size,slots", [(1, 1), (3, 2), (4, 3)])
def test_token_budget_plan_deals_equal_batches_and_resumes_without_repeats(world_size: int, slots: int) -> None:
    rng = np.random.default_rng(world_size)
    lengths = rng.integers(2, 129, size=997)  # uneven documents
    plan = Plan(((0, 997),), world_size, slots, 0, 512, lengths)
    batches = [[plan.positions(r, j) for j in range(plan.batches)] for r in range(world_size)]
    flat = np.concatenate([p for rank in batches for p in rank])
    assert len(set(flat.tolist())) == len(flat)
    assert all(lengths[p].sum() <= 512 for rank in batches for p in rank)
    assert plan.batches == (len(token_budget_cuts(lengths, 512)) - 1) // world_size
    done = plan.batches // 2
    consumed = {int(x) for rank in batches for p in rank[:done] for x in p}
    rest = Plan(tuple(plan.remaining_after(done)), 2, 1, 0, 512, lengths)
    left = {int(x) for r in range(2) for j in range(rest.batches) for x in rest.positions(r, j)}
    assert not left & consumed
    # the new plan leaves out fewer than its world size (2) batches of tokens
    dropped = sorted(set(flat.tolist()) - consumed - left)
    assert lengths[dropped].sum() < 2 * 512
