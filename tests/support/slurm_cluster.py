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

from distaff.train.core.distributed import free_port
from distaff.train.data.loader import WORKER_SIGTERM_GRACE_S

NODE_NAMES = ("n1", "n2")
DAEMON_BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "unshare")
# Job states after which a job never runs again (REQUEUED and PREEMPTED are not among them).
PREEMPTING_PARTITION = "urgent"  # its jobs preempt (requeue) those of the default partition, "debug"
NODE_FAIL_TIMEOUT_S = 10  # SlurmdTimeout of the cluster for node-failure tests
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
    """The CPU layout fields of ``slurmd -C``, and half its RealMemory: both "nodes" share this machine's
    memory, and a node that registers with less than its configured memory is drained. Memory is not
    a consumable resource here (``CR_Core``): a job's ``--mem`` only has to fit one node's RealMemory."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.split("\n")[0]
    keep = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
    fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
    return " ".join([f"{key}={fields[key]}" for key in keep] + [f"RealMemory={int(fields['RealMemory']) // 2}"])


@dataclass
class SlurmCluster:
    """A running local cluster: run client commands against it with :meth:`run`; crash and restart a
    node with :meth:`freeze_node`, :meth:`kill_node` and :meth:`start_node`."""

    root: Path
    conf: Path
    env: dict[str, str]
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)
    stack: ExitStack | None = None       # stops what :meth:`start_node` starts, with the rest
    hosts: Path | None = None            # the private /etc/hosts
    _node_ns: dict[str, str] = field(default_factory=dict)  # node -> its mount namespace

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

    def node_processes(self, name: str) -> list[int]:
        """Every process of node ``name``: its slurmd and all it started (job steps, ranks) share the
        slurmd's private mount namespace, which no other process on the machine has. The namespace is
        remembered until :meth:`kill_node`, so a node's processes are found after its slurmd is gone."""
        namespace = self._node_ns.get(name) or os.readlink(f"/proc/{self.daemons[f'slurmd-{name}'].pid}/ns/mnt")
        self._node_ns[name] = namespace
        pids = []
        for pid_dir in Path("/proc").iterdir():
            try:
                if pid_dir.name.isdigit() and os.readlink(pid_dir / "ns" / "mnt") == namespace:
                    pids.append(int(pid_dir.name))
            except OSError:  # gone meanwhile
                continue
        return pids

    def freeze_node(self, name: str) -> int:
        """A host that hangs: SIGSTOP every process of the node (repeated until no running one is left, as
        processes may fork meanwhile). Its sockets stay open, so peers see silence, not a closed
        connection, and its slurmd answers no ping. Returns how many processes were stopped.
        Whatever a test leaves frozen is killed when the cluster stops."""
        if self.stack is not None and name not in self._node_ns:
            self.stack.callback(lambda: self.kill_node(name) if name in self._node_ns else None)
        while True:
            running = [pid for pid in self.node_processes(name) if _state(pid) not in ("T", "Z", "")]
            if not running:
                return len(self.node_processes(name))
            for pid in running:
                _signal(pid, signal.SIGSTOP)

    def kill_node(self, name: str, timeout: float = 30) -> None:
        """The host is gone: SIGKILL every process of the node (stopped ones too) and wait until none is left."""
        deadline = time.monotonic() + timeout
        while pids := self.node_processes(name):
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {name}: processes {pids} survive SIGKILL")
            for pid in pids:
                _signal(pid, signal.SIGKILL)
            time.sleep(0.1)
        self.daemons[f"slurmd-{name}"].wait(timeout=timeout)
        del self._node_ns[name]

    def start_node(self, name: str) -> None:
        """(Re)start node ``name``'s slurmd; with ``ReturnToService=2`` a DOWN node returns once it registers."""
        assert self.stack is not None and self.hosts is not None
        _start(self.stack, self, f"slurmd-{name}",
               _in_private_hosts(self.hosts, ["slurmd", "-D", "-N", name, "-f", str(self.conf)]))

    def wait_for_nodes(self, state: str, timeout: float = 60) -> None:
        """Until every node is in ``state`` (sinfo's word: idle, down, ...)."""
        _wait_until(lambda: _nodes_in(self, state), timeout, f"bringing nodes n1, n2 to {state}", self)

    def log_tail(self, lines: int = 40) -> str:
        """The end of every daemon log, for failure messages."""
        parts = []
        for log in sorted((self.root / "log").glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(parts)


def _state(pid: int) -> str:
    """A process's state letter (R, S, T stopped, Z zombie ...), or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


def _signal(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass


def _write_config(root: Path, munge_socket: Path, slurmd_timeout_s: int) -> Path:
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
# Binds each task to the CPUs its step was given: a rank's os.sched_getaffinity shows its request.
TaskPlugin=task/affinity
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
# A node that answers no ping for this long is DOWN and its jobs end as NODE_FAIL (Slurm's default: 300).
SlurmdTimeout={slurmd_timeout_s}
{nodes}
# A job in "urgent" preempts one in "debug" on the same nodes, which Slurm requeues (as a preemptible partition
# of a real cluster does): SIGCONT and SIGTERM, then SIGKILL after KillWait.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=debug Nodes={",".join(NODE_NAMES)} Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName={PREEMPTING_PARTITION} Nodes={",".join(NODE_NAMES)} MaxTime=INFINITE State=UP PriorityTier=2
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


def _nodes_in(cluster: SlurmCluster, state: str) -> bool:
    out = cluster.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split()
    states = dict(zip(out[0::2], out[1::2]))
    return all(states.get(name) == state for name in NODE_NAMES)


def _cancel_all_jobs(cluster: SlurmCluster) -> None:
    """Cancel every job and wait for their processes to end, so no slurmstepd outlives slurmd."""
    partitions = f"--partition=debug,{PREEMPTING_PARTITION}"
    cluster.run("scancel", "--full", "--signal=KILL", partitions, check=False)
    cluster.run("scancel", partitions, check=False)
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
def slurm_cluster(base: Path | None = None, slurmd_timeout_s: int = 300) -> Iterator[SlurmCluster]:
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
    conf = _write_config(root, munge_socket, slurmd_timeout_s)
    env = dict(os.environ, SLURM_CONF=str(conf))

    with ExitStack() as stack:
        cluster = SlurmCluster(root=root, conf=conf, env=env, stack=stack, hosts=hosts)
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
            cluster.start_node(name)
        # Registered last, so it runs first on exit: no job step may outlive its slurmd.
        stack.callback(_cancel_all_jobs, cluster)
        cluster.wait_for_nodes("idle")
        yield cluster


def _serve(**options) -> Iterator[SlurmCluster]:
    """A fixture's cluster (skips where it cannot run); checks nothing outlives it."""
    reason = slurm_unavailable_reason()
    if reason:
        pytest.skip(reason)
    with slurm_cluster(**options) as cluster:
        yield cluster
    still_running = [name for name, proc in cluster.daemons.items() if proc.poll() is None]
    # A rank's DataLoader worker may outlive the rank for a few seconds: it ends once it sees its parent
    # gone, or at the latest when its SIGTERM grace runs out (data/loader.py); with proctrack/linuxproc
    # such an orphan escapes the step's cleanup. Give it that long.
    deadline = time.monotonic() + WORKER_SIGTERM_GRACE_S + 10
    while (leftovers := processes_using(cluster.root)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not still_running and not leftovers, f"left running: {still_running} {leftovers}"


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    """A local two-node cluster for the session."""
    yield from _serve()


@pytest.fixture(scope="module")
def slurm_quick_node_fail() -> Iterator[SlurmCluster]:
    """A cluster of its own whose controller declares a silent node DOWN after ``NODE_FAIL_TIMEOUT_S``
    (Slurm's default, 300 s, is a production value) for the tests that crash a node."""
    yield from _serve(slurmd_timeout_s=NODE_FAIL_TIMEOUT_S)
