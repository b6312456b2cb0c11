"""The trainer's exit statuses, which launchers act on (the Slurm script requeues on :data:`EXIT_PREEMPTED` and
:data:`EXIT_STALLED`).

Imports nothing, so launchers read them without importing torch.
"""

EXIT_FAILURE = 1
EXIT_BAD_CONFIG = 2
EXIT_PREEMPTED = 75     # EX_TEMPFAIL: checkpointed on a signal; run again to resume
EXIT_STALLED = 76       # the watchdog saw no step progress and dumped the stacks: run again to resume from the
                        # latest checkpoint (a stall is usually a slow filesystem or a hung peer, not the run's fault)
