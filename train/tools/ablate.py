"""``distaff ablate --config ABL.yaml``: named variants of one run config on equal budgets, compared.

Every variant runs on the same prepared data, for the same token budget (``train.max_steps`` is
derived from it), once per seed, evaluating on the held-out split every few steps. Runs go one
after another as subprocesses (``launcher: sequential``: plain ``python`` for one rank,
``torchrun`` for more; ``parallel: N`` runs up to N single-rank runs at once, each with the cores
split evenly between them) or are written as job scripts to start elsewhere (``launcher: script``;
``distaff ablate --config ABL.yaml --report`` then gathers them). Runs go seed by seed (every
variant of the first seed, then the second seed...), so a partial ablation holds paired results.
A run whose ``summary.json`` says it finished the planned number of steps, with the planned config (the
fingerprint of its resolved config: every key but ``wandb``, ``logging``, ``checkpoint``, ``distributed``,
``run.name`` and ``run.out_dir``), is not run again; a run made with other settings (a variant edited since) is
refused, naming the changed keys, until its folder is deleted; any other
run is started again and resumes from its latest checkpoint, so an interrupted ablation continues where
it stopped and only runs of the planned length are compared. A failed run is reported with its log and
the others go on; Ctrl-C or SIGTERM stops the runs in progress (each gets SIGTERM: it saves a checkpoint
it resumes from) and exits 75, as a run does (run the same command again to continue). One ablation at a time per ``out_dir``: a second is refused, naming the first (the lock
runs take, ``runlock.py``).

A variant may also be made from an earlier variant's run, for each seed (train/tools/ablate_derived.py):
``branch: {of: NAME, decay: 0.2, shape: 1-sqrt}`` is a decay branch of NAME's WSD run (``distaff decay``) over
its last 20% of steps, at equal steps and tokens; ``average: {of: NAME, last: 5, ema: 0}`` is ``distaff average``
of the last 5 checkpoints of NAME's run, scored by the run's own held-out evaluation. They run after their
parent. ``budget: real`` counts ``tokens`` as real tokens (padding left out, from the prepared data's sample
lengths), to compare padded with packed batches at equal text; ``prepare.pack_documents: false`` prepares one
document per sequence.

The report, read back from each run's ``summary.json`` and ``metrics.jsonl``: ``ablation.csv``
(one row per run and one per variant), ``ablation.md`` (held-out loss and MLM accuracy, or for RTD the
discriminator's accuracy and AUC, mean +- std over seeds, tokens/s; each variant's per-seed difference in
held-out loss against the first variant, mean +- std) and ``ablation.png`` (held-out loss against tokens seen). The runs share the
W&B group ``name``. Paths in the file are relative to the working directory, like run configs; the
file itself and ``base`` may also name installed presets (``distaff ablate --config positions-cpu``,
``base: tiny-cpu``).

ABL.yaml::

    name: positions                       # W&B group, report title
    base: tiny-cpu                        # the run config every variant starts from (a file or a preset)
    out_dir: runs/ablation/positions      # runs/<variant>/seed-<s>/, data/, the report
    prepare:                              # optional: tokenizer + shards made here once (else data.dir)
      input: [data/austen-emma-pride.txt.gz]
      vocab_size: 4000
      seq_len: 128
      heldout_fraction: 0.02
    tokens: 1000000                       # per run: max_steps = ceil(tokens / tokens per step)
    seeds: [1, 2, 3]
    evals: 8                              # held-out evaluations per run (eval.every = max_steps // evals)
    ranks: 1
    launcher: sequential                  # sequential | script
    parallel: 1                           # sequential, ranks: 1: runs at once (cores split between them)
    overrides: {checkpoint.every: 0}      # dotted run-config keys for every variant
    budget: positions                     # positions | real: what `tokens` counts
    variants:
      - name: relative+emd
        overrides: {model.emd: true}
      - name: absolute
        overrides: {model.relative_attention: false, model.pos_att_type: [], model.position_biased_input: true}
      - name: wsd                         # a parent: it branches / averages need it to checkpoint
        overrides: {optim.schedule: wsd, checkpoint.every: 20}
      - name: wsd-decay
        branch: {of: wsd, decay: 0.2}
      - name: wsd-avg
        average: {of: wsd, last: 5}
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from distaff.train.core import presets
from distaff.train.core.config_yaml import load_yaml
from distaff.train.core.errors import MAX_COUNT, RunFailure, UserError, command_main, document_ranges, int_arg, shown
from distaff.train.core.exit_codes import EXIT_PREEMPTED
from distaff.train.core.files import check_apart, read_text
from distaff.train.core.runlock import DirLock
from distaff.train.core.threads import RANKS_FLAG, busy_cores, check_ranks_per_node, plan_threads, rank_bound
from distaff.train.data.errors import DataError
from distaff.train.run.config import (ConfigError, RunConfig, changed_keys, config_file, config_fingerprint,
                                     config_to_dict, fingerprinted, load_config, read_config_values)
from distaff.train.run.metrics import METRICS_FILE, numbers, read_metrics, save_figure
from distaff.train.run.runtime import SUMMARY_FILE
from distaff.train.run.schedule import RunSchedule
from distaff.train.tools.ablate_derived import (AverageSpec, BranchSpec, branch_overrides, parent_overrides,
                                                parse_spec, run_average)

LAUNCHERS = ("sequential", "script")
# the report's figures per objective, and their column titles
REPORT_KEYS = {"mlm": ("eval_loss", "eval_accuracy", "tokens_per_s"),
               "rtd": ("eval_loss", "eval_rtd_accuracy", "eval_rtd_auc", "tokens_per_s")}
TITLES = {"eval_loss": "held-out loss", "eval_accuracy": "held-out MLM accuracy", "tokens_per_s": "tokens/s",
          "eval_rtd_accuracy": "held-out discriminator accuracy", "eval_rtd_auc": "held-out replaced-token AUC"}
BUDGETS = ("positions", "real")
# a run's config as far as its step count goes (batch, accumulation, packing): whatever its schedule
SIZING = {"optim.schedule": "linear", "optim.decay_start": 0, "optim.decay_steps": 0}
POLL_S = 0.5                    # how often the runs in progress are checked
STOP_TIMEOUT_S = 120            # a run sent SIGTERM has this long to save its checkpoint and exit


@dataclass
class PrepareSection:
    input: list[str]
    vocab_size: int = 4000
    seq_len: int = 128
    heldout_fraction: float = 0.02
    shard_mb: float = 0.2
    pack_documents: bool = True         # false: one document (or a piece of a long one) per sequence


@dataclass
class Variant:
    name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    branch: BranchSpec | None = None    # a decay branch of another variant's run (ablate_derived.py)
    average: AverageSpec | None = None  # an average of another variant's last checkpoints

    def trained(self, cfg: "AblationConfig") -> "Variant":
        """What this variant's run trains with: a branch, its parent's overrides and then its own."""
        if self.branch is None:
            return self
        parent = next(v for v in cfg.variants if v.name == self.branch.of)
        return Variant(self.name, {**parent.overrides, **self.overrides})


@dataclass
class AblationConfig:
    name: str
    base: str
    out_dir: str
    tokens: int
    variants: list[Variant]
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    evals: int = 8
    ranks: int = 1
    launcher: str = "sequential"
    parallel: int = 1
    overrides: dict[str, Any] = field(default_factory=dict)
    prepare: PrepareSection | None = None
    budget: str = "positions"           # tokens counts token positions (padding included) or real tokens

    @property
    def root(self) -> Path:
        return Path(self.out_dir)

    @property
    def data_dir(self) -> Path:
        return self.root / "data"


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


# ---------------------------------------------------------------- reading ABL.yaml

def _typed(source: str, key: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise ConfigError(f"{source}: {key}: expected {getattr(kind, '__name__', kind)}, got {shown(value)}")
    return value


def _section(source: str, key: str, values: Any, cls: type) -> dict[str, Any]:
    """``values`` checked as a mapping of ``cls``'s fields, with simple types checked."""
    _typed(source, key, values, dict)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {[f'{key}.{k}'.lstrip('.') for k in unknown]} "
                          f"(known: {sorted(known)})")
    kinds = {"str": str, "int": int, "float": (int, float), "dict[str, Any]": dict, "list[int]": list,
             "list[str]": (list, str), "bool": bool}  # one path or several
    for name, value in values.items():
        kind = kinds.get(str(known[name].type))
        if kind is not None:
            _typed(source, f"{key}.{name}".lstrip("."), value, kind)
    return values


