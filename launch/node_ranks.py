"""One node's ranks of a Slurm job: torchrun, quiet about the exits the ranks explain themselves.

``python -m distaff.launch.node_ranks TORCHRUN_ARGS ...`` (the per-node script of ``distaff slurm submit``) runs
torchrun's own entry point with the same arguments. torchrun alone turns any failed rank into exit 1, printed as a
``ChildFailedError`` traceback of about 40 lines, after torch elastic's log lines about the failure. A rank that
checkpointed on a signal (75), stalled (76) or refused its config (2) has already said why in one line; so here:

- the node exits with the status of the rank that failed first (75, 76, 2 ... as the rank returned it; 128 + N for
  a rank killed by signal N), which the batch script acts on;
- for 75, 76 and 2 nothing is added; for any other failure, one line naming the rank and its status or signal;
- a node whose rendezvous host (the first node's torchrun) went away, because that node's ranks ended (a stall) or
  the node failed, says so in one line instead of a traceback, and exits 1: the batch script goes by the other
  node's status and the stack dumps;
- torch elastic's own log lines (INFO/WARNING/ERROR) and the c10d store's C++ warnings are not shown.

``--verbose`` (``DISTAFF_VERBOSE=1``, which the script of ``distaff slurm submit --verbose`` exports) shows elastic's lines and the traceback as
torchrun prints them; the exit status is the same.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from typing import TYPE_CHECKING

from distaff.train.core.exit_codes import EXIT_BAD_CONFIG, EXIT_FAILURE, EXIT_PREEMPTED, EXIT_STALLED
from distaff.train.core.verbosity import verbose

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"   # read once, as torch's C++ library loads

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


def _import_torchrun_quietly() -> None:
    """torch, with the C++ warnings of this process off unless verbose (a store whose host went away warns
    with a C++ stack); the ranks inherit the environment as it was."""
    before = os.environ.get(CPP_LOG_LEVEL)
    if not verbose():
        os.environ[CPP_LOG_LEVEL] = "ERROR"
    import torch.distributed.run  # noqa: F401  (loads torch's C++ library)
    if before is None:
        os.environ.pop(CPP_LOG_LEVEL, None)
    else:
        os.environ[CPP_LOG_LEVEL] = before


def main(argv: list[str] | None = None) -> int:
    _import_torchrun_quietly()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.run import parse_args, run

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
    except RendezvousConnectionError:
        if verbose():
            raise
        print(f"distaff: lost the rendezvous on {args.rdzv_endpoint}: the first node's ranks ended (its log says "
              "why) or the node failed", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    return 0


if __name__ == "__main__":
    sys.exit(main())
