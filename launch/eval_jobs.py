"""One checkpoint's evaluation as a Slurm job of its own (``evals.mode: slurm``): ``python -m distaff.launch.eval_jobs
RUN_DIR --checkpoint CKPT [--dry-run] [key=value ...]`` writes ``RUN_DIR/slurm/evals-<checkpoint>.sbatch`` and
submits it. The trainer's rank 0 starts it after each selected checkpoint; ``distaff evals RUN --slurm`` for each
checkpoint missing results.

The job asks for ``evals.slurm`` (CPUs, memory, GPUs, time, partition, account, extra ``#SBATCH`` lines), checked as
``distaff slurm submit`` checks its own, and runs ``python -m distaff.train.tools.evals RUN_DIR --checkpoint CKPT``
from the submitting folder (relative paths resolve as the run's did). It depends on its run's earlier evaluation
jobs (``--dependency=singleton`` on the job name ``<run.name>-evals``): one at a time per run, in the order the
checkpoints came, never competing with each other for the partition. It is requeue-safe: ``--requeue`` and
``--open-mode=append``, and the runner records each (evaluation, seed) as soon as it has it, so a requeued attempt
runs only what is missing (and takes over its own earlier attempt's work-folder lock). sbatch hands the
submitter's environment to the job: the trainer and ``distaff evals`` start this module without their rank
variables (train/core/distributed.py's RANK_VARIABLES).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from distaff.launch.run_config import LaunchTarget
from distaff.launch.script_values import plain_text, sbatch_extra, sbatch_option, slurm_path_pattern, slurm_time
from distaff.launch.slurm import _MEMORY, sbatch_command
from distaff.train.core.errors import ConfigError, RunFailure, command_main
from distaff.train.run.config import EvalsSlurmSection, RunConfig, config_from_dict, read_config_values

RUNNER = "distaff.train.tools.evals"
_SET_BY_THE_JOB = ("--dependency", "-d", "--job-name", "-J", "--output", "-o", "--requeue", "--no-requeue")


@dataclass(frozen=True)
class EvalJob:
    run_dir: Path               # absolute
    run_name: str
    checkpoint: Path            # absolute: the checkpoint (or pin) the job evaluates
    slurm: EvalsSlurmSection
    workdir: Path               # the job's working folder: where it was submitted from
    python: str = sys.executable
    runner_args: tuple[str, ...] = ()   # evals.* overrides and --average options for the runner

    @property
    def job_name(self) -> str:
        return f"{self.run_name}-evals"

    @property
    def script_path(self) -> Path:
        return self.run_dir / "slurm" / f"evals-{self.checkpoint.name}.sbatch"


def _validate(job: EvalJob) -> None:
    """What ``distaff slurm submit`` checks of its own job, for ``evals.slurm`` and every text the script holds."""
    slurm = job.slurm
    if slurm.mem and not _MEMORY.fullmatch(slurm.mem):
        raise ConfigError(f"evals.slurm.mem {slurm.mem!r}: expected a Slurm size such as 16G, 4000M or 4000 (MB)")
    if slurm.time:
        slurm_time(slurm.time)
    for line in slurm.sbatch:
        if sbatch_extra(line).split("=")[0] in _SET_BY_THE_JOB:
            raise ConfigError(f"evals.slurm.sbatch {line!r}: the evaluation job sets its name, log, requeue and "
                              "dependency itself; leave it out")
    for what, value in (("run.name", job.run_name), ("run.out_dir", str(job.run_dir)), ("--checkpoint",
                        str(job.checkpoint)), ("the submit directory", str(job.workdir)), ("the python path", job.python),
                        ("evals.slurm.partition", slurm.partition), ("evals.slurm.account", slurm.account),
                        *(("override", arg) for arg in job.runner_args)):
        plain_text(what, value)


def _header(job: EvalJob) -> list[str]:
    slurm = job.slurm
    options = [sbatch_option("job-name", job.job_name, what="run.name"), sbatch_option("dependency", "singleton"),
               sbatch_option("nodes", 1), sbatch_option("ntasks", 1), sbatch_option("cpus-per-task", slurm.cpus),
               sbatch_option("output", f"{slurm_path_pattern(str(job.run_dir / 'slurm'))}/evals-%j.out",
                             what="run.out_dir"),
               sbatch_option("open-mode", "append"), sbatch_option("requeue"),
               sbatch_option("chdir", str(job.workdir), what="the submit directory")]
    if slurm.mem:
        options.append(sbatch_option("mem", slurm.mem, what="evals.slurm.mem"))
    if slurm.gpus:
        options.append(sbatch_option("gpus", slurm.gpus))
    options += [sbatch_option(name, value, what=f"evals.slurm.{name}") for name, value in
                (("partition", slurm.partition), ("account", slurm.account), ("time", slurm.time)) if value]
    options += [sbatch_extra(line) for line in slurm.sbatch]
    return [f"#SBATCH {option}" for option in options]


def render_eval_job(job: EvalJob) -> str:
    """The sbatch script of ``job``, its values checked first."""
    _validate(job)
    cpu = "" if job.slurm.gpus else "export CUDA_VISIBLE_DEVICES= DS_ACCELERATOR=cpu\n"
    command = shlex.join([job.python, "-m", RUNNER, str(job.run_dir), "--checkpoint", str(job.checkpoint),
                          *job.runner_args])
    return f"""#!/bin/bash
