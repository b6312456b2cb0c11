"""Nothing outlives a killed ``distaff launch``: a watcher process that stops the job when the launcher dies.

``distaff launch`` starts deepspeed's runner in a session of its own (so a terminal's Ctrl-C reaches only
the launcher, which hands it to the ranks). That also means a SIGKILLed launcher (``kill -9``, the OOM
killer) would leave the runner, deepspeed's per-node launcher and every rank training unattended, holding
the run's lock. A parent-death signal on the runner alone is not enough: it would end the runner and
leave its children. So the launcher starts this watcher, in a session of its own too, with a pipe on
its stdin whose only writer is the launcher: the pipe reads end-of-file when the launcher exits, however
it exits. The watcher then stops the job as a Ctrl-C would: SIGTERM to the ranks (they checkpoint at the
step boundary and exit 75, and deepspeed's processes follow), or to the runner on several nodes (its pdsh
handler stops every node); whatever is left of the job's process group after :data:`GRACE_S` is
SIGKILLed. After a normal exit the group is empty and the watcher just ends.

``python -m distaff.launch.watcher RUNNER_PID MODULE {ranks|runner}`` (started by :func:`start_watcher`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil       # imported here, never first inside a signal handler (a second Ctrl-C would see it half-made)

GRACE_S = 120.0          # for the ranks' checkpoint, as `distaff ablate` allows a run it stops
POLL_S = 0.2


def runs_module(cmdline: list[str], module: str) -> bool:
    """Is ``cmdline`` ``python ... -m module ...``? (deepspeed's own processes name the module as an argument)"""
    return any(a == "-m" and b == module for a, b in zip(cmdline, cmdline[1:]))


def group_processes(pgid: int) -> list:
    """The live (not zombie) processes of process group ``pgid``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, ProcessLookupError):     # gone since the listing
            pass
    return found


def trainer_processes(pgid: int, module: str) -> list:
    """This node's processes of the job (process group ``pgid``) that run ``module``: the ranks, and their
    forked workers."""
    found = []
    for proc in group_processes(pgid):
        try:
            if runs_module(proc.cmdline(), module):
                found.append(proc)
        except psutil.Error:
            pass
    return found


def signal_job(runner_pid: int, module: str, signum: int, *, to_ranks: bool) -> None:
    """``signum`` to the job's ranks (one node; with none started yet, SIGTERM to the whole job), or to the runner
    (several nodes: its pdsh handler signals every node). The runner leads the job's process group."""
    if not to_ranks:
        try:
            os.kill(runner_pid, signum)
        except ProcessLookupError:
            pass
        return
    ranks = trainer_processes(runner_pid, module)
    if not ranks:                  # none started yet: nothing to save, stop the whole launch
        try:
            os.killpg(runner_pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for rank in ranks:
        try:
            rank.send_signal(signum)
        except psutil.Error:       # exited meanwhile
            pass


def start_watcher(runner_pid: int, module: str, *, to_ranks: bool) -> subprocess.Popen:
    """The watcher of the job led by ``runner_pid``; it acts when this process closes its stdin (or dies)."""
    command = [sys.executable, "-m", "distaff.launch.watcher", str(runner_pid), module, "ranks" if to_ranks else "runner"]
    return subprocess.Popen(command, stdin=subprocess.PIPE, start_new_session=True)


def _say(message: str) -> None:
    try:                           # the launcher's terminal or pipe may be gone with it
        print(f"distaff launch: {message}", file=sys.stderr, flush=True)
    except OSError:
        pass


def watch(runner_pid: int, module: str, *, to_ranks: bool, grace_s: float = GRACE_S) -> None:
    """Wait for end-of-file on stdin (the launcher has exited), then stop what is left of the job."""
    while sys.stdin.buffer.read(4096):
        pass
    if not group_processes(runner_pid):
        return                     # the launcher waited for the job: nothing left
    signal_job(runner_pid, module, signal.SIGTERM, to_ranks=to_ranks)
    _say(f"the launcher is gone: stopping its job (process group {runner_pid}); the ranks checkpoint and exit 75")
    deadline = time.monotonic() + grace_s
    while group_processes(runner_pid) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    try:
        os.killpg(runner_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    pid, module, mode = (sys.argv[1:] if argv is None else argv)
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)    # the launcher's terminal is not ours: its signals reach the launcher
    watch(int(pid), module, to_ranks=mode == "ranks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
