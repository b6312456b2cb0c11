"""A real, throw-away Slurm cluster on loopback for tests: munged, slurmctld and two slurmd "nodes".

Everything lives in one temporary directory (config, keys, spool, state, logs) and every daemon is a
child process of the test: :func:`slurm_cluster` stops all of them on exit, even after a failure.
The node names ``n1`` and ``n2`` resolve through a private ``/etc/hosts`` that each daemon
bind-mounts in its own mount namespace (``unshare -m``), so the machine's files stay untouched; job
processes inherit that namespace from their slurmd, so jobs can resolve ``n1``/``n2`` too.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from distaff.train.distributed import free_port

NODE_NAMES = ("n1", "n2")
DAEMON_BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "unshare")
# Job states after which a job never runs again (REQUEUED and PREEMPTED are not among them).
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def slurm_unavailable_reason() -> str | None:
    """Why a local Slurm cluster cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (slurmd, munged and bind-mounting /etc/hosts)"
    missing = [name for name in DAEMON_BINARIES if shutil.which(name) is None]
    if missing:
        return f"Slurm/munge binaries not installed: {', '.join(missing)} (run scripts/install-slurm.sh as root)"
    return None


def _node_hardware() -> str:
    """The CPU layout fields of ``slurmd -C`` (RealMemory left out, so memory is never checked)."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.split("\n")[0]
    keep = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
    return " ".join(item for item in out.split() if item.split("=")[0] in keep)


@dataclass
class SlurmCluster:
    """A running local cluster: run client commands against it with :meth:`run`."""

    root: Path
    conf: Path
    env: dict[str, str]
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)

    def run(self, *args: str, check: bool = True, timeout: float = 60,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run a Slurm client command (``sbatch``, ``srun``, ...) against this cluster; ``env`` adds variables."""
        proc = subprocess.run(list(args), env={**self.env, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def job_field(self, job_id: str, name: str) -> str:
        """One field of ``scontrol show job`` (e.g. JobState, ExitCode, Restarts)."""
        text = self.run("scontrol", "-o", "show", "job", job_id).stdout
        for item in text.split():
            key, _, value = item.partition("=")
            if key == name:
                return value
        raise KeyError(f"field {name!r} not in scontrol output for job {job_id}: {text}")

    def wait_for(self, job_id: str, states: set[str], timeout: float) -> str:
        """Poll until the job reaches one of ``states`` (or a final state); return that state."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.job_field(job_id, "JobState")
            if state in states or state in FINAL_STATES:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f}s (wanted {sorted(states)})")
            time.sleep(0.5)

    def log_tail(self, lines: int = 40) -> str:
        """The end of every daemon log, for failure messages."""
        parts = []
        for log in sorted((self.root / "log").glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(parts)


def _write_config(root: Path, munge_socket: Path) -> Path:
    host = socket.gethostname().split(".")[0]
    hardware = _node_hardware()
    nodes = "\n".join(
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} {hardware} State=UNKNOWN"
        for name in NODE_NAMES
    )
    conf = root / "slurm.conf"
    conf.write_text(f"""\
ClusterName=distafftest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job may start again only after this many seconds (default 120).
AuthInfo=socket={munge_socket},cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
MinJobAge=600
KillWait=10
{nodes}
PartitionName=debug Nodes={",".join(NODE_NAMES)} Default=YES MaxTime=INFINITE State=UP
""")
    return conf


def _in_private_hosts(hosts: Path, argv: list[str]) -> list[str]:
    """``argv`` run in a new mount namespace where ``hosts`` is bind-mounted over /etc/hosts."""
    return ["unshare", "-m", "--", "sh", "-c", f'mount --bind "{hosts}" /etc/hosts && exec "$@"', "sh", *argv]


def _start(stack: ExitStack, cluster: SlurmCluster, name: str, argv: list[str]) -> None:
    log = open(cluster.root / "log" / f"{name}.stdout", "wb")
    stack.callback(log.close)
    proc = subprocess.Popen(argv, env=cluster.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    cluster.daemons[name] = proc
    stack.callback(_stop, proc)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def _wait_until(predicate, timeout: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        dead = [name for name, proc in cluster.daemons.items() if proc.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = f"daemons exited: {dead}" if dead else f"timed out after {timeout:.0f}s"
            raise RuntimeError(f"local Slurm: {what} failed ({why})\n{cluster.log_tail()}")
        time.sleep(0.3)


def _nodes_idle(cluster: SlurmCluster) -> bool:
    out = cluster.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split()
    states = dict(zip(out[0::2], out[1::2]))
    return all(states.get(name) == "idle" for name in NODE_NAMES)


def _cancel_all_jobs(cluster: SlurmCluster) -> None:
    """Cancel every job and wait for their processes to end, so no slurmstepd outlives slurmd."""
    cluster.run("scancel", "--full", "--signal=KILL", "--partition=debug", check=False)
    cluster.run("scancel", "--partition=debug", check=False)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        active = cluster.run("squeue", "-h", "-t", "all", "-o", "%i %T", check=False).stdout.split()
        if not any(state in ("RUNNING", "COMPLETING", "PENDING", "CONFIGURING") for state in active[1::2]):
            return
        time.sleep(0.5)


def processes_using(root: Path) -> list[str]:
    """Processes whose command line or environment mentions ``root`` (daemons and job steps of a cluster)."""
    found = []
    needle = str(root).encode()
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
            continue
        try:
            cmdline = (pid_dir / "cmdline").read_bytes()
            environ = (pid_dir / "environ").read_bytes()
        except OSError:
            continue
        if needle in cmdline or needle in environ:
            command = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
            found.append(f"{pid_dir.name}: {command}")
    return found


@contextmanager
def slurm_cluster(base: Path | None = None) -> Iterator[SlurmCluster]:
    """Bring up munged + slurmctld + slurmd n1/n2 in a temp dir; stop them all on exit."""
    reason = slurm_unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    root = Path(tempfile.mkdtemp(prefix="distaff-slurm-", dir=base))
    for sub in ("munge", "state", "spool/n1", "spool/n2", "run", "log"):
        (root / sub).mkdir(parents=True)
    munge_socket = root / "munge" / "munge.socket"
    hosts = root / "hosts"
    hosts.write_text(Path("/etc/hosts").read_text() + f"127.0.0.1 {' '.join(NODE_NAMES)}\n")
    conf = _write_config(root, munge_socket)
    env = dict(os.environ, SLURM_CONF=str(conf))
    cluster = SlurmCluster(root=root, conf=conf, env=env)

    with ExitStack() as stack:
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        key = root / "munge" / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
        # munged refuses root without --force; the test runs as root and owns every file involved.
        _start(stack, cluster, "munged", [
            "munged", "--foreground", "--force", f"--socket={munge_socket}", f"--key-file={key}",
            f"--pid-file={root}/run/munged.pid", f"--log-file={root}/log/munged.log",
            f"--seed-file={root}/munge/munged.seed",
        ])
        _wait_until(munge_socket.exists, 10, "starting munged", cluster)
        _start(stack, cluster, "slurmctld", _in_private_hosts(hosts, ["slurmctld", "-D", "-c", "-f", str(conf)]))
        for name in NODE_NAMES:
            _start(stack, cluster, f"slurmd-{name}", _in_private_hosts(hosts, ["slurmd", "-D", "-N", name, "-f", str(conf)]))
        # Registered last, so it runs first on exit: no job step may outlive its slurmd.
        stack.callback(_cancel_all_jobs, cluster)
        _wait_until(lambda: _nodes_idle(cluster), 60, "bringing nodes n1, n2 to idle", cluster)
        yield cluster


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    """A local two-node cluster for the session (skips where it cannot run); checks nothing outlives it."""
    reason = slurm_unavailable_reason()
    if reason:
        pytest.skip(reason)
    with slurm_cluster() as cluster:
        yield cluster
    still_running = [name for name, proc in cluster.daemons.items() if proc.poll() is None]
    leftovers = processes_using(cluster.root)
    assert not still_running and not leftovers, f"left running: {still_running} {leftovers}"
