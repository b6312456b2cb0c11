"""The fine-tuning run configuration (``distaff finetune --config FT.yaml [key=value ...]``).

Same machinery as pretraining (:mod:`distaff.train.run.config`): typed sections, unknown keys and
wrong types rejected naming the dotted key, ``key=value`` overrides parsed as YAML. The sections
the DeepSpeed engine reads (``data.batch_size``, ``train.grad_accum/precision/grad_clip``,
``optim``, ``zero``, ``deepspeed``) have the same names and meaning as in pretraining.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from distaff.train.run.config import (CheckpointSection, DeepSpeedSection, DistributedSection, LoggingSection,
                                      OptimSection, RunSection, WandbSection, ZeroSection, _check_value, build_sections,
                                      check_engine_sections, check_ranges, check_seed, read_config_values)
from distaff.train.core.errors import ConfigError, reject_unknown_keys, shown
from distaff.train.core.files import check_apart
from distaff.train.finetune.sift import SiftConfig
from distaff.train.model.config import ModelConfig
from distaff.train.run.checkpoint_files import check_apart_from_checkpoints
from distaff.train.run.model_folder import FREE_FIELDS

__all__ = ["ConfigError", "FinetuneConfig", "load_finetune_config", "finetune_config_to_dict"]

CLASSIFICATION_METRICS = ("accuracy", "f1", "mcc", "loss")
REGRESSION_METRICS = ("pearson", "spearman", "loss")
# what a fine-tuning run may change in the encoder it starts from (the Enhanced Mask Decoder is a pretraining part)
FINETUNE_FREE_FIELDS = tuple(name for name in FREE_FIELDS if not name.startswith("emd"))


@dataclass
class LabelledDataSection:
    train: str = ""                     # .tsv, .csv or .jsonl file (optionally .gz): the extension says which
    dev: str = ""                       # "": hold out dev_fraction of train
    dev_fraction: float = 0.0
    split_seed: int = 0                 # which examples dev_fraction holds out
    columns: list[str] = field(default_factory=list)          # names of a header-less TSV/CSV's columns
    tokenizer: str = ""                 # "": the tokenizer saved with model.init_from
    text_column: str = "text"
    text_pair_column: str = ""          # set for sentence pairs
    label_column: str = "label"
    task: Literal["classification", "regression"] = "classification"
    labels: list[str] = field(default_factory=list)           # classification: the label values, in id order
    # classification: a readable name per label value ({0: negative, 1: positive}), the export's id2label
    label_names: dict[str, str] = field(default_factory=dict)
    max_len: int = 128                  # tokens per example, [CLS] and [SEP]s included
    batch_size: int = 16                # examples per micro-batch per rank
    eval_batch_size: int = 0            # 0: batch_size
    # padded: rows padded to the batch's longest example; varlen: the same examples packed end to end
    packing: Literal["padded", "varlen"] = "padded"


@dataclass
class FinetuneModelSection:
    init_from: str = ""                 # a distaff checkpoint / run dir / model folder, or an HF DebertaV2 folder
    pooler_dropout: float = 0.0         # HF's pooler_dropout
    # free ModelConfig fields (dropouts, attention_impl, kernel_impl ...): ``model.<field>=value``
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class FinetuneOptimSection(OptimSection):
    lr: float = 2e-5
    warmup_ratio: float = 0.0           # warmup as a fraction of the run's steps (or optim.warmup_steps)
    # layer-wise lr decay: embeddings and layer i (1..L) get lr * layer_decay ** (L - i), the head lr
    layer_decay: float = 1.0


@dataclass
class FinetuneTrainSection:
    epochs: int = 3
    max_steps: int = 0                  # > 0: this many optimizer steps instead of epochs
    grad_accum: int = 1
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    grad_clip: float = 1.0
    max_nonfinite_steps: int = 10


@dataclass
class FinetuneEvalSection:
    every: int = 0                      # optimizer steps between dev evaluations; 0: at the end of every epoch
    metric: str = ""                    # what "best" means; "": accuracy (classification), pearson (regression)
    patience: int = 0                   # stop after this many evaluations without a better metric; 0: never


@dataclass
class FinetuneConfig:
    run: RunSection = field(default_factory=lambda: RunSection(out_dir="runs/finetune", name="finetune"))
    model: FinetuneModelSection = field(default_factory=FinetuneModelSection)
    data: LabelledDataSection = field(default_factory=LabelledDataSection)
    train: FinetuneTrainSection = field(default_factory=FinetuneTrainSection)
    optim: FinetuneOptimSection = field(default_factory=FinetuneOptimSection)
    eval: FinetuneEvalSection = field(default_factory=FinetuneEvalSection)
    checkpoint: CheckpointSection = field(default_factory=lambda: CheckpointSection(every=0, keep=1))
    sift: SiftConfig = field(default_factory=SiftConfig)
    zero: ZeroSection = field(default_factory=ZeroSection)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    wandb: WandbSection = field(default_factory=WandbSection)

    @property
    def out_dir(self) -> Path:
        return Path(self.run.out_dir)

    @property
    def regression(self) -> bool:
        return self.data.task == "regression"

    @property
    def metric(self) -> str:
        """The dev metric that picks the best checkpoint and drives early stopping."""
        return self.eval.metric or ("pearson" if self.regression else "accuracy")


def _build_model_section(values: Any) -> FinetuneModelSection:
    if not isinstance(values, dict):
        raise ConfigError(f"model: expected a mapping, got {shown(values)}")
    values = dict(values)
    init_from = _check_value("model.init_from", values.pop("init_from", ""), str)
    pooler_dropout = _check_value("model.pooler_dropout", values.pop("pooler_dropout", 0.0), float)
    reject_unknown_keys(values, (f.name for f in fields(ModelConfig)), "unknown config key(s)", "model.",
                        " (not ModelConfig fields)")
    fixed = sorted(set(values) - set(FINETUNE_FREE_FIELDS))
    if fixed:
        raise ConfigError(f"model.{fixed[0]}: fine-tuning keeps the architecture of model.init_from; only "
                          f"{list(FINETUNE_FREE_FIELDS)} may be set")
    return FinetuneModelSection(init_from=init_from, pooler_dropout=pooler_dropout, overrides=values)


def _validate(cfg: FinetuneConfig) -> None:
    data, train, optim = cfg.data, cfg.train, cfg.optim
    check_ranges(
        positive={"data.max_len": data.max_len, "data.batch_size": data.batch_size,
                  "train.grad_accum": train.grad_accum,
                  "train.max_nonfinite_steps": train.max_nonfinite_steps, "logging.every": cfg.logging.every,
                  "checkpoint.keep": cfg.checkpoint.keep, "distributed.timeout_s": cfg.distributed.timeout_s,
                  "optim.lr": optim.lr, "optim.layer_decay": optim.layer_decay},
        non_negative={"data.eval_batch_size": data.eval_batch_size,
                      "train.epochs": train.epochs, "train.max_steps": train.max_steps,
                      "train.grad_clip": train.grad_clip, "optim.warmup_steps": optim.warmup_steps,
                      "optim.weight_decay": optim.weight_decay, "eval.every": cfg.eval.every,
                      "eval.patience": cfg.eval.patience, "checkpoint.every": cfg.checkpoint.every,
                      "distributed.watchdog_s": cfg.distributed.watchdog_s})
    check_engine_sections(cfg)
    check_seed("data.split_seed", data.split_seed)
    for key in ("train", "init_from"):
        section = "data" if key == "train" else "model"
        if not getattr(getattr(cfg, section), key):
            raise ConfigError(f"{section}.{key}: required")
    if not train.epochs and not train.max_steps:
        raise ConfigError("train.epochs and train.max_steps are both 0: set one of them")
    if optim.layer_decay > 1.0:
        raise ConfigError(f"optim.layer_decay: must be in (0, 1], got {optim.layer_decay}")
    if not 0.0 <= optim.warmup_ratio < 1.0:
        raise ConfigError(f"optim.warmup_ratio: must be in [0, 1), got {optim.warmup_ratio}")
    if optim.warmup_ratio and optim.warmup_steps:
        raise ConfigError("optim.warmup_ratio and optim.warmup_steps: set one of them, not both")
    if not 0.0 <= data.dev_fraction < 1.0:
        raise ConfigError(f"data.dev_fraction: must be in [0, 1), got {data.dev_fraction}")
    if bool(data.dev) == bool(data.dev_fraction):
        raise ConfigError("data.dev and data.dev_fraction: give a dev file or a fraction of data.train to hold out "
                          "(exactly one)")
    if cfg.regression and (data.labels or data.label_names):
        raise ConfigError(f"data.{'labels' if data.labels else 'label_names'}: a regression task has numeric "
                          "targets, not labels")
    for value, name in data.label_names.items():
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"data.label_names.{value}: must be a non-empty name, got {shown(name)}")
    allowed = REGRESSION_METRICS if cfg.regression else CLASSIFICATION_METRICS
    if cfg.metric not in allowed:
        raise ConfigError(f"eval.metric: {cfg.metric!r} is not a {data.task} metric; choose one of {list(allowed)}")
    # the run writes, and rotates checkpoints, in run.out_dir: what it reads must lie elsewhere (beside a pretraining
    # run's checkpoints is fine)
    out_dir = ("run.out_dir", cfg.run.out_dir)
    check_apart_from_checkpoints(out_dir, [("model.init_from", cfg.model.init_from)], ConfigError)
    check_apart(out_dir, [("data.train", data.train), ("data.dev", data.dev), ("data.tokenizer", data.tokenizer)],
                error=ConfigError)


def finetune_config_from_dict(values: dict[str, Any]) -> FinetuneConfig:
    """A validated :class:`FinetuneConfig` from nested plain values (YAML after overrides)."""
    cfg = build_sections(FinetuneConfig, values, _build_model_section)
    _validate(cfg)
    return cfg


def load_finetune_config(path: str | Path | None, overrides: list[str] = ()) -> FinetuneConfig:
    """Read a YAML fine-tuning config and apply ``key=value`` overrides."""
    return finetune_config_from_dict(read_config_values(path, overrides, kind="finetune"))


def finetune_config_to_dict(cfg: FinetuneConfig) -> dict[str, Any]:
    """Plain nested values that :func:`finetune_config_from_dict` turns back into ``cfg``."""
    values = dataclasses.asdict(cfg)
    values["model"] = {"init_from": cfg.model.init_from, "pooler_dropout": cfg.model.pooler_dropout,
                       **cfg.model.overrides}
    return values


def save_finetune_config(cfg: FinetuneConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(finetune_config_to_dict(cfg), sort_keys=False))
