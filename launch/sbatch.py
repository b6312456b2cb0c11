"""Handing a written job script to ``sbatch``: the one way ``distaff slurm submit`` and the evaluation jobs
(``evals.mode: slurm``) queue work."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from distaff.train.core.errors import RunFailure


def sbatch_command(script: Path) -> list[str]:
    """The command that queues ``script`` and prints only its job id (``--parsable``)."""
    return ["sbatch", "--parsable", str(script)]


def require_sbatch(where_sbatch_is: str) -> None:
    """A RunFailure unless sbatch is installed here; ``where_sbatch_is`` is the advice."""
    if shutil.which("sbatch") is None:
        raise RunFailure(f"sbatch not found: {where_sbatch_is}")


def submit_script(path: Path, script: str, where_sbatch_is: str) -> str:
    """Write ``script`` to ``path`` (its folder made first: sbatch opens the job's log there before the script
    runs), queue it, return the job id; ``where_sbatch_is`` is the advice when sbatch is not installed here."""
    require_sbatch(where_sbatch_is)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    proc = subprocess.run(sbatch_command(path), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RunFailure(f"sbatch {path} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]  # --parsable prints "JOBID[;CLUSTER]"
