"""What every training run shares: the typed run config, the DeepSpeed engine, the step loop skeleton
(``runtime.RunBase``: lock, signals, watchdog, metrics), atomic checkpoints and their file lists, resuming on
another rank count, the weights inside a checkpoint, model folders, the step schedule (learning rate, phases,
batch ramp) and the metrics sinks.

Imports: ``distaff.train.core``, ``data``, ``model``, ``distaff.kernels``. Imported by: ``pretrain``,
``finetune``, ``tools``; ``distaff.launch`` reads ``run.config`` only.
"""
