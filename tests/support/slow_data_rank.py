"""A rank program for the plan check's test: the real pretraining trainer over a data source slowed by
``$SLOW_DATA_S`` seconds per batch (a loader that cannot keep up, as on a slow network disk)."""

from __future__ import annotations

import os
import sys
import time

from distaff.train.data import loader


def slow(iterate):
    def batches(self):
        for batch in iterate(self):
            time.sleep(float(os.environ["SLOW_DATA_S"]))
            yield batch
    return batches


loader.PretrainLoader.__iter__ = slow(loader.PretrainLoader.__iter__)

if __name__ == "__main__":
    from distaff.train.core.distributed import exit_process
    from distaff.train.pretrain.trainer import main

    exit_process(main(sys.argv[1:]))
