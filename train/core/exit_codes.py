"""The trainer's exit statuses, which launchers act on (Slurm requeues on :data:`EXIT_PREEMPTED`).

Imports nothing, so launchers read them without importing torch.
"""

EXIT_FAILURE = 1
EXIT_BAD_CONFIG = 2
EXIT_PREEMPTED = 75     # EX_TEMPFAIL: checkpointed on a signal; run again to resume