def _variants(source: str, values: Any) -> list[Variant]:
    if not isinstance(values, list) or not values:
        raise ConfigError(f"{source}: variants: expected a non-empty list of {{name, overrides}}, got {shown(values)}")
    variants = [Variant(**_section(source, f"variants[{i}]", v, Variant)) for i, v in enumerate(values)]
    for i, variant in enumerate(variants):
        if not variant.name or "/" in variant.name or variant.name.startswith("."):
            raise ConfigError(f"{source}: variants[{i}].name: {variant.name!r} is not usable as a folder name")
        if variant.name in [v.name for v in variants[:i]]:
            raise ConfigError(f"{source}: variants[{i}].name: {variant.name!r} is used twice")
        _derived(source, f"variants[{i}]", variant, variants[:i])
    return variants


def _derived(source: str, where: str, variant: Variant, earlier: list[Variant]) -> None:
    """A ``branch`` or ``average`` mapping made a spec, made of an earlier variant that trains a run itself."""
    if variant.branch is not None and variant.average is not None:
        raise ConfigError(f"{source}: {where}: a variant is a branch or an average, not both")
    for kind in ("branch", "average"):
        if getattr(variant, kind) is None:
            continue
        spec = parse_spec(source, where, kind, getattr(variant, kind))
        made_from = next((v for v in earlier if v.name == spec.of), None)
        if made_from is None or made_from.branch is not None or made_from.average is not None:
            raise ConfigError(f"{source}: {where}.{kind}.of: {spec.of!r} is not an earlier variant that trains a run "
                              "of its own")
        if kind == "average" and variant.overrides:
            raise ConfigError(f"{source}: {where}: an average trains nothing; its overrides would apply to nothing")
        setattr(variant, kind, spec)


