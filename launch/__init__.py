"""Starting runs on many processes and machines: the ``distaff`` command (``cli``), the ``deepspeed``
launcher with hostfiles (``launcher``, ``hostlist``), Slurm scripts with preemption, stall and node-loss requeue (``slurm``) and a site's set-up lines,
containers and GPU requests (``slurm_site``), decay
branches of a run launched as it was (``decay``).

Imports: ``distaff.train.core``, the two config loaders (``distaff.train.run.config``,
``distaff.train.finetune.config``), and for decay branches a checkpoint's file layout and the schedule
(``distaff.train.run.checkpoint_files``, ``distaff.train.run.schedule``); a trainer is started as a process, never
imported. Imported by: nothing (``cli`` is the installed ``distaff`` script).
"""
