"""A rank program for the fine-tuning resume test: the real trainer, stopped as if signalled.

With ``PROBE_STOP_AT=N`` every rank reports a signal after optimizer step N, so the run checkpoints there
and exits 75 exactly as on SIGTERM/SIGUSR1, at a step the test chooses (a real signal lands wherever the
ranks happen to be).
"""

from __future__ import annotations

import os
import sys

from distaff.train import distributed as dist_utils
from distaff.train.finetune import FinetuneTrainer
from distaff.train.finetune_config import load_finetune_config
from distaff.train.runtime import parse_args


def main(argv: list[str]) -> int:
    args = parse_args("finetune_probe", "", argv)
    cfg = load_finetune_config(args.config, args.overrides)
    layout = dist_utils.init_distributed(cfg.distributed.timeout_s)
    trainer = FinetuneTrainer(cfg, layout)
    stop_at = int(os.environ.get("PROBE_STOP_AT", "0"))
    if stop_at:
        take_step = trainer._step
        trainer._step = lambda: take_step() or trainer.state.step == stop_at
    code = trainer.run()
    dist_utils.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