def _check_ranges(source: str, cfg: AblationConfig) -> None:
    for key in ("tokens", "evals", "ranks", "parallel"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"{source}: {key}: must be positive, got {getattr(cfg, key)}")
    if not cfg.seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in cfg.seeds):
        raise ConfigError(f"{source}: seeds: expected a non-empty list of integers, got {shown(cfg.seeds)}")
    if len(set(cfg.seeds)) != len(cfg.seeds):
        raise ConfigError(f"{source}: seeds: repeated seed in {cfg.seeds}")
    if cfg.budget not in BUDGETS:
        raise ConfigError(f"{source}: budget: must be one of {list(BUDGETS)}, got {cfg.budget!r}")
    if cfg.launcher not in LAUNCHERS:
        raise ConfigError(f"{source}: launcher: must be one of {list(LAUNCHERS)}, got {cfg.launcher!r}")
    if cfg.parallel > 1 and (cfg.ranks > 1 or cfg.launcher != "sequential"):
        raise ConfigError(f"{source}: parallel: {cfg.parallel} runs at once needs ranks: 1 and launcher: sequential "
                          f"(got ranks: {cfg.ranks}, launcher: {cfg.launcher})")


def load_ablation(path: str | Path) -> AblationConfig:
    """The validated ablation config; every variant's run config is checked too (before any run)."""
    source = str(path)
    path = config_file(path, "ablation")
    values = load_yaml(read_text(path, error=ConfigError), source) or {}
    values = dict(_section(source, "", values, AblationConfig))
    missing = [f.name for f in fields(AblationConfig) if f.name not in values and f.name in
               ("name", "base", "out_dir", "tokens", "variants")]
    if missing:
        raise ConfigError(f"{source}: missing required key(s) {missing}")
    values["variants"] = _variants(source, values["variants"])
    if values.get("prepare") is not None:
        values["prepare"] = PrepareSection(**_section(source, "prepare", values["prepare"], PrepareSection))
        if isinstance(values["prepare"].input, str):
            values["prepare"].input = [values["prepare"].input]
    cfg = AblationConfig(**values)
    _check_ranges(source, cfg)
    try:
        base = config_file(cfg.base, "run")     # runs read it by the same name, a preset's included
    except ConfigError as err:
        raise ConfigError(f"{source}: base: {err}") from None
    # each run's own config check keeps its run.out_dir apart from its data and init checkpoints
    inputs = [("base", base), *(("prepare.input", path) for path in (cfg.prepare.input if cfg.prepare else ()))]
    try:
        check_apart(("out_dir", cfg.out_dir), inputs, error=ConfigError)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    objectives = {}
    for variant in cfg.variants:
        try:
            if variant.average is None:
                objectives[variant.name] = _checked_config(cfg, variant).train.objective
        except ConfigError as err:
            raise ConfigError(f"{source}: variants[{variant.name}]: {err}") from None
    if len(set(objectives.values())) > 1:
        raise ConfigError(f"{source}: variants train different objectives ({objectives}); their held-out figures "
                          "are not comparable: ablate one objective at a time")
    return cfg


