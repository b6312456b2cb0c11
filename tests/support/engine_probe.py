"""A rank program for tests that look inside the engine: the real trainer, plus ``$PROBE_DIR/engine-rank<r>.json``
(what DeepSpeed built: optimizer classes, offload, precision, the config it runs on) and a dump of the full
training state right after resuming (``start``, only when resumed) and after the run (``end``) into
``$PROBE_DIR/<when>-rank<r>.pt``.

The dump holds every parameter's full fp32 master weights and Adam moments (gathered across the ranks'
ZeRO partitions with DeepSpeed's own ``safe_get_full_*`` calls, so each world size is read its own way),
the loop's counters and this rank's data-stream state.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch

from distaff.train.core import distributed as dist_utils
from distaff.train.pretrain.trainer import Trainer, parse_args
from distaff.train.run.config import load_config
from distaff.train.run.steps import _base_optimizer


def full_state(engine) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2: link the moments as they are now
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    state = {}
    for name, param in engine.module.named_parameters():
        master = safe_get_full_fp32_param(param)  # collective; None under ZeRO-0: the optimizer holds it whole
        partitioned = master is not None
        own = {} if partitioned else engine.optimizer.state[param]
        state[f"fp32/{name}"] = (master if partitioned else param).detach().cpu().clone()
        for moment in ("exp_avg", "exp_avg_sq"):
            value = safe_get_full_optimizer_state(param, moment) if partitioned else own[moment]
            state[f"{moment}/{name}"] = value.detach().cpu().clone()
    return state


def dump(trainer: Trainer, when: str) -> None:
    out = Path(os.environ["PROBE_DIR"]) / f"{when}-rank{trainer.layout.rank}.pt"
    torch.save({"tensors": full_state(trainer.engine), "train_state": trainer.state.state_dict(),
                "data": trainer.loader.state_dict(), "world_size": trainer.layout.world_size}, out)


def describe(trainer: Trainer) -> None:
    engine = trainer.engine
    masters = getattr(engine.optimizer, "single_partition_of_fp32_groups", None)  # ZeRO-1/2
    facts = {"optimizer": type(_base_optimizer(engine.optimizer)).__name__,
             "wrapper": type(engine.optimizer).__name__,
             "cpu_offload": bool(getattr(engine.optimizer, "cpu_offload", False)),
             "param_dtype": str(next(engine.module.parameters()).dtype),
             "master_dtype": str(masters[0].dtype) if masters else None,
             "master_device": str(masters[0].device) if masters else None,
             "fp16": engine.fp16_enabled(), "bf16": engine.bfloat16_enabled(),
             "ds_config": engine._config._param_dict}
    out = Path(os.environ["PROBE_DIR"]) / f"engine-rank{trainer.layout.rank}.json"
    out.write_text(json.dumps(facts, default=str))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    layout = dist_utils.init_distributed(cfg.distributed.timeout_s)
    trainer = Trainer(cfg, layout)
    describe(trainer)
    dump_state = os.environ.get("PROBE_STATE", "1") == "1"
    if dump_state and trainer.state.step:  # resumed (a new run has no optimizer moments yet)
        dump(trainer, "start")
    stop_at = int(os.environ.get("PROBE_STOP_AT", "0"))
    if stop_at:  # as if preempted at that step: every rank saves a checkpoint there and exits 75
        take_step = trainer._step
        trainer._step = lambda: take_step() or trainer.state.step >= stop_at
    code = trainer.run()
    if dump_state:
        dump(trainer, "end")
    dist_utils.shutdown()
    return code


if __name__ == "__main__":
    try:
        exit_code = main(sys.argv[1:])
    except Exception:  # noqa: BLE001 - as the trainer's entry point: report, exit 1, no interpreter teardown
        traceback.print_exc()
        exit_code = 1
    dist_utils.exit_process(exit_code)
