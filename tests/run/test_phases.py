"""The step schedule (train/run/schedule.py: phases, the batch ramp) as pure functions of the step, and the one-line
errors for bad mixing, phase and ramp values: in the config, against the ranks, against the prepared data."""

from __future__ import annotations

from pathlib import Path

import pytest

from distaff.train.data.errors import DataError
from distaff.train.data.loader import open_sources
from distaff.train.data.prepare import PrepareConfig, prepare
from distaff.train.data.tokenizer import train_tokenizer
from distaff.train.run.config import ConfigError, load_config
from distaff.train.run.schedule import RunSchedule

pytestmark = pytest.mark.unit

LENGTHS = {"short": 128, "web": 128, "long": 512}


def _schedule(*overrides: str, world: int = 4, lengths: dict[str, int] = LENGTHS) -> RunSchedule:
    return RunSchedule(load_config(None, ["data.dir=short", *overrides]), world, lengths)


def test_ramp_sizes_steps_and_tokens():
    """Global batch 256 on 4 ranks (8 x 8 x 4) ramped from 64: 64, 128, 192 for n steps each, n spending 1M tokens;
    a phase from step 200 at 512 tokens with a global batch of 128 in micro-batches of 4."""
    schedule = _schedule("data.batch_size=8", "train.grad_accum=8", "train.batch_warmup.start=64",
                         "train.batch_warmup.tokens=1000000",
                         "phases=[{at_step: 200, sources: [{dir: long}], global_batch: 128, batch_size: 4}]")
    n = round(1_000_000 / (64 * 128 * (1 + 2 + 3)))
    assert schedule.ramp.steps_per_size == n == 20 and schedule.ramp.end_step == 3 * n
    shapes = [schedule.at(step) for step in range(205)]
    assert [s.global_batch for s in shapes[:3 * n + 1]] == [64] * n + [128] * n + [192] * n + [256]
    assert [s.micro_batches for s in shapes[:3 * n + 1]] == [2] * n + [4] * n + [6] * n + [8]
    late = {(s.phase.index, s.global_batch, s.micro_batches, s.phase.seq_len) for s in shapes[200:]}
    assert late == {(1, 128, 8, 512)}
    ramp_tokens = n * (64 + 128 + 192) * 128
    assert ramp_tokens == pytest.approx(1_000_000, rel=0.03)             # n: whole steps per size
    assert schedule.steps_for_tokens(ramp_tokens + 256 * 128 * 10) == 3 * n + 10
    assert schedule.steps_for_tokens(ramp_tokens + 256 * 128 * 10 + 1) == 3 * n + 11
    later = ramp_tokens + 256 * 128 * (200 - 3 * n)
    assert schedule.steps_for_tokens(later + 128 * 512 * 5) == 205


def test_phases_keep_what_they_leave_out_and_say_what_they_change():
    schedule = _schedule("data.dir=", "data.sources=[{dir: short, weight: 3}, {dir: web}]",
                         "phases=[{at_step: 90, mask_rate: 0.3}, {at_step: 95, sources: [{dir: long}], seq_len: 512}]",
                         world=2)
    first, masked, long = schedule.phases
    assert (first.sources, first.mask_rate, first.seq_len, first.global_batch) == (
        (("short", 3.0), ("web", 1.0)), 0.15, 128, 16)
    assert (masked.sources, masked.mask_rate, masked.at_step) == (first.sources, 0.3, 90)
    assert (long.sources, long.mask_rate, long.seq_len) == ((("long", 1.0),), 0.3, 512)
    assert [schedule.phase_at(s).index for s in (0, 89, 90, 94, 95, 10**9)] == [0, 0, 1, 1, 2, 2]
    assert long.changes(masked) == "sources [short x3, web x1] -> [long x1]; seq_len 128 -> 512"


