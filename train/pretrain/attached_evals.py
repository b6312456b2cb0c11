"""The run's side of the evaluations attached to its checkpoints (``evals``; docs/pretraining.md, "Evaluations
attached to a run"): which checkpoints, keeping them readable, and the processes that evaluate them.

A checkpoint is evaluated when its step is a multiple of ``evals.every`` (or of a task's own ``every``) or is the
run's last (``train.max_steps``). Rank 0 *pins* it right after saving it: hard links of its files under
``<run>/evals/pinned/<step>`` (no data copied) keep it readable however ``checkpoint.keep`` prunes meanwhile; the
evaluation that completes it removes the pin. The evaluation itself is ``python -m distaff.train.tools.evals RUN
--checkpoint PIN`` (train/tools/evals/: this layer may not import it), run by ``evals.mode``:

- ``inline``: rank 0 runs it and waits, between two steps; the other ranks wait for it in a barrier of a gloo group
  of their own whose timeout covers ``evals.timeout_s`` (each attempt's limit), not in the training's collectives
  (``distributed.timeout_s``), and every rank's watchdog is paused meanwhile. The time is logged as
  ``evals_inline_s`` beside ``step_time_s``.
- ``side``: rank 0 starts it beside training, one at a time (later checkpoints queue), on the CPU with
  ``evals.threads`` threads at the lowest priority (nice 19), and never waits for it, except for the last ones when
  the run ends (the other ranks then wait in short broadcasts of that group, never in a collective of the run).
- ``slurm``: rank 0 starts ``python -m distaff.launch.eval_jobs``, which submits one Slurm job per checkpoint.

A process that fails, is killed or outlives ``evals.timeout_s`` is run again up to ``evals.retries`` times, then
reported (one line); its pin stays, so a resumed run queues it again and ``distaff evals RUN`` runs it later. No
evaluation touches the run's checkpoints or its training: a failure is never the run's.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from distaff.train.core.distributed import DistEnv, without_rank_variables
from distaff.train.core.errors import ConfigError
from distaff.train.core.files import read_text
from distaff.train.data.loader import open_data_dir
from distaff.train.data.manifest import MANIFEST_FILE
from distaff.train.data.tokenizer import TokenizerInfo
from distaff.train.run.checkpoint_files import tag_for_step
from distaff.train.run.config import EvalsSection, EvalTaskSection, RunConfig, config_file
from distaff.train.run.metrics import warn

PINNED = Path("evals") / "pinned"
LOGS = Path("evals") / "logs"
RUNNER = "distaff.train.tools.evals"            # python -m: the evaluation of one checkpoint (or distaff evals)
SUBMITTER = "distaff.launch.eval_jobs"          # python -m: submits a checkpoint's evaluation job (evals.mode=slurm)
EXIT_EVALUATED_ELSEWHERE = 3    # the runner found another process evaluating the checkpoint: not a failure
EXIT_STOPPED = -1               # close(): the run stops before its evaluations are done
SIDE_NICENESS = 19
GROUP_MARGIN_S = 60            # the evaluations' group timeout beyond evals.timeout_s: starting and reaping a process


# ---------------------------------------------------------------- which checkpoints, which evaluations

def tasks_at(evals: EvalsSection, step: int, last_step: int) -> list[EvalTaskSection]:
    """The evaluations of the checkpoint at ``step``: each whose ``every`` (or ``evals.every``) divides it, all at the
    run's last step."""
    return [task for task in evals.tasks
            if step == last_step or ((task.every or evals.every) and step % (task.every or evals.every) == 0)]


# ---------------------------------------------------------------- pins

