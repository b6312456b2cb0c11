"""The trainer's exit statuses, which launchers act on (the Slurm script requeues on :data:`EXIT_PREEMPTED` and
:data:`EXIT_STALLED`), and :func:`leave_now`, the way a rank leaves without the interpreter's teardown.

Imports no torch, so launchers read them without it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from typing import NoReturn

EXIT_FAILURE = 1
EXIT_BAD_CONFIG = 2
EXIT_PREEMPTED = 75     # EX_TEMPFAIL: checkpointed on a signal; run again to resume
EXIT_STALLED = 76       # the watchdog saw no step progress and dumped the stacks: run again to resume from the
                        # latest checkpoint (a stall is usually a slow filesystem or a hung peer, not the run's fault)

_REAP_S = 2.0     # a SIGKILLed child is gone within milliseconds; bounded so a leaving rank never waits on one
_ENDING = threading.RLock()     # held by the thread that ends the process: see claim_exit


def claim_exit() -> None:
    """Make this thread the one that ends the process; in any other thread, wait for that end instead.

    A rank's watchdog and its main thread can both set out to end it at once: the peer a rank waits on is often
    killed just as its watchdog fires, and the collective that breaks would print a traceback beside the stall
    (or the DataLoader's handler, as the watchdog kills the workers). The first to claim reports and exits; the
    other never returns.
    """
    if not _ENDING.acquire(blocking=False):
        threading.Event().wait()


def _end_children() -> None:
    """SIGKILL this process's multiprocessing children (a rank's DataLoader workers) and reap them."""
    if threading.current_thread() is threading.main_thread():
        # torch's DataLoader handler would raise "worker killed by signal" here, out of the exit; a watchdog
        # thread cannot reset it, and there the handler runs in the main thread, which claim_exit keeps quiet
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    children = multiprocessing.active_children()
    for child in children:
        child.kill()
    for child in children:
        child.join(_REAP_S)


def leave_now(code: int) -> NoReturn:
    """Exit with ``code`` at once, its DataLoader workers first.

    A rank leaves this way when its main thread is stuck (the watchdog), when its peers may be mid-collective (a
    failed rank), or once it has had a process group (gloo's threads can abort a normal teardown). ``os._exit``
    alone leaves the workers running until they notice their parent is gone, and a worker caught handing a batch
    over (torch passes tensors through a file-descriptor server thread) prints that thread's traceback into the
    node's log as the rank vanishes mid-handshake. The workers only read shards: nothing of theirs needs saving.
    """
    claim_exit()
    try:
        _end_children()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:    # a closed pipe or a child that will not die must not keep the rank, holding the exit, alive
        os._exit(code)
