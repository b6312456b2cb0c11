"""An ablation's runs started: one after another or several at once as subprocesses (stopped with a checkpoint on
Ctrl-C or SIGTERM), its averages made, or job scripts written to start elsewhere."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from distaff.train.core.errors import UserError
from distaff.train.core.threads import busy_cores, plan_threads
from distaff.train.run.config import config_fingerprint
from distaff.train.tools.ablate.config import AblationConfig
from distaff.train.tools.ablate.derived import run_average
from distaff.train.tools.ablate.plan import PlannedRun

POLL_S = 0.5                    # how often the runs in progress are checked
STOP_TIMEOUT_S = 120            # a run sent SIGTERM has this long to save its checkpoint and exit


def run_command(cfg: AblationConfig, run: PlannedRun, port: int) -> list[str]:
    """``python -m distaff.train.pretrain`` for one rank, ``torchrun`` for several."""
    target = ["-m", "distaff.train.pretrain", "--config", cfg.base, *run.overrides]
    if cfg.ranks == 1:
        return [sys.executable, *target]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [torchrun, "--nproc_per_node", str(cfg.ranks), "--master_port", str(port), *target]


def _run_env(ranks: int, parallel: int) -> dict[str, str]:
    """CPU machines need DeepSpeed's CPU accelerator; the ``ranks x parallel`` processes at once get an even
    share of the cores each (cut to what other processes leave idle), unless the user set ``OMP_NUM_THREADS``."""
    import torch

    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    if not env.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = str(plan_threads(len(os.sched_getaffinity(0)), ranks * parallel, busy_cores()).threads)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "WANDB_RUN_ID"):  # each run is its own job
        env.pop(key, None)
    return env


def run_all(cfg: AblationConfig, runs: list[PlannedRun]) -> list[str]:
    """Each run not yet finished, ``cfg.parallel`` at a time, in plan order; the failures, each with its log."""
    from distaff.train.core.distributed import free_port

    for run in runs:
        run.check_plan()
    jobs = []
    for i, run in enumerate(runs, 1):
        label = f"[{i}/{len(runs)}] {run.variant} seed {run.seed}"
        if run.done:
            print(f"distaff ablate: {label}: done before ({run.summary_path}), skipped", flush=True)
        elif run.average is None:
            resumed = " (not finished before: resuming)" if run.summary() is not None else ""
            jobs.append((label + resumed, run_command(cfg, run, free_port()), run))
    return run_parallel(jobs, cfg.parallel, _run_env(cfg.ranks, cfg.parallel)) + run_averages(runs)


def run_averages(runs: list[PlannedRun]) -> list[str]:
    """Each average not made yet whose parent run is done (in this process: it trains nothing); the failures."""
    failures = []
    for run in runs:
        if run.average is None or run.done:
            continue
        label = f"{run.variant} seed {run.seed}"
        if not run.parent.done:
            failures.append(f"{label}: its run {run.parent.out_dir} is not finished")
            continue
        print(f"distaff ablate: {label}: average of the last {run.average.last} checkpoint(s) of "
              f"{run.parent.out_dir} -> {run.out_dir}", flush=True)
        run.out_dir.mkdir(parents=True, exist_ok=True)
        try:
            run_average(run.average, run.parent.out_dir, run.out_dir, run.config, config_fingerprint(run.config),
                        int(run.config.get("eval.batches", 0)))
        except (UserError, FileNotFoundError) as err:
            failures.append(f"{label} failed: {err}")
    return failures


def interrupt(signum: int, frame: Any) -> None:
    """A SIGTERM handler: stop as Ctrl-C does (KeyboardInterrupt, named by the signal)."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run_parallel(jobs: list[tuple[str, list[str], PlannedRun]], parallel: int, env: dict[str, str]) -> list[str]:
    """``(label, command, run)`` jobs as subprocesses, up to ``parallel`` at once, output to ``run.log``;
    a run failed if it exits non-zero or leaves no summary. Ctrl-C or SIGTERM stops the ones in
    progress (:func:`_stop`) and raises KeyboardInterrupt; finished runs keep their summaries."""
    queue, running, failures = list(jobs), {}, []
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        while queue or running:
            failures += _drop_orphans(queue, running)
            while len(running) < parallel and (job := _next_ready(queue)) is not None:
                label, command, run = job
                queue.remove(job)
                run.out_dir.parent.mkdir(parents=True, exist_ok=True)
                print(f"distaff ablate: {label}: {run.max_steps} steps -> {run.out_dir} (log {run.log})", flush=True)
                with open(run.log, "a") as handle:
                    # its own session: a terminal's Ctrl-C reaches only us, and the run gets SIGTERM (checkpoint)
                    running[subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                             start_new_session=True)] = (label, run)
            time.sleep(POLL_S)
            for proc, (label, run) in list(running.items()):
                code = proc.poll()
                if code is None:
                    continue
                del running[proc]
                if code != 0 or not run.done:
                    failures.append(f"{label} failed (exit {code}); see {run.log}")
                    print(f"distaff ablate: {failures[-1]}; the other runs go on", flush=True)
    except KeyboardInterrupt:
        _stop(running)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    return failures


def _next_ready(queue: list[tuple[str, list[str], PlannedRun]]) -> tuple[str, list[str], PlannedRun] | None:
    """The first queued job free to start: a branch waits until the run it branches from is done."""
    return next((job for job in queue if job[2].parent is None or job[2].parent.done), None)


def _drop_orphans(queue: list[tuple[str, list[str], PlannedRun]], running: dict) -> list[str]:
    """Queued branches whose parent run ended without finishing (failed): removed, each a failure."""
    busy = {id(run) for _, _, run in queue} | {id(run) for _, run in running.values()}
    orphans = [job for job in queue if job[2].parent is not None and not job[2].parent.done
               and id(job[2].parent) not in busy]
    for job in orphans:
        queue.remove(job)
    return [f"{label}: not started, its parent run {run.parent.out_dir} did not finish" for label, _, run in orphans]


def _stop(running: dict[subprocess.Popen, tuple[str, PlannedRun]]) -> None:
    """SIGTERM to each run in progress (it saves a checkpoint and exits), SIGKILL after STOP_TIMEOUT_S."""
    for proc in running:
        proc.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc, (label, run) in running.items():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print(f"distaff ablate: {label}: stopped (log {run.log})", flush=True)


def write_job_scripts(cfg: AblationConfig, runs: list[PlannedRun]) -> list[Path]:
    """One bash script per unfinished run under ``out_dir/jobs`` (start them with any scheduler)."""
    jobs = cfg.root / "jobs"
    jobs.mkdir(parents=True, exist_ok=True)
    written = []
    for run in runs:
        if run.done or run.average is not None:     # averages are made by `--report`, once their run is done
            continue
        script = jobs / f"{run.variant}-seed-{run.seed}.sh"
        command = run_command(cfg, run, 29500 + len(written))
        after = f"\n# start it once {run.parent.out_dir} has finished (it branches from it)" if run.parent else ""
        script.write_text("#!/usr/bin/env bash\n# distaff ablate job: one run of the ablation "
                          f"{cfg.name!r}{after}\nset -euo pipefail\ncd {shlex.quote(os.getcwd())}\n"
                          f"exec {shlex.join(command)}\n")
        script.chmod(0o755)
        written.append(script)
    return written


