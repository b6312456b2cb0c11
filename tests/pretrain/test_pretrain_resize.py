"""Resuming on a different number of ranks (2 -> 1 -> 2 CPU ranks, real DeepSpeed engines): the model's fp32
weights and Adam moments after the resize equal the saved ones exactly, the step, learning-rate schedule and
counters continue, and the data stream re-deals the rest of the epoch: no sample is read twice or skipped."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain_fixtures import (SEQ_LEN, assert_redealt, metrics, prepare_data, rank_logs, run_probe, spawn_ranks,
                               wait_all, write_config)

from distaff.train.data.loader import PretrainLoader, open_data_dir
from distaff.train.pretrain.trainer import EXIT_PREEMPTED
from distaff.train.run.schedule import lr_at

pytestmark = pytest.mark.integration

STEPS, LR, WARMUP = 9, 3e-3, 2


def _run(config: Path, tmp: Path, world: int, probe: Path, stop_at: int = 0) -> None:
    codes, logs = run_probe(config, tmp, world, probe, stop_at=stop_at)
    assert set(codes) == {EXIT_PREEMPTED if stop_at else 0}, logs


def _dump(probe: Path, when: str, rank: int = 0) -> dict:
    return torch.load(probe / f"{when}-rank{rank}.pt", weights_only=True)


def _assert_same_state(resumed: dict, saved: dict) -> None:
    assert resumed["tensors"].keys() == saved["tensors"].keys()
    for name, tensor in saved["tensors"].items():
        assert torch.equal(resumed["tensors"][name], tensor), name
    assert resumed["train_state"]["step"] == saved["train_state"]["step"]
    assert resumed["train_state"]["tokens"] == saved["train_state"]["tokens"]
    assert resumed["train_state"]["samples"] == saved["train_state"]["samples"]


def _assert_redealt(saved: dict, resumed: dict, later: dict, lengths: np.ndarray | None = None) -> None:
    """The resumed plan starts fresh and holds exactly the saved plan's positions nobody read; what is read
    after comes from it (``later``: a state of the same plan)."""
    assert resumed["batch_in_plan"] == 0 and later["plan_index"] == resumed["plan_index"]
    assert_redealt(saved, later, lengths)


def _assert_counters_continue(run_dir: Path, steps: int = STEPS) -> None:
    rows = [r for r in metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:  # one schedule across the resizes: the lr set before step k is lr_at(k - 1)
        expected = lr_at(r["step"] - 1, lr=LR, warmup_steps=WARMUP, max_steps=steps, schedule="linear",
                         min_lr_ratio=0.0)
        assert r["lr"] == pytest.approx(expected, rel=1e-12), r
    tokens = [r["tokens_seen"] for r in rows]
    assert all(b > a for a, b in zip(tokens, tokens[1:]))


def _config(stage: int, sample_data: Path, tmp_path_factory, steps: int = STEPS) -> tuple[Path, Path]:
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    tmp = tmp_path_factory.mktemp(f"resize-zero{stage}")
    config = write_config(tmp / "run.yaml", data, tmp / "run", train={"max_steps": steps},
                          optim={"lr": LR, "warmup_steps": WARMUP}, zero={"stage": stage},
                          eval={"every": 0, "batches": 1})
    return config, tmp


@pytest.mark.timeout(400)
def test_zero2_resumes_on_fewer_then_more_ranks(sample_data, tmp_path_factory):
    config, tmp = _config(2, sample_data, tmp_path_factory)
    _run(config, tmp, 2, tmp / "p2", stop_at=3)
    _run(config, tmp, 1, tmp / "p1", stop_at=6)
    _run(config, tmp, 2, tmp / "p2b")

    saved2, resumed1, end1 = _dump(tmp / "p2", "end"), _dump(tmp / "p1", "start"), _dump(tmp / "p1", "end")
    _assert_same_state(resumed1, saved2)                                    # 2 -> 1
    for rank in (0, 1):
        _assert_same_state(_dump(tmp / "p2b", "start", rank), end1)         # 1 -> 2, on both ranks
    _assert_redealt(saved2["data"], resumed1["data"], end1["data"])
    resumed2, end2 = _dump(tmp / "p2b", "start"), _dump(tmp / "p2b", "end")
    _assert_redealt(end1["data"], resumed2["data"], end2["data"])
    assert end1["train_state"]["samples"] - saved2["train_state"]["samples"] == 3 * 4          # 1 rank x 4
    assert end2["train_state"]["samples"] - end1["train_state"]["samples"] == 3 * 2 * 4        # 2 ranks x 4
    _assert_counters_continue(tmp / "run")
    log = (tmp / "rank0.log").read_text()
    assert "resuming a 1-rank checkpoint on 2 rank(s): global batch 4 -> 8 samples" in log


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [0, 3])
def test_other_zero_stages_resume_on_fewer_ranks(stage, sample_data, tmp_path_factory):
    """ZeRO-0 (full optimizer state on every rank: no conversion) and ZeRO-3 (weights partitioned too)."""
    config, tmp = _config(stage, sample_data, tmp_path_factory, steps=5)
    _run(config, tmp, 2, tmp / "p2", stop_at=3)
    _run(config, tmp, 1, tmp / "p1")
    saved, resumed = _dump(tmp / "p2", "end"), _dump(tmp / "p1", "start")
    _assert_same_state(resumed, saved)
    _assert_redealt(saved["data"], resumed["data"], _dump(tmp / "p1", "end")["data"])
    _assert_counters_continue(tmp / "run", steps=5)
    converted = "to a universal checkpoint" in (tmp / "rank0.log").read_text()
    assert converted == (stage != 0)


@pytest.mark.timeout(200)
def test_rank0_alone_checks_the_checkpoint_and_tells_the_others(sample_data, tmp_path_factory):
    """Only rank 0 resolves and hashes the checkpoint, before any engine; its verdict, here bad input, reaches rank 1
    at once, and both refuse in one line, exit 2."""
    config, tmp = _config(0, sample_data, tmp_path_factory, steps=2)
    codes = wait_all(spawn_ranks(config, tmp, f"checkpoint.resume={tmp / 'no-such-checkpoint'}"), timeout=120)
    assert codes == [2, 2], rank_logs(tmp)
    for rank in (0, 1):
        log = (tmp / f"rank{rank}.log").read_text()
        assert f"rank {rank}: checkpoint.resume='{tmp / 'no-such-checkpoint'}': not a complete checkpoint" in log, log
        assert "Traceback" not in log and "DeepSpeed" not in log, log


@pytest.mark.timeout(1000)
def test_zero_offload_resumes_on_fewer_ranks(sample_data, tmp_path_factory):
    """ZeRO-2 with the optimizer offloaded to DeepSpeed's CPU Adam, 2 -> 1 ranks: the fp32 masters and Adam moments
    (kept on the CPU) come back exactly through the universal checkpoint, and the epoch is re-dealt."""
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    tmp = tmp_path_factory.mktemp("resize-offload")
    config = write_config(tmp / "run.yaml", data, tmp / "run", train={"max_steps": 5},
                          optim={"lr": LR, "warmup_steps": WARMUP}, zero={"stage": 2, "offload_optimizer": True},
                          eval={"every": 0, "batches": 1})
    codes, logs = run_probe(config, tmp, 2, tmp / "p2", stop_at=3, timeout=900)
    assert codes == [EXIT_PREEMPTED] * 2, logs
    _run(config, tmp, 1, tmp / "p1")
    engine = json.loads((tmp / "p1" / "engine-rank0.json").read_text())
    assert engine["optimizer"] == "DeepSpeedCPUAdam" and engine["cpu_offload"], engine
    saved, resumed = _dump(tmp / "p2", "end"), _dump(tmp / "p1", "start")
    _assert_same_state(resumed, saved)
    _assert_redealt(saved["data"], resumed["data"], _dump(tmp / "p1", "end")["data"])
    _assert_counters_continue(tmp / "run", steps=5)
    assert "to a universal checkpoint" in (tmp / "rank0.log").read_text()


def _epoch_lengths(data: Path, seed: int) -> np.ndarray:
    """Every epoch-0 position's token count, as the loaders of the run compute it."""
    manifest, tokenizer = open_data_dir(data)
    loader = PretrainLoader(data, manifest, tokenizer, batch_size=4, rank=0, world_size=1, num_workers=0, seed=seed,
                            masking=None, token_budget=4 * SEQ_LEN)
    return loader._epoch_lengths(0)


