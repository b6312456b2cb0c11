"""``distaff slurm submit``: write an sbatch script for N nodes x G ranks and submit it.

The job survives preemption and time limits by itself:

- ``#SBATCH --signal=USR1@<lead>`` makes Slurm send SIGUSR1 to every process of the job step
  ``<lead>`` seconds before the time limit (``scancel --signal=USR1 JOBID`` does the same at once;
  a signal that reaches the batch shell, e.g. ``--signal=B:USR1@...``, is forwarded to the step).
  Each rank finishes its step, saves a checkpoint and exits 75 (``EXIT_PREEMPTED``).
- One task per node (``srun --ntasks-per-node=1``) runs torchrun with a c10d rendezvous on the
  first node, through :mod:`distaff.launch.node_ranks`: the node exits with the status of its rank that failed
  first (torchrun alone turns any failed rank into exit 1, with a traceback).
- A node whose ranks exited 75 leaves a mark in the log folder and exits 0 once every node has left one:
  ``srun --kill-on-bad-exit`` (below) would otherwise end the step on the nodes still exiting, turning a
  checkpoint into a failure (a node slower to tear down lost its 75 to srun's kill). Past ``PREEMPTED_GRACE_S``
  it exits 75, and srun ends a node whose ranks froze after the checkpoint. The batch script reads any mark
  back as the attempt's 75: the checkpoint ends with a barrier, so one node's 75 means every rank saved it.
- On 75 after SIGUSR1 the batch script requeues the job (``--requeue``, logs opened with
  ``--open-mode=append``); the next attempt keeps the job id, hence the rendezvous port, the log
  files and the W&B run id, and resumes from the latest checkpoint (``checkpoint.resume=auto``).
- SIGTERM (a preemption, ``scontrol requeue``, ``scancel``, the time limit): the ranks checkpoint and exit 75 within
  Slurm's KillWait; the batch shell traps it and writes down which it was (Slurm requeues the job itself, or it
  was cancelled). A preemption or a requeue is never a failure.
- A stall (a rank's watchdog: no step progress for ``distributed.watchdog_s``, its stacks dumped) exits 76;
  ``srun --kill-on-bad-exit=1`` then ends the step on every node, so a rank frozen on another node cannot hold
  the job, and the batch script requeues it. A node that dies ends the job as NODE_FAIL, which ``--requeue``
  also requeues (docs/launch.md). Stalls and lost nodes count against ``--max-requeues`` (in
  ``<run>/slurm/attempts-<jobid>.txt``, once per attempt); past it the job stops with a message naming the
  stack dumps.
- On 75, 76 and 2 the logs carry distaff's lines: srun's lines that restate the status are left out of the
  batch log unless ``--verbose`` (the script then exports ``DISTAFF_VERBOSE=1``).
- What a site needs before the launch (``--setup`` lines, a container, ``--gres``): :mod:`distaff.launch.slurm_site`,
  which also refuses a container that would not see the job's paths.
- Before anything is queued the run's own ``--check`` runs on it (launch/run_config.py; ``--no-check`` skips it),
  so a config the trainer refuses costs no queue trip.
- Rank 0's lines land in the log of the node the rendezvous gives it: rank 0 links ``<job>-<id>-rank0.out`` to
  that log (``DISTAFF_RANK0_LOG``), and the batch log names the link.

It also requests what it starts: ``--cpus-per-task`` (the ranks and their DataLoader workers, one
CPU each) and memory per CPU, both passed on to the ``srun`` step as well (since Slurm 22.05 a step
does not inherit the job's ``--cpus-per-task``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from distaff.launch.eval_jobs import preview
from distaff.launch.run_config import (LaunchTarget, add_ranks_flag, add_task_argument, check_target, record_launch,
                                       resolve_launch_target)
from distaff.launch.script_values import (NODE_SCRIPT_END, plain_text, sbatch_extra, sbatch_option,
                                          slurm_memory, slurm_path_pattern, slurm_time)
from distaff.launch.sbatch import require_sbatch, sbatch_command, submit_script
from distaff.launch.slurm_site import (SiteOptions, add_site_arguments, check_container_paths, node_python,
                                      site_options)
from distaff.train.core import presets
from distaff.train.core.errors import (MAX_COUNT, MAX_NODES, ConfigError, command_main, document_ranges,
                                       int_arg)
from distaff.train.core.distributed import NODE_LOG_VARIABLE, RANK0_LOG_VARIABLE
from distaff.train.core.exit_codes import EXIT_BAD_CONFIG, EXIT_FAILURE, EXIT_PREEMPTED, EXIT_STALLED
from distaff.train.core.threads import check_ranks_per_node, rank_bound
from distaff.train.core.verbosity import VERBOSE_ENV, verbose

DEFAULT_SIGNAL_LEAD_S = 300
PREEMPTED_GRACE_S = 60       # a node whose ranks exited 75 waits this long for every node's mark, then ends the step
DEFAULT_MAX_REQUEUES = 3     # stalled or lost attempts a job comes back from; then it stops for a person to look
MAX_REQUEUES = 1000          # the batch script counts attempts in shell arithmetic: a bound far inside it
MAX_SIGNAL_LEAD_S = 65535    # the most seconds sbatch --signal takes
DEFAULT_MEM_PER_CPU = "4G"   # the rank and each DataLoader worker get one CPU, hence this much memory each
_NO_KILL = ("--no-kill", "-k")
NO_SBATCH = "run this on a Slurm login node (or use --dry-run)"


@dataclass(frozen=True)
class SlurmJobSpec:
    target: LaunchTarget
    nodes: int
    ranks_per_node: int
    cpu: bool = False                    # CPU ranks: no GPU request, DS_ACCELERATOR=cpu
    cpus_per_task: int | None = None     # per node; None: ranks_per_node x (1 + data workers)
    mem: str | None = None               # per node, Slurm syntax ("64G"; "0": all of it)
    mem_per_cpu: str | None = None       # default DEFAULT_MEM_PER_CPU, unless mem is given or exclusive
    exclusive: bool = False              # whole nodes (and all their memory unless a memory option is given)
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    job_name: str | None = None          # default: run.name
    signal_lead_s: int = DEFAULT_SIGNAL_LEAD_S
    sbatch_lines: tuple[str, ...] = ()   # extra "#SBATCH" options, e.g. "--qos=high"
    workdir: Path = field(default_factory=Path.cwd)  # job cwd: relative config paths resolve as here
    python: str = sys.executable
    max_ranks_per_node: int | None = None  # --max-ranks-per-node (ranks_per_node.py)
    max_requeues: int = DEFAULT_MAX_REQUEUES  # requeues after a stall or a lost node (signals: unbounded)
    site: SiteOptions = SiteOptions()      # set-up lines, a container, --gres

    @property
    def cpus(self) -> int:
        """CPUs per node: one for every rank and for each of its DataLoader workers, unless given."""
        return self.cpus_per_task or self.ranks_per_node * (1 + self.target.data_workers)

    def memory_option(self) -> str:
        """The sbatch memory request: what was given, else all of exclusive nodes, else per CPU."""
        if self.mem is not None:
            return f"--mem={self.mem}"
        if self.mem_per_cpu is None and self.exclusive:
            return "--mem=0"
        return f"--mem-per-cpu={self.mem_per_cpu or DEFAULT_MEM_PER_CPU}"

    @property
    def log_dir(self) -> Path:
        return self.target.out_dir / "slurm"

    @property
    def script_path(self) -> Path:
        return self.log_dir / f"{self.target.task}.sbatch"

    @property
    def node_log(self) -> str:
        return f"{slurm_path_pattern(str(self.log_dir))}/%x-%j-node%n.out"


def _validate(spec: SlurmJobSpec) -> None:
    if spec.nodes < 1:
        raise ConfigError(f"--nodes must be >= 1, got {spec.nodes}")
    if spec.ranks_per_node < 1:
        raise ConfigError(f"--gpus-per-node must be >= 1, got {spec.ranks_per_node}")
    check_ranks_per_node(spec.ranks_per_node, f"--gpus-per-node {spec.ranks_per_node}",
                         rank_bound(spec.max_ranks_per_node, here=False))
    if spec.cpu and spec.cpus_per_task is not None and spec.ranks_per_node > spec.cpus_per_task:
        raise ConfigError(f"--gpus-per-node {spec.ranks_per_node} with --cpu: more ranks than the node's "
                          f"--cpus-per-task {spec.cpus_per_task}; a CPU rank needs a core of its own: give at most "
                          f"{spec.cpus_per_task} ranks, or more CPUs")
    if spec.signal_lead_s < 1:
        raise ConfigError(f"--signal-lead must be >= 1 second, got {spec.signal_lead_s}")
    if not 0 <= spec.max_requeues <= MAX_REQUEUES:
        raise ConfigError(f"--max-requeues must be >= 0 and <= {MAX_REQUEUES:,}, got {spec.max_requeues}")
    spec.site.validate(spec.ranks_per_node, spec.cpu)
    if spec.cpus_per_task is not None and spec.cpus_per_task < 1:
        raise ConfigError(f"--cpus-per-task must be >= 1, got {spec.cpus_per_task}")
    if spec.mem is not None and spec.mem_per_cpu is not None:
        raise ConfigError("--mem and --mem-per-cpu exclude each other: give one")
    for name, size in (("--mem", spec.mem), ("--mem-per-cpu", spec.mem_per_cpu)):
        if size is not None:
            slurm_memory(name, size)
    for line in spec.sbatch_lines:
        if sbatch_extra(line).split("=")[0] in _NO_KILL:
            raise ConfigError(f"--sbatch {line!r}: with it a node failure leaves the job running without that "
                             "node's ranks, and it fails instead of being requeued; leave it out")
    if spec.time is not None:
        slurm_time(spec.time)
    _validate_text(spec)


def _validate_text(spec: SlurmJobSpec) -> None:
    """Every other value the script holds: no control characters (a newline would end a ``#SBATCH`` line or
    the per-node heredoc and run the rest as a command); the header and the body quote the rest."""
    values = [*spec.target.text_values(), ("the submit directory", str(spec.workdir)),
              ("the python path", spec.python), ("--partition", spec.partition), ("--account", spec.account),
              ("--job-name", spec.job_name)]
    for what, value in values:
        if value is not None:
            plain_text(what, value)


def _sbatch_header(spec: SlurmJobSpec) -> list[str]:
    options = [
        sbatch_option("job-name", spec.job_name or spec.target.name, what="--job-name" if spec.job_name else "run.name"),
        sbatch_option("nodes", spec.nodes),
        sbatch_option("ntasks-per-node", 1),
        sbatch_option("cpus-per-task", spec.cpus),
        spec.memory_option(),
        sbatch_option("output", f"{slurm_path_pattern(str(spec.log_dir))}/%x-%j.out", what="run.out_dir"),
        sbatch_option("open-mode", "append"),
        sbatch_option("requeue"),
        sbatch_option("signal", f"USR1@{spec.signal_lead_s}"),
        sbatch_option("chdir", str(spec.workdir), what="the submit directory"),
    ]
    if not spec.cpu or spec.site.gres:
        options.append(spec.site.gpu_option(spec.ranks_per_node))  # a step gets the job's GPUs by default
    if spec.exclusive:
        options.append(sbatch_option("exclusive"))
    options += [sbatch_option(name, value) for name, value in
                (("partition", spec.partition), ("account", spec.account), ("time", spec.time)) if value]
    options += [sbatch_extra(line) for line in spec.sbatch_lines]
    return [f"#SBATCH {option}" for option in options]


def _torchrun_command(spec: SlurmJobSpec) -> str:
    """This node's ranks (shell text): torchrun, through :mod:`distaff.launch.node_ranks` (the ranks' own exit
    status, without torchrun's traceback), joins the c10d rendezvous on the job's first node. It handles no SIGTERM
    (``--signals-to-handle``; the node script makes it ignore it): it would give the ranks 30 s to checkpoint, then
    kill them; Slurm gives them KillWait (or a preemption's GraceTime)."""
    fixed = shlex.join([spec.python, "-m", "distaff.launch.node_ranks", f"--nproc-per-node={spec.ranks_per_node}",
                        "--max-restarts=0", "--rdzv-backend=c10d", "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT"])
    per_job = ('--nnodes="$SLURM_JOB_NUM_NODES" --rdzv-id="$SLURM_JOB_ID" '
               '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-conf="is_host=$is_host"')
    trainer = shlex.join(["--module", spec.target.module, *spec.target.trainer_args()])
    return f'{fixed} {per_job} {trainer} "${{resume[@]}}"'


def render_sbatch_script(spec: SlurmJobSpec) -> str:
    """The complete sbatch script for ``spec``."""
    _validate(spec)
    header = "\n".join(_sbatch_header(spec))
    cpu_env = "export DS_ACCELERATOR=cpu\n" if spec.cpu else ""
    if verbose():   # written down: a site's SBATCH_EXPORT=NONE would not pass it on
        cpu_env += f"export {VERBOSE_ENV}=1   # submitted with --verbose: torchrun's and srun's own lines too\n"
    where = (f"inside the container {spec.site.container}" if spec.site.container else
             "its venv must be on a filesystem all nodes mount at that same path")
    return f"""#!/bin/bash
# Written by `distaff slurm submit` for run {spec.target.name!r} ({spec.target.out_dir}).
# Every node runs {spec.python}: {where}.
{header}

# A requeued attempt keeps its job id: same logs, rendezvous port and W&B run.
echo "distaff: job $SLURM_JOB_ID attempt restart_count=${{SLURM_RESTART_COUNT:-0}} on $SLURM_JOB_NODELIST at $(date -Is)"
export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"
export MASTER_PORT=$((10000 + SLURM_JOB_ID % 20000))
export WANDB_RUN_ID="${{WANDB_RUN_ID:-${{SLURM_CLUSTER_NAME:-slurm}}-$SLURM_JOB_ID}}"
{_rank0_log(spec)}{cpu_env}{_attempts_start(spec)}
# Runs once per node (srun --ntasks-per-node=1).
read -r -d '' node_script <<'{NODE_SCRIPT_END}'
{_node_script(spec)}{NODE_SCRIPT_END}

# A signal sent to the batch shell only (scancel --batch, --signal=B:...) goes on to the ranks. SIGTERM (a
# preemption, scontrol requeue, scancel, the time limit) reaches the ranks from Slurm too: the shell writes down
# at once which it was (Slurm kills it after KillWait) and waits for their checkpoint.
trap 'scancel --signal=USR1 "$SLURM_JOB_ID"' USR1
trap on_term TERM
# One task per node of this attempt's allocation (SLURM_NTASKS keeps the submitted count, which a job
# shrunk after a lost node no longer has). Slurm >= 22.05: a step does not inherit the job's
# --cpus-per-task; it is asked for again. --kill-on-bad-exit: a node whose ranks fail (a stall, a dead rank, a
# config error) ends the step on every node (SIGTERM, then SIGKILL after KillWait), so that a rank frozen on
# another node cannot hold the job. srun's own lines go to a file, shown after it.
srun_lines=$(mktemp)
{_waited(_srun_command(spec), "trap : USR1 TERM")}# A node whose ranks checkpointed on a signal left a mark (the node script): every rank saved that checkpoint (it
# ends with a barrier), so the attempt's status is {EXIT_PREEMPTED}, whatever srun says of a node it ended after that.
if [ "$status" -ne {EXIT_STALLED} ] && compgen -G "$preempted_marks.node*" > /dev/null; then status={EXIT_PREEMPTED}; fi
rm -f "$preempted_marks".node*
show_srun_lines "$srun_lines" "$status"
echo "distaff: job $SLURM_JOB_ID ranks exited with $status at $(date -Is)"
{_attempts_end(spec)}rm -f "$attempt_start"
exit "$status"
"""


def _rank0_log(spec: SlurmJobSpec) -> str:
    """Batch-script text: the name rank 0 links to the log of the node it runs on (train/run/runtime.py's
    ``link_rank0_log``: the rendezvous chooses that node), said at each attempt."""
    logs = shlex.quote(str(spec.log_dir))
    return f"""# Rank 0's lines (its steps, its one-line errors) are in the log of the node the rendezvous gives it.
export {RANK0_LOG_VARIABLE}={logs}/"$SLURM_JOB_NAME-$SLURM_JOB_ID-rank0.out"
export {NODE_LOG_VARIABLE}={logs}/"$SLURM_JOB_NAME-$SLURM_JOB_ID-node%n.out"
echo "distaff: rank 0's lines: ${RANK0_LOG_VARIABLE} (a link to the node log that holds them, once rank 0 starts)"
"""


def _node_script(spec: SlurmJobSpec) -> str:
    """The per-node script (run by ``bash -c`` on every node): set-up lines (after the signal traps: a signal
    during a slow set-up does not kill the node's script), then torchrun for the node's ranks."""
    prefix = spec.site.command_prefix(spec.cpu)
    # what the ranks inherit (nproc would answer OMP_NUM_THREADS instead)
    affinity = prefix + shlex.join([spec.python, "-c", "import os; print(len(os.sched_getaffinity(0)))"])
    return f"""# The ranks act on USR1 and TERM (a checkpoint, exit {EXIT_PREEMPTED}); this script outlives both to report their status.
trap : USR1 TERM
{spec.site.setup_block()}is_host=$([ "$SLURM_NODEID" = 0 ] && echo true || echo false)
echo "distaff: node $SLURM_NODEID ($SLURMD_NODENAME): $({affinity}) CPUs for its ranks"
resume=()
[ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ] && resume=(checkpoint.resume=auto)
# torchrun ignores USR1 (it would die of it) and TERM (it would kill the ranks 30 s later); the ranks install
# their own handlers. It exits with the status of the rank that failed first.
{_waited(prefix + _torchrun_command(spec), "trap '' USR1 TERM")}echo "distaff: node $SLURM_NODEID ranks exited with $status"
# A checkpoint on a signal is not a failure: say {EXIT_PREEMPTED} with a mark the batch script reads back, and exit 0
# once every node has left one, so that srun --kill-on-bad-exit does not end the step on a node still exiting.
# Past {PREEMPTED_GRACE_S} s exit {EXIT_PREEMPTED}: srun then ends a node whose ranks froze after the checkpoint.
marks={_preempted_marks(spec)}
if [ "$status" -eq {EXIT_PREEMPTED} ] && touch "$marks.node$SLURM_NODEID"; then
    for _ in $(seq {PREEMPTED_GRACE_S * 10}); do
        [ "$(compgen -G "$marks.node*" | wc -l)" -ge "$SLURM_JOB_NUM_NODES" ] && exit 0
        sleep 0.1
    done
fi
exit "$status"
"""


def _preempted_marks(spec: SlurmJobSpec) -> str:
    """Shell text: the stem of this attempt's marks, one a node whose ranks exited 75 (in the log folder, which
    every node sees: the nodes' logs are written there)."""
    return f'{shlex.quote(str(spec.log_dir))}/.preempted-"$SLURM_JOB_ID"-"${{SLURM_RESTART_COUNT:-0}}"'


def _srun_command(spec: SlurmJobSpec) -> str:
    """Shell text: the step, one task a node running the node script, its own lines to ``$srun_lines``."""
    return f"""srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 \\
    --cpus-per-task={spec.cpus} --kill-on-bad-exit=1 --open-mode=append --output={shlex.quote(spec.node_log)} \\
    {spec.site.srun_options(spec.workdir)}bash -c "$node_script" 2>"$srun_lines\""""


def _waited(command: str, traps: str) -> str:
    """Shell text: ``command`` run in the background by a subshell that first sets ``traps``, waited for through
    the script's own traps (how the script outlives the signals it acts on); then ``$status`` is its exit status.
    The subshell writes that status down: bash's ``wait`` returns 128 + N, not the status, when a trapped signal N
    arrives as the command ends (a node's ranks exited 75 as srun ended the step, and the node reported -1)."""
    return f"""status_file=$(mktemp)
(
{traps}
{command}
echo "$?" > "$status_file"
) &
pid=$!
while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done
wait "$pid"; status=$?
[ -s "$status_file" ] && status=$(cat "$status_file")    # else the subshell was killed: wait's status
rm -f "$status_file"
"""


# srun's lines that restate a status the ranks explained themselves (75, 76, 2), or its own ending of the step.
_SRUN_RESTATED = ("^srun: (error: .*: tasks? [0-9,-]+: (Exited with exit code [0-9]+|Killed|Terminated)$|"
                  "launch/slurm: _step_signal: Terminating StepId=|Job step aborted: Waiting up to|got SIGCONT$|"
                  "forcing job termination$)")

# Shell functions of the batch script (after ``attempts``, ``batch_log``, ``out_dir`` and ``attempt`` are set).
_ATTEMPT_FUNCTIONS = f"""dumps() {{ local found; found=$(ls -1 "$out_dir"/stacks-rank*.txt 2>/dev/null | paste -sd ' ')
    echo "${{found:-none}}"; }}
new_dumps() {{ find "$out_dir" -maxdepth 1 -name 'stacks-rank*.txt' -newer "$attempt_start" 2>/dev/null; }}
# An attempt counts once, however often it is written down as failed (lost with a node, and stalled).
failed_attempts() {{ grep -oE '^attempt [0-9]+ (stalled|lost)' "$attempts" 2>/dev/null | cut -d' ' -f2 | sort -u \\
    | wc -l; }}
latest_step() {{ local tag; tag=$(cat "$out_dir/checkpoints/latest" 2>/dev/null)
    if [ -n "$tag" ]; then echo "step $((10#${{tag#step-}}))"; else echo "no checkpoint"; fi; }}
down_nodes() {{ sinfo -h -N -n "$SLURM_JOB_NODELIST" -o '%N %T' 2>/dev/null \\
    | awk '$2 ~ /down|fail|\\*/ {{print $1}}' | sort -u | paste -sd ,; }}
# SIGTERM: Slurm ends the attempt. It has counted a restart already if it requeues the job: a preemption (its
# batch step's line in the log, written as it signals, says "DUE TO PREEMPTION"), a lost node (down now) or
# scontrol requeue; if not, it was scancel or the time limit.
on_term() {{
    [ -n "$stopped_by" ] && return
    local restarts lost
    restarts=$(scontrol -o show job "$SLURM_JOB_ID" 2>/dev/null | grep -oE 'Restarts=[0-9]+')
    restarts=${{restarts#Restarts=}}
    lost=$(down_nodes)
    if [ "${{restarts:-0}}" -le "$attempt" ]; then stopped_by=cancelled
        echo "attempt $attempt got SIGTERM: cancelled (scancel, or the time limit), not requeued" >> "$attempts"
    elif [ -n "$lost" ]; then stopped_by=lost
        echo "attempt $attempt lost: node $lost failed; Slurm requeues the job" >> "$attempts"
    elif tail -n 5 "$batch_log" 2>/dev/null | grep -q 'DUE TO PREEMPTION'; then stopped_by=preempted
        echo "attempt $attempt got SIGTERM: preempted" >> "$attempts"
    else stopped_by=requeued
        echo "attempt $attempt got SIGTERM: requeued from outside (scontrol requeue)" >> "$attempts"
    fi
}}
# srun's lines restate the status the ranks explained in one line ("task 0: Exited with exit code 75"): shown
# for any other status, and always with --verbose.
show_srun_lines() {{
    if [ "${{DISTAFF_VERBOSE:-0}}" != 0 ] || ! [[ " 0 {EXIT_PREEMPTED} {EXIT_STALLED} {EXIT_BAD_CONFIG} " == *" $2 "* ]]
    then cat "$1" >&2
    else grep -vE '{_SRUN_RESTATED}' "$1" >&2
    fi
    rm -f "$1"
}}"""

# A preempted, requeued or cancelled attempt (``$stopped_by``) as its line says it: "<what> at step S,
# checkpointed<after>".
_STOPPED_WORDS = {"preempted": ("preempted", ", requeued"), "requeued": ("requeued from outside (scontrol requeue)", ""),
                  "cancelled": ("cancelled (scancel, or the time limit)", "; not requeued")}


def _attempts_start(spec: SlurmJobSpec) -> str:
    """Batch-script text: count the attempts that failed on their own (a stall, a lost node) and stop once there
    were more than ``--max-requeues``; mark this attempt started; the functions the rest of the script calls."""
    return f"""# Attempts that failed on their own (stalled, or lost with a node) count against --max-requeues; a checkpoint
# on a signal ({EXIT_PREEMPTED}), a preemption, a requeue from outside and a cancel do not.
attempts={shlex.quote(str(spec.log_dir))}/attempts-"$SLURM_JOB_ID".txt
batch_log={shlex.quote(str(spec.log_dir))}/"$SLURM_JOB_NAME-$SLURM_JOB_ID".out
out_dir={shlex.quote(str(spec.target.out_dir))}
attempt=${{SLURM_RESTART_COUNT:-0}}
preempted_marks={_preempted_marks(spec)}
max_requeues={spec.max_requeues}
{_ATTEMPT_FUNCTIONS}
last=$(tail -n 1 "$attempts" 2>/dev/null)
if [ "${{last% started}}" != "$last" ]; then   # it started and said nothing more: its batch script was killed
    echo "${{last% started}} lost (it ended without a word: its first node failed, or Slurm killed its script)" \\
        >> "$attempts"
fi
failed=$(failed_attempts)
if [ "$failed" -gt "$max_requeues" ]; then
    echo "distaff: job $SLURM_JOB_ID: $failed attempts stalled or were lost, more than --max-requeues" \\
         "$max_requeues: not running again; stack dumps: $(dumps); attempts: $attempts"
    exit {EXIT_FAILURE}
fi
echo "attempt $attempt started" >> "$attempts"
attempt_start=$(mktemp)      # the ranks' stack dumps newer than this are this attempt's
stopped_by=""                # on SIGTERM: preempted, requeued, lost or cancelled
"""


def _attempts_end(spec: SlurmJobSpec) -> str:
    """Batch-script text after the step: a stall (76, or a failure with this attempt's stack dumps: the node whose
    rank stalled ended the step) requeues up to ``--max-requeues`` times; a preemption, a requeue from outside, a
    lost node and a cancel are Slurm's to act on, written down with the step of the checkpoint; a checkpoint on
    SIGUSR1 (the time limit is near) requeues."""
    stopped = "\n".join(f'    {name}) what="{what}"; after="{after}" ;;' for name, (what, after) in _STOPPED_WORDS.items())
    return f"""if [ "$status" -eq {EXIT_STALLED} ] || {{ [ "$status" -ne 0 ] && [ -n "$(new_dumps)" ]; }}; then
    status={EXIT_STALLED}
    echo "attempt $attempt stalled" >> "$attempts"
    failed=$(failed_attempts)
    if [ -n "$stopped_by" ]; then
        echo "distaff: stalled (stack dumps: $(dumps)) as Slurm ended job $SLURM_JOB_ID ($stopped_by)"
    elif [ "$failed" -le "$max_requeues" ]; then
        echo "distaff: stalled (stack dumps: $(dumps)): requeueing job $SLURM_JOB_ID to resume from its latest" \\
             "checkpoint ($failed of --max-requeues $max_requeues)"
        scontrol requeue "$SLURM_JOB_ID"
    else
        echo "distaff: stalled: not requeueing job $SLURM_JOB_ID: $failed attempts stalled or were lost, more than" \\
             "--max-requeues $max_requeues; stack dumps: $(dumps); attempts: $attempts"
    fi
elif [ "$stopped_by" = lost ]; then
    echo "distaff: job $SLURM_JOB_ID lost a node: Slurm requeues it ($(failed_attempts) of --max-requeues" \\
         "$max_requeues)"
elif [ -n "$stopped_by" ]; then
    case "$stopped_by" in
{stopped}
    esac
    if [ "$status" -eq {EXIT_PREEMPTED} ]; then what="$what at $(latest_step), checkpointed"
    else what="$what; not checkpointed (ranks exited with $status; resumes from $(latest_step))"; fi
    what="$what$after"
    echo "attempt $attempt $what" >> "$attempts"
    echo "distaff: job $SLURM_JOB_ID $what"
elif [ "$status" -eq {EXIT_PREEMPTED} ]; then
    what="checkpointed at $(latest_step) on SIGUSR1 (the time limit is near, or scancel --signal=USR1), requeued"
    echo "attempt $attempt $what" >> "$attempts"
    echo "distaff: $what: requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
else
    echo "attempt $attempt ended with $status" >> "$attempts"
fi
"""


NODE_LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/local", "/localscratch", "/scratch/local")
NODE_LOCAL_FILESYSTEMS = ("tmpfs", "ramfs")


def _mount_type(path: Path) -> str:
    """The filesystem type of the mount that holds ``path`` (from /proc/self/mounts; "" where unknown)."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return ""
    best, kind = "", ""
    for line in mounts:
        fields = line.split()
        if len(fields) > 2:
            point = fields[1].replace("\\040", " ")
            if (str(path) == point or str(path).startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind


def node_local_reason(python: str, env: dict[str, str]) -> str | None:
    """Why the venv of ``python`` looks local to this node (a temporary folder, a RAM filesystem), or None."""
    path = Path(python).absolute()
    local = [d for d in (*NODE_LOCAL_DIRS, env.get("TMPDIR", "")) if d and d != "/"]
    under = next((d for d in local if path == Path(d) or Path(d) in path.parents), None)
    if under is not None:
        return f"it is under {under}"
    kind = _mount_type(path)
    return f"it is on a {kind} filesystem" if kind in NODE_LOCAL_FILESYSTEMS else None


def warn_if_node_local(python: str, env: dict[str, str]) -> None:
    reason = node_local_reason(python, env)
    if reason:
        print(f"distaff slurm: warning: every node runs {python}, but {reason}, usually local to this node; the "
              "job fails on nodes that do not have it: make the venv on a filesystem all nodes share (the home or "
              "project folder)", file=sys.stderr)


def submit(spec: SlurmJobSpec) -> str:
    """Write the script into the run directory (sbatch opens the log there before the script runs), submit it,
    return the job id."""
    return submit_script(spec.script_path, render_sbatch_script(spec), NO_SBATCH)


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """``distaff slurm`` and its ``submit`` subcommand (parsed on its own: options may follow the overrides)."""
    parser = argparse.ArgumentParser(prog="distaff slurm", description="Run pretraining or fine-tuning as a Slurm job.")
    commands = parser.add_subparsers(dest="command", required=True)
    sub = commands.add_parser(
        "submit", help="write the sbatch script into the run dir and submit it",
        epilog="Remaining key=value arguments are config overrides. Extra sbatch options need '=': "
               "--sbatch=--qos=high.")
    sub.add_argument("--config", required=True, help=f"run config: {presets.CONFIG_HELP}")
    add_task_argument(sub)
    sub.add_argument("--nodes", type=int_arg("--nodes", low=1, high=MAX_NODES), required=True)
    sub.add_argument("--gpus-per-node", type=int_arg("--gpus-per-node", low=1, high=MAX_COUNT),
                     required=True, help="ranks per node (one per GPU)")
    add_ranks_flag(sub)
    sub.add_argument("--cpu", action="store_true", help="CPU ranks: request no GPUs, set DS_ACCELERATOR=cpu")
    sub.add_argument("--cpus-per-task", type=int_arg("--cpus-per-task", low=1, high=MAX_COUNT),
                     help="CPUs per node (default: ranks per node x (1 + data.num_workers))")
    memory = sub.add_mutually_exclusive_group()
    memory.add_argument("--mem", help="memory per node, e.g. 256G (0: all of it)")
    memory.add_argument("--mem-per-cpu", help=f"memory per CPU (default {DEFAULT_MEM_PER_CPU}; with --exclusive: "
                                              "--mem=0)")
    sub.add_argument("--exclusive", action="store_true", help="whole nodes: share them with no other job")
    sub.add_argument("--partition")
    sub.add_argument("--account")
    sub.add_argument("--time", help="time limit, e.g. 1-00:00:00")
    sub.add_argument("--job-name", help="default: run.name")
    sub.add_argument("--signal-lead", type=int_arg("--signal-lead", low=1, high=MAX_SIGNAL_LEAD_S),
                     default=DEFAULT_SIGNAL_LEAD_S,
                     help="seconds before the time limit at which the ranks checkpoint and requeue")
    sub.add_argument("--sbatch", action="append", default=[], metavar="OPTION", help="extra #SBATCH option")
    sub.add_argument("--max-requeues", type=int_arg("--max-requeues", high=MAX_REQUEUES), default=DEFAULT_MAX_REQUEUES,
                     metavar="N",
                     help="requeue after a stall or a lost node up to N times, then stop (default "
                          f"{DEFAULT_MAX_REQUEUES}; a checkpoint on a signal always requeues)")
    add_site_arguments(sub)
    sub.add_argument("--gpu-kind", help="GPU kind for the plan's line (distaff plan --list-gpus; default A100-80GB)")
    sub.add_argument("--dry-run", action="store_true", help="print the script and the command, submit nothing")
    sub.add_argument("--no-check", action="store_true",
                     help="submit without first running the run's own --check on it (the dry run never runs it)")
    sub.add_argument("overrides", nargs="*", help="config overrides dotted.key=value")
    return document_ranges(parser), sub


def main(argv: list[str] | None = None) -> int:
    return command_main("distaff slurm", _main, argv)


def _main(argv: list[str]) -> int:
    parser, submit_parser = _parser()
    if not argv or argv[0] != "submit":
        parser.parse_args(argv)            # help, or the usage error naming the subcommands
    return submit_job(submit_parser.parse_intermixed_args(argv[1:]))


def _job_paths(spec: SlurmJobSpec) -> list[tuple[str, Path]]:
    """(what, absolute path) of what the job's ranks read or write on a filesystem: the config, the run directory
    and its local inputs (relative ones resolve in the submit folder, as the job's do)."""
    target = spec.target
    return [("--config", target.config), ("run.out_dir", target.out_dir),
            *((key, Path(os.path.normpath(spec.workdir / path))) for key, path in target.inputs)]


def submit_job(args: argparse.Namespace) -> int:
    """``distaff slurm submit`` with parsed options (``distaff decay`` passes a parent run's, recorded)."""
    target = resolve_launch_target(args.config, args.overrides, args.task)
    site = site_options(args)
    spec = SlurmJobSpec(
        target=target, nodes=args.nodes, ranks_per_node=args.gpus_per_node, cpu=args.cpu,
        cpus_per_task=args.cpus_per_task, mem=args.mem, mem_per_cpu=args.mem_per_cpu, exclusive=args.exclusive,
        partition=args.partition, account=args.account, time=args.time, job_name=args.job_name,
        signal_lead_s=args.signal_lead, sbatch_lines=tuple(args.sbatch),
        python=node_python(args.python, site),
        max_ranks_per_node=args.max_ranks_per_node, max_requeues=args.max_requeues, site=site)
    script = render_sbatch_script(spec)   # a bad request is refused before anything is printed
    for line in check_container_paths(site, _job_paths(spec), spec.workdir, spec.python):
        print(f"distaff slurm: {line}", file=sys.stderr)
    eval_job = preview(target, site, spec.python)   # evals.mode=slurm's job, checked now
    if not args.dry_run:
        require_sbatch(NO_SBATCH)       # before the run's check: it takes seconds
        if not getattr(args, "no_check", False):   # (a recorded launch, distaff decay's, may lack the option)
            print(check_target(target, args.nodes * args.gpus_per_node, args.cpu), file=sys.stderr)  # its OK line
    if not site.container:
        warn_if_node_local(spec.python, dict(os.environ))
    if not args.cpu:   # the plan's line for this job (memory per GPU, fit, estimated time)
        from distaff.train.plan.planner import print_launch_summary

        print_launch_summary(target, args.gpus_per_node, args.nodes, args.gpu_kind, "distaff slurm")
    if args.dry_run:
        print(f"# {spec.script_path}\n{script}")
        print(f"# submit with:\n{shlex.join(sbatch_command(spec.script_path))}")
        if eval_job is not None:
            print(f"# each selected checkpoint's evaluation job (evals.mode=slurm; the trainer submits it):\n{eval_job}")
        return 0
    job_id = submit(spec)
    record_launch(target.out_dir, "slurm", args)
    print(job_id)
    print(f"distaff slurm: job {job_id}, logs in {spec.log_dir}", file=sys.stderr)
    return 0
