"""The pieces of a resize-resume that need no training run: the global-batch notice, per-rank RNG seeding, which
checkpoints need converting, and the load-time universal switch (the runs are in test_pretrain_resize.py)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from distaff.train.run.checkpoint import RNGState
from distaff.train.run.resize import global_batch_notice, has_partitioned_state, universal_loading

pytestmark = pytest.mark.unit


def _config(batch_size: int, grad_accum: int) -> dict:
    return {"data": {"batch_size": batch_size}, "train": {"grad_accum": grad_accum}}


def test_the_notice_says_how_the_global_batch_changes_and_what_keeps_it():
    fewer = global_batch_notice(_config(4, 1), _config(4, 1), saved_world=2, world=1)
    assert fewer.endswith("global batch 8 -> 4 samples (data.batch_size x train.grad_accum x ranks); "
                          "train.grad_accum=2 keeps it at 8")
    more = global_batch_notice(_config(4, 1), _config(4, 1), saved_world=1, world=2)
    assert more.endswith("global batch 4 -> 8 samples (data.batch_size x train.grad_accum x ranks)")  # no setting can
    kept = global_batch_notice(_config(4, 1), _config(4, 2), saved_world=2, world=1)
    assert "global batch 8 -> 8 samples" in kept and "keeps it" not in kept


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_resized_ranks_seed_distinct_reproducible_streams():
    saved = [RNGState().state_dict() for _ in range(2)]
    draws = {}
    for rank in (0, 1, 2):
        RNGState(rank).load_resized_state_dict(saved)
        draws[rank] = _draws()
    assert len(set(draws.values())) == 3
    RNGState(1).load_resized_state_dict(saved)
    assert _draws() == draws[1]


def test_only_split_optimizer_state_needs_converting(tmp_path):
    (tmp_path / "mp_rank_00_model_states.pt").touch()
    assert not has_partitioned_state(tmp_path)                     # ZeRO-0: the model file holds it all
    (tmp_path / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").touch()
    assert has_partitioned_state(tmp_path)


def test_the_universal_switch_is_on_only_inside_the_block():
    engine = SimpleNamespace(_config=SimpleNamespace(load_universal_checkpoint=False))
    with pytest.raises(RuntimeError):
        with universal_loading(engine):
            assert engine._config.load_universal_checkpoint
            raise RuntimeError("load failed")
    assert engine._config.load_universal_checkpoint is False
