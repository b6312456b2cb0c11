"""Learning-rate schedule: linear warmup, then linear or cosine decay to ``min_lr_ratio * lr``.

A pure function of the optimizer step, so a resumed run needs no scheduler state: the trainer
sets the rate on the optimizer before every step.
"""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, warmup_steps: int, max_steps: int, schedule: str = "linear",
          min_lr_ratio: float = 0.0) -> float:
    """The learning rate of optimizer step ``step`` (0-based) out of ``max_steps``."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "linear":
        shape = 1.0 - progress
    elif schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"schedule must be 'linear' or 'cosine', got {schedule!r}")
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * shape)