def _checked_config(cfg: AblationConfig, variant: Variant) -> RunConfig:
    """A variant's run config as its first seed's run would have it, on the base's step count (the data may not be
    prepared yet to size the runs)."""
    seed, trained = cfg.seeds[0], variant.trained(cfg)
    steps = variant_config(cfg, trained, seed, SIZING).train.max_steps
    extra: dict[str, Any] = {"train.max_steps": steps}
    if variant.branch is not None:
        extra.update(branch_overrides(variant.branch, steps, cfg.root / "runs" / variant.branch.of / f"seed-{seed}"))
    else:
        extra.update(_parent_extra(cfg, variant, seed, steps))
    return variant_config(cfg, trained, seed, extra)


def _override_args(values: dict[str, Any]) -> list[str]:
    """``{"model.emd": True}`` -> ``["model.emd=true"]`` (values as YAML, which the run config parses)."""
    return [f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"
            for key, value in values.items()]


def run_overrides(cfg: AblationConfig, variant: Variant, seed: int, extra: dict[str, Any] | None = None
                  ) -> list[str]:
    """A run's overrides, later ones winning: prepared data, the common ones, the variant's, the seed, ``extra``."""
    data = {"data.dir": str(cfg.data_dir)} if cfg.prepare is not None else {}
    return _override_args({**data, **cfg.overrides, **variant.overrides, "run.seed": seed, **(extra or {})})


def variant_config(cfg: AblationConfig, variant: Variant, seed: int, extra: dict[str, Any] | None = None
                   ) -> RunConfig:
    return load_config(cfg.base, run_overrides(cfg, variant, seed, extra))


def _parent_extra(cfg: AblationConfig, variant: Variant, seed: int, max_steps: int) -> dict[str, Any]:
    """What the run of a variant others branch from or average needs (``ablate_derived.parent_overrides``)."""
    branches = [v.branch for v in cfg.variants if v.branch is not None and v.branch.of == variant.name]
    averages = [v.average for v in cfg.variants if v.average is not None and v.average.of == variant.name]
    if not branches and not averages:
        return {}
    sized = variant_config(cfg, variant, seed, {**SIZING, "train.max_steps": max_steps})
    optim = read_config_values(config_file(cfg.base, "run"), run_overrides(cfg, variant, seed)).get("optim") or {}
    return parent_overrides(variant.name, optim, sized.checkpoint, max_steps, branches, averages)


# ---------------------------------------------------------------- data and the runs

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
        extra.update(_parent_extra(cfg, variant, seed, max_steps))
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


def run_command(cfg: AblationConfig, run: PlannedRun, port: int) -> list[str]:
    """``python -m distaff.train.pretrain`` for one rank, ``torchrun`` for several."""
    target = ["-m", "distaff.train.pretrain", "--config", cfg.base, *run.overrides]
    if cfg.ranks == 1:
        return [sys.executable, *target]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [torchrun, "--nproc_per_node", str(cfg.ranks), "--master_port", str(port), *target]


def _run_env(ranks: int, parallel: int) -> dict[str, str]:
    """CPU machines need DeepSpeed's CPU accelerator; the ``ranks x parallel`` processes at once get an even
    share of the cores each (cut to what other processes leave idle), unless the user set ``OMP_NUM_THREADS``."""
    import torch

    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    if not env.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = str(plan_threads(len(os.sched_getaffinity(0)), ranks * parallel, busy_cores()).threads)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "WANDB_RUN_ID"):  # each run is its own job
        env.pop(key, None)
    return env


def run_all(cfg: AblationConfig, runs: list[PlannedRun]) -> list[str]:
    """Each run not yet finished, ``cfg.parallel`` at a time, in plan order; the failures, each with its log."""
    from distaff.train.core.distributed import free_port

    for run in runs:
        run.check_plan()
    jobs = []
    for i, run in enumerate(runs, 1):
        label = f"[{i}/{len(runs)}] {run.variant} seed {run.seed}"
        if run.done:
            print(f"distaff ablate: {label}: done before ({run.summary_path}), skipped", flush=True)
        elif run.average is None:
            resumed = " (not finished before: resuming)" if run.summary() is not None else ""
            jobs.append((label + resumed, run_command(cfg, run, free_port()), run))
    return run_parallel(jobs, cfg.parallel, _run_env(cfg.ranks, cfg.parallel)) + run_averages(runs)


