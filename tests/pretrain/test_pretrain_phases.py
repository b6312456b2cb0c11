"""Batch-size warmup, weighted data mixing and phases on real shards and real DeepSpeed engines (2 CPU ranks, ZeRO-2).

Two sources of bundled text (Shakespeare, Austen) share a tokenizer and are mixed 3:1; a phase reads Austen
prepared at twice the length, with another mask rate and micro-batch. One run is resized mid-ramp (2 -> 1 ranks):
the tokens come out 3:1, every source's stream continues without a sample read twice or skipped, and the global
batch keeps its schedule. Another is started without phases, stopped mid-ramp, resumed with them and stopped at a
phase switch, and resumed again: it ends bit-identical to the uninterrupted run, its first stretch trained by an
engine built for one micro-batch while the uninterrupted engine was set to one from three (so the live
accumulation change is what DeepSpeed does natively)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pretrain_fixtures import (SEQ_LEN, TEST_MODEL, assert_redealt, metrics, prepare_data, prepare_source,
                               run_probe, train_losses, write_config)

from distaff.train.pretrain.trainer import EXIT_PREEMPTED

pytestmark = pytest.mark.integration


def _sources(sample_data: Path, tmp_path_factory) -> tuple[Path, Path, Path]:
    base = tmp_path_factory.getbasetemp()
    return (prepare_data(base, sample_data), prepare_source(base, sample_data),
            prepare_source(base, sample_data, seq_len=2 * SEQ_LEN))


def _mixed(shakespeare: Path, austen: Path) -> dict:
    return {"dir": "", "batch_size": 4, "sources": [{"dir": str(shakespeare), "weight": 3},
                                                    {"dir": str(austen), "weight": 1.0}]}


def _run(config: Path, tmp: Path, world: int, probe: Path, *overrides: str, stop_at: int = 0) -> str:
    codes, logs = run_probe(config, tmp, world, probe, *overrides, stop_at=stop_at)
    assert set(codes) == {EXIT_PREEMPTED if stop_at else 0}, logs
    return "\n".join((tmp / f"rank{r}.log").read_text() for r in range(world))


def _dump(probe: Path, when: str) -> dict:
    return torch.load(probe / f"{when}-rank0.pt", weights_only=True)


@pytest.mark.timeout(400)
def test_three_to_one_mix_resumes_mid_ramp_on_fewer_ranks(sample_data, tmp_path_factory):
    """Global batch 16 on 2 ranks (4 x 2 micro-batches x 2), ramped from 8 over 4 steps; stopped at step 2 and
    resumed on 1 rank with train.grad_accum=4 (16 again)."""
    shakespeare, austen, _ = _sources(sample_data, tmp_path_factory)
    tmp = tmp_path_factory.mktemp("mix-resize")
    config = write_config(tmp / "run.yaml", shakespeare, tmp / "run", data=_mixed(shakespeare, austen),
                          train={"max_steps": 8, "grad_accum": 2,
                                 "batch_warmup": {"start": 8, "tokens": 8 * SEQ_LEN * 4}})
    _run(config, tmp, 2, tmp / "p2", stop_at=2)
    log = _run(config, tmp, 1, tmp / "p1", "train.grad_accum=4")

    rows = [r for r in metrics(tmp / "run") if "loss" in r]
    assert [r["global_batch"] for r in rows] == [8] * 4 + [16] * 4          # the ramp's schedule across the resize
    for r in rows:                                                          # every real token, counted once
        assert sum(r["tokens_by_source"].values()) == r["tokens_seen"], r
    tokens = rows[-1]["tokens_by_source"]
    assert tokens[str(shakespeare)] / tokens[str(austen)] == pytest.approx(3.0, rel=0.02)

    saved, end = _dump(tmp / "p2", "end"), _dump(tmp / "p1", "end")
    assert end["train_state"]["samples"] == 8 * 4 + 16 * 4
    # token slots (sequences x seq_len over all ranks) per source: 3:1 exactly, the 2-rank part included
    slots = (8 * 4 + 16 * 4) * SEQ_LEN
    assert saved["data"]["slots"] == [2 * 8 * SEQ_LEN, 0] and end["data"]["slots"] == [slots * 3 // 4, slots // 4]
    for source, (before, after) in enumerate(zip(saved["data"]["sources"], end["data"]["sources"])):
        assert before["plan"]["world_size"] == 2 and after["plan"]["world_size"] == 1
        assert_redealt(before, after)                       # each source: nothing read twice or skipped
        assert (before["batch_in_plan"], after["batch_in_plan"]) == [(2, 14), (0, 6)][source]   # 18 + 6 rounds
    assert "resuming a 2-rank checkpoint on 1 rank(s): global batch 16 -> 16 samples" in log


@pytest.mark.timeout(600)
def test_resumes_mid_ramp_and_across_phase_switches_bit_exactly(sample_data, tmp_path_factory):
    """Global batch 24 on 2 ranks (4 x 3 x 2) ramped 8, 16, 24 (2 steps each). Shakespeare alone (data.dir); from
    step 3 mixed 3:1 with Austen; from step 5 Austen at twice the length, mask rate 0.3, micro-batch 2 and global
    batch 8. The interrupted run starts without phases (the single stream of data.dir) and stops at step 2 (mid-ramp),
    is resumed with them, crosses the first switch live and stops at step 5, where the second switch is the resumed
    run's first step."""
    shakespeare, austen, austen_long = _sources(sample_data, tmp_path_factory)
    tmp = tmp_path_factory.mktemp("phases")
    phases = [{"at_step": 3, "sources": _mixed(shakespeare, austen)["sources"]},
              {"at_step": 5, "sources": [{"dir": str(austen_long), "weight": 1}], "seq_len": 2 * SEQ_LEN,
               "mask_rate": 0.3, "batch_size": 2, "global_batch": 8}]
    config = write_config(tmp / "run.yaml", shakespeare, tmp / "whole",
                          model={**TEST_MODEL, "max_position_embeddings": 2 * SEQ_LEN},
                          train={"max_steps": 7, "grad_accum": 3,
                                 "batch_warmup": {"start": 8, "tokens": 8 * SEQ_LEN * 2 * 3}},
                          phases=phases)
    whole_log = _run(config, tmp, 2, tmp / "whole-probe")
    parts = f"run.out_dir={tmp / 'parts'}"
    _run(config, tmp, 2, tmp / "p1", parts, "phases=[]", "train.batch_warmup.start=0", "train.batch_warmup.tokens=0",
         "train.grad_accum=1", stop_at=2)               # the ramp's first size, from an engine built for it
    _run(config, tmp, 2, tmp / "p2", parts, stop_at=5)
    parts_log = _run(config, tmp, 2, tmp / "p3", parts)

    whole, resumed = train_losses(tmp / "whole"), train_losses(tmp / "parts")
    assert list(whole) == list(range(1, 8)) and resumed == whole                   # bit-equal losses, every step
    assert len(set(whole.values())) == 7
    end, end_whole = _dump(tmp / "p3", "end"), _dump(tmp / "whole-probe", "end")
    for name, tensor in end_whole["tensors"].items():
        assert torch.equal(end["tensors"][name], tensor), name
    # every source's stream position and the phase's shares; the tokens counted per rank differ (rank 0 took over
    # the single stream's, all of them), their sums over the ranks are checked below
    assert {**end["data"], "tokens": None} == {**end_whole["data"], "tokens": None}
    for key in ("step", "tokens", "samples", "positions", "last_eval"):
        assert end["train_state"][key] == end_whole["train_state"][key], key

    rows = [r for r in metrics(tmp / "parts") if "loss" in r]
    assert [r["global_batch"] for r in rows] == [8, 8, 16, 16, 24, 8, 8]
    for r in rows:                                          # the single stream's tokens carried over to source 0
        assert sum(r["tokens_by_source"].values()) == r["tokens_seen"], r
    switches = [r for r in metrics(tmp / "parts") if "phase_change" in r]
    assert switches == [r for r in metrics(tmp / "whole") if "phase_change" in r]
    assert [(r["step"], r["phase"]) for r in switches] == [(4, 1), (6, 2)]
    assert switches[0]["phase_change"] == f"sources [{shakespeare} x1] -> [{shakespeare} x3, {austen} x1]"
    for change in ("seq_len 64 -> 128", "mask_rate 0.15 -> 0.3", "global_batch 24 -> 8", "batch_size 4 -> 2",
                   f"x1] -> [{austen_long} x1]"):
        assert change in switches[1]["phase_change"]
    line = f"step 6: phase 2 begins: sources [{shakespeare} x3, {austen} x1]"
    assert line in whole_log and line in parts_log
    by_source = [rows[i]["tokens_by_source"] for i in (2, 4, 6)]          # after steps 3, 5 and 7
    assert by_source[0][str(austen)] == 0 < by_source[1][str(austen)] == by_source[2][str(austen)]
    assert by_source[2][str(austen_long)] == rows[6]["tokens_seen"] - rows[4]["tokens_seen"] > 0
