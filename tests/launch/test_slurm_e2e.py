"""The launchers on a real Slurm: a local cluster of two nodes (n1, n2) from Debian's packages.

A 2-node CPU pretraining job submitted with ``distaff slurm submit`` gets the CPUs and memory its script
asks for, and is interrupted with ``scancel --signal=USR1``: it checkpoints, exits 75, requeues itself,
resumes from that checkpoint and finishes; its per-step losses equal those of an uninterrupted 2-rank
run started with ``distaff launch`` (the deepspeed launcher). Another loses a node mid-run: the
surviving rank's watchdog ends it, Slurm requeues the job, and it resumes on the node left, on one
rank, with the rest of the epoch re-dealt. Two one-node jobs stall (a DataLoader worker stops answering): the
watchdog's exit 76 requeues the first, which resumes and finishes, with its set-up lines run on each attempt;
the second, allowed no requeue, stops naming its stack dumps. A 2-node job allowed one failed attempt is requeued
twice with `scontrol requeue` and preempted once (a job of the `urgent` partition): none counts, and it completes
with every step once. A 2-node job has its rank frozen on the first node (the rendezvous host), then on the second:
each time the step ends on both nodes and the job is requeued within the watchdog and a minute, and completes.
Skipped, with the reason, where Slurm cannot run (not root, packages missing: scripts/install-slurm.sh installs
them).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import re
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from pretrain_fixtures import assert_redealt
from slurm_cluster import FINAL_STATES, NODE_FAIL_TIMEOUT_S, PREEMPTING_PARTITION, SlurmCluster

from distaff.launch import cli
from distaff.launch.hostlist import expand_hostlist
from distaff.train.core.distributed import free_port

pytestmark = pytest.mark.integration

MAX_STEPS = 40
CHECKPOINT_EVERY = 10


def test_srun_places_one_task_on_each_node(slurm: SlurmCluster) -> None:
    out = slurm.run("srun", "-N2", "--ntasks-per-node=1", "-l", "printenv", "SLURMD_NODENAME").stdout
    assert sorted(out.split("\n")[:-1]) == ["0: n1", "1: n2"]


@pytest.mark.parametrize("spec", ["gpu[01-03,07]", "a[1-2],b3", "r[1-2]n[08-10]", "x[8-11],login"])
def test_hostlist_expansion_matches_scontrol(slurm: SlurmCluster, spec: str) -> None:
    assert expand_hostlist(spec) == slurm.run("scontrol", "show", "hostnames", spec).stdout.split()


@pytest.mark.timeout(120)
def test_gloo_job_across_two_nodes(slurm: SlurmCluster, tmp_path: Path) -> None:
    """The trainer's process-group setup from Slurm's variables (SLURM_PROCID/NTASKS), over gloo."""
    script = tmp_path / "gloo_job.py"
    script.write_text(textwrap.dedent("""
        import os
        import torch
        import torch.distributed as dist
        from distaff.train.core.distributed import init_distributed
        layout = init_distributed(timeout_s=60)
        total = torch.tensor([float(layout.rank + 1)])
        dist.all_reduce(total)
        print(f"{os.environ['SLURMD_NODENAME']} rank={layout.rank}/{layout.world_size} sum={total.item():g}")
        dist.destroy_process_group()
    """))
    out = slurm.run("srun", "-N2", "--ntasks-per-node=1", sys.executable, str(script), timeout=100,
                    env={"MASTER_ADDR": "n1", "MASTER_PORT": str(free_port())}).stdout
    assert sorted(out.split()) == sorted("n1 rank=0/2 sum=3 n2 rank=1/2 sum=3".split())


def test_launch_writes_the_hostfile_of_the_allocation(slurm: SlurmCluster, run_config: Path) -> None:
    out = slurm.run("salloc", "-N2", "--quiet", sys.executable, "-m", "distaff.launch.cli", "launch",
                    "--config", str(run_config), "--dry-run").stdout
    assert re.search(r"# \S+/launch/hostfile\nn1 slots=1\nn2 slots=1\n", out), out
    assert "--hostfile" in out and "--master_addr n1" in out


# ---------------------------------------------------------------- preemption and requeue

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory, sample_data: Path) -> Path:
    """Shards of a slice of real text, made with our own CLIs."""
    root = tmp_path_factory.mktemp("slurm-data")
    text = root / "austen-slice.txt"
    with gzip.open(sample_data / "austen-emma-pride.txt.gz", "rt") as source:
        text.write_text(source.read(300_000))
    assert cli.main(["tokenizer", "train", "--input", str(text), "--vocab-size", "500", "--out", str(root / "tok")]) == 0
    assert cli.main(["data", "prepare", "--input", str(text), "--tokenizer", str(root / "tok"), "--seq-len", "64",
                     "--out", str(root / "data"), "--shard-mb", "0.03", "--heldout-fraction", "0.05",
                     "--workers", "1", "--no-progress"]) == 0
    return root / "data"


@pytest.fixture(scope="module")
def run_config(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("slurm-run")
    config = root / "run.yaml"
    # Dropout (the tiny preset's 0.1) and EMD on: the resumed losses depend on the restored RNG state.
    config.write_text(textwrap.dedent(f"""
        run: {{out_dir: {root}/default-out, name: slurm-e2e, seed: 7}}
        model: {{preset: tiny, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 2, intermediate_size: 128,
                 emd: true}}
        data: {{dir: {data_dir}, batch_size: 8, num_workers: 1}}
        train: {{max_steps: {MAX_STEPS}, precision: fp32}}
        optim: {{lr: 1.0e-3, warmup_steps: 4}}
        zero: {{stage: 1}}
        logging: {{every: 1, progress_bar: false, plot: false}}
        wandb: {{mode: offline, project: distaff-slurm-test}}
        eval: {{every: 0, batches: 2}}
        checkpoint: {{every: {CHECKPOINT_EVERY}, keep: 2}}
    """))
    return config


def _losses(out_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def _log_files(log_dir: Path) -> list[Path]:
    """The job's logs, each once: ``<job>-<id>-rank0.out`` is a link to the node log that holds rank 0's lines."""
    return [p for p in sorted(log_dir.glob("*.out")) if not p.is_symlink()]


def _logs(log_dir: Path) -> str:
    return "\n".join(f"=== {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in _log_files(log_dir))


NOISE = ("Traceback", "ChildFailedError", "death signal", "Exited with exit code", "stack dumps: ;")


def _assert_quiet(log_dir: Path, victims: int = 0) -> None:
    """The logs of attempts that ended with 75 or 76 hold distaff's lines, not torchrun's or srun's; but for the
    traceback of each of ``victims`` frozen ranks (SIGCONT and SIGTERM from Slurm as it ends the step wake it in a
    collective whose peer is gone)."""
    files, links = _log_files(log_dir), [p for p in log_dir.glob("*.out") if p.is_symlink()]
    targets = {p.resolve() for p in files}
    assert all(link.resolve() in targets for link in links), links   # each counted once, as its node's log
    logs = "".join(p.read_text(errors="replace") for p in files)
    assert not [noise for noise in NOISE[1:] if noise in logs] and logs.count("Traceback") <= victims, logs


def _submit(cluster: SlurmCluster, run_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys,
            *options: str, nodes: int = 2) -> str:
    """``distaff slurm submit`` of a CPU job (2 nodes unless told), one rank per node; the job id."""
    monkeypatch.chdir(tmp_path)
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))  # sbatch exports our environment to the job
    # 1 rank + 1 data worker per node: the script asks for 2 CPUs per node, the whole of a local "node"
    assert cli.main(["slurm", "submit", "--config", str(run_config), "--nodes", str(nodes), "--gpus-per-node", "1",
                     "--cpu", "--mem-per-cpu=1G", *options]) == 0
    job_id = capsys.readouterr().out.strip()
    assert job_id.isdigit(), job_id
    return job_id


def _node_logs(log_dir: Path, job_id: str) -> str:
    """Both nodes' logs (rank 0 prints; the c10d rendezvous may put it on either node)."""
    return "".join((log_dir / f"slurm-e2e-{job_id}-node{n}.out").read_text() for n in (0, 1))