def run_averages(runs: list[PlannedRun]) -> list[str]:
    """Each average not made yet whose parent run is done (in this process: it trains nothing); the failures."""
    failures = []
    for run in runs:
        if run.average is None or run.done:
            continue
        label = f"{run.variant} seed {run.seed}"
        if not run.parent.done:
            failures.append(f"{label}: its run {run.parent.out_dir} is not finished")
            continue
        print(f"distaff ablate: {label}: average of the last {run.average.last} checkpoint(s) of "
              f"{run.parent.out_dir} -> {run.out_dir}", flush=True)
        run.out_dir.mkdir(parents=True, exist_ok=True)
        try:
            run_average(run.average, run.parent.out_dir, run.out_dir, run.config, config_fingerprint(run.config),
                        int(run.config.get("eval.batches", 0)))
        except (UserError, FileNotFoundError) as err:
            failures.append(f"{label} failed: {err}")
    return failures


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run_parallel(jobs: list[tuple[str, list[str], PlannedRun]], parallel: int, env: dict[str, str]) -> list[str]:
    """``(label, command, run)`` jobs as subprocesses, up to ``parallel`` at once, output to ``run.log``;
    a run failed if it exits non-zero or leaves no summary. Ctrl-C or SIGTERM stops the ones in
    progress (:func:`_stop`) and raises KeyboardInterrupt; finished runs keep their summaries."""
    queue, running, failures = list(jobs), {}, []
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        while queue or running:
            failures += _drop_orphans(queue, running)
            while len(running) < parallel and (job := _next_ready(queue)) is not None:
                label, command, run = job
                queue.remove(job)
                run.out_dir.parent.mkdir(parents=True, exist_ok=True)
                print(f"distaff ablate: {label}: {run.max_steps} steps -> {run.out_dir} (log {run.log})", flush=True)
                with open(run.log, "a") as handle:
                    # its own session: a terminal's Ctrl-C reaches only us, and the run gets SIGTERM (checkpoint)
                    running[subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                             start_new_session=True)] = (label, run)
            time.sleep(POLL_S)
            for proc, (label, run) in list(running.items()):
                code = proc.poll()
                if code is None:
                    continue
                del running[proc]
                if code != 0 or not run.done:
                    failures.append(f"{label} failed (exit {code}); see {run.log}")
                    print(f"distaff ablate: {failures[-1]}; the other runs go on", flush=True)
    except KeyboardInterrupt:
        _stop(running)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    return failures


def _next_ready(queue: list[tuple[str, list[str], PlannedRun]]) -> tuple[str, list[str], PlannedRun] | None:
    """The first queued job free to start: a branch waits until the run it branches from is done."""
    return next((job for job in queue if job[2].parent is None or job[2].parent.done), None)


def _drop_orphans(queue: list[tuple[str, list[str], PlannedRun]], running: dict) -> list[str]:
    """Queued branches whose parent run ended without finishing (failed): removed, each a failure."""
    busy = {id(run) for _, _, run in queue} | {id(run) for _, run in running.values()}
    orphans = [job for job in queue if job[2].parent is not None and not job[2].parent.done
               and id(job[2].parent) not in busy]
    for job in orphans:
        queue.remove(job)
    return [f"{label}: not started, its parent run {run.parent.out_dir} did not finish" for label, _, run in orphans]


def _stop(running: dict[subprocess.Popen, tuple[str, PlannedRun]]) -> None:
    """SIGTERM to each run in progress (it saves a checkpoint and exits), SIGKILL after STOP_TIMEOUT_S."""
    for proc in running:
        proc.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc, (label, run) in running.items():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print(f"distaff ablate: {label}: stopped (log {run.log})", flush=True)


def write_job_scripts(cfg: AblationConfig, runs: list[PlannedRun]) -> list[Path]:
    """One bash script per unfinished run under ``out_dir/jobs`` (start them with any scheduler)."""
    jobs = cfg.root / "jobs"
    jobs.mkdir(parents=True, exist_ok=True)
    written = []
    for run in runs:
        if run.done or run.average is not None:     # averages are made by `--report`, once their run is done
            continue
        script = jobs / f"{run.variant}-seed-{run.seed}.sh"
        command = run_command(cfg, run, 29500 + len(written))
        after = f"\n# start it once {run.parent.out_dir} has finished (it branches from it)" if run.parent else ""
        script.write_text("#!/usr/bin/env bash\n# distaff ablate job: one run of the ablation "
                          f"{cfg.name!r}{after}\nset -euo pipefail\ncd {shlex.quote(os.getcwd())}\n"
                          f"exec {shlex.join(command)}\n")
        script.chmod(0o755)
        written.append(script)
    return written


