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

The report, read back from each run's ``summary.json`` and ``metrics.jsonl``: ``ablation.csv``
(one row per run and one per variant), ``ablation.md`` (held-out loss and MLM accuracy mean +- std
over seeds, tokens/s; each variant's per-seed difference in held-out loss against the first
variant, mean +- std) and ``ablation.png`` (held-out loss against tokens seen). The runs share the
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
    variants:
      - name: relative+emd
        overrides: {model.emd: true}
      - name: absolute
        overrides: {model.relative_attention: false, model.pos_att_type: [], model.position_biased_input: true}
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
from distaff.train.core.errors import RunFailure, command_main, shown
from distaff.train.core.exit_codes import EXIT_PREEMPTED
from distaff.train.core.files import read_text
from distaff.train.core.runlock import DirLock
from distaff.train.core.threads import RANKS_FLAG, busy_cores, check_ranks_per_node, plan_threads, rank_bound
from distaff.train.data.errors import DataError
from distaff.train.run.config import (ConfigError, RunConfig, changed_keys, config_file, config_fingerprint,
                                     config_to_dict, fingerprinted, load_config)
from distaff.train.run.metrics import save_figure
from distaff.train.run.runtime import SUMMARY_FILE

LAUNCHERS = ("sequential", "script")
REPORT_KEYS = ("eval_loss", "eval_accuracy", "tokens_per_s")
POLL_S = 0.5                    # how often the runs in progress are checked
STOP_TIMEOUT_S = 120            # a run sent SIGTERM has this long to save its checkpoint and exit


@dataclass
class PrepareSection:
    input: list[str]
    vocab_size: int = 4000
    seq_len: int = 128
    heldout_fraction: float = 0.02
    shard_mb: float = 0.2


@dataclass
class Variant:
    name: str
    overrides: dict[str, Any] = field(default_factory=dict)


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
             "list[str]": (list, str)}  # one path or several
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
    return variants


def _check_ranges(source: str, cfg: AblationConfig) -> None:
    for key in ("tokens", "evals", "ranks", "parallel"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"{source}: {key}: must be positive, got {getattr(cfg, key)}")
    if not cfg.seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in cfg.seeds):
        raise ConfigError(f"{source}: seeds: expected a non-empty list of integers, got {shown(cfg.seeds)}")
    if len(set(cfg.seeds)) != len(cfg.seeds):
        raise ConfigError(f"{source}: seeds: repeated seed in {cfg.seeds}")
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
        config_file(cfg.base, "run")        # runs read it by the same name, a preset's included
    except ConfigError as err:
        raise ConfigError(f"{source}: base: {err}") from None
    for variant in cfg.variants:
        try:
            variant_config(cfg, variant, cfg.seeds[0])
        except ConfigError as err:
            raise ConfigError(f"{source}: variants[{variant.name}]: {err}") from None
    return cfg


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
              str(section.seq_len), "--pack-documents", "--heldout-fraction", str(section.heldout_fraction),
              "--shard-mb", str(section.shard_mb), "--out", str(data), "--no-progress"]]
    for step in steps:
        print(f"distaff ablate: {shlex.join(['distaff', *step])}", flush=True)
        if subprocess.run(cli + step).returncode != 0:
            raise RunFailure(f"data preparation failed: distaff {' '.join(step[:2])} (its error is above)")
    return data