def pin_checkpoint(checkpoint: Path, run_dir: Path) -> Path:
    """Hard links of ``checkpoint``'s files under ``run_dir/evals/pinned/<its name>`` (replacing an older pin of the
    step); the checkpoint itself where the filesystem makes no hard links (its evaluation then fails cleanly if
    ``checkpoint.keep`` removes it first)."""
    pin = run_dir / PINNED / checkpoint.name
    partial = pin.with_name(f".partial-{pin.name}")
    try:
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(checkpoint, partial, copy_function=os.link)
        shutil.rmtree(pin, ignore_errors=True)
        os.replace(partial, pin)
    except OSError as err:
        shutil.rmtree(partial, ignore_errors=True)
        warn(f"evals: {checkpoint} could not be pinned ({err.strerror or err}): it is evaluated where it is, and "
             f"fails if checkpoint.keep prunes it first")
        return checkpoint
    return pin


def pinned(run_dir: Path) -> list[Path]:
    """The run's pins, oldest step first: checkpoints whose evaluation has not completed."""
    root = run_dir / PINNED
    return sorted(p for p in root.glob("step-*") if p.is_dir()) if root.is_dir() else []


# ---------------------------------------------------------------- what --check and every rank check

def check_eval_inputs(cfg: RunConfig, tokenizer: TokenizerInfo) -> None:
    """What the evaluations read exists here: text and labelled files, fine-tuning configs, held-out data dirs
    prepared with the run's tokenizer; and ``sbatch`` for ``evals.mode=slurm``. One line naming the field."""
    for i, task in enumerate(cfg.evals.tasks):
        key = f"evals.tasks[{i}]"
        for name in ("text", "train", "dev"):
            value = getattr(task, name)
            if value and not Path(value).is_file():
                problem = "does not exist" if not Path(value).exists() else "is not a file"
                raise ConfigError(f"{key}.{name}: {Path(value).resolve()} {problem}; give the file the {task.kind} "
                                  "evaluation reads (a relative path is read from the folder the run starts in)")
        if task.kind == "finetune":
            path = config_file(task.config, "finetune")
            read_text(path, error=ConfigError)
        if task.kind == "heldout":
            _check_heldout_data(f"{key}.data", task.data, tokenizer)
    if cfg.evals.tasks and cfg.evals.mode == "slurm" and shutil.which("sbatch") is None:
        raise ConfigError("evals.mode=slurm: sbatch is not found here, so no evaluation job can be submitted; run "
                          "where Slurm's commands are, or set evals.mode=side")


def _check_heldout_data(key: str, value: str, tokenizer: TokenizerInfo) -> None:
    if not (Path(value) / MANIFEST_FILE).is_file():
        raise ConfigError(f"{key}: {Path(value).resolve()} holds no {MANIFEST_FILE}; give a folder written by "
                          "`distaff data prepare` with the run's tokenizer")
    _, theirs = open_data_dir(value)
    if theirs.fingerprint != tokenizer.fingerprint:
        raise ConfigError(f"{key}: {value} was prepared with another tokenizer ({theirs.path}) than the run's "
                          f"({tokenizer.path}); prepare it with the run's tokenizer")


def eval_summary(evals: EvalsSection) -> str:
    """``--check``'s words for the evaluations ("" when there are none)."""
    if not evals.tasks:
        return ""
    names = ", ".join(f"{t.name} ({t.kind}, {len(t.seeds)} seed(s))" for t in evals.tasks)
    when = f"every {evals.every} steps and the last" if evals.every else "the last checkpoint"
    return f"; evaluations {names} at {when}, {evals.mode}"


# ---------------------------------------------------------------- the processes

@dataclass
class Job:
    """The evaluation of one pinned checkpoint and its attempts."""
    checkpoint: Path
    attempts: int = 0
    proc: subprocess.Popen | None = None
    deadline: float = 0.0

    @property
    def name(self) -> str:
        return self.checkpoint.name