# ---------------------------------------------------------------- the report

def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def report_keys(runs: list[PlannedRun]) -> tuple[str, ...]:
    """The figures the report compares: the objective's (every variant trains the same one, load_ablation)."""
    return REPORT_KEYS["rtd" if any(run.config.get("train.objective") == "rtd" for run in runs) else "mlm"]


def collect(runs: list[PlannedRun]) -> list[dict[str, Any]]:
    """Each finished run's summary figures (unfinished runs, and runs of another length, are left out)."""
    rows, keys = [], report_keys(runs)
    for run in runs:
        if not run.done:
            continue
        summary = run.summary()
        missing = [k for k in keys if summary.get(k) is None]
        if missing:
            raise DataError(f"{run.summary_path}: no {missing} (did the run evaluate?)")
        rows.append({"variant": run.variant, "seed": run.seed, "steps": summary["steps"],
                     "tokens": summary["tokens"], **{k: summary[k] for k in keys}})
    return rows


def row_keys(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """The report's figures, as ``collect`` put them in the rows."""
    return REPORT_KEYS["rtd" if rows and "eval_rtd_auc" in rows[0] else "mlm"]


def aggregate(cfg: AblationConfig, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per variant (in config order): seeds finished and each figure's mean and std over them."""
    table = []
    for variant in cfg.variants:
        mine = [r for r in rows if r["variant"] == variant.name]
        if not mine:
            continue
        entry: dict[str, Any] = {"variant": variant.name, "seeds": len(mine),
                                 "tokens": round(sum(r["tokens"] for r in mine) / len(mine))}
        for key in row_keys(rows):
            entry[f"{key}_mean"], entry[f"{key}_std"] = _mean_std([float(r[key]) for r in mine])
        table.append(entry)
    return table


def _write_csv(path: Path, rows: list[dict[str, Any]], table: list[dict[str, Any]]) -> None:
    """Per-variant rows (seed ``all``) then per-run rows, one header for both."""
    header = ["variant", "seed", "seeds", "steps", "tokens"] + [f"{k}{s}" for k in row_keys(rows)
                                                                 for s in ("_mean", "_std", "")]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=header, restval="")
        writer.writeheader()
        writer.writerows({"seed": "all", **entry} for entry in table)
        writer.writerows(rows)


def _per_seed(cfg: AblationConfig, rows: list[dict[str, Any]]) -> list[str]:
    """Held-out loss per variant and seed: a seed shares data order across variants, so columns pair up."""
    loss = {(r["variant"], r["seed"]): r["eval_loss"] for r in rows}
    lines = ["", "Held-out loss per seed (same seed = same data order and masking across variants):", "",
             "| variant | " + " | ".join(f"seed {s}" for s in cfg.seeds) + " |",
             "| --- |" + " ---: |" * len(cfg.seeds)]
    for variant in cfg.variants:
        cells = [f"{loss[variant.name, s]:.4f}" if (variant.name, s) in loss else "-" for s in cfg.seeds]
        lines.append(f"| {variant.name} | " + " | ".join(cells) + " |")
    return lines


def paired_differences(cfg: AblationConfig, rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per variant after the first: its held-out loss minus the first variant's, for each seed both finished."""
    loss = {(r["variant"], r["seed"]): r["eval_loss"] for r in rows}
    first = cfg.variants[0].name
    return {v.name: [loss[v.name, s] - loss[first, s] for s in cfg.seeds if (v.name, s) in loss and (first, s) in loss]
            for v in cfg.variants[1:]}


def _paired_with_parent(cfg: AblationConfig, rows: list[dict[str, Any]]) -> list[str]:
    """Each branch's and average's held-out loss minus the run it was made from, paired by seed."""
    loss = {(r["variant"], r["seed"]): r["eval_loss"] for r in rows}
    derived = [(v.name, (v.branch or v.average).of) for v in cfg.variants if v.branch or v.average]
    if not derived:
        return []
    lines = ["", "Held-out loss minus that of the run each was made from, paired by seed:", "",
             "| variant | made from | pairs | difference |", "| --- | --- | ---: | ---: |"]
    for name, parent in derived:
        diffs = [loss[name, s] - loss[parent, s] for s in cfg.seeds if (name, s) in loss and (parent, s) in loss]
        mean, std = _mean_std(diffs) if diffs else (math.nan, math.nan)
        lines.append(f"| {name} | {parent} | {len(diffs)} | {mean:+.4f} +- {std:.4f} |")
    return lines


def _paired(cfg: AblationConfig, rows: list[dict[str, Any]]) -> list[str]:
    lines = ["", f"Held-out loss minus `{cfg.variants[0].name}`'s, paired by seed (mean +- sample std over the "
             "seeds both finished; negative: lower loss):", "", "| variant | pairs | difference |", "| --- | ---: | ---: |"]
    for name, diffs in paired_differences(cfg, rows).items():
        mean, std = _mean_std(diffs) if diffs else (math.nan, math.nan)
        lines.append(f"| {name} | {len(diffs)} | {mean:+.4f} +- {std:.4f} |")
    return lines


def _cell(entry: dict[str, Any], key: str) -> str:
    mean, std = entry[f"{key}_mean"], entry[f"{key}_std"]
    return f"{mean:,.0f} +- {std:,.0f}" if key == "tokens_per_s" else f"{mean:.4f} +- {std:.4f}"


def _markdown(cfg: AblationConfig, table: list[dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    keys = row_keys(rows)
    budget = "real tokens" if cfg.budget == "real" else "tokens"
    lines = [f"# Ablation {cfg.name}", "",
             f"Base `{cfg.base}`, {cfg.tokens:,} {budget} per run, seeds {cfg.seeds}, {cfg.ranks} rank(s) per run. "
             "Mean +- sample std over seeds; held-out figures are from each run's final evaluation.", "",
             "| variant | seeds | tokens | " + " | ".join(TITLES[k] for k in keys) + " |",
             "| --- | ---: | ---: |" + " ---: |" * len(keys)]
    for e in table:
        lines.append(f"| {e['variant']} | {e['seeds']} | {e['tokens']:,} | "
                     + " | ".join(_cell(e, k) for k in keys) + " |")
    derived = [v for v in cfg.variants if v.branch is not None or v.average is not None]
    if derived:
        lines += ["", "Made from another variant's run: " + "; ".join(_derived_line(v) for v in derived) + "."]
    return "\n".join(lines + _per_seed(cfg, rows) + _paired(cfg, rows) + _paired_with_parent(cfg, rows)) + "\n"


def _derived_line(variant: Variant) -> str:
    if variant.branch is not None:
        return (f"`{variant.name}` is a decay branch of `{variant.branch.of}` over its last "
                f"{variant.branch.decay:.0%} of steps ({variant.branch.shape or 'the parent decay shape'})")
    how = f"exponential weights, decay {variant.average.ema}" if variant.average.ema else "uniform"
    return (f"`{variant.name}` is the average of the last {variant.average.last} checkpoint(s) of "
            f"`{variant.average.of}` ({how}; its tokens/s are that run's)")


def eval_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(tokens seen, held-out loss) at each evaluation; tokens from the train record of the same step."""
    records = read_metrics(run_dir / METRICS_FILE)
    tokens = {r["step"]: r["tokens_seen"] for r in records if numbers(r, "tokens_seen")}
    return [(tokens[r["step"]], r["eval_loss"]) for r in records if numbers(r, "eval_loss") and r["step"] in tokens]


def plot_curves(cfg: AblationConfig, runs: list[PlannedRun], path: Path) -> Path | None:
    """Held-out loss against tokens: each variant's mean over seeds, +- std shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant in cfg.variants:
        curves = [eval_curve(r.out_dir) for r in runs if r.variant == variant.name and r.done]
        length = min((len(c) for c in curves), default=0)
        if not length:
            continue
        tokens = [sum(c[i][0] for c in curves) / len(curves) for i in range(length)]
        stats = [_mean_std([c[i][1] for c in curves]) for i in range(length)]
        ax.plot(tokens, [m for m, _ in stats], "o-", label=f"{variant.name} ({len(curves)} seeds)")
        ax.fill_between(tokens, [m - s for m, s in stats], [m + s for m, s in stats], alpha=0.2)
    loss = "held-out loss (generator + rtd.weight x discriminator)" if "eval_rtd_auc" in report_keys(runs) \
        else "held-out MLM loss"
    ax.set(xlabel="tokens seen", ylabel=loss, title=f"ablation {cfg.name}")
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


def write_report(cfg: AblationConfig, runs: list[PlannedRun]) -> list[dict[str, Any]]:
    """``ablation.csv``, ``ablation.md`` and ``ablation.png`` under ``out_dir``; the per-variant table."""
    rows = collect(runs)
    table = aggregate(cfg, rows)
    cfg.root.mkdir(parents=True, exist_ok=True)
    _write_csv(cfg.root / "ablation.csv", rows, table)
    markdown = _markdown(cfg, table, rows)
    (cfg.root / "ablation.md").write_text(markdown)
    plot_curves(cfg, runs, cfg.root / "ablation.png")
    print(markdown, flush=True)
    return table


# ---------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> int:
    return command_main("distaff ablate", _main, argv)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="distaff ablate", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help=f"ablation config: {presets.CONFIG_HELP}")
    parser.add_argument("--report", action="store_true", help="only gather finished runs into the report")
    parser.add_argument("--dry-run", action="store_true", help="print the planned runs' commands, run nothing")
    parser.add_argument(RANKS_FLAG, type=int_arg(RANKS_FLAG, low=1, high=MAX_COUNT), metavar="N",
                        help="allow up to N ranks on this node (ranks x parallel; default: its GPUs, else its cores)")
    args = document_ranges(parser).parse_args(argv)
    cfg = load_ablation(args.config)
    if cfg.launcher == "sequential":        # the runs' ranks all start on this node
        check_ranks_per_node(cfg.ranks * cfg.parallel, f"{args.config}: ranks {cfg.ranks} x parallel {cfg.parallel}",
                             rank_bound(args.max_ranks_per_node, here=True))
    previous = signal.signal(signal.SIGTERM, _interrupt)   # SIGTERM stops like Ctrl-C, whatever is under way
    try:
        if args.dry_run:
            return _ablate(cfg, args)
        # one ablation per out_dir, by the lock runs take: two would run, report and log over each other
        with DirLock(cfg.root, f"{args.config}: out_dir"):
            return _ablate(cfg, args)
    except KeyboardInterrupt as stop:
        how = "SIGTERM" if str(stop) == "SIGTERM" else "Ctrl-C"
        print(f"distaff ablate: interrupted ({how}); the runs in progress saved a checkpoint, finished runs keep "
              f"their summaries; exiting with {EXIT_PREEMPTED} (run the same command again to continue)",
              file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    finally:
        signal.signal(signal.SIGTERM, previous)


def _planned_line(cfg: AblationConfig, run: PlannedRun) -> str:
    """A run's command, or what an average does (in ablate's own process, after its run)."""
    if run.average is None:
        return shlex.join(run_command(cfg, run, 29500))
    ema = ["--ema", str(run.average.ema)] if run.average.ema else []
    return shlex.join(["distaff", "average", str(run.parent.out_dir), "--last", str(run.average.last), *ema,
                       "--out", str(run.out_dir / "checkpoint")]) + "   # then scored on the held-out split"


def _ablate(cfg: AblationConfig, args: argparse.Namespace) -> int:
    if not args.report and not args.dry_run:
        prepare_data(cfg)
    runs = plan_runs(cfg)
    if args.dry_run:
        print("\n".join(_planned_line(cfg, run) for run in runs))
        return 0
    if not args.report and cfg.launcher == "script":
        scripts = write_job_scripts(cfg, runs)
        print(f"distaff ablate: wrote {len(scripts)} job script(s) under {cfg.root / 'jobs'}; start them, then "
              f"run `distaff ablate --config {args.config} --report`")
        return 0
    failures = run_averages(runs) if args.report else run_all(cfg, runs)
    write_report(cfg, runs)
    unfinished = [str(run.out_dir) for run in runs if not run.done]
    if args.report and unfinished:
        print(f"distaff ablate: {len(unfinished)} run(s) not finished, left out of the report: "
              f"{', '.join(unfinished)}", flush=True)
    if failures:
        print("distaff ablate: " + "\n  ".join([f"{len(failures)} run(s) failed (the report has the others):"]
                                               + failures), file=sys.stderr)
        return 1
    print(f"distaff ablate: report in {cfg.root / 'ablation.md'}, {cfg.root / 'ablation.csv'}, "
          f"{cfg.root / 'ablation.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
