"""Starting runs on many processes and machines: the ``distaff`` command (``cli``), the ``deepspeed``
launcher with hostfiles (``launcher``, ``hostlist``), Slurm scripts with preemption and requeue (``slurm``).

Imports: ``distaff.train.core`` and the two config loaders (``distaff.train.run.config``,
``distaff.train.finetune.config``); a trainer is started as a process, never imported. Imported by: nothing
(``cli`` is the installed ``distaff`` script).
"""
