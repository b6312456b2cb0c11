"""``distaff ablate``'s command line: plan, run (or write job scripts), report; one ablation per ``out_dir``."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys

from distaff.train.core import presets
from distaff.train.core.errors import MAX_COUNT, command_main, document_ranges, int_arg
from distaff.train.core.exit_codes import EXIT_PREEMPTED
from distaff.train.core.runlock import DirLock
from distaff.train.core.threads import RANKS_FLAG, check_ranks_per_node, rank_bound
from distaff.train.tools.ablate.config import AblationConfig, load_ablation
from distaff.train.tools.ablate.plan import PlannedRun, plan_runs, prepare_data
from distaff.train.tools.ablate.report import write_report
from distaff.train.tools.ablate.runs import interrupt, run_all, run_averages, run_command, write_job_scripts

DESCRIPTION = "named variants of one run config on equal budgets, compared"


def main(argv: list[str] | None = None) -> int:
    return command_main("distaff ablate", _main, argv)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="distaff ablate", description=DESCRIPTION)
    parser.add_argument("--config", required=True, help=f"ablation config: {presets.CONFIG_HELP}")
    parser.add_argument("--report", action="store_true", help="only gather finished runs into the report")
    parser.add_argument("--dry-run", action="store_true", help="print the planned runs' commands, run nothing")
    parser.add_argument(RANKS_FLAG, type=int_arg(RANKS_FLAG, low=1, high=MAX_COUNT), metavar="N",
                        help="allow up to N ranks on this node (ranks x parallel; default: its GPUs, else its cores)")
    args = document_ranges(parser).parse_args(argv)
    cfg = load_ablation(args.config)
    if cfg.launcher == "sequential":        # the runs' ranks all start on this node
        check_ranks_per_node(cfg.ranks * cfg.parallel, f"{args.config}: ranks {cfg.ranks} x parallel {cfg.parallel}",
                             rank_bound(args.max_ranks_per_node, here=True))
    previous = signal.signal(signal.SIGTERM, interrupt)   # SIGTERM stops like Ctrl-C, whatever is under way
    try:
        if args.dry_run:
            return _ablate(cfg, args)
        # one ablation per out_dir, by the lock runs take: two would run, report and log over each other
        with DirLock(cfg.root, f"{args.config}: out_dir"):
            return _ablate(cfg, args)
    except KeyboardInterrupt as stop:
        how = "SIGTERM" if str(stop) == "SIGTERM" else "Ctrl-C"
        print(f"distaff ablate: interrupted ({how}); the runs in progress saved a checkpoint, finished runs keep "
              f"their summaries; exiting with {EXIT_PREEMPTED} (run the same command again to continue)",
              file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    finally:
        signal.signal(signal.SIGTERM, previous)


def _planned_line(cfg: AblationConfig, run: PlannedRun) -> str:
    """A run's command, or what an average does (in ablate's own process, after its run)."""
    if run.average is None:
        return shlex.join(run_command(cfg, run, 29500))
    ema = ["--ema", str(run.average.ema)] if run.average.ema else []
    return shlex.join(["distaff", "average", str(run.parent.out_dir), "--last", str(run.average.last), *ema,
                       "--out", str(run.out_dir / "checkpoint")]) + "   # then scored on the held-out split"


def _ablate(cfg: AblationConfig, args: argparse.Namespace) -> int:
    if not args.report and not args.dry_run:
        prepare_data(cfg)
    runs = plan_runs(cfg)
    if args.dry_run:
        print("\n".join(_planned_line(cfg, run) for run in runs))
        return 0
    if not args.report and cfg.launcher == "script":
        scripts = write_job_scripts(cfg, runs)
        print(f"distaff ablate: wrote {len(scripts)} job script(s) under {cfg.root / 'jobs'}; start them, then "
              f"run `distaff ablate --config {args.config} --report`")
        return 0
    failures = run_averages(runs) if args.report else run_all(cfg, runs)
    write_report(cfg, runs)
    unfinished = [str(run.out_dir) for run in runs if not run.done]
    if args.report and unfinished:
        print(f"distaff ablate: {len(unfinished)} run(s) not finished, left out of the report: "
              f"{', '.join(unfinished)}", flush=True)
    if failures:
        print("distaff ablate: " + "\n  ".join([f"{len(failures)} run(s) failed (the report has the others):"]
                                               + failures), file=sys.stderr)
        return 1
    print(f"distaff ablate: report in {cfg.root / 'ablation.md'}, {cfg.root / 'ablation.csv'}, "
          f"{cfg.root / 'ablation.png'}")
    return 0


