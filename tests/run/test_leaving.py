"""How a rank leaves at once (``exit_codes.leave_now``): one thread ends the process, with the status it chose,
and its DataLoader workers go first. Each case runs in its own interpreter, since it ends it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import psutil
import pytest

from distaff.train.core.exit_codes import EXIT_STALLED

pytestmark = pytest.mark.unit


def _run(source: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(source)], capture_output=True, text=True, timeout=120)


def test_the_thread_that_claims_the_exit_ends_the_process_and_the_other_stays_quiet():
    """The watchdog claims the exit before it dumps the stacks; the main thread's broken collective, raised while
    it dumps them, must neither print nor exit with its own status."""
    result = _run("""
        import threading, time
        from distaff.train.core.exit_codes import claim_exit, leave_now

        claimed = threading.Event()
        def watchdog():
            claim_exit()
            claimed.set()
            time.sleep(0.5)          # dumping the stacks, while the main thread fails
            print("stalled", flush=True)
            leave_now(76)
        threading.Thread(target=watchdog, daemon=True).start()
        claimed.wait()
        claim_exit()                 # the main thread's failure path: never returns
        print("the main thread reported", flush=True)
        leave_now(1)
    """)
    assert (result.returncode, result.stdout, result.stderr) == (EXIT_STALLED, "stalled\n", "")


def test_leaving_ends_the_dataloader_workers_first():
    result = _run("""
        import os, time
        import torch
        from torch.utils.data import DataLoader, IterableDataset
        from distaff.train.core.exit_codes import leave_now

        class Slow(IterableDataset):
            def __iter__(self):
                yield torch.tensor([os.getpid()])
                time.sleep(600)      # the next batch never comes: a worker a rank would leave behind

        batches = iter(DataLoader(Slow(), batch_size=None, num_workers=1))
        print(int(next(batches)), flush=True)
        leave_now(76)
    """)
    assert result.returncode == EXIT_STALLED, result.stderr
    worker = int(result.stdout)
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE, worker


def test_a_watchdog_that_cannot_write_its_stacks_still_ends_the_rank():
    """It holds the exit from its first step: were it to die on a full or read-only disk, the rank would hang."""
    result = _run("""
        import time
        from distaff.train.core.watchdog import Watchdog

        Watchdog(0.2, "/nonexistent/run", rank=3)
        time.sleep(60)
    """)
    assert result.returncode == EXIT_STALLED, result.stderr
    assert "distaff: rank 3: stalled: no step progress for 0.2 s" in result.stderr, result.stderr
    assert "its stacks could not be appended to /nonexistent/run/stacks-rank3.txt" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
