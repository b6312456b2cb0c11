"""``python crash_during_save.py STEP --config RUN.yaml ...``: the trainer, except that every rank
dies in the middle of step STEP's checkpoint save (after its DeepSpeed files and its own state are
written, before the checkpoint is published), as a crash would."""

from __future__ import annotations

import os
import sys

from distaff.train.pretrain import trainer as pretrain
from distaff.train.run.checkpoint import Checkpointer

CRASH_EXIT_CODE = 86


def crash_after_writing(step: int) -> None:
    write_rank_files = Checkpointer._write_rank_files

    def write_then_crash(self: Checkpointer, partial, at_step: int) -> None:
        write_rank_files(self, partial, at_step)
        if at_step == step:
            os._exit(CRASH_EXIT_CODE)

    Checkpointer._write_rank_files = write_then_crash


if __name__ == "__main__":
    crash_after_writing(int(sys.argv[1]))
    sys.exit(pretrain.main(sys.argv[2:]))
