"""One checkpoint's evaluation as a Slurm job of its own (``evals.mode: slurm``): ``python -m distaff.launch.eval_jobs
RUN_DIR --checkpoint CKPT [--dry-run] [key=value ...]`` writes ``RUN_DIR/slurm/evals-<checkpoint>.sbatch`` and
submits it. The trainer's rank 0 starts it after each selected checkpoint; ``distaff evals RUN --slurm`` for each
checkpoint missing results.

The job asks for ``evals.slurm`` (CPUs, memory, GPUs, time, partition, account, extra ``#SBATCH`` lines), checked as
``distaff slurm submit`` checks its own, and runs ``python -m distaff.train.tools.evals RUN_DIR --checkpoint CKPT``
from the folder the run was submitted from (relative paths resolve as the run's did). It depends on its run's earlier evaluation
jobs (``--dependency=singleton`` on the job name ``<run.name>-evals``): one at a time per run, in the order the
checkpoints came, never competing with each other for the partition. It is requeue-safe: ``--requeue`` and
``--open-mode=append``, and the runner records each (evaluation, seed) as soon as it has it, so a requeued attempt
runs only what is missing (and takes over its own earlier attempt's work-folder lock). sbatch hands the
submitter's environment to the job: the trainer and ``distaff evals`` start this module without their rank
variables (train/core/distributed.py's RANK_VARIABLES).

It runs where the run's ranks ran: a run submitted by ``distaff slurm submit`` with site options (launch/slurm_site.py:
``--setup`` lines, a pyxis or Apptainer container and its mounts, ``--python``) has them in its launch record
(``RUN_DIR/launch/command.json``), and the evaluation job runs in the same folder the same set-up lines, then the
runner with the same python in the same container (pyxis: a one-task ``srun`` step, the set-up lines inside it as the training's nodes run
them). The values are checked as the training script's are. ``--gres`` is the training's GPU request, not the
evaluation's (``evals.slurm.gpus``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from distaff.launch.run_config import LaunchTarget, read_launch_record
from distaff.launch.sbatch import sbatch_command, submit_script
from distaff.launch.script_values import (NODE_SCRIPT_END, plain_text, sbatch_extra, sbatch_option, slurm_memory,
                                          slurm_path_pattern, slurm_time)
from distaff.launch.slurm_site import SiteOptions, recorded_site
from distaff.train.core.errors import ConfigError, command_main
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
    site: SiteOptions = SiteOptions()   # the training job's set-up lines and container (never its --gres)

    @property
    def job_name(self) -> str:
        return f"{self.run_name}-evals"

    @property
    def script_path(self) -> Path:
        return self.run_dir / "slurm" / f"evals-{self.checkpoint.name}.sbatch"


def _validate(job: EvalJob) -> None:
    """What ``distaff slurm submit`` checks of its own job, for ``evals.slurm`` and every text the script holds."""
    slurm = job.slurm
    if slurm.mem:
        slurm_memory("evals.slurm.mem", slurm.mem)
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
    job.site.validate(1, cpu=True)


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
    cpu = not job.slurm.gpus
    command = job.site.command_prefix(cpu) + shlex.join([job.python, "-m", RUNNER, str(job.run_dir), "--checkpoint",
                                                         str(job.checkpoint), *job.runner_args])
    where = f"inside the container {job.site.container}" if job.site.container else "as the run's ranks ran"
    return f"""#!/bin/bash
# Written by distaff (evals.mode=slurm): the evaluation of {job.checkpoint.name} of run {job.run_name!r} ({job.run_dir}).
# It runs {job.python} {where}.
{chr(10).join(_header(job))}

# A requeued attempt runs only the evaluations not recorded yet.
echo "distaff: evaluation job $SLURM_JOB_ID attempt restart_count=${{SLURM_RESTART_COUNT:-0}} on $(hostname) at $(date -Is)"
export OMP_NUM_THREADS={job.slurm.cpus}
{"export CUDA_VISIBLE_DEVICES= DS_ACCELERATOR=cpu" + chr(10) if cpu else ""}{_run_block(job, command)}"""


def _run_block(job: EvalJob, command: str) -> str:
    """The job's set-up lines, then ``command`` (shell text); in a pyxis container both run in a one-task step."""
    if not job.site.container_image:
        return f"{job.site.setup_block()}exec {command}\n"
    return f"""read -r -d '' eval_script <<'{NODE_SCRIPT_END}'
{job.site.setup_block()}exec {command}
{NODE_SCRIPT_END}
exec srun --ntasks=1 --cpus-per-task={job.slurm.cpus} {job.site.srun_options(job.workdir)}bash -c "$eval_script"
"""


def submit_eval_job(job: EvalJob) -> str:
    """Write the script into the run directory, submit it, return the job id."""
    return submit_script(job.script_path, render_eval_job(job),
                         "evals.mode=slurm submits from a machine with Slurm's commands")


class JobPlace(NamedTuple):
    """Where and how an evaluation job runs: its site options, python and working folder."""
    site: SiteOptions
    python: str
    workdir: Path


def eval_job_for(cfg: RunConfig, run_dir: Path, checkpoint: Path, runner_args: tuple[str, ...] = (),
                 place: JobPlace | None = None) -> EvalJob:
    """The job evaluating ``checkpoint`` for ``distaff evals run_dir`` (its run, or the parent of its branch), run
    as ``place`` says (default: as the run's latest launch ran, :func:`place_of_run`)."""
    place = place or place_of_run(run_dir)
    return EvalJob(run_dir=run_dir.resolve(), run_name=cfg.run.name, checkpoint=checkpoint.absolute(),
                   slurm=cfg.evals.slurm, workdir=place.workdir, python=place.python, runner_args=runner_args,
                   site=place.site)


def place_of_run(run_dir: Path) -> JobPlace:
    """As ``distaff slurm submit`` ran the run (its launch record): its site options less ``--gres``, its node
    python, the folder it was submitted from; for a run started otherwise, none, this python and this folder (the
    trainer's, where its ranks run)."""
    record = read_launch_record(run_dir)
    if record is None or record["launcher"] != "slurm":
        return JobPlace(SiteOptions(), sys.executable, Path.cwd())
    site, python = recorded_site(record)
    return JobPlace(replace(site, gres=None), python, Path(record["cwd"]))


def preview(target: LaunchTarget, site: SiteOptions, python: str) -> str | None:
    """For ``distaff slurm submit``: the evaluation job script of a run with ``evals.mode: slurm`` (checked now, with
    the training job's ``site`` and ``python``; its checkpoint a placeholder), else None."""
    if target.task != "pretrain":
        return None
    cfg = config_from_dict(read_config_values(target.config, list(target.overrides)))
    if not cfg.evals.tasks or cfg.evals.mode != "slurm":
        return None
    placeholder = target.out_dir / "evals" / "pinned" / "step-N"
    place = JobPlace(replace(site, gres=None), python, Path.cwd())
    return render_eval_job(eval_job_for(cfg, target.out_dir, placeholder, place=place))


def main(argv: list[str] | None = None) -> int:
    return command_main("distaff evals (slurm job)", _main, argv)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m distaff.launch.eval_jobs", description=__doc__.split("\n\n")[0])
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
