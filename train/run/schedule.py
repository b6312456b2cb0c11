"""What each optimizer step trains with, as pure functions of the step, so a resumed run needs no scheduler
state: the learning rate (:func:`lr_at`: linear warmup, then linear or cosine decay to ``min_lr_ratio * lr``
over the rest of the run, or warmup-stable-decay (``wsd``): the peak rate held until a decay of its own start,
length and shape (linear, cosine or 1-sqrt) down to ``min_lr_ratio * lr``; the trainer sets it on the optimizer
before every step; a decay branch, ``distaff decay``, is a WSD run whose decay starts at the step it branched
from), and the run's phases and batch ramp (:class:`RunSchedule`).

*Phases.* Phase 0 is the run config itself: its data (``data.dir`` or ``data.sources``), mask rate
(``data.masking.mlm_probability``), micro-batch (``data.batch_size``) and global batch (``data.batch_size x
train.grad_accum x ranks`` sequences). ``phases[i]`` starts once ``at_step`` steps are done and changes what it
gives, keeping the rest. A phase reads its sources at the length they were prepared with.

*Batch ramp* (``train.batch_warmup``). The global batch of step ``s`` is at most ``start x (1 + s // n)``: it grows
from ``start`` sequences in steps of ``start`` to phase 0's global batch, each size held for the same ``n`` steps,
``n`` chosen so that the sizes below the full one spend ``tokens`` (sequences x seq_len), as ModernBERT's ramp
does in whole micro-batches. Only the number of micro-batches a rank accumulates changes, never their shape, so
the engine is neither rebuilt nor recompiled; the learning rate stays a function of the step alone
(docs/pretraining.md, "Batch-size warmup", says why).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Mapping

from distaff.train.core.errors import ConfigError

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


# ---------------------------------------------------------------- phases and the batch ramp

@dataclass(frozen=True)
class Phase:
    """What the steps from ``at_step`` on train with (until the next phase)."""
    index: int
    at_step: int
    sources: tuple[tuple[str, float], ...]  # (prepared data dir, weight)
    mask_rate: float | None                 # None: nothing is masked (T-TA)
    batch_size: int                         # micro-batch per rank
    global_batch: int                       # sequences per step once the batch ramp is over
    seq_len: int                            # the sources' prepared length
    key: str                                # where the user sets it

    def changes(self, before: Phase) -> str:
        """What this phase changes from ``before``, for the log: ``seq_len 128 -> 512; mask_rate ...``."""
        return "; ".join(f"{name} {before.shown(name)} -> {self.shown(name)}"
                         for name in ("sources", "seq_len", "mask_rate", "global_batch", "batch_size")
                         if getattr(self, name) != getattr(before, name)) or "nothing"

    def shown(self, name: str) -> str:
        if name == "sources":
            return "[" + ", ".join(f"{d} x{w:g}" for d, w in self.sources) + "]"
        return str(getattr(self, name))


@dataclass(frozen=True)
class StepShape:
    """One optimizer step: its phase, its global batch (sequences, the ramp applied) and the micro-batches
    each rank accumulates for it."""
    phase: Phase
    global_batch: int
    micro_batches: int


@dataclass(frozen=True)
class BatchRamp:
    """``train.batch_warmup``: the global batch of step ``s`` is at most ``start x (1 + s // steps_per_size)``."""
    start: int
    steps_per_size: int
    full: int

    def cap(self, step: int) -> int:
        return self.start * (1 + step // self.steps_per_size)

    @property
    def end_step(self) -> int:
        """The first step at the full batch."""
        return self.steps_per_size * (self.full // self.start - 1)


def run_phases(cfg: Any, world_size: int, prepared: Mapping[str, int]) -> list[Phase]:
    """Phase 0 (the run config) and one per ``phases`` entry, each keeping what the entry leaves out;
    ``prepared``: every source dir's seq_len."""
    data = cfg.data
    first = "data.sources" if data.sources else "data.dir"
    sources = tuple((s.dir, s.weight) for s in data.sources) or ((data.dir, 1.0),)
    mask_rate = None if cfg.train.objective == "tta" else data.masking.mlm_probability
    phases = [Phase(0, 0, sources, mask_rate, data.batch_size, data.batch_size * cfg.train.grad_accum * world_size,
                    _prepared_length(sources, 0, first, prepared), first)]
    for i, entry in enumerate(cfg.phases):
        before, key = phases[-1], f"phases[{i}]"
        sources = tuple((s.dir, s.weight) for s in entry.sources) or before.sources
        seq_len = _prepared_length(sources, entry.seq_len, key, prepared)
        phases.append(Phase(i + 1, entry.at_step, sources, entry.mask_rate or before.mask_rate,
                            entry.batch_size or before.batch_size, entry.global_batch or before.global_batch,
                            seq_len, key))
    for phase in phases:
        unit = phase.batch_size * world_size
        if phase.global_batch % unit:
            raise ConfigError(f"{phase.key}: the global batch of {phase.global_batch} sequences is not a multiple of "
                              f"the micro-batch x ranks = {phase.batch_size} x {world_size}: every rank accumulates "
                              "whole micro-batches; change global_batch or batch_size")
    return phases


def _prepared_length(sources: tuple[tuple[str, float], ...], stated: int, key: str,
                     prepared: Mapping[str, int]) -> int:
    """The one seq_len a phase's sources were prepared with (and ``stated``, when given)."""
    lengths = {d: prepared[d] for d, _ in sources}
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{d}: {n}" for d, n in lengths.items())
        raise ConfigError(f"{key}: the sources were prepared at different lengths ({shown}); a phase reads one "
                          "seq_len: prepare them with one --seq-len, or put them in different phases")
    (length,) = set(lengths.values())
    if stated and stated != length:
        raise ConfigError(f"{key}.seq_len: {stated}, but {', '.join(lengths)} {'was' if len(lengths) == 1 else 'were'} "
                          f"prepared at {length}; a phase reads its sources at their prepared length: give it sources "
                          f"prepared with `distaff data prepare --seq-len {stated}`")
    return length


def batch_ramp(warmup: Any, phases: list[Phase], world_size: int) -> BatchRamp | None:
    """The ramp of ``train.batch_warmup`` (None when off), checked against the phases it runs through."""
    if not warmup.start:
        return None
    first, start = phases[0], warmup.start
    full = first.global_batch
    if start >= full or full % start:
        raise ConfigError(f"train.batch_warmup.start: {start} sequences must be below, and divide, the global batch "
                          f"of {full} (data.batch_size x train.grad_accum x ranks = {first.batch_size} x "
                          f"{full // (first.batch_size * world_size)} x {world_size}): the batch grows in steps of "
                          "start")
    sizes = full // start - 1                          # the sizes below full: start, 2 start, ...
    per_size = max(1, round(warmup.tokens / (start * first.seq_len * sizes * (sizes + 1) / 2)))
    ramp = BatchRamp(start, per_size, full)
    for phase in phases:
        if phase.at_step < ramp.end_step and start % (phase.batch_size * world_size):
            raise ConfigError(f"train.batch_warmup.start: {start} sequences is not a multiple of the micro-batch x "
                              f"ranks = {phase.batch_size} x {world_size} ({phase.key}): every rank accumulates "
                              "whole micro-batches")
    return ramp


class RunSchedule:
    """The phase, global batch and micro-batches per rank of every step (pure functions of the step)."""

    def __init__(self, cfg: Any, world_size: int, prepared: Mapping[str, int]):
        self.world_size = world_size
        self.phases = run_phases(cfg, world_size, prepared)
        self.ramp = batch_ramp(cfg.train.batch_warmup, self.phases, world_size)
        self._starts = [phase.at_step for phase in self.phases]

    def phase_at(self, step: int) -> Phase:
        return self.phases[bisect.bisect_right(self._starts, step) - 1]

    def at(self, step: int) -> StepShape:
        phase = self.phase_at(step)
        batch = phase.global_batch if self.ramp is None else min(phase.global_batch, self.ramp.cap(step))
        return StepShape(phase, batch, batch // (phase.batch_size * self.world_size))

    def steps_for_tokens(self, tokens: int) -> int:
        """The fewest steps whose sequences x seq_len reach ``tokens`` (``distaff ablate``'s equal budgets)."""
        steps, done = 0, 0
        settled = max(self._starts[-1], self.ramp.end_step if self.ramp else 0)    # one shape from here on
        while done < tokens and steps < settled:
            shape = self.at(steps)
            done += shape.global_batch * shape.phase.seq_len
            steps += 1
        if done < tokens:
            shape = self.at(steps)
            steps += math.ceil((tokens - done) / (shape.global_batch * shape.phase.seq_len))
        return max(1, steps)
