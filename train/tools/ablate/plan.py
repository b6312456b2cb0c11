"""An ablation's runs: one per variant and seed (``PlannedRun``), each with the step count that spends the token
budget, and the data they read, prepared once."""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distaff.train.core.errors import RunFailure
from distaff.train.data.errors import DataError
from distaff.train.run.config import (ConfigError, RunConfig, changed_keys, config_fingerprint, config_to_dict,
                                     fingerprinted)
from distaff.train.run.runtime import SUMMARY_FILE
from distaff.train.run.schedule import RunSchedule
from distaff.train.tools.ablate.config import (SIZING, AblationConfig, Variant, parent_extra, run_overrides,
                                               variant_config)
from distaff.train.tools.ablate.derived import AverageSpec, branch_overrides


@dataclass
class PlannedRun:
    variant: str
    seed: int
    out_dir: Path
    overrides: list[str]            # key=value for `distaff pretrain`
    max_steps: int
    config: dict[str, Any] = field(default_factory=dict)   # the run's resolved config, fingerprinted()
    parent: PlannedRun | None = None    # the run a branch or an average is made from (same seed)
    average: AverageSpec | None = None  # an average: made by ablate itself, not trained

    @property
    def summary_path(self) -> Path:
        return self.out_dir / SUMMARY_FILE

    def summary(self) -> dict[str, Any] | None:
        """The run's ``summary.json``, if it has written one (a run stopped by a signal writes one too)."""
        if not self.summary_path.is_file():
            return None
        try:
            return json.loads(self.summary_path.read_text())
        except ValueError:
            raise DataError(f"{self.summary_path}: not valid JSON; delete it to run {self.out_dir} again") from None

    @property
    def done(self) -> bool:
        """Finished, and with the step count the plan gives it: only such runs are compared."""
        summary = self.summary()
        return (summary is not None and summary.get("finished") is True and summary.get("steps") == self.max_steps
                and summary.get("config_fingerprint") == config_fingerprint(self.config))

    def check_plan(self) -> None:
        """A run made with other settings than the plan now gives it (a variant edited since) is not reused, nor
        resumed under the new ones; a run that finished more steps than the plan gives it cannot be brought to the
        plan's length."""
        summary = self.summary() or {}
        if summary and summary.get("config_fingerprint") != config_fingerprint(self.config):
            changed = changed_keys(summary.get("fingerprinted_config") or {}, self.config)
            what = (f"with other settings than the ablation now gives it ({'; '.join(changed[:4])}"
                    f"{'; ...' if len(changed) > 4 else ''})" if "fingerprinted_config" in summary
                    else "by a distaff that recorded no config fingerprint")
            raise ConfigError(f"{self.out_dir}: this run was made {what}; its results would be reported under the new "
                              f"settings: delete {self.out_dir} to run it again with them, or restore the variant")
        if summary.get("finished") is True and summary.get("steps", 0) > self.max_steps:
            raise ConfigError(f"{self.summary_path}: the run finished {summary['steps']} steps but the ablation now "
                              f"gives it {self.max_steps} (were tokens, the batch size or ranks changed?); restore "
                              f"them, or delete {self.out_dir} to run it again")

    @property
    def log(self) -> Path:
        return self.out_dir.with_name(self.out_dir.name + ".log")


def prepare_data(cfg: AblationConfig) -> Path:
    """The ``prepare`` section's tokenizer and shards under ``out_dir/data`` (once; reused after)."""
    section, data = cfg.prepare, cfg.data_dir
    if section is None or (data / "manifest.json").is_file():
        return data
    cli = [sys.executable, "-m", "distaff.launch.cli"]
    tokenizer = cfg.root / "tokenizer"
    steps = [["tokenizer", "train", "--input", *section.input, "--vocab-size", str(section.vocab_size),
              "--out", str(tokenizer)],
             ["data", "prepare", "--input", *section.input, "--tokenizer", str(tokenizer), "--seq-len",
              str(section.seq_len), *(["--pack-documents"] if section.pack_documents else []), "--heldout-fraction",
              str(section.heldout_fraction), "--shard-mb", str(section.shard_mb), "--out", str(data), "--no-progress"]]
    for step in steps:
        print(f"distaff ablate: {shlex.join(['distaff', *step])}", flush=True)
        if subprocess.run(cli + step).returncode != 0:
            raise RunFailure(f"data preparation failed: distaff {' '.join(step[:2])} (its error is above)")
    return data


