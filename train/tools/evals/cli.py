"""``distaff evals RUN_DIR [key=value ...]``: run the evaluations a run's checkpoints are missing, then print each
evaluation across them (and plot it).

The evaluations are the run's ``evals`` section (its ``config.yaml``; ``evals.*`` overrides change it, e.g.
``evals.every=500`` or another ``evals.tasks``); the checkpoints are those it selects, the end of each decay branch
(``RUN_DIR/branches/*``) and every average of the run's checkpoints (``distaff average`` output in the run directory,
or named with ``--average``). Whatever ``evals.jsonl`` already holds is not run again, so the command is a backfill:
after the run ended, after a failed or killed evaluation, or for evaluations added later; run twice, the second
runs nothing. It runs here, one checkpoint after another, or with ``--slurm`` as one Slurm job per checkpoint
(``evals.slurm``; ``--dry-run`` shows the scripts). Relative paths in the section are read from the current
folder, as the run read them: run it where the run was started.

``--checkpoint CKPT`` evaluates that checkpoint alone (what the trainer's side process, its inline evaluation and
its Slurm jobs run); exit 3 when another process is evaluating it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

from distaff.train.core.errors import ConfigError, RunFailure, command_main, document_ranges, int_arg
from distaff.train.core.threads import configure_threads
from distaff.train.core.distributed import without_rank_variables
from distaff.train.pretrain.attached_evals import EXIT_EVALUATED_ELSEWHERE, SUBMITTER
from distaff.train.run.config import RunConfig
from distaff.train.tools.evals import records, report
from distaff.train.tools.evals.catalog import Plan, find_target, gone_target, read_run_config, run_plan
from distaff.train.tools.evals.runner import Outcome, evaluate


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="distaff evals", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run directory (run.out_dir) of a pretraining run")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="evals.* overrides, e.g. evals.every=500")
    parser.add_argument("--checkpoint", type=Path, help="evaluate this checkpoint (or pin) of the run alone")
    parser.add_argument("--average", type=Path, action="append", default=[], metavar="CKPT",
                        help="also this averaged checkpoint (distaff average --out) of the run's checkpoints")
    parser.add_argument("--table", action="store_true", help="print the table and write the plot; run nothing")
    parser.add_argument("--dry-run", action="store_true", help="list what would run (with --slurm: the job scripts)")
    parser.add_argument("--slurm", action="store_true", help="one Slurm job per checkpoint instead of here")
    parser.add_argument("--nice", type=int_arg("--nice", high=19),
                        default=0, help=argparse.SUPPRESS)   # the trainer's side process: 19
    return document_ranges(parser).parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    return command_main("distaff evals", _main, argv)


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    _become_a_process_of_its_own(args.nice)
    cfg = read_run_config(args.run_dir, args.overrides)
    if not cfg.evals.tasks:
        raise ConfigError(f"{args.run_dir}: its config has no evals.tasks; attach evaluations in the run config, or "
                          "give them here: evals.tasks='[{name: ..., kind: probe, text: ...}]'")
    plan = run_plan(args.run_dir, cfg, args.average)
    if args.checkpoint is not None:
        return _one_checkpoint(args.checkpoint, args.run_dir, cfg, plan)
    todo = [(t, tasks) for t, tasks in plan
            if records.missing(t, tasks, records.read(t.run_dir / records.EVALS_FILE))]
    failed: list[str] = []
    if args.dry_run or args.slurm:
        _plan_or_submit(todo, args)
    elif not args.table:
        failed = _run_here(todo)
    _report(args.run_dir, run_plan(args.run_dir, cfg, args.average), cfg)
    if failed:
        raise RunFailure(f"{len(failed)} evaluation(s) failed, the first: {failed[0]} (all: "
                         f"{args.run_dir / records.FAILURES_FILE}); run distaff evals again to retry them")
    return 0


def _become_a_process_of_its_own(niceness: int) -> None:
    """Not one rank of the run that may have started it, at the priority asked for, and deaf to Slurm's warning
    signal (an evaluation has nothing to checkpoint: a requeued job redoes only what is missing)."""
    kept = without_rank_variables(os.environ)
    for name in set(os.environ) - set(kept):
        del os.environ[name]
    if niceness:
        os.nice(niceness)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    configure_threads()


def _one_checkpoint(path: Path, run_dir: Path, cfg: RunConfig, plan: Plan) -> int:
    found = find_target(plan, path) or gone_target(path, run_dir, cfg)
    if found is None:
        raise ConfigError(f"--checkpoint {path}: not a checkpoint (or pin) that {run_dir}'s evals select, nor one of "
                          "its branches' ends or averages")
    filing = records.Filing()
    try:
        outcome = evaluate(*found, filing)
    finally:
        filing.close()
    return _exit_code(outcome, found[0].label)


def _exit_code(outcome: Outcome, label: str) -> int:
    if outcome.busy:
        print(f"distaff evals: {label}: {outcome.busy}; leaving it to that process", flush=True)
        return EXIT_EVALUATED_ELSEWHERE
    if outcome.failed:
        raise RunFailure(f"{len(outcome.failed)} evaluation(s) of {label} failed, the first: {outcome.failed[0]}")
    print(f"distaff evals: {label}: {outcome.ran} evaluation(s) recorded" if outcome.ran else
          f"distaff evals: {label}: every evaluation is recorded already", flush=True)
    return 0


def _run_here(todo: Plan) -> list[str]:
    if not todo:
        print("distaff evals: nothing to run: every selected checkpoint has its results", flush=True)
    failed: list[str] = []
    filing = records.Filing()
    try:
        for target, tasks in todo:
            outcome = evaluate(target, tasks, filing)
            if outcome.busy:
                print(f"distaff evals: {target.label}: {outcome.busy}; skipped", flush=True)
            failed += outcome.failed
    finally:
        filing.close()
    return failed


def _plan_or_submit(todo: Plan, args: argparse.Namespace) -> None:
    """``--dry-run``: what would run (with ``--slurm``, each job's script); ``--slurm``: submit the jobs."""
    for target, tasks in todo:
        missing = records.missing(target, tasks, records.read(target.run_dir / records.EVALS_FILE))
        print(f"distaff evals: {target.label} ({target.folder}): "
              + ", ".join(f"{task.name} seed {seed}" for task, seed in missing), flush=True)
        if args.slurm:
            command = [sys.executable, "-m", SUBMITTER, str(args.run_dir), "--checkpoint", str(target.folder),
                       *args.overrides, *(f"--average={p}" for p in args.average),
                       *(["--dry-run"] if args.dry_run else [])]
            done = subprocess.run(command, check=False)
            if done.returncode != 0:
                raise RunFailure(f"submitting the evaluation of {target.label} failed (exit {done.returncode})")
    if not todo:
        print("distaff evals: nothing to run: every selected checkpoint has its results", flush=True)


def _report(run_dir: Path, plan: Plan, cfg: RunConfig) -> None:
    print(f"\n== evaluations of {run_dir} (mean +- std over seeds (seeds), each seed's newest record; "
          f"{run_dir / records.EVALS_FILE})\n"
          + report.table(run_dir, plan, cfg.evals.tasks), flush=True)
    figure = report.plot(run_dir, plan, cfg.evals.tasks)
    if figure is not None:
        print(f"plot: {figure}", flush=True)
