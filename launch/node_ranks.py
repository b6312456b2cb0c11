"""One node's ranks of a Slurm job: torchrun, quiet about the exits the ranks explain themselves.

``python -m distaff.launch.node_ranks TORCHRUN_ARGS ...`` (the per-node script of ``distaff slurm submit``) runs
torchrun's own entry point with the same arguments. torchrun alone turns any failed rank into exit 1, printed as a
``ChildFailedError`` traceback of about 40 lines, after torch elastic's log lines about the failure. A rank that
checkpointed on a signal (75), stalled (76) or refused its config (2) has already said why in one line; so here:

- the node exits with the status of the rank that failed first (75, 76, 2 ... as the rank returned it; 128 + N for
  a rank killed by signal N), which the batch script acts on;
- for 75, 76 and 2 nothing is added; for any other failure, one line naming the rank and its status or signal;
- torch elastic's own log lines (INFO/WARNING/ERROR) are not shown.

``--verbose`` (``DISTAFF_VERBOSE=1``, which sbatch passes on to the job) shows elastic's lines and the traceback as
torchrun prints them; the exit status is the same.
"""

from __future__ import annotations

import logging
import signal
import sys
import traceback

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from distaff.train.core.exit_codes import EXIT_BAD_CONFIG, EXIT_PREEMPTED, EXIT_STALLED
from distaff.train.core.verbosity import verbose

SELF_EXPLAINED = (EXIT_PREEMPTED, EXIT_STALLED, EXIT_BAD_CONFIG)   # the rank printed its own line


def node_status(failure: ChildFailedError) -> tuple[int, str | None]:
    """The node's exit status for ``failure`` (its first failed rank's) and the line to print, if any."""
    rank, first = failure.get_first_failure()
    if first.exitcode < 0:
        name = signal.Signals(-first.exitcode).name if -first.exitcode in signal.valid_signals() else -first.exitcode
        return 128 - first.exitcode, f"distaff: rank {rank} was killed by {name}"
    if first.exitcode in SELF_EXPLAINED:
        return first.exitcode, None
    return first.exitcode, f"distaff: rank {rank} exited with {first.exitcode} (its own lines above say why)"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not verbose():
        logging.disable(logging.ERROR)   # elastic's lines only: this process runs nothing else
    try:
        run(args)
    except ChildFailedError as failure:
        if verbose():
            traceback.print_exc()
        status, line = node_status(failure)
        if line:
            print(line, file=sys.stderr, flush=True)
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
