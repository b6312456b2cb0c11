"""Engine paths that CPU runs can execute (issue 15, item 11), each run for real on a CPU rank with DeepSpeed's
CPU accelerator: ZeRO-Offload with DeepSpeed's compiled CPU Adam, bf16 training, fp16 with dynamic loss
scaling, and a raw DeepSpeed JSON passed through (``deepspeed.config``) taking effect.

DeepSpeed's CPU accelerator has fp16 only where oneDNN does (CPUs with AVX512-FP16 or AMX-FP16): on such a
machine the fp16 run is tested; on any other the trainer's refusal of ``train.precision=fp16`` is.

ZeRO-Offload compiles DeepSpeed's ``cpu_adam`` C++ op with the machine's compiler on first use and caches it
under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``): the first run of that test on a machine
pays the build (measured ~7 minutes on a loaded 2-core machine), later runs load it in a second.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pretrain_fixtures import metrics, prepare_data, run_probe, spawn_ranks, train_losses, wait_all, write_config

from distaff.train.core.exit_codes import EXIT_BAD_CONFIG
from distaff.train.core.safe_load import safe_load

pytestmark = pytest.mark.integration

STEPS = 6


@pytest.fixture(scope="module")
def fp16_on_this_cpu() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


def _one_rank_run(name: str, sample_data: Path, tmp_path_factory, **sections) -> tuple[Path, dict, str]:
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    tmp = tmp_path_factory.mktemp(name)
    sections = {"train": {"max_steps": STEPS}, "wandb": {"mode": "disabled"}, "eval": {"every": 0, "batches": 1},
                **sections}
    config = write_config(tmp / "run.yaml", data, tmp / "run", **sections)
    codes, logs = run_probe(config, tmp, 1, tmp / "probe", state=False, timeout=900)
    assert codes == [0], logs
    return tmp / "run", json.loads((tmp / "probe" / "engine-rank0.json").read_text()), logs


@pytest.mark.timeout(1000)
def test_zero_offload_steps_with_deepspeed_cpu_adam_like_torch_adamw(sample_data, tmp_path_factory):
    run, engine, logs = _one_rank_run("offload", sample_data, tmp_path_factory,
                                      zero={"stage": 2, "offload_optimizer": True})
    assert engine["optimizer"] == "DeepSpeedCPUAdam" and engine["cpu_offload"], engine
    assert engine["master_device"] == "cpu"
    # the same run with torch's AdamW inside ZeRO-2: CPU Adam computes the same update
    reference, plain, _ = _one_rank_run("no-offload", sample_data, tmp_path_factory, zero={"stage": 2})
    assert plain["optimizer"] == "AdamW" and not plain["cpu_offload"]
    offloaded, expected = train_losses(run), train_losses(reference)
    assert sorted(offloaded) == list(range(1, STEPS + 1))
    for step, loss in expected.items():
        assert offloaded[step] == pytest.approx(loss, rel=1e-4, abs=1e-4), (step, offloaded, expected)
    assert offloaded[1] != offloaded[STEPS]


@pytest.mark.timeout(300)
def test_bf16_trains_on_cpu_with_fp32_master_weights(sample_data, tmp_path_factory):
    run, engine, _ = _one_rank_run("bf16", sample_data, tmp_path_factory, train={"max_steps": STEPS,
                                                                                 "precision": "bf16"})
    assert engine["bf16"] and not engine["fp16"] and engine["ds_config"]["bf16"] == {"enabled": True}
    assert engine["param_dtype"] == "torch.bfloat16" and engine["master_dtype"] == "torch.float32"
    losses = train_losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(math.isfinite(v) for v in losses.values())
    checkpoint = run / "checkpoints" / "step-00000006"
    weights = safe_load(checkpoint / "mp_rank_00_model_states.pt")["module"]
    assert {str(t.dtype) for t in weights.values()} == {"torch.bfloat16"}
    masters = safe_load(checkpoint / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert str(masters["single_partition_of_fp32_groups"][0].dtype) == "torch.float32"


@pytest.mark.timeout(300)
def test_fp16_dynamic_loss_scale_with_a_passthrough_initial_scale(sample_data, tmp_path_factory, fp16_on_this_cpu):
    """The passthrough JSON starts the loss scale at 2^20 (ours would be 2^16): fp16 gradients overflow, DeepSpeed
    skips those steps and halves the scale each time (hysteresis 1, also passed through) until they fit."""
    if not fp16_on_this_cpu:
        pytest.skip("this CPU has no oneDNN fp16, so DeepSpeed's CPU accelerator has no fp16 "
                    "(test_fp16_is_refused_naming_the_key_where_the_accelerator_lacks_it runs instead)")
    passthrough = tmp_path_factory.mktemp("passthrough") / "ds.json"
    passthrough.write_text(json.dumps({"fp16": {"initial_scale_power": 20, "hysteresis": 1}}))
    run, engine, _ = _one_rank_run("fp16", sample_data, tmp_path_factory, deepspeed={"config": str(passthrough)},
                                   train={"max_steps": 10, "precision": "fp16"})
    fp16 = engine["ds_config"]["fp16"]
    assert engine["fp16"] and engine["param_dtype"] == "torch.float16"
    assert fp16["loss_scale"] == 0 and fp16["initial_scale_power"] == 20 and fp16["hysteresis"] == 1
    assert fp16["loss_scale_window"] == 1000                        # generated keys kept beside the passed ones
    rows = [r for r in metrics(run) if "loss" in r]
    scales = [r["loss_scale"] for r in rows]
    overflowed = [r["grad_norm"] is None or not math.isfinite(r["grad_norm"]) for r in rows]
    assert scales[0] <= 2.0**20 and scales[0] > 2.0**16             # started from the passed-through scale
    assert overflowed[0] and not overflowed[-1]
    for before, after, skipped in zip(scales, scales[1:], overflowed[1:]):
        assert after == (before / 2 if skipped else before)         # halved on each overflow, else kept
    assert all(math.isfinite(r["loss"]) for r in rows)


@pytest.mark.timeout(300)
def test_fp16_is_refused_naming_the_key_where_the_accelerator_lacks_it(sample_data, tmp_path_factory,
                                                                       fp16_on_this_cpu):
    """Without fp16 the rank exits with the config-error code and a message naming ``train.precision``, before
    DeepSpeed's own error (which names no setting)."""
    if fp16_on_this_cpu:
        pytest.skip("this CPU has oneDNN fp16 (test_fp16_dynamic_loss_scale_with_a_passthrough_initial_scale runs)")
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    tmp = tmp_path_factory.mktemp("fp16-refused")
    config = write_config(tmp / "run.yaml", data, tmp / "run", train={"max_steps": STEPS, "precision": "fp16"},
                          wandb={"mode": "disabled"})
    assert wait_all(spawn_ranks(config, tmp, world_size=1), timeout=240) == [EXIT_BAD_CONFIG]
    log = (tmp / "rank0.log").read_text()
    assert "train.precision (or deepspeed.config): fp16 is not supported by DeepSpeed's cpu accelerator" in log, log
    assert "Type fp16 is not supported on your device" not in log