def _wait_for_file(path: Path, job_id: str, slurm: SlurmCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        state = slurm.job_field(job_id, "JobState")
        if state not in ("PENDING", "CONFIGURING", "RUNNING") or time.monotonic() > deadline:
            raise AssertionError(f"{path} not written (job {job_id} {state})\n{_logs(path.parent.parent / 'slurm')}")
        time.sleep(0.2)


@pytest.mark.timeout(330)
def test_preempted_job_requeues_resumes_and_matches_an_uninterrupted_run(
        slurm: SlurmCluster, run_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    out_dir = tmp_path / "slurm-run"
    # Node 0 is slower to tear down than node 1 (a real one can be): its ranks' launcher exits 8 s after them. srun
    # --kill-on-bad-exit must not kill it when node 1's ranks have exited 75 first (that ended the attempt 255,
    # not requeued, on a loaded machine).
    python = tmp_path / "python"
    python.write_text(f'#!/bin/bash\n{shlex.quote(sys.executable)} "$@"; status=$?\n'
                      '[ "$2" = distaff.launch.node_ranks ] && [ "$SLURM_NODEID" = 0 ] && [ "$status" = 75 ] && sleep 8\n'
                      'exit "$status"\n')
    python.chmod(0o755)
    job_id = _submit(slurm, run_config, tmp_path, monkeypatch, capsys, f"run.out_dir={out_dir}", "--python",
                     str(python))
    log_dir = out_dir / "slurm"

    # It trains and checkpoints; then the signal: every rank checkpoints and exits 75.
    _wait_for_file(out_dir / "checkpoints" / "latest", job_id, slurm, timeout=150)
    slurm.run("scancel", "--signal=USR1", job_id)
    state = slurm.wait_for(job_id, {"COMPLETED"}, timeout=240)
    logs = _logs(log_dir)
    assert state == "COMPLETED", f"job {job_id} ended {state}\n{logs}\n{slurm.log_tail()}"
    assert slurm.job_field(job_id, "Restarts") == "1", logs
    assert slurm.job_field(job_id, "ExitCode") == "0:0", logs
    # What the script asked for, the job got, and the ranks' step too (task/affinity binds them to it).
    assert [slurm.job_field(job_id, name) for name in ("CPUs/Task", "NumCPUs", "MinMemoryCPU")] == ["2", "4", "1G"]

    batch_log = (log_dir / f"slurm-e2e-{job_id}.out").read_text()
    assert "restart_count=0" in batch_log and "restart_count=1" in batch_log, batch_log
    assert "ranks exited with 75" in batch_log and f"requeueing job {job_id}" in batch_log, batch_log
    node_logs = _node_logs(log_dir, job_id)
    for node, name in enumerate(("n1", "n2")):
        assert node_logs.count(f"distaff: node {node} ({name}): 2 CPUs for its ranks") == 2, node_logs
    assert node_logs.count("ranks exited with 75") == 2 and "CANCELLED" not in node_logs, node_logs  # srun waited
    stopped = re.search(r"signal received; checkpoint saved at step (\d+)", node_logs)
    assert stopped, node_logs
    stop_step = int(stopped.group(1))
    assert CHECKPOINT_EVERY < stop_step < MAX_STEPS, f"the signal landed at step {stop_step}\n{node_logs}"
    assert f"resuming from {out_dir}/checkpoints/step-{stop_step:08d};" in node_logs, node_logs

    # The uninterrupted reference: same config, 2 ranks on one node, through the deepspeed launcher.
    ref_dir = tmp_path / "reference-run"
    reference = subprocess.run(
        [sys.executable, "-m", "distaff.launch.cli", "launch", "--config", str(run_config), "--gpus-per-node", "2",
         "--master-port", str(free_port()), f"run.out_dir={ref_dir}"],
        capture_output=True, text=True, timeout=200)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]

    resumed, uninterrupted = _losses(out_dir), _losses(ref_dir)
    assert [step for step, _ in uninterrupted] == list(range(1, MAX_STEPS + 1))
    assert resumed == uninterrupted  # exact: same steps, once each, bit-identical losses

    # Both attempts logged to one W&B run, named after the job.
    run_dirs = sorted(p.name for p in (out_dir / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 2 and all(name.endswith(f"-distafftest-{job_id}") for name in run_dirs), run_dirs
    assert all(any((out_dir / "wandb" / name).glob("*.wandb")) for name in run_dirs)
    _assert_quiet(log_dir)


# ---------------------------------------------------------------- a node lost mid-run

LOSS_STEPS, LOSS_EVERY, WATCHDOG_S = 48, 20, 6


def _wait_for_step(out_dir: Path, step: int, job_id: str, slurm: SlurmCluster, timeout: float) -> None:
    """Until ``step`` is in metrics.jsonl (the job may be between attempts meanwhile)."""
    deadline = time.monotonic() + timeout
    while not any(s >= step for s, _ in (_losses(out_dir) if (out_dir / "metrics.jsonl").is_file() else [])):
        state = slurm.job_field(job_id, "JobState")
        if state in FINAL_STATES or time.monotonic() > deadline:
            raise AssertionError(f"step {step} not reached (job {job_id} {state})\n{_logs(out_dir / 'slurm')}")
        time.sleep(0.05)


def _wait_for_requeue(job_id: str, slurm: SlurmCluster, timeout: float) -> None:
    """Until the job is back in the queue (Slurm requeues a NODE_FAIL'ed job that has ``--requeue``)."""
    deadline = time.monotonic() + timeout
    while (slurm.job_field(job_id, "Restarts"), slurm.job_field(job_id, "JobState")) != ("1", "PENDING"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} not requeued in {timeout:.0f}s: "
                               f"{slurm.run('scontrol', 'show', 'job', job_id).stdout}\n{slurm.log_tail()}")
        time.sleep(0.5)


def _rank_state(checkpoint: Path, rank: int) -> dict:
    return json.loads((checkpoint / "distaff" / f"rank-{rank:05d}.json").read_text())


@pytest.mark.timeout(330)
def test_a_node_lost_mid_run_requeues_and_the_run_finishes_on_the_node_left(
        slurm_quick_node_fail: SlurmCluster, run_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys) -> None:
    cluster, out_dir = slurm_quick_node_fail, tmp_path / "run"
    job_id = _submit(cluster, run_config, tmp_path, monkeypatch, capsys, f"run.out_dir={out_dir}",
                     f"train.max_steps={LOSS_STEPS}", f"checkpoint.every={LOSS_EVERY}", "checkpoint.keep=5",
                     f"distributed.watchdog_s={WATCHDOG_S}")
    log_dir, checkpoints = out_dir / "slurm", out_dir / "checkpoints"

    # Both nodes train past the checkpoint at step 20; then n2 hangs as a crashed host does: its slurmd and
    # its rank stop answering, and their connections stay open (no reset tells the peer).
    _wait_for_step(out_dir, LOSS_EVERY + 1, job_id, cluster, timeout=150)
    frozen_at = time.time()
    assert cluster.freeze_node("n2") > 3  # slurmd, slurmstepd, the node script, torchrun, the rank ...
    _wait_for_requeue(job_id, cluster, timeout=NODE_FAIL_TIMEOUT_S + 90)

    # The surviving rank did not wait for Slurm: its watchdog ended it within distributed.watchdog_s.
    stacks = list(out_dir.glob("stacks-rank*.txt"))
    assert len(stacks) == 1, _logs(log_dir)
    assert f"no step progress for {WATCHDOG_S} s" in stacks[0].read_text()
    assert stacks[0].stat().st_mtime - frozen_at < WATCHDOG_S + 4
    controller = (cluster.root / "log" / "slurmctld.log").read_text()
    assert f"requeue job JobId={job_id} due to failure of node n2" in controller, controller[-3000:]
    assert (checkpoints / "latest").read_text().strip() == f"step-{LOSS_EVERY:08d}"

    # Go on at once on the node left instead of waiting for n2 (docs/launch.md): one rank, one node.
    cluster.run("scontrol", "update", f"JobId={job_id}", "NumNodes=1", "NumTasks=1", "MinCPUsNode=2")
    state = cluster.wait_for(job_id, {"COMPLETED"}, timeout=180)
    logs = _logs(log_dir)
    assert state == "COMPLETED", f"job {job_id} ended {state}\n{logs}\n{cluster.log_tail()}"
    assert cluster.job_field(job_id, "ExitCode") == "0:0" and cluster.job_field(job_id, "NodeList") == "n1", logs
    assert "restart_count=1 on n1 at" in (log_dir / f"slurm-e2e-{job_id}.out").read_text()
    attempts = (log_dir / f"attempts-{job_id}.txt").read_text().splitlines()   # a lost attempt counts as failed
    first = attempts.index("attempt 1 started")
    assert attempts[0] == "attempt 0 started" and attempts[first:] == ["attempt 1 started", "attempt 1 ended with 0"]
    # the batch shell's SIGTERM as Slurm ends the job (n2 down), the watchdog's status, or both (they count once)
    assert 1 <= first - 1 <= 2 and set(attempts[1:first]) <= {
        "attempt 0 lost: node n2 failed; Slurm requeues the job", "attempt 0 stalled",
        "attempt 0 lost (it ended without a word: its first node failed, or Slurm killed its script)"}, attempts
    node0 = (log_dir / f"slurm-e2e-{job_id}-node0.out").read_text()
    assert f"resuming from {checkpoints}/step-{LOSS_EVERY:08d}; 1 rank(s)" in node0, node0
    assert "resuming a 2-rank checkpoint on 1 rank(s): global batch 16 -> 8 samples" in node0

    # No step lost beyond the checkpoint, none twice; every sample of the epoch read once.
    assert [step for step, _ in _losses(out_dir)] == list(range(1, LOSS_STEPS + 1))
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["samples"] == LOSS_EVERY * 2 * 8 + (LOSS_STEPS - LOSS_EVERY) * 8
    saved = [_rank_state(checkpoints / f"step-{LOSS_EVERY:08d}", rank)["data"] for rank in (0, 1)]
    assert saved[0] == saved[1]  # the ranks of a run share one stream position
    final = _rank_state(checkpoints / f"step-{LOSS_STEPS:08d}", 0)["data"]
    assert final["batch_in_plan"] == LOSS_STEPS - LOSS_EVERY
    assert_redealt(saved[0], final)


# ---------------------------------------------------------------- a stalled run comes back

STALL_STEPS, STALL_EVERY, STALL_WATCHDOG_S = 150, 20, 6


def _data_worker(out_dir: Path) -> psutil.Process | None:
    """The DataLoader worker of the run in ``out_dir``: forked from its rank, it has the rank's command line."""
    ranks = []
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []
        if "distaff.train.pretrain" in argv and argv[argv.index("distaff.train.pretrain") - 1] == "-m" \
                and f"run.out_dir={out_dir}" in argv:
            ranks.append(proc)
    pids = {proc.pid for proc in ranks}
    return next((proc for proc in ranks if proc.ppid() in pids), None)


def _stall(out_dir: Path, after: Path, job_id: str, slurm: SlurmCluster) -> psutil.Process:
    """Once ``after`` exists, the run's reads stop coming back (a filesystem that hangs): its DataLoader worker is
    stopped, so its rank waits for a batch that never comes."""
    _wait_for_file(after, job_id, slurm, timeout=150)
    deadline = time.monotonic() + 30
    while (worker := _data_worker(out_dir)) is None:
        assert time.monotonic() < deadline, f"no DataLoader worker of {out_dir}"
        time.sleep(0.1)
    worker.suspend()
    return worker


@pytest.mark.timeout(330)
def test_a_stalled_run_requeues_resumes_and_finishes_and_stops_past_max_requeues(
        slurm: SlurmCluster, run_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Two one-node jobs side by side, each stalled by a DataLoader worker that stops answering: the first, with
    set-up lines, requeues on its watchdog's exit and finishes; the second, with --max-requeues 0, stops."""
    finishes, stops = tmp_path / "finishes", tmp_path / "stops"
    setup_file = tmp_path / "site-setup.sh"
    setup_file.write_text('# a site\'s set-up: its exports reach the ranks\nexport WANDB_RUN_ID="site-$SLURM_JOB_ID"\n')
    common = [f"checkpoint.every={STALL_EVERY}", f"distributed.watchdog_s={STALL_WATCHDOG_S}"]
    job = _submit(slurm, run_config, tmp_path, monkeypatch, capsys, f"run.out_dir={finishes}", *common,
                  f"train.max_steps={STALL_STEPS}", "--max-requeues", "1", "--setup-file", str(setup_file),
                  "--setup", 'echo "set-up line on $SLURMD_NODENAME"', nodes=1)
    stopped_job = _submit(slurm, run_config, tmp_path, monkeypatch, capsys, f"run.out_dir={stops}", *common,
                          "train.max_steps=100000", "--max-requeues", "0", nodes=1)
    stalls = [(finishes, job, _stall(finishes, finishes / "checkpoints" / "latest", job, slurm))]
    try:
        stalls.append((stops, stopped_job, _stall(stops, stops / "metrics.jsonl", stopped_job, slurm)))
        for out_dir, job_id, worker in stalls:   # each rank's watchdog dumps its stacks, ends its worker, exits 76
            _wait_for_file(out_dir / "stacks-rank0.txt", job_id, slurm, timeout=60)
            try:
                worker.wait(timeout=30)
            except psutil.TimeoutExpired:
                raise AssertionError(f"the stalled rank of {out_dir} left its DataLoader worker {worker.pid}") from None
        states = [slurm.wait_for(job_id, {"COMPLETED"}, timeout=240) for job_id in (job, stopped_job)]
    finally:
        for _, _, worker in stalls:
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.kill()
    logs = _logs(finishes / "slurm") + _logs(stops / "slurm")
    assert states == ["COMPLETED", "FAILED"], f"{states}\n{logs}\n{slurm.log_tail()}"

    # The first: requeued once, resumed from its checkpoint, every step once; the set-up ran on each attempt.
    assert [slurm.job_field(job, name) for name in ("Restarts", "ExitCode")] == ["1", "0:0"], logs
    batch = (finishes / "slurm" / f"slurm-e2e-{job}.out").read_text()
    assert (f"distaff: stalled (stack dumps: {finishes}/stacks-rank0.txt): requeueing job {job} to resume from its "
            "latest checkpoint (1 of --max-requeues 1)") in batch, batch
    assert (finishes / "slurm" / f"attempts-{job}.txt").read_text().splitlines() == [
        "attempt 0 started", "attempt 0 stalled", "attempt 1 started", "attempt 1 ended with 0"]
    node = (finishes / "slurm" / f"slurm-e2e-{job}-node0.out").read_text()
    assert node.count("set-up line on n") == 2 and "distaff: node 0 ranks exited with 76" in node, node
    stacks = (finishes / "stacks-rank0.txt").read_text()
    assert f"Slurm job {job} attempt 0): no step progress for {STALL_WATCHDOG_S} s" in stacks and "Thread" in stacks
    resumed = re.search(rf"resuming from {finishes}/checkpoints/step-(\d+);", node)
    assert resumed and int(resumed.group(1)) >= STALL_EVERY, node
    assert [step for step, _ in _losses(finishes)] == list(range(1, STALL_STEPS + 1))
    run_dirs = {p.name.rsplit("-", 2)[-2:] == ["site", job] for p in (finishes / "wandb").glob("offline-run-*")}
    assert run_dirs == {True}, list((finishes / "wandb").glob("*"))       # the set-up file's export reached the ranks

    # The second: no requeue past --max-requeues 0; the job ends with the stall's status, naming the dumps.
    assert [slurm.job_field(stopped_job, name) for name in ("Restarts", "ExitCode")] == ["0", "76:0"], logs
    batch = (stops / "slurm" / f"slurm-e2e-{stopped_job}.out").read_text()
    assert (f"distaff: stalled: not requeueing job {stopped_job}: 1 attempts stalled or were lost, more than "
            f"--max-requeues 0; stack dumps: {stops}/stacks-rank0.txt; attempts: {stops}/slurm/attempts-"
            f"{stopped_job}.txt") in batch, batch
    _assert_quiet(finishes / "slurm")
    _assert_quiet(stops / "slurm")


@pytest.mark.timeout(120)
def test_a_failing_set_up_line_stops_the_job_before_the_launch(
        slurm: SlurmCluster, run_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    out_dir = tmp_path / "run"
    job = _submit(slurm, run_config, tmp_path, monkeypatch, capsys, f"run.out_dir={out_dir}", "--setup",
                  "echo before", "--setup", "module load no-such-module", "--setup", "echo after", nodes=1)
    assert slurm.wait_for(job, {"COMPLETED"}, timeout=90) == "FAILED"
    assert slurm.job_field(job, "Restarts") == "0"
    node = (out_dir / "slurm" / f"slurm-e2e-{job}-node0.out").read_text()
    assert node.startswith("before\n") and "distaff: node 0: a set-up line failed with status 127" in node, node
    assert "after" not in node and "CPUs for its ranks" not in node and not (out_dir / "metrics.jsonl").exists()


# ---------------------------------------------------------------- preemption and requeues are not failures

def _wait_for_restarts(job_id: str, restarts: int, slurm: SlurmCluster, timeout: float) -> float:
    """Until Slurm has counted ``restarts`` restarts of the job; the seconds that took."""
    started = time.monotonic()
    while int(slurm.job_field(job_id, "Restarts")) < restarts:
        state = slurm.job_field(job_id, "JobState")
        if state in FINAL_STATES or time.monotonic() - started > timeout:
            raise AssertionError(f"job {job_id} {state}, not restarted {restarts} times in {timeout:.0f} s\n"
                                 f"{_logs(Path(slurm.job_field(job_id, 'StdOut')).parent)}\n{slurm.log_tail()}")
        time.sleep(0.2)
    return time.monotonic() - started


REQUEUE_STEPS = 300


@pytest.mark.timeout(900)
def test_requeues_and_a_preemption_are_not_failures(
        slurm: SlurmCluster, run_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Two `scontrol requeue`s and a preemption by a job of a higher-priority partition (PreemptMode=REQUEUE), each
    mid-run, to a 2-node job allowed one failed attempt: each one checkpoints on SIGTERM and comes back, and the job
    completes with every step trained once."""
    out_dir = tmp_path / "run"
    job_id = _submit(slurm, run_config, tmp_path, monkeypatch, capsys, f"run.out_dir={out_dir}",
                     f"train.max_steps={REQUEUE_STEPS}", "checkpoint.every=1000", "--max-requeues", "1")
    log_dir, resumed_at = out_dir / "slurm", 0
    for restarts, how in enumerate(("requeue", "requeue", "preempt"), 1):
        _wait_for_step(out_dir, resumed_at + 2, job_id, slurm, timeout=240)   # past its signal handlers' set-up
        if how == "requeue":
            slurm.run("scontrol", "requeue", job_id)
        else:   # every CPU of both nodes: Slurm requeues our job to make room
            slurm.run("sbatch", f"--partition={PREEMPTING_PARTITION}", "--nodes=2", "--exclusive",
                      f"--output={tmp_path}/urgent-%j.out", "--wrap", "sleep 1")
        _wait_for_restarts(job_id, restarts, slurm, timeout=120)
        deadline = time.monotonic() + 60    # the batch shell writes the checkpoint's step once its ranks are done
        while not (stopped := re.search(rf"attempt {restarts - 1} \S.* at step (\d+), checkpointed",
                                        (log_dir / f"attempts-{job_id}.txt").read_text())):
            assert time.monotonic() < deadline, _logs(log_dir)
            time.sleep(0.2)
        resumed_at = int(stopped.group(1))
    state = slurm.wait_for(job_id, {"COMPLETED"}, timeout=300)
    logs = _logs(log_dir)
    assert state == "COMPLETED", f"job {job_id} ended {state}\n{logs}\n{slurm.log_tail()}"
    assert [slurm.job_field(job_id, name) for name in ("Restarts", "ExitCode")] == ["3", "0:0"], logs

    attempts = (log_dir / f"attempts-{job_id}.txt").read_text().splitlines()
    steps = [int(step) for step in re.findall(r"at step (\d+), checkpointed", "\n".join(attempts))]
    requeued = "requeued from outside (scontrol requeue)"
    assert attempts == [
        "attempt 0 started", f"attempt 0 got SIGTERM: {requeued}", f"attempt 0 {requeued} at step {steps[0]}, checkpointed",
        "attempt 1 started", f"attempt 1 got SIGTERM: {requeued}", f"attempt 1 {requeued} at step {steps[1]}, checkpointed",
        "attempt 2 started", "attempt 2 got SIGTERM: preempted",
        f"attempt 2 preempted at step {steps[2]}, checkpointed, requeued", "attempt 3 started", "attempt 3 ended with 0"]
    batch = (log_dir / f"slurm-e2e-{job_id}.out").read_text()
    assert f"distaff: job {job_id} preempted at step {steps[2]}, checkpointed, requeued" in batch, batch
    node_logs = _node_logs(log_dir, job_id)
    for step in steps:    # each attempt resumed from the checkpoint its predecessor saved on SIGTERM
        assert f"resuming from {out_dir}/checkpoints/step-{step:08d};" in node_logs, node_logs
    assert 0 < steps[0] < steps[1] < steps[2] < REQUEUE_STEPS
    assert [step for step, _ in _losses(out_dir)] == list(range(1, REQUEUE_STEPS + 1))
    _assert_quiet(log_dir)


HANG_STEPS, HANG_EVERY = 150, 10
HANG_WATCHDOG_S = 20    # above the slowest first step of the loaded test machine (6 s stalled spuriously)


def _rank_on(node: str, out_dir: Path, slurm: SlurmCluster) -> psutil.Process:
    """The rank of the run in ``out_dir`` on ``node`` (not its DataLoader worker, forked with its command line)."""
    trainers = []
    for pid in slurm.node_processes(node):
        try:
            proc = psutil.Process(pid)
            argv = proc.cmdline()
        except psutil.Error:
            continue
        if "distaff.train.pretrain" in argv and argv[argv.index("distaff.train.pretrain") - 1] == "-m" \
                and f"run.out_dir={out_dir}" in argv:
            trainers.append(proc)
    pids = {proc.pid for proc in trainers}
    ranks = [proc for proc in trainers if proc.ppid() not in pids]
    assert len(ranks) == 1, f"{node}: {ranks}"
    return ranks[0]


@pytest.mark.timeout(900)
def test_a_rank_frozen_on_either_node_ends_the_step_everywhere_and_the_job_comes_back(
        slurm: SlurmCluster, run_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A 2-node job whose rank is frozen (SIGSTOP) first on n1, the node of the c10d rendezvous, then on n2: each
    time the other rank's watchdog ends it, its node's exit ends the step on both nodes, and the job is requeued
    within the watchdog and a minute; it resumes and completes."""
    out_dir = tmp_path / "run"
    job_id = _submit(slurm, run_config, tmp_path, monkeypatch, capsys, f"run.out_dir={out_dir}",
                     f"train.max_steps={HANG_STEPS}", f"checkpoint.every={HANG_EVERY}",
                     f"distributed.watchdog_s={HANG_WATCHDOG_S}", "--max-requeues", "2")
    log_dir, reached = out_dir / "slurm", HANG_EVERY
    took = []
    for restarts, node in enumerate(("n1", "n2"), 1):
        _wait_for_step(out_dir, reached + 1, job_id, slurm, timeout=240)
        _rank_on(node, out_dir, slurm).suspend()
        took.append(_wait_for_restarts(job_id, restarts, slurm, timeout=HANG_WATCHDOG_S + 60))
        reached = max(step for step, _ in _losses(out_dir)) + 1
    state = slurm.wait_for(job_id, {"COMPLETED"}, timeout=300)
    logs = _logs(log_dir)
    assert state == "COMPLETED", f"job {job_id} ended {state}\n{logs}\n{slurm.log_tail()}"
    assert [slurm.job_field(job_id, name) for name in ("Restarts", "ExitCode")] == ["2", "0:0"], logs
    assert all(seconds < HANG_WATCHDOG_S + 60 for seconds in took), took
    assert (log_dir / f"attempts-{job_id}.txt").read_text().splitlines() == [
        "attempt 0 started", "attempt 0 stalled", "attempt 1 started", "attempt 1 stalled", "attempt 2 started",
        "attempt 2 ended with 0"]
    batch = (log_dir / f"slurm-e2e-{job_id}.out").read_text()
    for failed in (1, 2):
        assert re.search(rf"distaff: stalled \(stack dumps: [^)]*stacks-rank\d.txt[^)]*\): requeueing job {job_id} to "
                         rf"resume from its latest checkpoint \({failed} of --max-requeues 2\)", batch), batch
    assert [step for step, _ in _losses(out_dir)] == list(range(1, HANG_STEPS + 1))
    _assert_quiet(log_dir, victims=2)
