"""T-TA pretraining (``train.objective=tta``) with the bundled demo config (``configs/run/tiny-cpu.yaml``)
on 2 CPU ranks under real DeepSpeed, on real text: the all-token loss is finite and falls, and the
checkpointed model is the T-TA model. Padded batches under ZeRO-3 with every parameter partitioned (so
the position-query table must be gathered where it is read), packed batches under the demo's ZeRO-2."""

from __future__ import annotations

import json

import pytest
from pretrain_fixtures import REPO, metrics, prepare_data, rank_logs, spawn_ranks, train_losses, wait_all

from distaff.train.run.checkpoint import META, latest_checkpoint

pytestmark = pytest.mark.integration

STEPS = 16


@pytest.mark.timeout(400)
@pytest.mark.parametrize("packing,stage", [("padded", 3), ("varlen", 2)])
def test_tiny_cpu_trains_with_the_all_token_objective(packing, stage, sample_data, tmp_path_factory, tmp_path):
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    out = tmp_path / "run"
    # no parameter stays whole under ZeRO-3 (the default keeps those under 1e5 elements, which would be
    # every table of this model), so the position-query table must be gathered where it is read
    partition_all = tmp_path / "partition-all.json"
    partition_all.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    overrides = [f"run.out_dir={out}", f"data.dir={data}", "train.objective=tta", f"train.max_steps={STEPS}",
                 f"data.packing={packing}", f"zero.stage={stage}", f"deepspeed.config={partition_all}",
                 "optim.warmup_steps=2", "optim.lr=3e-3", "logging.every=1", "logging.progress_bar=false",
                 f"eval.every={STEPS // 2}", "eval.batches=2", "checkpoint.every=0", "checkpoint.keep=1", "wandb.mode=disabled"]
    procs = spawn_ranks(REPO / "configs" / "run" / "tiny-cpu.yaml", tmp_path, *overrides)
    assert wait_all(procs, timeout=360) == [0, 0], rank_logs(tmp_path)
    losses = train_losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    first, last = losses[1], [losses[step] for step in range(STEPS - 3, STEPS + 1)]
    assert all(value == value and value < 20 for value in losses.values())  # finite
    assert max(last) < first - 0.5, losses
    print(f"{packing}, ZeRO-{stage}: loss at step 1 {first:.3f}, steps {STEPS - 3}-{STEPS} {last}")
    evals = [r for r in metrics(out) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [STEPS // 2, STEPS] and all(0 < r["eval_loss"] < 20 for r in evals)
    assert evals[-1]["eval_tokens"] > 0  # held-out batches: every non-special token a target
    checkpoint = latest_checkpoint(out / "checkpoints")
    assert checkpoint is not None, "the run ends with a checkpoint"
    model_cfg = json.loads((checkpoint / META).read_text())["model_config"]
    assert model_cfg["tta"] and not model_cfg["emd"]  # the objective's model, saved as such
