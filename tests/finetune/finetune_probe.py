"""A rank program for the fine-tuning resume tests: the real trainer (and its command-line error handling),
stopped as if signalled, optionally recording what it does.

With ``PROBE_STOP_AT=N`` every rank reports a signal after optimizer step N, so the run checkpoints there
and exits 75 exactly as on SIGTERM/SIGUSR1, at a step the test chooses (a real signal lands wherever the
ranks happen to be). With ``PROBE_RECORD=DIR`` each rank writes ``DIR/engine-rank<r>`` when it starts
building its DeepSpeed engine and appends each micro-batch's ``example_ids`` to ``DIR/examples-rank<r>.jsonl``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from distaff.train.core import distributed as dist_utils
from distaff.train.finetune.config import load_finetune_config
from distaff.train.finetune.trainer import FinetuneTrainer
from distaff.train.run.runtime import run_main


def _recorded(batches, path: Path):
    for batch in batches:
        with open(path, "a") as handle:
            handle.write(json.dumps(batch["example_ids"].tolist()) + "\n")
        yield batch


def train(cfg, layout: dist_utils.DistEnv) -> int:
    record = os.environ.get("PROBE_RECORD")
    if record:
        build = FinetuneTrainer._initialize_engine

        def marked(self, *args, **kwargs):
            Path(record, f"engine-rank{layout.rank}").touch()
            return build(self, *args, **kwargs)

        FinetuneTrainer._initialize_engine = marked
    trainer = FinetuneTrainer(cfg, layout)
    if record:
        trainer.batches = _recorded(trainer.batches, Path(record, f"examples-rank{layout.rank}.jsonl"))
    stop_at = int(os.environ.get("PROBE_STOP_AT", "0"))
    if stop_at:
        take_step = trainer._step
        trainer._step = lambda: take_step() or trainer.state.step == stop_at
    return trainer.run()


if __name__ == "__main__":
    dist_utils.exit_process(run_main("finetune_probe", "", sys.argv[1:], load_finetune_config, train))