class AttachedEvals:
    """Built by every rank (``inline`` makes its gloo group, a collective); rank 0 alone pins and starts processes.
    The trainer calls :meth:`after_checkpoint` after each save, :meth:`poll` after each step, :meth:`finish` when the
    loop completed and :meth:`close` with the exit code."""

    def __init__(self, cfg: RunConfig, layout: DistEnv, stop_requested: Callable[[], bool] = lambda: False):
        self.evals, self.run_dir, self.last_step = cfg.evals, cfg.out_dir, cfg.train.max_steps
        self.stop_requested = stop_requested     # a signal came: inline, rank 0 stops waiting
        self.enabled, self.main = bool(cfg.evals.tasks), layout.is_main
        self.queue: deque[Job] = deque()
        self.running: Job | None = None
        self.inline_s = self.inline_total_s = 0.0
        self.group = None
        if self.enabled and layout.world_size > 1:     # the other ranks wait for rank 0's evaluations over it
            timeout = self.evals.timeout_s * (self.evals.retries + 1) + GROUP_MARGIN_S    # inline: every attempt
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        if self.enabled and self.main:
            self.queue.extend(Job(pin) for pin in pinned(self.run_dir))   # evaluations a stopped run left undone

    # ---- the trainer's calls
    def after_checkpoint(self, step: int, saved: bool, signalled: bool = False) -> None:
        """Every rank, after the save (or none) at ``step``: a selected checkpoint just saved is pinned and queued;
        inline, every rank then waits for one evaluation (not when the run was signalled: it must save and go)."""
        selected = self.enabled and saved and bool(tasks_at(self.evals, step, self.last_step))
        if selected and self.main:
            checkpoint = self.run_dir / "checkpoints" / tag_for_step(step)
            self.queue.append(Job(pin_checkpoint(checkpoint, self.run_dir)))
        if selected and self.evals.mode == "inline" and not signalled:
            self._inline(at_most=1)

    def poll(self) -> None:
        """Rank 0, side and slurm: reap a finished process, stop one past its time, start the next."""
        if not self.enabled or not self.main or self.evals.mode == "inline":
            return
        job = self.running
        if job is not None:
            code = job.proc.poll()
            if code is None and time.monotonic() > job.deadline:
                code = self._stop(job, "ran past evals.timeout_s")
            if code is None:
                return
            self.running = None
            self._outcome(job, code)
        if self.queue:
            self.running = self._start(self.queue.popleft())

    def finish(self) -> None:
        """Every rank, the loop completed: the queued evaluations (the last checkpoint's included) run now, and rank
        0 waits for them; the other ranks wait with it in short broadcasts of the evaluations' own group (not in the
        process group's shutdown barrier, which ``distributed.timeout_s`` bounds)."""
        if not self.enabled:
            return
        if self.evals.mode == "inline":
            self._inline(at_most=None)
            return
        if self.main and (self.queue or self.running):
            print(f"distaff: evals: waiting for the evaluation of {len(self.queue) + bool(self.running)} "
                  f"checkpoint(s) ({self.evals.mode})", flush=True)
        while self._more(bool(self.queue or self.running) and not self.stop_requested() if self.main else False):
            self.poll()
            time.sleep(0.5)
        if self.main and self.stop_requested():     # a signal while waiting: the trained run is saved, pins stay
            self.close(EXIT_STOPPED)

    def close(self, exit_code: int) -> None:
        """Rank 0, a run stopped early: an evaluation in progress stops with it; its pin stays for the resumed run."""
        if self.main and self.running is not None and exit_code != 0:
            self._stop(self.running, "the run stopped")
            print(f"distaff: evals: the evaluation of {self.running.name} stopped with the run; the resumed run "
                  f"(or distaff evals {self.run_dir}) runs it again", flush=True)
            self.running = None

    def timing(self) -> dict[str, float]:
        """The inline evaluations' seconds since the last call (the step-time breakdown's share), inline only."""
        if not self.enabled or self.evals.mode != "inline":
            return {}
        spent, self.inline_s = self.inline_s, 0.0
        return {"evals_inline_s": round(spent, 3)}

    # ---- inline
    def _inline(self, at_most: int | None) -> None:
        """Every rank: rank 0 runs queued evaluations one by one (at most ``at_most``), the others wait in the gloo
        group's barrier after each (its timeout covers one evaluation)."""
        started, done = time.monotonic(), 0
        while at_most is None or done < at_most:
            if not self._more(bool(self.queue) and not self.stop_requested() if self.main else False):
                break
            if self.main:
                self._run_inline(self.queue.popleft())
            if self.group is not None:
                dist.barrier(group=self.group)
            done += 1
        spent = time.monotonic() - started
        self.inline_s += spent
        self.inline_total_s += spent

    def _more(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank (over the evaluations' own group)."""
        if self.group is None:
            return flag
        value = torch.tensor([float(flag)])
        dist.broadcast(value, src=0, group=self.group)
        return bool(value.item())

    def _run_inline(self, job: Job) -> None:
        """Rank 0: ``job`` until it ends, fails for good, runs past its time, or the run is signalled (then it is
        stopped: the run must checkpoint and go; its pin stays for the resumed run)."""
        while True:
            job = self._start(job)
            code = job.proc.poll()
            while code is None and time.monotonic() < job.deadline and not self.stop_requested():
                time.sleep(0.2)
                code = job.proc.poll()
            if code is None and self.stop_requested():
                self._stop(job, "the run was signalled")
                print(f"distaff: evals: the evaluation of {job.name} stopped: the run was signalled; the resumed run "
                      "runs it again", flush=True)
                return
            if code is None:
                code = self._stop(job, "ran past evals.timeout_s")
            if not self._outcome(job, code):
                return

    # ---- one process
    def _command(self, job: Job) -> list[str]:
        if self.evals.mode == "slurm":
            return [sys.executable, "-m", SUBMITTER, str(self.run_dir), "--checkpoint", str(job.checkpoint)]
        nice = ["--nice", str(SIDE_NICENESS)] if self.evals.mode == "side" else []
        return [sys.executable, "-m", RUNNER, str(self.run_dir), "--checkpoint", str(job.checkpoint), *nice]

    def _env(self) -> dict[str, str]:
        env = without_rank_variables(os.environ)
        if self.evals.mode == "side":    # beside the ranks: few threads, and no GPU memory taken from them
            env.update(OMP_NUM_THREADS=str(self.evals.threads), CUDA_VISIBLE_DEVICES="")
        return env

    def _start(self, job: Job) -> Job:
        """Start ``job``'s process in a session of its own (stopping it stops what it started), output to its log."""
        log = self.run_dir / LOGS / f"{job.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as handle:
            handle.write(f"== distaff evals: {job.name}, attempt {job.attempts + 1} ({self.evals.mode}), "
                         f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            handle.flush()
            job.proc = subprocess.Popen(self._command(job), stdout=handle, stderr=subprocess.STDOUT,
                                        env=self._env(), start_new_session=True)
        job.attempts += 1
        job.deadline = time.monotonic() + self.evals.timeout_s
        return job

    def _stop(self, job: Job, why: str) -> int:
        """End ``job``'s process group (SIGTERM, then SIGKILL); its exit code."""
        for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(job.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                return job.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
        warn(f"evals: the evaluation of {job.name} ({why}) did not end after SIGKILL")
        return -signal.SIGKILL

    def _outcome(self, job: Job, code: int) -> bool:
        """Report a finished process; whether ``job`` runs again (a failure with attempts left)."""
        log = self.run_dir / LOGS / f"{job.name}.log"
        if code in (0, EXIT_EVALUATED_ELSEWHERE):
            what = "submitted" if self.evals.mode == "slurm" else "evaluated"
            print(f"distaff: evals: {job.name} {what} ({self.evals.mode}; {log})", flush=True)
            return False
        cause = f"killed by signal {-code}" if code < 0 else f"exit {code}"
        if job.attempts <= self.evals.retries:
            warn(f"evals: the evaluation of {job.name} failed ({cause}; {log}); running it again "
                 f"(attempt {job.attempts + 1} of {self.evals.retries + 1})")
            if self.evals.mode != "inline":
                self.queue.appendleft(job)
            return True
        warn(f"evals: the evaluation of {job.name} failed {job.attempts} time(s) ({cause}; {log}); training goes on, "
             f"the checkpoint stays pinned in {self.run_dir / PINNED}: `distaff evals {self.run_dir}` runs it later")
        return False
