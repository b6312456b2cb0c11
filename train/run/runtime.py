"""What every distaff training run shares, pretraining and fine-tuning alike.

:class:`RunBase` is one rank of a run: it locks ``run.out_dir``, catches SIGTERM/SIGUSR1, builds
the DeepSpeed engine and the checkpointer, opens the metrics, and runs the loop skeleton (a step,
then evaluation and checkpointing with the watchdog paused, until the subclass says it is done or
a signal arrives: then a checkpoint and :data:`EXIT_PREEMPTED`) around one optimizer step over the
subclass's micro-batches and objective. Subclasses supply their data, model, evaluation and summary. :func:`run_main` is the command-line entry with the shared error handling.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import re
import secrets
import signal
import string
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import numpy as np
import torch

from distaff.train.core import distributed as dist_utils
from distaff.train.core import presets
from distaff.train.core.errors import DEBUG_FLAG, MAX_COUNT, RunFailure, int_arg, report, take_debug_flag
from distaff.train.core.exit_codes import EXIT_BAD_CONFIG, EXIT_PREEMPTED, claim_exit, leave_now
from distaff.train.core.runlock import DirLock
from distaff.train.core.threads import configure_threads
from distaff.train.core.verbosity import VERBOSE_FLAG, take_verbose_flag
from distaff.train.core.watchdog import Watchdog
from distaff.train.run.checkpoint import Checkpointer, Stateful, latest_checkpoint
from distaff.train.run.config import ConfigError, changed_keys, config_fingerprint, fingerprinted
from distaff.train.run.engine import initialize, set_lr
from distaff.train.run.metrics import MetricsLogger, StageClock, TensorBoardSink, WandbSink, system_info
from distaff.train.run.steps import optimizer_step, train_step

SUMMARY_FILE = "summary.json"       # written by rank 0 when a run ends, "finished": true once it is complete


class PreemptionFlag:
    """Remembers a SIGTERM/SIGUSR1 or a first Ctrl-C (SIGINT); the loop acts on it at the next step boundary.

    A second Ctrl-C ends the process at once: the first restores SIGINT's default action (the kernel ends the
    process, even inside a collective that never returns to Python; no checkpoint, no traceback)."""

    def __init__(self) -> None:
        self.signum = 0
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum     # the first one names the cause
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def new_wandb_id() -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


@dataclass
class TrainState:
    """The W&B run id, where the loop is and its counters: what a resumed run continues from."""
    wandb_run_id: str | None = None
    step: int = 0
    tokens: int = 0                     # real (non-padding) tokens
    samples: int = 0
    positions: int = 0                  # token positions computed, padding included
    train_time_s: float = 0.0
    nonfinite_steps: int = 0            # steps skipped for a non-finite loss
    last_eval: dict[str, float] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in dataclasses.fields(self):
            if f.name in state:         # checkpoints from before a counter existed lack it
                setattr(self, f.name, state[f.name])


class RunSections(Protocol):
    """What :class:`RunBase` reads of a config: the sections a pretraining ``RunConfig`` and a fine-tuning
    config both have (each trainer reads the rest of its own)."""

    run: Any
    train: Any
    zero: Any
    distributed: Any
    logging: Any
    wandb: Any
    checkpoint: Any

    @property
    def out_dir(self) -> Path: ...


class RunBase:
    """One rank of a run. Subclasses set ``self.resume_from`` (the checkpoint chosen by
    ``resume_check.check_resumable``, or None), ``self.state`` (a :class:`TrainState`), ``self.engine``,
    ``self.objective``, ``self.batches`` (an iterator of micro-batches), ``self.max_steps``,
    ``self.checkpointer``, ``self.metrics`` and ``self.throughput``, and implement :meth:`_done`,
    :meth:`_lr`, :meth:`_log_train`, :meth:`_after_step`, :meth:`_finish` and :meth:`_summary`."""

    def __init__(self, cfg: RunSections, layout: dist_utils.DistEnv):
        self.cfg, self.layout = cfg, layout
        self.device = dist_utils.device_for(layout)
        self.out_dir_lock = self._lock_out_dir()
        self.preemption = PreemptionFlag()
        self.nonfinite_in_a_row = 0
        self.watchdog: Watchdog | None = None
        self.finished_before = False

    # ---------------------------------------------------------------- building

    def _lock_out_dir(self) -> DirLock | None:
        """Rank 0 holds ``run.out_dir``'s lock for the run's life; every rank learns of a refusal, and why."""
        lock, refusal = None, ""
        if self.layout.is_main:
            try:
                lock = DirLock(self.cfg.out_dir, "run.out_dir")
            except ConfigError as err:
                refusal = str(err)
        refusal = dist_utils.broadcast_text(refusal, self.device)
        if refusal:
            raise ConfigError(refusal)
        return lock

    def _initialize_engine(self, build_model: Callable[[], torch.nn.Module],
                           param_groups: Callable[[torch.nn.Module], list[dict[str, Any]]] | None = None):
        """The model, built with the same seed on every rank (identical initial weights), under DeepSpeed
        (optimizer groups ``param_groups(model)``, default the engine's); then every rank's generators are
        seeded apart (dropout, masking)."""
        seed_everything(self.cfg.run.seed)
        model = build_model()
        groups = param_groups(model) if param_groups is not None else None
        engine = initialize(model, self.cfg, self.layout.world_size, groups)
        seed_everything(self.cfg.run.seed + 7919 * (self.layout.rank + 1))
        self.clock = StageClock(self.device)
        self.clock.watch_reduction(engine)
        return engine

    def _new_checkpointer(self, root: Path, *, per_rank: dict[str, Stateful], meta: dict[str, Any], every: int,
                          keep: int, tokenizer_dir: Path | None) -> Checkpointer:
        """A checkpointer of the engine, ``per_rank`` components and the loop's state (rank 0 writes it); its
        saves are timed."""
        checkpointer = Checkpointer(root, self.engine, per_rank=per_rank, shared={"train_state": self.state}, meta=meta,
                            every=every, keep=keep, rank=self.layout.rank, world_size=self.layout.world_size,
                            barrier=dist_utils.barrier, any_rank=self._any_rank,
                            from_rank0=lambda text: dist_utils.broadcast_text(text, self.device),
                            tokenizer_dir=tokenizer_dir)
        self.clock.watch_saves(checkpointer)
        return checkpointer

    def _restore(self) -> Path | None:
        """The checkpoint the subclass chose before building its engine (``self.resume_from``) loaded; every rank
        must be at the same step afterwards."""
        resumed_from = self.checkpointer.restore_chosen(self.resume_from)
        branch_from = getattr(self.cfg.checkpoint, "branch_from", "")     # pretraining's only
        step = self.state.step
        if dist_utils.all_reduce_sum([float(step)], self.device)[0] != step * self.layout.world_size:
            raise RuntimeError(f"ranks resumed from different steps (this rank: {step}); "
                               f"is {self.checkpointer.root} shared?")
        if branch_from and resumed_from == Path(branch_from):
            self.state.wandb_run_id = None      # a branch is its own W&B run, not its parent's continued
        self.state.wandb_run_id = self.state.wandb_run_id or os.environ.get("WANDB_RUN_ID") or new_wandb_id()
        # re-running a finished run: nothing to train, evaluate or log (run() says so and returns)
        self.finished_before = resumed_from is not None and self._done()
        return resumed_from

    def _any_rank(self, flag: bool) -> bool:
        return dist_utils.all_reduce_sum([float(flag)], self.device)[0] > 0

    def _open_metrics(self, resumed_from: Path | None, *, max_steps: int, wandb_config: dict[str, Any],
                      what: str) -> MetricsLogger:
        """Rank 0 announces the run (``what`` appended to the line) and opens W&B with ``wandb_config`` (the
        resolved config); all ranks get a logger."""
        cfg, sinks = self.cfg, []
        if self.layout.is_main and not self.finished_before:
            link_rank0_log(os.environ)
            parameters = sum(getattr(p, "ds_numel", p.numel()) for p in self.engine.module.parameters())
            print(f"distaff: {'resuming from ' + str(resumed_from) if resumed_from else 'starting a new run'}; "
                  f"{self.layout.world_size} rank(s) x {torch.get_num_threads()} CPU thread(s), ZeRO-{cfg.zero.stage}, "
                  f"{cfg.train.precision}, "
                  f"{parameters / 1e6:.2f}M parameters{what}", flush=True)
            sinks.append(WandbSink(cfg.wandb, run_name=cfg.run.name, out_dir=cfg.out_dir,
                                   run_id=self.state.wandb_run_id,
                                   config={**wandb_config, "system": system_info(self.layout.world_size)}))
            if cfg.logging.tensorboard:
                sinks.append(TensorBoardSink(cfg.out_dir))
        return MetricsLogger(cfg.out_dir, enabled=self.layout.is_main, max_steps=max_steps,
                             start_step=self.state.step, progress_bar=cfg.logging.progress_bar, sinks=sinks)

    # ---------------------------------------------------------------- the loop

    def run(self) -> int:
        """Loop until done or signalled, then the final save and evaluation; the exit code."""
        cfg = self.cfg
        if self.finished_before:
            if self.layout.is_main:
                print(f"distaff: {cfg.out_dir} is finished: {self._finished_line()}", flush=True)
                ignored = self._changed_since_finished()
                if ignored:
                    print(f"distaff: warning: changed since that run finished, and applied to nothing (it trains no "
                          f"further step): {'; '.join(ignored)}. To train with them, start a new run "
                          "(another run.out_dir)", flush=True)
            return 0
        self.watchdog = Watchdog(cfg.distributed.watchdog_s or cfg.distributed.timeout_s, cfg.out_dir,
                                 self.layout.rank)
        exit_code = self._loop()
        self.watchdog.stop()
        self.metrics.close()
        if exit_code == 0:
            self._finish()
        self._close(exit_code)
        return exit_code

    def _loop(self) -> int:
        while not self._done():
            signalled = self._step()
            self.metrics.advance(self.state.step)
            self.watchdog.feed()
            self._stop_if_nonfinite()
            with self.watchdog.paused():  # bounded by the collective timeout, may take longer than a step
                self._after_step(signalled)
            if signalled:
                if self.layout.is_main:
                    what = "interrupted (Ctrl-C)" if self.preemption.signum == signal.SIGINT else "signal received"
                    print(f"distaff: {what}; checkpoint saved at step {self.state.step}; exiting with "
                          f"{EXIT_PREEMPTED} (run again to resume)", flush=True)
                return EXIT_PREEMPTED
        return 0

    def _step(self) -> bool:
        """One optimizer step over :meth:`_micro_batches` micro-batches of ``self.batches`` and its bookkeeping;
        returns whether any rank got a signal."""
        state, started = self.state, time.perf_counter()
        self.clock.start()
        set_lr(self.engine, self._lr(state.step))
        local = train_step(self.engine, self.batches, self._micro_batches(state.step), self.device, self.objective,
                           self.layout.world_size, self.clock)
        (*sums, tokens, samples, positions), skipped, signalled = self._reduce_step(local)
        self.clock.lap("other")
        optimizer_step(self.engine, skip=skipped)
        self.clock.lap("optimizer")
        if not skipped:
            self.objective.after_step(self.engine.module, sums)
        state.step += 1
        state.tokens += int(tokens)
        state.samples += int(samples)
        state.positions += int(positions)
        state.train_time_s += time.perf_counter() - started
        self.throughput.add(int(tokens), int(samples), int(positions))
        self.clock.finish()
        if state.step % self.cfg.logging.every == 0 or state.step == self.max_steps:
            self._log_train(self.objective.report(sums))
        return signalled

    def _reduce_step(self, local: torch.Tensor) -> tuple[list[float], bool, bool]:
        """One small collective per step: the global sums of ``local`` plus "did any rank get a signal?";
        returns the sums, whether the step must be skipped (a non-finite sum: every rank skips the same
        step) and whether a rank was signalled."""
        flag = torch.tensor([float(self.preemption.signum != 0)], dtype=torch.float64, device=self.device)
        *sums, signalled = dist_utils.all_reduce_sum(torch.cat([local, flag]), self.device)
        skipped = not all(map(math.isfinite, sums))
        self._count_nonfinite(skipped)
        return sums, skipped, bool(signalled)

    def _count_nonfinite(self, skipped: bool) -> None:
        if not skipped:
            self.nonfinite_in_a_row = 0
            return
        self.state.nonfinite_steps += 1
        self.nonfinite_in_a_row += 1
        if self.layout.is_main:
            print(f"distaff: step {self.state.step + 1}: non-finite loss; optimizer step skipped "
                  f"({self.nonfinite_in_a_row} in a row, limit train.max_nonfinite_steps="
                  f"{self.cfg.train.max_nonfinite_steps})", flush=True)

    def _stop_if_nonfinite(self) -> None:
        """``train.max_nonfinite_steps`` skipped steps in a row stop the run before this step is saved."""
        in_a_row = self.nonfinite_in_a_row
        if in_a_row >= self.cfg.train.max_nonfinite_steps:
            raise RunFailure(       # one line, exit 1: the cause is the run's numbers, not a bug to trace back
                f"the loss was not finite for {in_a_row} steps in a row (up to step {self.state.step}); stopping "
                f"without saving (those steps left the weights unchanged; latest checkpoint: "
                f"{latest_checkpoint(self.checkpointer.root)}); lower optim.lr or check the data")

    # ---------------------------------------------------------------- subclass hooks

    def _done(self) -> bool:
        raise NotImplementedError

    def _finished_line(self) -> str:
        """Where a finished run stopped and which key to raise to continue it."""
        raise NotImplementedError

    def _lr(self, step: int) -> float:
        """The base learning rate of optimizer step ``step`` (0-based)."""
        raise NotImplementedError

    def _micro_batches(self, step: int) -> int:
        """The micro-batches each rank accumulates for optimizer step ``step`` (0-based)."""
        return self.cfg.train.grad_accum

    def _log_train(self, objective_metrics: dict[str, float | None]) -> None:
        raise NotImplementedError

    def _after_step(self, signalled: bool) -> None:
        """Evaluation and checkpointing after a step (a checkpoint is due when ``signalled``)."""
        raise NotImplementedError

    def _finish(self) -> None:
        """After a completed loop: the final checkpoint first, then the final evaluation."""
        raise NotImplementedError

    def _resolved_config(self) -> dict[str, Any]:
        """The resolved config as plain values (what ``config.yaml`` holds): its fingerprint goes into the summary
        (``distaff ablate`` reuses a finished run only when it matches)."""
        raise NotImplementedError

    def _summary(self) -> dict[str, Any]:
        """Rank 0: the run's figures for ``summary.json``; draws the plot and prints a report."""
        raise NotImplementedError

    def _changed_since_finished(self) -> list[str]:
        """``key: old -> new`` for each fingerprinted value this invocation asks for that differs from what the
        finished run in ``out_dir`` recorded (none when its summary is missing or unreadable)."""
        try:
            recorded = json.loads((self.cfg.out_dir / SUMMARY_FILE).read_text()).get("fingerprinted_config")
        except (OSError, ValueError, AttributeError):
            return []
        if not isinstance(recorded, dict):
            return []
        return changed_keys(recorded, fingerprinted(self._resolved_config()))

    def _close(self, exit_code: int) -> None:
        """Rank 0 writes ``summary.json``; ``finished`` says whether the run is complete (a run stopped by a
        signal writes one too, to be resumed: its step count alone does not say so)."""
        if not self.layout.is_main:
            return
        resolved = fingerprinted(self._resolved_config())
        summary = {**self._summary(), "finished": exit_code == 0, "config_fingerprint": config_fingerprint(resolved),
                   "fingerprinted_config": resolved}
        (self.cfg.out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
        for sink in self.metrics.sinks:
            sink.summary(summary)
            sink.finish(exit_code)


def parse_args(prog: str, description: str, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     epilog=f"{DEBUG_FLAG}: print the traceback of any error; {VERBOSE_FLAG}: show the "
                                            "libraries' INFO lines and warnings")
    parser.add_argument("--config", help=f"run config: {presets.CONFIG_HELP}")
    # the deepspeed launcher appends --local_rank unless run with --no_local_rank; LOCAL_RANK is read from the env
    parser.add_argument("--local_rank", "--local-rank", type=int_arg("--local_rank", high=MAX_COUNT),
                        help=argparse.SUPPRESS)
    parser.add_argument("--check", action="store_true",
                        help="check the config, the data and that a checkpoint to resume fits this run, then exit "
                             "(no engine is built, nothing is trained or written)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (presets, file and overrides merged) as YAML and exit "
                             "(with --check: then check it)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. optim.lr=3e-4")
    return parser.parse_intermixed_args(take_verbose_flag(take_debug_flag(argv)))


@dataclass(frozen=True)
class Inspection:
    """What ``--print-config`` and ``--check`` do for one trainer: the resolved config as plain values, and the
    checks of a run that builds no engine (a one-line summary, or an error in the one style). A preset can be read
    before its inputs exist: ``load`` reads the config without looking for them, ``missing`` names each input the
    run reads that is not there (one line each), ``needs`` says which checks cannot run without them."""
    resolved: Callable[[Any], dict[str, Any]]
    check: Callable[[Any], str]
    load: Callable[[str | None, list[str]], Any]
    missing: Callable[[Any], list[str]]
    needs: str


def link_rank0_log(env: Mapping[str, str]) -> None:
    """Under a ``distaff slurm submit`` job, point ``$DISTAFF_RANK0_LOG`` at the log of the node this rank 0 runs on
    (``$DISTAFF_NODE_LOG`` with ``%n`` its ``SLURM_NODEID``): the rendezvous may give rank 0 to any node, and at
    each attempt another, so one name follows its lines (``tail -F``). Replaced atomically; a filesystem that
    refuses links costs a warning, never the run."""
    link, pattern = env.get(dist_utils.RANK0_LOG_VARIABLE), env.get(dist_utils.NODE_LOG_VARIABLE)
    node = env.get("SLURM_NODEID")
    if not (link and pattern and node):
        return
    target = Path(pattern.replace("%n", node))
    staged = Path(f"{link}.{os.getpid()}")
    try:
        staged.unlink(missing_ok=True)
        staged.symlink_to(target.name if target.parent == Path(link).parent else target)
        os.replace(staged, link)
    except OSError as err:
        print(f"distaff: warning: could not link {link} to {target} ({err}); rank 0's lines are in {target}",
              flush=True)


def explain_zeros(text: str, cfg: Any) -> str:
    """``--print-config``'s YAML with a comment on each 0 that stands for another value: ``watchdog_s: 0`` is
    ``distributed.timeout_s``, which a reader would otherwise take for "no watchdog"."""
    return re.sub(r"^(  watchdog_s: 0)$", rf"\1  # 0: distributed.timeout_s, {cfg.distributed.timeout_s} s", text,
                  count=1, flags=re.M)


def _inspect(prog: str, args: argparse.Namespace, cfg: Any, inspection: Inspection) -> int:
    """``--print-config`` (exit 0, each missing input noted on stderr) and/or ``--check`` (its summary; with an
    input missing, which checks could not run and exit 2: the run would stop there). Given both, the config is
    printed, then checked."""
    import yaml

    missing = inspection.missing(cfg)
    if args.print_config:
        print(explain_zeros(yaml.safe_dump(inspection.resolved(cfg), sort_keys=False), cfg), end="", flush=True)
        if not args.check:
            for line in missing:
                print(f"{prog}: note: {line}", file=sys.stderr)
            return 0
    if missing:
        for line in missing:
            print(f"{prog}: --check: {line}", file=sys.stderr)
        print(f"{prog}: --check: the config is valid; not checked without {'them' if len(missing) > 1 else 'it'}: "
              f"{inspection.needs}; a run would stop on the same line (exit {EXIT_BAD_CONFIG})", file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        print(f"{prog}: OK: {inspection.check(cfg)}", flush=True)
    except Exception as err:  # noqa: BLE001 - reported in the one style
        return report(prog, err)
    return 0


def run_main(prog: str, description: str, argv: list[str] | None, load: Callable[[str | None, list[str]], Any],
             train: Callable[[Any, dist_utils.DistEnv], int], inspection: Inspection | None = None) -> int:
    """Parse the command line, load the config with ``load``, run ``train`` on this rank (or with ``--check`` /
    ``--print-config``, ``inspection``'s instead); the exit code.

    Errors are reported as every command reports them (:mod:`distaff.train.core.errors`), naming the rank when
    there are several. A config error is raised by every rank together, so the process group is shut
    down in step; any other failure leaves at once (its peers may be mid-collective)."""
    try:
        args = parse_args(prog, description, sys.argv[1:] if argv is None else argv)
        inspecting = inspection is not None and (args.check or args.print_config)
        configure_threads(announce=not inspecting)    # the load line only where it trains
        layout = dist_utils.env_from_environ()      # a bad launcher variable is named before anything else
        cfg = (inspection.load if inspecting else load)(args.config, args.overrides)
    except Exception as err:  # noqa: BLE001 - reported in the one style
        return report(prog, err)
    if inspecting:
        return _inspect(prog, args, cfg, inspection)
    dist_utils.die_with_launcher()
    dist_utils.quiet_library_warnings(layout.rank)
    try:
        layout = dist_utils.init_distributed(cfg.distributed.timeout_s)
        code = train(cfg, layout)
        dist_utils.shutdown()
        return code
    except Exception as err:  # noqa: BLE001 - report which rank failed and why, then exit
        return _rank_failed(prog, err, layout, cfg.distributed.timeout_s)
    finally:
        sys.stdout.flush()


def _rank_failed(prog: str, err: Exception, layout: dist_utils.DistEnv, timeout_s: int) -> int:
    where, hint = f"rank {layout.rank}: " if layout.world_size > 1 else "", ""
    if isinstance(err, (torch.distributed.DistError, RuntimeError)) and layout.world_size > 1 \
            and not isinstance(err, RunFailure):
        hint = (f"if a collective failed: another rank probably died, or a collective waited longer than "
                f"distributed.timeout_s={timeout_s}")
    # its peers may be gone or mid-collective, so the process group can be neither destroyed (that
    # may wait) nor left to the interpreter's teardown (gloo's threads abort it with -6): it leaves now
    leaving = dist_utils.torch_distributed_initialized() and not isinstance(err, ConfigError)
    if leaving:
        claim_exit()    # unless its watchdog is already ending the rank (a broken collective is then its doing)
    code = report(prog, err, where, hint)
    if leaving:
        leave_now(code)
    if isinstance(err, ConfigError):
        # every rank refuses together, so no collective is pending: a live process group left to the
        # interpreter's exit aborts the process ("terminate called without an active exception")
        dist_utils.shutdown()
    return code
