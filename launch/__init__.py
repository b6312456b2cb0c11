"""Starting runs on many processes and machines: the ``distaff`` command (``cli``), the ``deepspeed``
launcher with hostfiles (``launcher``, ``hostlist``), Slurm scripts with preemption, stall and node-loss requeue
(``slurm``), a site's set-up lines, containers and GPU requests (``slurm_site``), evaluation jobs of checkpoints
(``eval_jobs``), queueing a written script (``sbatch``), decay branches of a run launched as it was (``decay``).

Imports: ``distaff.train.core``, the two config loaders (``distaff.train.run.config``,
``distaff.train.finetune.config``), for decay branches a checkpoint's file layout and the schedule
(``distaff.train.run.checkpoint_files``, ``distaff.train.run.schedule``), and ``distaff.train.data.manifest``'s
test of a remote data dir; a trainer is started as a process, never imported. No two of its modules import each
other (tests/test_layering.py). Imported by: nothing (``cli`` is the installed ``distaff`` script).
"""
