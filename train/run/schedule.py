"""Learning-rate schedules: linear warmup, then linear or cosine decay to ``min_lr_ratio * lr`` over the rest
of the run, or warmup-stable-decay (``wsd``): the peak rate held until a decay of its own start, length and
shape (linear, cosine or 1-sqrt) down to ``min_lr_ratio * lr``.

A pure function of the optimizer step, so a resumed run needs no scheduler state: the trainer
sets the rate on the optimizer before every step. A decay branch (``distaff decay``) is a WSD run whose
decay starts at the step it branched from.
"""

from __future__ import annotations

import math

DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


def wsd_window(max_steps: int, decay_start: int, decay_steps: int) -> tuple[int, int]:
    """(first step, length) of a WSD decay: both given; only ``decay_steps``: the run's last steps; only
    ``decay_start``: from there to ``max_steps`` (``decay_start == max_steps``: no decay in this run)."""
    if decay_start and decay_steps:
        return decay_start, decay_steps
    if decay_steps:
        return max_steps - decay_steps, decay_steps
    return decay_start, max_steps - decay_start


def decay_factor(shape: str, progress: float) -> float:
    """1 at the decay's start (``progress`` 0), 0 at its end (1)."""
    if shape == "linear":
        return 1.0 - progress
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if shape == "1-sqrt":
        return 1.0 - math.sqrt(progress)
    raise ValueError(f"decay shape must be one of {list(DECAY_SHAPES)}, got {shape!r}")


def lr_at(step: int, *, lr: float, warmup_steps: int, max_steps: int, schedule: str = "linear",
          min_lr_ratio: float = 0.0, decay_start: int = 0, decay_steps: int = 0, decay_shape: str = "1-sqrt") -> float:
    """The learning rate of optimizer step ``step`` (0-based) out of ``max_steps``; ``decay_*`` are ``wsd``'s
    (:func:`wsd_window`)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "wsd":
        start, length = wsd_window(max_steps, decay_start, decay_steps)
        if step < start:
            return lr
        progress, shape = min(1.0, (step - start) / max(1, length)), decay_shape
    elif schedule in ("linear", "cosine"):
        progress, shape = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps)), schedule
    else:
        raise ValueError(f"schedule must be 'linear', 'cosine' or 'wsd', got {schedule!r}")
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * decay_factor(shape, progress))