# Written by distaff (evals.mode=slurm): the evaluation of {job.checkpoint.name} of run {job.run_name!r} ({job.run_dir}).
{chr(10).join(_header(job))}

# A requeued attempt runs only the evaluations not recorded yet.
echo "distaff: evaluation job $SLURM_JOB_ID attempt restart_count=${{SLURM_RESTART_COUNT:-0}} on $(hostname) at $(date -Is)"
export OMP_NUM_THREADS={job.slurm.cpus}
{cpu}exec {command}
"""


def submit_eval_job(job: EvalJob) -> str:
    """Write the script into the run directory, submit it, return the job id."""
    script = render_eval_job(job)
    if shutil.which("sbatch") is None:
        raise RunFailure("sbatch not found: evals.mode=slurm submits from a machine with Slurm's commands")
    job.script_path.parent.mkdir(parents=True, exist_ok=True)
    job.script_path.write_text(script)
    proc = subprocess.run(sbatch_command(job.script_path), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RunFailure(f"sbatch {job.script_path} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]


def eval_job_for(cfg: RunConfig, run_dir: Path, checkpoint: Path, runner_args: tuple[str, ...] = ()) -> EvalJob:
    """The job evaluating ``checkpoint`` for ``distaff evals run_dir`` (its run, or the parent of its branch)."""
    return EvalJob(run_dir=run_dir.resolve(), run_name=cfg.run.name, checkpoint=checkpoint.absolute(),
                   slurm=cfg.evals.slurm, workdir=Path.cwd(), runner_args=runner_args)


def preview(target: LaunchTarget) -> str | None:
    """For ``distaff slurm submit``: the evaluation job script of a run with ``evals.mode: slurm`` (checked now;
    its checkpoint a placeholder), else None."""
    if target.task != "pretrain":
        return None
    cfg = config_from_dict(read_config_values(target.config, list(target.overrides)))
    if not cfg.evals.tasks or cfg.evals.mode != "slurm":
        return None
    placeholder = target.out_dir / "evals" / "pinned" / "step-N"
    return render_eval_job(eval_job_for(cfg, target.out_dir, placeholder))


def main(argv: list[str] | None = None) -> int:
    return command_main("distaff evals (slurm job)", _main, argv)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m distaff.launch.eval_jobs", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--average", type=Path, action="append", default=[])
    parser.add_argument("--dry-run", action="store_true", help="print the script and the command, submit nothing")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="evals.* overrides for the runner")
    args = parser.parse_intermixed_args(argv)
    config = args.run_dir / "config.yaml"
    if not config.is_file():
        raise ConfigError(f"{args.run_dir}: no config.yaml here: not the run directory of a pretraining run")
    cfg = config_from_dict(read_config_values(config, args.overrides))
    extra = (*args.overrides, *(f"--average={p.absolute()}" for p in args.average))
    job = eval_job_for(cfg, args.run_dir, args.checkpoint, extra)
    if args.dry_run:
        print(f"# {job.script_path}\n{render_eval_job(job)}# submit with:\n{shlex.join(sbatch_command(job.script_path))}")
        return 0
    job_id = submit_eval_job(job)
    print(f"distaff: evals: submitted job {job_id} for {job.checkpoint.name} ({job.script_path})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
