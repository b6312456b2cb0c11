"""The learning-rate schedules as pure functions of the step: linear and cosine decay as before, warmup-stable-decay
with its three decay shapes, a decay branch equal to its parent up to the branch point, and the WSD fields'
one-line errors."""

from __future__ import annotations

import math

import pytest

from distaff.train.run.config import ConfigError, load_config
from distaff.train.run.schedule import decay_factor, lr_at, wsd_window

pytestmark = pytest.mark.unit

LR, WARMUP, STEPS, MIN = 1e-3, 10, 100, 0.1


def wsd(step: int, **decay) -> float:
    return lr_at(step, lr=LR, warmup_steps=WARMUP, max_steps=STEPS, schedule="wsd", min_lr_ratio=MIN, **decay)


def test_linear_and_cosine_decay_over_the_run_after_the_warmup():
    for step in (0, 4, 9):
        assert lr_at(step, lr=LR, warmup_steps=WARMUP, max_steps=STEPS) == LR * (step + 1) / WARMUP
    for step in (10, 37, 99, 150):
        progress = min(1.0, (step - WARMUP) / (STEPS - WARMUP))
        linear = lr_at(step, lr=LR, warmup_steps=WARMUP, max_steps=STEPS, min_lr_ratio=MIN)
        cosine = lr_at(step, lr=LR, warmup_steps=WARMUP, max_steps=STEPS, schedule="cosine", min_lr_ratio=MIN)
        assert linear == pytest.approx(LR * (MIN + (1 - MIN) * (1 - progress)), rel=1e-12)
        assert cosine == pytest.approx(LR * (MIN + (1 - MIN) * 0.5 * (1 + math.cos(math.pi * progress))), rel=1e-12)


@pytest.mark.parametrize("shape, quarter", [("linear", 0.75), ("cosine", 0.5 * (1 + math.cos(math.pi / 4))),
                                            ("1-sqrt", 0.5)])
def test_wsd_warms_up_holds_the_peak_then_decays_in_its_shape_to_the_floor(shape, quarter):
    decay = dict(decay_start=60, decay_steps=40, decay_shape=shape)
    assert [wsd(s, **decay) for s in range(WARMUP)] == [LR * (s + 1) / WARMUP for s in range(WARMUP)]
    assert all(wsd(s, **decay) == LR for s in range(WARMUP, 61))          # stable, and the decay's first step
    assert wsd(70, **decay) == pytest.approx(LR * (MIN + (1 - MIN) * quarter), rel=1e-12)
    values = [wsd(s, **decay) for s in range(60, 100)]
    assert all(a >= b for a, b in zip(values, values[1:])) and values[-1] > LR * MIN
    assert wsd(100, **decay) == pytest.approx(LR * MIN) == wsd(500, **decay)
    assert decay_factor(shape, 0.0) == 1.0 and decay_factor(shape, 1.0) == pytest.approx(0.0, abs=1e-15)


def test_wsd_windows_from_either_field_and_a_branch_equals_its_parent_until_it_decays():
    assert wsd_window(STEPS, 0, 20) == (80, 20)            # the run's last 20 steps
    assert wsd_window(STEPS, 70, 0) == (70, 30)            # from step 70 to the end
    assert wsd_window(STEPS, STEPS, 0) == (STEPS, 0)       # all stable: decays come from branches
    parent = [wsd(s, decay_start=STEPS) for s in range(STEPS)]
    assert parent[WARMUP:] == [LR] * (STEPS - WARMUP)
    branch_at, length = 40, 25                             # distaff decay RUN --from 40 --steps 25
    branch = [lr_at(s, lr=LR, warmup_steps=WARMUP, max_steps=branch_at + length, schedule="wsd", min_lr_ratio=MIN,
                    decay_start=branch_at, decay_steps=length) for s in range(branch_at + length)]
    assert branch[:branch_at + 1] == parent[:branch_at + 1]
    assert branch[-1] < branch[branch_at + 1] < LR


@pytest.mark.parametrize("overrides, message", [
    (["optim.schedule=wsd"], r"^optim\.schedule=wsd: set optim\.decay_steps"),
    (["optim.schedule=wsd", "optim.decay_start=1200"], r"^optim\.decay_start: 1200 is past the end of the run "
                                                        r"\(train\.max_steps=1000\)"),
    (["optim.schedule=wsd", "optim.decay_steps=1500"], r"^optim\.decay_steps: 1500 steps of decay are longer"),
    (["optim.schedule=wsd", "optim.decay_start=900", "optim.decay_steps=200"],
     r"^optim\.decay_steps: a decay of 200 steps from step 900 ends at step 1100, past train\.max_steps=1000"),
    (["optim.schedule=wsd", "optim.decay_start=10", "optim.warmup_steps=20"], r"^optim\.decay_start: .* inside the "
                                                                               r"warmup \(optim\.warmup_steps=20\)"),
    (["optim.decay_steps=100"], r"^optim\.decay_start/decay_steps with optim\.schedule=linear"),
    (["optim.schedule=wsd", "optim.decay_steps=100", "optim.decay_shape=sqrt"], r"^optim\.decay_shape: must be one of"),
    (["optim.schedule=wsd", "optim.decay_steps=-1"], r"^optim\.decay_steps: must be >= 0"),
])
def test_bad_wsd_fields_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, ["data.dir=/d", *overrides])
    assert "\n" not in str(err.value)


def test_wsd_fields_load_and_the_finetuning_optim_section_has_none():
    cfg = load_config(None, ["data.dir=/d", "optim.schedule=wsd", "optim.decay_start=1000"])
    assert (cfg.optim.decay_start, cfg.optim.decay_steps, cfg.optim.decay_shape) == (1000, 0, "1-sqrt")
    from distaff.train.finetune.config import FinetuneOptimSection

    assert not hasattr(FinetuneOptimSection(), "decay_start")
