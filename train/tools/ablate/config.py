"""An ablation's file (``ABL.yaml``) read and checked, and each variant's run config: what a run of a variant and
seed is given (``run_overrides``, ``variant_config``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from distaff.train.core.config_yaml import load_yaml
from distaff.train.core.errors import shown
from distaff.train.core.files import check_apart, read_text
from distaff.train.run.config import ConfigError, RunConfig, config_file, load_config, read_config_values
from distaff.train.tools.ablate.derived import (AverageSpec, BranchSpec, branch_overrides, parent_overrides,
                                                parse_spec)

LAUNCHERS = ("sequential", "script")
BUDGETS = ("positions", "real")
# a run's config as far as its step count goes (batch, accumulation, packing): whatever its schedule
SIZING = {"optim.schedule": "linear", "optim.decay_start": 0, "optim.decay_steps": 0}


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
    branch: BranchSpec | None = None    # a decay branch of another variant's run (derived.py)
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
        extra.update(parent_extra(cfg, variant, seed, steps))
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


def parent_extra(cfg: AblationConfig, variant: Variant, seed: int, max_steps: int) -> dict[str, Any]:
    """What the run of a variant others branch from or average needs (``derived.parent_overrides``)."""
    branches = [v.branch for v in cfg.variants if v.branch is not None and v.branch.of == variant.name]
    averages = [v.average for v in cfg.variants if v.average is not None and v.average.of == variant.name]
    if not branches and not averages:
        return {}
    sized = variant_config(cfg, variant, seed, {**SIZING, "train.max_steps": max_steps})
    optim = read_config_values(config_file(cfg.base, "run"), run_overrides(cfg, variant, seed)).get("optim") or {}
    return parent_overrides(variant.name, optim, sized.checkpoint, max_steps, branches, averages)