@pytest.mark.timeout(600)
def test_packed_plans_resume_on_fewer_then_more_ranks(sample_data, tmp_path_factory):
    """Packed batches (data.packing=varlen: whole samples up to a token budget) under ZeRO-2, 2 -> 1 -> 2 ranks: the
    rest of the epoch is re-cut and re-dealt by tokens, no sample read twice or skipped; the state comes back exact."""
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data, pack_documents=False)
    tmp = tmp_path_factory.mktemp("resize-packed")
    config = write_config(tmp / "run.yaml", data, tmp / "run", train={"max_steps": 7},
                          optim={"lr": LR, "warmup_steps": WARMUP}, zero={"stage": 2}, eval={"every": 0, "batches": 1},
                          data={"packing": "varlen"})
    _run(config, tmp, 2, tmp / "p2", stop_at=3)
    _run(config, tmp, 1, tmp / "p1", stop_at=5)
    _run(config, tmp, 2, tmp / "p2b")
    lengths = _epoch_lengths(data, seed=7)                                       # write_config's run.seed
    saved2, resumed1, end1 = _dump(tmp / "p2", "end"), _dump(tmp / "p1", "start"), _dump(tmp / "p1", "end")
    assert saved2["data"]["plan"]["token_budget"] == 4 * SEQ_LEN
    _assert_same_state(resumed1, saved2)
    _assert_redealt(saved2["data"], resumed1["data"], end1["data"], lengths)
    _assert_same_state(_dump(tmp / "p2b", "start", 1), end1)
    _assert_redealt(end1["data"], _dump(tmp / "p2b", "start")["data"], _dump(tmp / "p2b", "end")["data"], lengths)
    _assert_counters_continue(tmp / "run", steps=7)