def plan_runs(cfg: AblationConfig) -> list[PlannedRun]:
    """One run per variant and seed, seed by seed (so unfinished ablations hold paired results), each
    with the step count that spends the token budget."""
    from distaff.train.data.manifest import read_manifest

    runs = []
    for seed in cfg.seeds:
        for variant in cfg.variants:
            run_cfg = variant_config(cfg, variant, seed)
            seq_len = cfg.prepare.seq_len if cfg.prepare is not None else read_manifest(run_cfg.data.dir).seq_len
            per_step = run_cfg.data.batch_size * run_cfg.train.grad_accum * cfg.ranks * seq_len
            max_steps = max(1, math.ceil(cfg.tokens / per_step))
            every = max(1, max_steps // cfg.evals)
            out_dir = cfg.root / "runs" / variant.name / f"seed-{seed}"
            extra = {"run.out_dir": str(out_dir), "run.name": f"{variant.name}-seed-{seed}",
                     "train.max_steps": max_steps, "eval.every": every, "logging.every": every,
                     "wandb.group": cfg.name, "wandb.name": f"{variant.name}-seed-{seed}"}
            resolved = variant_config(cfg, variant, seed, extra)  # the exact config the run will read, checked
            config = json.loads(json.dumps(fingerprinted(config_to_dict(resolved)), default=str))  # as summary.json has it
            runs.append(PlannedRun(variant.name, seed, out_dir, run_overrides(cfg, variant, seed, extra), max_steps,
                                   config))
    return runs


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
        else:
            resumed = " (not finished before: resuming)" if run.summary() is not None else ""
            jobs.append((label + resumed, run_command(cfg, run, free_port()), run))
    return run_parallel(jobs, cfg.parallel, _run_env(cfg.ranks, cfg.parallel))


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
            while queue and len(running) < parallel:
                label, command, run = queue.pop(0)
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
        if run.done:
            continue
        script = jobs / f"{run.variant}-seed-{run.seed}.sh"
        command = run_command(cfg, run, 29500 + len(written))
        script.write_text("#!/usr/bin/env bash\n# distaff ablate job: one run of the ablation "
                          f"{cfg.name!r}\nset -euo pipefail\ncd {shlex.quote(os.getcwd())}\n"
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


def collect(runs: list[PlannedRun]) -> list[dict[str, Any]]:
    """Each finished run's summary figures (unfinished runs, and runs of another length, are left out)."""
    rows = []
    for run in runs:
        if not run.done:
            continue
        summary = run.summary()
        missing = [k for k in REPORT_KEYS if summary.get(k) is None]
        if missing:
            raise DataError(f"{run.summary_path}: no {missing} (did the run evaluate?)")
        rows.append({"variant": run.variant, "seed": run.seed, "steps": summary["steps"],
                     "tokens": summary["tokens"], **{k: summary[k] for k in REPORT_KEYS}})
    return rows


def aggregate(cfg: AblationConfig, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per variant (in config order): seeds finished and each figure's mean and std over them."""
    table = []
    for variant in cfg.variants:
        mine = [r for r in rows if r["variant"] == variant.name]
        if not mine:
            continue
        entry: dict[str, Any] = {"variant": variant.name, "seeds": len(mine),
                                 "tokens": round(sum(r["tokens"] for r in mine) / len(mine))}
        for key in REPORT_KEYS:
            entry[f"{key}_mean"], entry[f"{key}_std"] = _mean_std([float(r[key]) for r in mine])
        table.append(entry)
    return table


def _write_csv(path: Path, rows: list[dict[str, Any]], table: list[dict[str, Any]]) -> None:
    """Per-variant rows (seed ``all``) then per-run rows, one header for both."""
    header = ["variant", "seed", "seeds", "steps", "tokens"] + [f"{k}{s}" for k in REPORT_KEYS
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


def _paired(cfg: AblationConfig, rows: list[dict[str, Any]]) -> list[str]:
    lines = ["", f"Held-out loss minus `{cfg.variants[0].name}`'s, paired by seed (mean +- sample std over the "
             "seeds both finished; negative: lower loss):", "", "| variant | pairs | difference |", "| --- | ---: | ---: |"]
    for name, diffs in paired_differences(cfg, rows).items():
        mean, std = _mean_std(diffs) if diffs else (math.nan, math.nan)
        lines.append(f"| {name} | {len(diffs)} | {mean:+.4f} +- {std:.4f} |")
    return lines


def _markdown(cfg: AblationConfig, table: list[dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    lines = [f"# Ablation {cfg.name}", "",
             f"Base `{cfg.base}`, {cfg.tokens:,} tokens per run, seeds {cfg.seeds}, {cfg.ranks} rank(s) per run. "
             "Mean +- sample std over seeds; held-out figures are from each run's final evaluation.", "",
             "| variant | seeds | tokens | held-out loss | held-out MLM accuracy | tokens/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for e in table:
        lines.append(f"| {e['variant']} | {e['seeds']} | {e['tokens']:,} | {e['eval_loss_mean']:.4f} +- "
                     f"{e['eval_loss_std']:.4f} | {e['eval_accuracy_mean']:.4f} +- {e['eval_accuracy_std']:.4f} "
                     f"| {e['tokens_per_s_mean']:,.0f} +- {e['tokens_per_s_std']:,.0f} |")
    return "\n".join(lines + _per_seed(cfg, rows) + _paired(cfg, rows)) + "\n"


def eval_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(tokens seen, held-out loss) at each evaluation; tokens from the train record of the same step."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tokens = {r["step"]: r["tokens_seen"] for r in records if "tokens_seen" in r}
    return [(tokens[r["step"]], r["eval_loss"]) for r in records if "eval_loss" in r and r["step"] in tokens]


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
    ax.set(xlabel="tokens seen", ylabel="held-out MLM loss", title=f"ablation {cfg.name}")
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
    parser.add_argument(RANKS_FLAG, type=int, metavar="N",
                        help="allow up to N ranks on this node (ranks x parallel; default: its GPUs, else its cores)")
    args = parser.parse_args(argv)
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


def _ablate(cfg: AblationConfig, args: argparse.Namespace) -> int:
    if not args.report and not args.dry_run:
        prepare_data(cfg)
    runs = plan_runs(cfg)
    if args.dry_run:
        print("\n".join(shlex.join(run_command(cfg, run, 29500)) for run in runs))
        return 0
    if not args.report and cfg.launcher == "script":
        scripts = write_job_scripts(cfg, runs)
        print(f"distaff ablate: wrote {len(scripts)} job script(s) under {cfg.root / 'jobs'}; start them, then "
              f"run `distaff ablate --config {args.config} --report`")
        return 0
    failures = [] if args.report else run_all(cfg, runs)
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