@pytest.mark.parametrize("overrides,message", [
    (["data.dir=", "data.sources=[{dir: a, weight: -1}]"], "data.sources[0].weight: must be >= 0, got -1.0"),
    (["data.dir=", "data.sources=[{dir: a, weight: 0}, {dir: b, weight: 0}]"],
     "data.sources: the weights [0.0, 0.0] must sum to a positive number"),
    (["data.dir=", "data.sources=[{dir: a, weight: .nan}]"],
     "data.sources[0].weight: expected a finite number, got nan"),
    (["data.sources=[{dir: a}]"], "data.dir and data.sources: give one of them"),
    (["data.dir=", "data.sources=[{dir: a}, {dir: a}]"], "data.sources[1].dir: a is listed twice"),
    # one folder under two spellings is one source listed twice (the mixture would double its share)
    (["data.dir=", "data.sources=[{dir: a}, {dir: ./b/../a/}]"],
     "data.sources[1].dir: ./b/../a/ is listed twice (as data.sources[0].dir a: the same folder)"),
    (["phases=[{at_step: 5, sources: [{dir: long}, {dir: long/.}]}]"], "phases[0].sources[1].dir: long/. is listed"),
    # a phase from train.max_steps on is never entered
    (["train.max_steps=100", "phases=[{at_step: 100, mask_rate: 0.2}]"],
     "phases[0].at_step: 100 is at or past the end of the run (train.max_steps=100)"),
    (["train.max_steps=100", "phases=[{at_step: 50, mask_rate: 0.2}, {at_step: 400, mask_rate: 0.1}]"],
     "phases[1].at_step: 400 is at or past the end of the run"),
    (["data.dir=", "data.sources=[a]"], "data.sources[0]: expected a mapping, got 'a'"),
    (["phases=[{at_step: 0, mask_rate: 0.2}]"], "phases[0].at_step: must be above 0"),
    (["phases=[{at_step: 5, mask_rate: 0.2}, {at_step: 5, mask_rate: 0.1}]"], "phases[1].at_step: must be above 5"),
    (["phases=[{at_step: 5}]"], "phases[0]: changes nothing"),
    (["phases=[{at_step: 5, mask_rate: 1.5}]"], "phases[0].mask_rate: must lie in (0, 1), got 1.5"),
    (["phases=[{at_step: 5, mask_rate: 0.2}]", "train.objective=tta"], "phases[0].mask_rate with train.objective=tta"),
    (["phases=[{at_step: 5, sources: [{dir: b, weight: -2}]}]"], "phases[0].sources[0].weight: must be >= 0"),
    (["phases=[{at_step: 5, maskrate: 0.2}]"], "did you mean phases[0].mask_rate?"),
    (["train.batch_warmup.start=8"], "train.batch_warmup: start (8) and tokens (0) go together"),
])
def test_bad_config_values_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["data.dir=short", *overrides])
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("overrides,world,message", [
    (["train.grad_accum=4", "train.batch_warmup.start=24", "train.batch_warmup.tokens=9"], 2,
     "train.batch_warmup.start: 24 sequences must be below, and divide, the global batch of 64"),
    (["train.grad_accum=4", "train.batch_warmup.start=64", "train.batch_warmup.tokens=9"], 2, "must be below"),
    (["train.grad_accum=4", "train.batch_warmup.start=8", "train.batch_warmup.tokens=9"], 2,
     "train.batch_warmup.start: 8 sequences is not a multiple of the micro-batch x ranks = 8 x 2 (data.dir)"),
    (["phases=[{at_step: 9, global_batch: 20}]"], 2,
     "phases[0]: the global batch of 20 sequences is not a multiple of the micro-batch x ranks = 8 x 2"),
    (["phases=[{at_step: 9, sources: [{dir: long}], seq_len: 1024}]"], 2,
     "phases[0].seq_len: 1024, but long was prepared at 512; a phase reads its sources at their prepared length: "
     "give it sources prepared with `distaff data prepare --seq-len 1024`"),
    (["data.dir=", "data.sources=[{dir: short}, {dir: long}]"], 1,
     "data.sources: the sources were prepared at different lengths (short: 128, long: 512)"),
])
def test_values_that_do_not_fit_the_ranks_or_the_data_are_one_line_errors(overrides, world, message):
    with pytest.raises(ConfigError) as caught:
        _schedule(*overrides, world=world)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_sources_of_two_tokenizers_are_refused_naming_both(data_dir: Path, corpus_files: list[Path],
                                                           tmp_path: Path):
    other = train_tokenizer(corpus_files[2:3], 600, tmp_path / "tok").path
    prepare(PrepareConfig(inputs=(str(corpus_files[3]),), tokenizer_dir=str(other), seq_len=128,
                          out_dir=str(tmp_path / "other"), shard_mb=0.12, heldout_every=20, workers=1, progress=False))
    with pytest.raises(DataError) as caught:
        open_sources([str(data_dir), str(tmp_path / "other")])
    text = str(caught.value)
    assert f"data sources {data_dir} and {tmp_path / 'other'} were prepared with different tokenizers" in text
    assert "\n" not in text
