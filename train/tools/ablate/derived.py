"""Ablation variants made from another variant's run: decay branches and checkpoint averages (``distaff ablate``).

A variant with ``branch: {of: NAME, decay: FRACTION, shape: SHAPE}`` is, for each seed, a decay branch of variant
NAME's run (``distaff decay``'s: it continues NAME's checkpoint exactly and decays): it branches at step
``S = steps - K`` with ``K = round(FRACTION x steps)``, so it ends on the same step count and tokens as NAME. NAME's
run then uses ``optim.schedule: wsd`` (required) and, unless it sets a decay itself, stays stable to its end, and it
checkpoints at S (``checkpoint.every`` is set to S when NAME has none; otherwise S must be a multiple of it).

A variant with ``average: {of: NAME, last: K, ema: DECAY}`` is, for each seed, ``distaff average`` of the last K
checkpoints of NAME's run (uniform, or exponential with ``ema``), scored on the held-out split by the same
evaluation a run does (train/tools/checkpoint_eval.py); NAME must set ``checkpoint.every``. Its tokens are NAME's,
and its tokens/s NAME's (it trains nothing). Both kinds run after their parent, and an average of ``last: 1`` is
the parent's last checkpoint scored the same way (what an average is compared with).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distaff.train.core.errors import ConfigError, shown
from distaff.train.run.checkpoint_files import tag_for_step
from distaff.train.run.schedule import DECAY_SHAPES


@dataclass(frozen=True)
class BranchSpec:
    of: str
    decay: float
    shape: str = ""

    def decay_steps(self, max_steps: int) -> int:
        return max(1, min(max_steps - 1, round(self.decay * max_steps)))

    def start(self, max_steps: int) -> int:
        return max_steps - self.decay_steps(max_steps)


@dataclass(frozen=True)
class AverageSpec:
    of: str
    last: int
    ema: float = 0.0


def parse_spec(source: str, where: str, kind: str, values: Any) -> BranchSpec | AverageSpec:
    """A variant's ``branch`` or ``average`` mapping, checked; errors name the key."""
    cls = BranchSpec if kind == "branch" else AverageSpec
    known = {"of", "decay", "shape"} if kind == "branch" else {"of", "last", "ema"}
    if not isinstance(values, dict) or not set(values) <= known or "of" not in values:
        raise ConfigError(f"{source}: {where}.{kind}: expected a mapping with 'of' (a variant's name) and "
                          f"{sorted(known - {'of'})}, got {shown(values)}")
    try:
        spec = cls(**values)
    except TypeError as err:
        raise ConfigError(f"{source}: {where}.{kind}: {err}") from None
    if isinstance(spec, BranchSpec) and not (isinstance(spec.decay, float) and 0 < spec.decay < 1):
        raise ConfigError(f"{source}: {where}.branch.decay: the decay's share of the steps, between 0 and 1; "
                          f"got {shown(spec.decay)}")
    if isinstance(spec, BranchSpec) and spec.shape and spec.shape not in DECAY_SHAPES:
        raise ConfigError(f"{source}: {where}.branch.shape: one of {list(DECAY_SHAPES)}, got {shown(spec.shape)}")
    if isinstance(spec, AverageSpec) and not (isinstance(spec.last, int) and spec.last >= 1):
        raise ConfigError(f"{source}: {where}.average.last: a number of checkpoints (1 or more), got {shown(spec.last)}")
    if isinstance(spec, AverageSpec) and not (isinstance(spec.ema, (int, float)) and 0 <= spec.ema < 1):
        raise ConfigError(f"{source}: {where}.average.ema: a decay in [0, 1) (0: uniform), got {shown(spec.ema)}")
    return spec


def branch_overrides(spec: BranchSpec, max_steps: int, parent_dir: Path) -> dict[str, Any]:
    """The run-config keys that make a run the decay branch of the run in ``parent_dir``."""
    start = spec.start(max_steps)
    shape = {"optim.decay_shape": spec.shape} if spec.shape else {}
    return {"optim.schedule": "wsd", "optim.decay_start": start, "optim.decay_steps": spec.decay_steps(max_steps),
            **shape, "checkpoint.resume": "auto",
            "checkpoint.branch_from": str((parent_dir / "checkpoints" / tag_for_step(start)).resolve())}


def parent_overrides(name: str, optim: dict[str, Any], checkpoint: Any, max_steps: int, branches: list[BranchSpec],
                     averages: list[AverageSpec]) -> dict[str, Any]:
    """What the run of variant ``name`` (its ``optim`` values as written, its checkpoint section) needs for the
    variants made from it: a stable WSD phase up to each branch point, a checkpoint there, and enough checkpoints
    kept for each branch and average."""
    every, extra = checkpoint.every, {}
    if branches and optim.get("schedule") != "wsd":
        raise ConfigError(f"variant {name}: other variants branch from it, so it needs optim.schedule: wsd (got "
                          f"{optim.get('schedule', 'linear')})")
    if branches and not (optim.get("decay_start") or optim.get("decay_steps")):
        extra["optim.decay_start"] = max_steps              # stable to its end: the branches decay
    if averages and not every:
        raise ConfigError(f"variant {name}: other variants average its last checkpoints, so it needs "
                          "checkpoint.every (their spacing)")
    starts = sorted({spec.start(max_steps) for spec in branches})
    if not every and starts:
        every = extra["checkpoint.every"] = math.gcd(*starts)
    wrong = [s for s in starts if s % every]
    if wrong:
        raise ConfigError(f"variant {name}: a branch starts at step {wrong[0]} of {max_steps}, which is no multiple of "
                          f"its checkpoint.every={every}; change its checkpoint.every or the branch's decay")
    newer = [math.ceil((max_steps - s) / every) + 1 for s in starts] + [spec.last for spec in averages]
    if max(newer, default=0) > checkpoint.keep:
        extra["checkpoint.keep"] = max(newer)
    return extra


def run_average(spec: AverageSpec, parent_dir: Path, out_dir: Path, config: dict[str, Any],
                fingerprint: str, batches: int) -> None:
    """The average of the parent's last checkpoints, scored, as a finished run's ``summary.json`` and
    ``metrics.jsonl`` (one evaluation record) in ``out_dir``: what the report reads of any run."""
    from distaff.train.tools.average import average
    from distaff.train.tools.checkpoint_eval import heldout_metrics

    parent = json.loads((parent_dir / "summary.json").read_text())
    checkpoint = average([str(parent_dir)], out_dir / "checkpoint", last=spec.last, ema=spec.ema, overwrite=True)
    figures = heldout_metrics(checkpoint, batches)
    record = {"step": parent["steps"], "tokens_seen": parent["tokens"], **figures}
    (out_dir / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    summary = {"steps": parent["steps"], "tokens": parent["tokens"], "tokens_per_s": parent["tokens_per_s"],
               **figures, "run_dir": str(out_dir), "checkpoint": str(checkpoint), "averaged_run": str(parent_dir),
               "finished": True, "config_fingerprint": fingerprint, "fingerprinted_config": config}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