def _prepared_lengths(cfg: AblationConfig, run_cfg: RunConfig) -> dict[str, int]:
    """The seq_len of every data dir a run reads (the ``prepare`` section's for the data it makes)."""
    from distaff.train.data.manifest import read_manifest

    dirs = [run_cfg.data.dir, *(s.dir for s in run_cfg.data.sources),
            *(s.dir for phase in run_cfg.phases for s in phase.sources)]
    made = str(cfg.data_dir) if cfg.prepare is not None else None
    return {d: cfg.prepare.seq_len if d == made else read_manifest(d).seq_len for d in dirs if d}


def plan_runs(cfg: AblationConfig) -> list[PlannedRun]:
    """One run per variant and seed, seed by seed (so unfinished ablations hold paired results), each
    with the step count that spends the token budget (a branch: its parent's)."""
    runs = []
    for seed in cfg.seeds:
        planned: dict[str, PlannedRun] = {}
        for variant in cfg.variants:
            planned[variant.name] = plan_run(cfg, variant, seed, planned)
        runs += planned.values()
    return runs


def plan_run(cfg: AblationConfig, variant: Variant, seed: int, planned: dict[str, PlannedRun]) -> PlannedRun:
    """The run of ``variant`` for ``seed``; ``planned``: this seed's runs of the variants before it."""
    out_dir = cfg.root / "runs" / variant.name / f"seed-{seed}"
    if variant.average is not None:
        parent = planned[variant.average.of]
        return PlannedRun(variant.name, seed, out_dir, [], parent.max_steps, parent.config, parent, variant.average)
    trained = variant.trained(cfg)
    max_steps = steps_for(cfg, trained, seed)
    every = max(1, max_steps // cfg.evals)
    extra = {"run.out_dir": str(out_dir), "run.name": f"{variant.name}-seed-{seed}",
             "train.max_steps": max_steps, "eval.every": every, "logging.every": every,
             "wandb.group": cfg.name, "wandb.name": f"{variant.name}-seed-{seed}"}
    parent = planned[variant.branch.of] if variant.branch is not None else None
    if parent is not None:
        extra.update(branch_overrides(variant.branch, max_steps, parent.out_dir))
    else:
        extra.update(parent_extra(cfg, variant, seed, max_steps))
    resolved = variant_config(cfg, trained, seed, extra)  # the exact config the run will read, checked
    config = json.loads(json.dumps(fingerprinted(config_to_dict(resolved)), default=str))  # as summary.json has it
    return PlannedRun(variant.name, seed, out_dir, run_overrides(cfg, trained, seed, extra), max_steps, config, parent)


def steps_for(cfg: AblationConfig, variant: Variant, seed: int) -> int:
    """The steps that spend ``tokens``: token positions per step (padding, a batch ramp and phases included), or
    with ``budget: real`` the real tokens a step holds on average over the first epoch."""
    from distaff.train.data.manifest import read_manifest

    sized = variant_config(cfg, variant, seed, SIZING)
    if cfg.budget != "real":
        return RunSchedule(sized, cfg.ranks, _prepared_lengths(cfg, sized)).steps_for_tokens(cfg.tokens)
    if sized.phases or sized.train.batch_warmup.start:
        raise ConfigError(f"variant {variant.name}: budget: real sizes a run by one batch shape; it cannot size a "
                          "batch ramp or phases (use budget: positions)")
    if not (Path(sized.data.dir) / "manifest.json").is_file():
        raise ConfigError(f"budget: real sizes runs by the prepared data's sample lengths; {sized.data.dir} is "
                          "not prepared yet (run the ablation, or prepare the data, first)")
    per_step = cfg.ranks * sized.train.grad_accum * real_tokens_per_batch(
        Path(sized.data.dir), sized.data.batch_size, sized.data.token_budget(read_manifest(sized.data.dir).seq_len),
        seed)
    return max(1, math.ceil(cfg.tokens / per_step))


def real_tokens_per_batch(data: Path, batch_size: int, token_budget: int, seed: int) -> float:
    """Mean real tokens of one rank's micro-batch over the first epoch: ``batch_size`` samples of the mean length
    when padded (``token_budget`` 0), the token-budget plan's mean batch when packed."""
    import numpy as np

    from distaff.train.data.manifest import read_manifest
    from distaff.train.data.stream import EpochOrder, GroupReader, token_budget_cuts

    manifest = read_manifest(data)
    split = manifest.splits["train"]
    if not token_budget:
        return batch_size * split.tokens / split.samples
    reader = GroupReader(str(data), split.shards, np.dtype(manifest.dtype), manifest.seq_len)
    lengths = EpochOrder([s.samples for s in split.shards], seed, 0, 4).lengths(reader.shard_lengths())
    cuts = token_budget_cuts(lengths, token_budget)
    return float(lengths.sum()) / (len(cuts) - 1)


