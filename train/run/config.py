"""The pretraining run configuration: typed sections read from YAML plus dotted ``key=value`` overrides.

Every key is checked against the dataclasses below: an unknown key or a value of the wrong type
is a :class:`ConfigError` naming the dotted key. The ``model`` section is a preset name plus any
:class:`~distaff.train.model.config.ModelConfig` field, validated by the model config itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import re
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Literal

import yaml

from distaff.train.core import presets
from distaff.train.core.config_yaml import load_yaml
from distaff.train.core.errors import ConfigError, closest, finite_float, reject_unknown_keys, shown
from distaff.train.core.files import check_apart, place, read_text
from distaff.train.data.collator import MaskingConfig
from distaff.train.model.config import ModelConfig, load_model_config
from distaff.train.run.schedule import wsd_window

__all__ = ["ConfigError", "RunConfig", "load_config", "parse_overrides", "save_config", "config_to_dict"]


MAX_SEED = 2**32 - 1      # numpy's generators take seeds up to this; torch's up to 2^64 - 1, the rank's offset included


@dataclass
class RunSection:
    out_dir: str = "runs/distaff"
    name: str = "distaff"
    seed: int = 1234


@dataclass
class ModelSection:
    preset: str = "tiny"
    # a model folder (`distaff grow` output, or Hugging Face) whose weights and architecture the run starts from
    init_from: str = ""
    # ModelConfig fields to change from the preset (``model.<field>=value``)
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class SourceSection:
    """One prepared dataset of a mixture and its share of the micro-batches (docs/data.md, "Several sources")."""
    dir: str = ""
    weight: float = 1.0


@dataclass
class DataSection:
    dir: str = ""                       # output of `distaff data prepare`
    # instead of `dir`: several prepared datasets (one tokenizer, one seq_len) mixed by weight
    sources: list[SourceSection] = field(default_factory=list)
    batch_size: int = 8                 # micro-batch per rank
    num_workers: int = 0
    eval_batch_size: int = 0            # 0: same as batch_size
    # padded: batch_size rows of seq_len; varlen: whole samples packed end to end (cu_seqlens) up to
    # tokens_per_batch tokens, attention per sample (docs/pretraining.md, "Packed training")
    packing: Literal["padded", "varlen"] = "padded"
    tokens_per_batch: int = 0           # varlen only; 0: batch_size x the data's seq_len
    masking: MaskingConfig = field(default_factory=MaskingConfig)

    def token_budget(self, seq_len: int, eval: bool = False) -> int:
        """Tokens per packed batch (0 for padded batches); eval batches hold eval_batch_size rows' worth."""
        if self.packing == "padded":
            return 0
        if eval:
            return (self.eval_batch_size or self.batch_size) * seq_len
        return self.tokens_per_batch or self.batch_size * seq_len

    @property
    def first_dir(self) -> str:
        """``dir``, or the first source's: the data whose tokenizer the model takes and whose held-out split
        evaluations read."""
        return self.dir or (self.sources[0].dir if self.sources else "")


@dataclass
class BatchWarmupSection:
    """The global batch grows from ``start`` sequences in steps of ``start`` to its full size, each size held
    for the same number of steps, over ``tokens`` (sequences x seq_len); ``start: 0`` is off
    (train/run/schedule.py, docs/pretraining.md "Batch-size warmup")."""
    start: int = 0
    tokens: int = 0


@dataclass
class TrainSection:
    max_steps: int = 1000               # optimizer steps
    grad_accum: int = 1
    batch_warmup: BatchWarmupSection = field(default_factory=BatchWarmupSection)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    grad_clip: float = 1.0              # 0 disables clipping
    max_nonfinite_steps: int = 10       # stop after this many skipped (non-finite loss) steps in a row
    # mlm: masked-LM; rtd: DeBERTa-v3's replaced-token detection (generator + discriminator, see `rtd`);
    # tta: T-TA's all-token objective (unmasked input, every token a target; sets model.tta, drops EMD)
    objective: Literal["mlm", "rtd", "tta"] = "mlm"


@dataclass
class RTDSection:
    """``train.objective=rtd`` only. The ``model`` section is the discriminator (the model exported)."""
    weight: float = 50.0                # total loss = generator MLM loss + weight x RTD loss
    embedding_sharing: Literal["none", "es", "gdes"] = "gdes"
    # how the two losses combine (train/model/loss_weighting.py): fixed (1 and `weight`), initial (each
    # over its first-step value, times those weights), uncertainty (learned, Kendall et al. 2018)
    loss_weighting: Literal["fixed", "initial", "uncertainty"] = "fixed"
    # the generator: ``preset`` and/or ModelConfig fields; empty = the discriminator's config with
    # half its layers (the DeBERTa-v3 paper's generator)
    generator: dict[str, Any] = field(default_factory=dict)
    # an HF folder (a public DeBERTa-v3 checkpoint, or one export-hf wrote) whose weights, RTD head
    # included when present, start the discriminator; shared embeddings start the generator's table
    init_discriminator: str = ""


@dataclass
class OptimSection:
    lr: float = 1e-4
    warmup_steps: int = 0
    schedule: Literal["linear", "cosine"] = "linear"
    min_lr_ratio: float = 0.0           # final lr as a fraction of lr
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    eps: float = 1e-6


@dataclass
class PretrainOptimSection(OptimSection):
    """Pretraining's schedules add warmup-stable-decay (docs/pretraining.md, "Warmup-stable-decay")."""
    schedule: Literal["linear", "cosine", "wsd"] = "linear"
    decay_start: int = 0                # wsd: the decay's first step; 0: train.max_steps - decay_steps
    decay_steps: int = 0                # wsd: the decay's length; 0: from decay_start to train.max_steps
    decay_shape: Literal["linear", "cosine", "1-sqrt"] = "1-sqrt"


@dataclass
class ZeroSection:
    stage: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False


@dataclass
class DeepSpeedSection:
    # a DeepSpeed JSON file deep-merged over the generated config (experts only)
    config: str = ""
    # DeepSpeed's shared-memory allreduce for CPU ranks; off by default because its first use
    # compiles a C++ op (~60-90 s) and gloo is enough for CPU runs
    cpu_shm_comm: bool = False


@dataclass
class DistributedSection:
    timeout_s: int = 300                # a collective waiting longer than this fails the job
    # a rank with no step progress for this long dumps its stacks and exits (0: timeout_s)
    watchdog_s: int = 0


@dataclass
class LoggingSection:
    every: int = 10
    progress_bar: bool = True           # tqdm bar on rank 0, when stderr is a terminal
    plot: bool = True
    tensorboard: bool = False           # TensorBoard event files in <run.out_dir>/tensorboard (the tensorboard extra)


@dataclass
class WandbSection:
    mode: Literal["online", "offline", "disabled"] = "offline"
    project: str = "distaff"
    name: str = ""                      # "": run.name
    group: str = ""
    tags: list[str] = field(default_factory=list)


@dataclass
class EvalSection:
    every: int = 0                      # 0: only at the end
    batches: int = 50                   # 0: the whole held-out split


@dataclass
class CheckpointSection:
    every: int = 1000                   # 0: only at the end and on preemption
    keep: int = 3
    resume: str = "auto"                # auto | none | PATH to a checkpoint directory
    # a checkpoint of another run that this one continues from, exactly as a resume, until it has a checkpoint
    # of its own (resume=auto only); `distaff decay` sets it to the parent's checkpoint
    branch_from: str = ""


# ``evals``: evaluations attached to the run's checkpoints (train/pretrain/attached_evals.py runs them,
# train/tools/evals/ holds the runner and ``distaff evals``; docs/pretraining.md, "Evaluations attached to checkpoints")
EVAL_KINDS = ("probe", "finetune", "heldout")
# train/tools/probe_tasks.py's TASKS and train/finetune/config.py's metrics (this layer may not import them;
# tests/pretrain/test_evals_config.py keeps them equal)
PROBE_TASKS = ("bshift", "coordinv", "sentlen", "wc")
FINETUNE_METRICS = ("accuracy", "f1", "mcc", "loss", "pearson", "spearman")
# the settings of each kind; name, kind, seeds and every are every kind's
EVAL_KIND_FIELDS = {"probe": ("text", "text_column", "probe_tasks", "max_sentences"),
                    "finetune": ("train", "dev", "dev_fraction", "config", "max_steps", "metric", "overrides"),
                    "heldout": ("data", "batches")}
# what a fine-tuning evaluation sets itself (its checkpoint, its files, its seed, its folder, its budget)
EVAL_FINETUNE_KEYS = ("model.init_from", "data.train", "data.dev", "data.dev_fraction", "run.seed", "run.out_dir",
                      "train.max_steps")


@dataclass
class EvalTaskSection:
    """One evaluation of the run's checkpoints: ``name`` (its records, its W&B charts eval/<name>/), ``kind``, the
    ``seeds`` it runs with, and its kind's settings."""
    name: str = ""
    kind: str = ""                      # probe | finetune | heldout
    seeds: list[int] = field(default_factory=lambda: [1])
    every: int = 0                      # checkpoints whose step is a multiple of this (0: evals.every), and the last
    # probe: `distaff probe`'s tasks built from the sentences of a text file, a linear probe of the frozen encoder
    text: str = ""
    text_column: str = ""               # a TSV/CSV text's column (header name or 0-based index); JSONL: its field
    probe_tasks: list[Literal["bshift", "coordinv", "sentlen", "wc"]] = field(default_factory=lambda: ["bshift"])
    max_sentences: int = 0              # 0: every held-out sentence
    # finetune: `distaff finetune` of the checkpoint on a labelled TSV/CSV/JSONL file, scored on dev
    train: str = ""
    dev: str = ""
    dev_fraction: float = 0.0           # instead of dev: this share of train held out (split by the seed)
    config: str = "probe-cpu"           # the fine-tuning config: a finetune preset or a YAML file
    max_steps: int = 0                  # 0: the fine-tuning config's
    metric: str = ""                    # "": the fine-tuning config's eval metric
    overrides: list[str] = field(default_factory=list)   # key=value for the fine-tuning config
    # heldout: the pretraining objective's held-out figures on another prepared dataset (same tokenizer)
    data: str = ""
    batches: int = 20                   # 0: the whole held-out split


@dataclass
class EvalsSlurmSection:
    """``evals.mode: slurm``: what each checkpoint's evaluation job asks for (launch/eval_jobs.py)."""
    cpus: int = 2
    mem: str = "8G"                     # per node, Slurm syntax
    gpus: int = 0
    time: str = ""                      # "": the partition's limit
    partition: str = ""
    account: str = ""
    sbatch: list[str] = field(default_factory=list)     # extra #SBATCH options, e.g. --qos=low


@dataclass
class EvalsSection:
    every: int = 0                      # checkpoints whose step is a multiple of this, and the last (0: the last)
    mode: Literal["inline", "side", "slurm"] = "side"
    tasks: list[EvalTaskSection] = field(default_factory=list)
    timeout_s: int = 3600               # an evaluation process running longer is stopped (and retried)
    retries: int = 1                    # a failed, killed or stopped evaluation process is run again this often
    threads: int = 1                    # side: the evaluation process's CPU threads (it runs at nice 19, on CPU)
    slurm: EvalsSlurmSection = field(default_factory=EvalsSlurmSection)


@dataclass
class PhaseSection:
    """From step ``at_step`` on (steps done before it), the run trains with these; 0 or empty keeps the previous
    phase's value (train/run/schedule.py, docs/pretraining.md "Phases")."""
    at_step: int = 0
    sources: list[SourceSection] = field(default_factory=list)
    seq_len: int = 0                    # a check: the phase's sources must be prepared at this length
    mask_rate: float = 0.0              # data.masking.mlm_probability
    global_batch: int = 0               # sequences per optimizer step, over all ranks
    batch_size: int = 0                 # micro-batch per rank


@dataclass
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    optim: PretrainOptimSection = field(default_factory=PretrainOptimSection)
    zero: ZeroSection = field(default_factory=ZeroSection)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    wandb: WandbSection = field(default_factory=WandbSection)
    eval: EvalSection = field(default_factory=EvalSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    rtd: RTDSection = field(default_factory=RTDSection)
    phases: list[PhaseSection] = field(default_factory=list)
    evals: EvalsSection = field(default_factory=EvalsSection)

    @property
    def out_dir(self) -> Path:
        return Path(self.run.out_dir)

    def model_config(self, **fixed: Any) -> ModelConfig:
        """The model preset with the run's overrides; ``fixed`` (e.g. the tokenizer's vocab size) last.

        Pretraining turns the Enhanced Mask Decoder on unless the run says ``model.emd: false``.
        """
        try:
            if self.model.init_from:  # the architecture is the folder's; the preset is not used
                from distaff.train.run.model_folder import init_model_config

                return init_model_config(self.model.init_from, self.model.overrides, fixed)
            cfg = load_model_config(self.model.preset, **{"emd": True, **self.model.overrides, **fixed})
        except ConfigError as err:
            raise ConfigError(f"model: {err}") from None
        if cfg.pos_att_type and not cfg.relative_attention:
            # Hugging Face accepts this (and only rescales attention by the unused terms); a new run means a mistake
            raise ConfigError(f"model.pos_att_type {cfg.pos_att_type} needs model.relative_attention: true; for "
                              "absolute positions or RoPE alone set model.pos_att_type: [] (content-only attention)")
        return cfg

    def generator_config(self, discriminator: ModelConfig) -> ModelConfig:
        """The RTD generator: ``rtd.generator`` (a preset and/or fields) over the discriminator's config
        with half its layers; vocabulary and padding are the discriminator's, and so is the embedding
        width when the embeddings are shared (a narrower generator projects them)."""
        values = dict(self.rtd.generator)
        preset = values.pop("preset", None)
        fixed = {"vocab_size": discriminator.vocab_size, "pad_token_id": discriminator.pad_token_id}
        if self.rtd.embedding_sharing != "none":
            fixed["embedding_size"] = values.pop("embedding_size", discriminator.embedding_size)
        try:
            if preset is not None:
                return load_model_config(str(preset), **{"emd": discriminator.emd, **values, **fixed})
            base = {**discriminator.to_dict(), "num_hidden_layers": max(1, discriminator.num_hidden_layers // 2)}
            if "hidden_size" in values and "embedding_size" not in fixed:
                base["embedding_size"] = None       # unshared: the generator's own width
            return ModelConfig.from_dict({**base, **values, **fixed}, "rtd.generator")
        except ConfigError as err:
            raise ConfigError(f"rtd.generator: {err}") from None


# ---------------------------------------------------------------- building from plain values

def _check_value(key: str, value: Any, annotation: Any) -> Any:
    """``value`` if it fits ``annotation`` (after the one coercion YAML needs: '1e-4' -> float)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: must be one of {list(args)}, got {shown(value)}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: must be a mapping, got {shown(value)} ({type(value).__name__})")
        return value
    if origin is list:
        if value is None:       # `key=null` (or `key:` in a file) unsets a preset's list: data.columns=null
            return []
        if not isinstance(value, list):
            raise ConfigError(f"{key}: must be a list, got {shown(value)} ({type(value).__name__})")
        return [_check_value(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(annotation):
        return _build(annotation, value, f"{key}.")
    if annotation is float:
        # YAML 1.1 reads "1e-4" as a string; .inf / .nan would pass every range check and poison the run silently
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return finite_float(value, key)
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, annotation):
        return value
    raise ConfigError(f"{key}: must be of type {annotation.__name__}, got {shown(value)} ({type(value).__name__})")


def _build(cls: type, values: Any, prefix: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {shown(values)}")
    hints = typing.get_type_hints(cls)
    known = sorted(f.name for f in fields(cls))
    reject_unknown_keys(values, known, "unknown config key(s)", prefix, f" (known keys: {known})")
    kwargs = {}
    for name, value in values.items():
        annotation = hints[name]
        if dataclasses.is_dataclass(annotation):
            kwargs[name] = _build(annotation, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _check_value(prefix + name, value, annotation)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as err:  # a component's own validation (e.g. MaskingConfig): name the section
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {err}") from None


def _build_model_section(values: Any) -> ModelSection:
    if not isinstance(values, dict):
        raise ConfigError(f"model: expected a mapping, got {shown(values)}")
    values = dict(values)
    preset = _check_value("model.preset", values.pop("preset", ModelSection.preset), str)
    init_from = _check_value("model.init_from", values.pop("init_from", ModelSection.init_from), str)
    reject_unknown_keys(values, (f.name for f in fields(ModelConfig)), "unknown config key(s)", "model.",
                        " (not ModelConfig fields)")
    return ModelSection(preset=preset, init_from=init_from, overrides=values)


def check_ranges(positive: dict[str, float], non_negative: dict[str, float]) -> None:
    """Each dotted key's value must be > 0 (``positive``) or >= 0 (``non_negative``)."""
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}: must be positive, got {value}")
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"{key}: must be >= 0, got {value}")


def check_seed(key: str, seed: int) -> None:
    if not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"{key}: must be a whole number from 0 to {MAX_SEED} (2^32 - 1), got {shown(seed)}")


def check_engine_sections(cfg: Any) -> None:
    """The ``zero``, ``optim`` and ``run`` settings every DeepSpeed run shares (pretraining, fine-tuning)."""
    if cfg.zero.stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero.stage: must be 0, 1, 2 or 3, got {cfg.zero.stage}")
    if cfg.zero.offload_param and cfg.zero.stage != 3:
        raise ConfigError("zero.offload_param: parameter offload needs zero.stage=3")
    if cfg.zero.offload_optimizer and cfg.zero.stage == 0:
        raise ConfigError("zero.offload_optimizer: optimizer offload needs zero.stage >= 1")
    if not 0.0 <= cfg.optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio: must be in [0, 1], got {cfg.optim.min_lr_ratio}")
    if len(cfg.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optim.betas):
        raise ConfigError(f"optim.betas: must be two values in [0, 1), got {cfg.optim.betas}")
    if not cfg.run.out_dir:
        raise ConfigError("run.out_dir: required")
    check_seed("run.seed", cfg.run.seed)
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("logging.tensorboard: the tensorboard package is not installed; pip install "
                          "'distaff[tensorboard]' (the tensorboard extra), or set logging.tensorboard=false")


def _validate(cfg: RunConfig) -> None:
    check_ranges(
        positive={"data.batch_size": cfg.data.batch_size, "train.max_steps": cfg.train.max_steps,
                  "train.grad_accum": cfg.train.grad_accum, "train.max_nonfinite_steps": cfg.train.max_nonfinite_steps,
                  "logging.every": cfg.logging.every,
                  "checkpoint.keep": cfg.checkpoint.keep, "distributed.timeout_s": cfg.distributed.timeout_s,
                  "optim.lr": cfg.optim.lr, "rtd.weight": cfg.rtd.weight},
        non_negative={"data.num_workers": cfg.data.num_workers, "data.eval_batch_size": cfg.data.eval_batch_size,
                      "data.tokens_per_batch": cfg.data.tokens_per_batch,
                      "optim.warmup_steps": cfg.optim.warmup_steps, "optim.weight_decay": cfg.optim.weight_decay,
                      "optim.decay_start": cfg.optim.decay_start, "optim.decay_steps": cfg.optim.decay_steps,
                      "train.grad_clip": cfg.train.grad_clip, "eval.every": cfg.eval.every,
                      "eval.batches": cfg.eval.batches, "checkpoint.every": cfg.checkpoint.every,
                      "distributed.watchdog_s": cfg.distributed.watchdog_s})
    check_engine_sections(cfg)
    if not cfg.data.dir and not cfg.data.sources:
        raise ConfigError("data.dir: required (a folder written by `distaff data prepare`), or data.sources")
    if cfg.data.dir and cfg.data.sources:
        raise ConfigError("data.dir and data.sources: give one of them (a single dataset is data.dir, or "
                          "data.sources with one entry)")
    _check_sources("data.sources", cfg.data.sources)
    _check_batch_warmup(cfg.train.batch_warmup)
    _check_phases(cfg)
    _check_combinations(cfg)
    _check_out_dir_apart(cfg)
    check_schedule(cfg.optim, cfg.train.max_steps)
    _check_evals(cfg.evals, cfg.checkpoint.every)


def check_schedule(optim: PretrainOptimSection, max_steps: int) -> None:
    """A WSD decay must lie after the warmup and end by ``train.max_steps``; other schedules have no decay fields."""
    if optim.schedule != "wsd":
        if optim.decay_start or optim.decay_steps:
            raise ConfigError(f"optim.decay_start/decay_steps with optim.schedule={optim.schedule}: only "
                              "optim.schedule=wsd has a decay phase of its own; set it, or drop them")
        return
    if not optim.decay_start and not optim.decay_steps:
        raise ConfigError("optim.schedule=wsd: set optim.decay_steps (a decay ending at train.max_steps) and/or "
                          "optim.decay_start (its first step); optim.decay_start=train.max_steps keeps the whole run "
                          "stable, to decay in branches (distaff decay)")
    start, length = wsd_window(max_steps, optim.decay_start, optim.decay_steps)
    if start < 0:
        raise ConfigError(f"optim.decay_steps: {length} steps of decay are longer than the run (train.max_steps="
                          f"{max_steps}); shorten it or raise train.max_steps")
    if start > max_steps:
        raise ConfigError(f"optim.decay_start: {start} is past the end of the run (train.max_steps={max_steps}); "
                          "start the decay at most at train.max_steps")
    if start + length > max_steps:
        raise ConfigError(f"optim.decay_steps: a decay of {length} steps from step {start} ends at step "
                          f"{start + length}, past train.max_steps={max_steps}; shorten it or raise train.max_steps")
    if start < optim.warmup_steps:
        raise ConfigError(f"optim.decay_start: the decay would start at step {start}, inside the warmup "
                          f"(optim.warmup_steps={optim.warmup_steps}); start it after the warmup")


def _check_sources(key: str, sources: list[SourceSection]) -> None:
    """Weights >= 0 summing to a positive number (NaN and infinity are refused as they are read), distinct dirs."""
    for i, source in enumerate(sources):
        if not source.dir:
            raise ConfigError(f"{key}[{i}].dir: required (a folder written by `distaff data prepare`)")
        if source.weight < 0:
            raise ConfigError(f"{key}[{i}].weight: must be >= 0, got {source.weight}")
        earlier = [j for j in range(i) if place(sources[j].dir) == place(source.dir)]
        if earlier:
            first = sources[earlier[0]].dir
            spelling = "" if first == source.dir else f" (as {key}[{earlier[0]}].dir {first}: the same folder)"
            raise ConfigError(f"{key}[{i}].dir: {source.dir} is listed twice{spelling}; give it once, with the "
                              "summed weight")
    if sources and not sum(s.weight for s in sources) > 0:
        raise ConfigError(f"{key}: the weights {[s.weight for s in sources]} must sum to a positive number")


def _check_out_dir_apart(cfg: RunConfig) -> None:
    """``run.out_dir`` apart from every folder the run reads: the run writes its files there and rotates its
    checkpoints away (a parent checkpoint or model folder inside it could be deleted or overwritten, a data dir would
    get a run's files)."""
    reads = [("data.dir", cfg.data.dir), *((f"data.sources[{i}].dir", s.dir) for i, s in enumerate(cfg.data.sources)),
             *((f"phases[{i}].sources[{j}].dir", s.dir) for i, phase in enumerate(cfg.phases)
               for j, s in enumerate(phase.sources)),
             ("model.init_from", cfg.model.init_from), ("rtd.init_discriminator", cfg.rtd.init_discriminator),
             ("checkpoint.branch_from", cfg.checkpoint.branch_from)]
    check_apart(("run.out_dir", cfg.run.out_dir), reads, error=ConfigError)


def _check_batch_warmup(warmup: BatchWarmupSection) -> None:
    check_ranges(positive={}, non_negative={"train.batch_warmup.start": warmup.start,
                                             "train.batch_warmup.tokens": warmup.tokens})
    if bool(warmup.start) != bool(warmup.tokens):
        raise ConfigError(f"train.batch_warmup: start ({warmup.start}) and tokens ({warmup.tokens}) go together: "
                          "set both (a ramp) or neither")


def _check_phases(cfg: RunConfig) -> None:
    after = 0
    for i, phase in enumerate(cfg.phases):
        key = f"phases[{i}]"
        if phase.at_step <= after:
            raise ConfigError(f"{key}.at_step: must be above {after} (phases start after step 0, in increasing "
                              f"order), got {phase.at_step}")
        after = phase.at_step
        if phase.at_step >= cfg.train.max_steps:
            raise ConfigError(f"{key}.at_step: {phase.at_step} is at or past the end of the run (train.max_steps="
                              f"{cfg.train.max_steps}), so the phase would never be entered; start it earlier, raise "
                              "train.max_steps, or drop it")
        check_ranges(positive={}, non_negative={f"{key}.seq_len": phase.seq_len, f"{key}.mask_rate": phase.mask_rate,
                                                f"{key}.global_batch": phase.global_batch,
                                                f"{key}.batch_size": phase.batch_size})
        _check_sources(f"{key}.sources", phase.sources)
        if not (phase.sources or phase.seq_len or phase.mask_rate or phase.global_batch or phase.batch_size):
            raise ConfigError(f"{key}: changes nothing; give sources, seq_len, mask_rate, global_batch or batch_size")
        if phase.mask_rate and not phase.mask_rate < 1.0:
            raise ConfigError(f"{key}.mask_rate: must lie in (0, 1), got {phase.mask_rate}")
        if phase.mask_rate and cfg.train.objective == "tta":
            raise ConfigError(f"{key}.mask_rate with train.objective=tta: T-TA masks nothing; drop the mask_rate")


def _check_combinations(cfg: RunConfig) -> None:
    """Settings that are valid alone but not together, each error naming both keys."""
    if cfg.data.tokens_per_batch and cfg.data.packing != "varlen":
        raise ConfigError("data.tokens_per_batch: only packed batches (data.packing=varlen) have a token budget")
    if cfg.checkpoint.branch_from and cfg.checkpoint.resume != "auto":
        raise ConfigError(f"checkpoint.branch_from with checkpoint.resume={cfg.checkpoint.resume}: a branch starts "
                          "from its parent's checkpoint only while it has none of its own; set checkpoint.resume=auto")
    if cfg.train.objective != "rtd" and cfg.rtd.loss_weighting != "fixed":
        raise ConfigError(f"rtd.loss_weighting={cfg.rtd.loss_weighting} with train.objective={cfg.train.objective}: "
                          "loss weighting combines RTD's two losses; set train.objective=rtd or drop "
                          "rtd.loss_weighting")
    if cfg.train.objective == "rtd" and cfg.model.init_from:
        raise ConfigError("model.init_from with train.objective=rtd: start the discriminator from an HF folder "
                          "with rtd.init_discriminator instead")
    if cfg.train.objective == "tta" and cfg.model.init_from:
        raise ConfigError("model.init_from with train.objective=tta: T-TA's attention and position queries do not "
                          "start from another model's weights; train it from scratch")
    if cfg.model.overrides.get("tta") and cfg.train.objective != "tta":
        raise ConfigError(f"model.tta with train.objective={cfg.train.objective}: a T-TA model is trained by the "
                          "all-token objective; set train.objective=tta (which sets model.tta itself)")


EVAL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _check_evals(evals: EvalsSection, checkpoint_every: int) -> None:
    """The ``evals`` section: each evaluation's kind and settings, distinct names, positive seeds, and a checkpoint
    at every step it selects."""
    check_ranges(positive={"evals.timeout_s": evals.timeout_s, "evals.threads": evals.threads,
                           "evals.slurm.cpus": evals.slurm.cpus},
                 non_negative={"evals.every": evals.every, "evals.retries": evals.retries,
                               "evals.slurm.gpus": evals.slurm.gpus})
    _check_eval_every("evals.every", evals.every, checkpoint_every)
    named: dict[str, int] = {}
    for i, task in enumerate(evals.tasks):
        key = f"evals.tasks[{i}]"
        _check_eval_task(key, task, checkpoint_every)
        if task.name in named:
            raise ConfigError(f"{key}.name: {task.name!r} is the name of evals.tasks[{named[task.name]}] too; give "
                              "each evaluation its own name")
        named[task.name] = i


def _check_eval_every(key: str, every: int, checkpoint_every: int) -> None:
    """The steps ``every`` selects must be checkpointed."""
    if every and not checkpoint_every:
        raise ConfigError(f"{key}: {every}, but checkpoint.every=0 saves a checkpoint only at the end; set "
                          f"checkpoint.every to a divisor of {every}, or {key}=0 (the last checkpoint alone)")
    if every and every % checkpoint_every:
        raise ConfigError(f"{key}: {every} is not a multiple of checkpoint.every={checkpoint_every}, so steps it "
                          "selects would have no checkpoint to evaluate; make it a multiple")


def _check_eval_task(key: str, task: EvalTaskSection, checkpoint_every: int) -> None:
    if not task.name:
        raise ConfigError(f"{key}.name: required (it names the evaluation's records and W&B charts, eval/<name>/)")
    if not EVAL_NAME.fullmatch(task.name):
        raise ConfigError(f"{key}.name: {shown(task.name)} may hold letters, digits, '_', '.' and '-' only, and "
                          "start with a letter or digit")
    if task.kind not in EVAL_KINDS:
        guess = closest(str(task.kind), EVAL_KINDS)
        what = f"{shown(task.kind)} is not a kind of evaluation" if task.kind else "required"
        raise ConfigError(f"{key}.kind: {what}; one of {list(EVAL_KINDS)}" + (f"; did you mean {guess}?" if guess else ""))
    _check_eval_seeds(f"{key}.seeds", task.seeds)
    check_ranges(positive={}, non_negative={f"{key}.every": task.every})
    _check_eval_every(f"{key}.every", task.every, checkpoint_every)
    defaults = EvalTaskSection()
    for kind, names in EVAL_KIND_FIELDS.items():
        stray = [n for n in names if n not in EVAL_KIND_FIELDS[task.kind] and getattr(task, n) != getattr(defaults, n)]
        if stray:
            raise ConfigError(f"{key}.{stray[0]}: a setting of a {kind} evaluation, not of this {task.kind} one; "
                              "remove it")
    {"probe": _check_probe_task, "finetune": _check_finetune_task, "heldout": _check_heldout_task}[task.kind](key, task)


def _check_eval_seeds(key: str, seeds: list[int]) -> None:
    if not seeds:
        raise ConfigError(f"{key}: give at least one seed")
    for j, seed in enumerate(seeds):
        if not 1 <= seed <= MAX_SEED:
            raise ConfigError(f"{key}[{j}]: a seed must be a positive whole number up to {MAX_SEED}, got {shown(seed)}")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"{key}: {seeds} names a seed twice; give each once")


def _check_probe_task(key: str, task: EvalTaskSection) -> None:
    if not task.text:
        raise ConfigError(f"{key}.text: required for a probe (a text file whose sentences the probing tasks are "
                          "built from: .txt, .jsonl, .parquet, or a TSV/CSV with text_column)")
    if not task.probe_tasks or len(set(task.probe_tasks)) != len(task.probe_tasks):
        raise ConfigError(f"{key}.probe_tasks: {task.probe_tasks}: give one or more of {list(PROBE_TASKS)}, each once")
    check_ranges(positive={}, non_negative={f"{key}.max_sentences": task.max_sentences})


def _check_finetune_task(key: str, task: EvalTaskSection) -> None:
    if not task.train:
        raise ConfigError(f"{key}.train: required for a finetune evaluation (a labelled .tsv, .csv or .jsonl file)")
    if bool(task.dev) == bool(task.dev_fraction):
        raise ConfigError(f"{key}.dev: a finetune evaluation scores on a dev file (dev: PATH) or on a share of "
                          "train held out (dev_fraction: 0.2); give exactly one")
    if task.dev_fraction and not 0 < task.dev_fraction < 1:
        raise ConfigError(f"{key}.dev_fraction: must lie in (0, 1), got {task.dev_fraction}")
    check_ranges(positive={}, non_negative={f"{key}.max_steps": task.max_steps})
    if task.metric and task.metric not in FINETUNE_METRICS:
        raise ConfigError(f"{key}.metric: {shown(task.metric)} is not a fine-tuning metric; one of "
                          f"{list(FINETUNE_METRICS)}")
    for keys, _ in parse_overrides(task.overrides):
        if ".".join(keys) in EVAL_FINETUNE_KEYS:
            raise ConfigError(f"{key}.overrides: {'.'.join(keys)} is set by the evaluation itself (the checkpoint, "
                              "train/dev, the seeds, max_steps); use the evaluation's own settings")


def _check_heldout_task(key: str, task: EvalTaskSection) -> None:
    if not task.data:
        raise ConfigError(f"{key}.data: required for a heldout evaluation (a folder written by `distaff data "
                          "prepare` with the run's tokenizer)")
    check_ranges(positive={}, non_negative={f"{key}.batches": task.batches})


def build_sections(cls: type, values: Any, build_model: Callable[[Any], Any]) -> Any:
    """A ``cls`` config from nested plain values (YAML after overrides), each section built and type-checked, the
    model section by ``build_model`` (a run's and a fine-tuning's differ); not yet validated as a whole."""
    if not isinstance(values, dict):
        raise ConfigError(f"config: expected a mapping of sections, got {type(values).__name__}")
    values = dict(values)
    model = build_model(values.pop("model", {}) or {})
    cfg = _build(cls, values, "")
    cfg.model = model
    return cfg


def config_from_dict(values: dict[str, Any]) -> RunConfig:
    """A validated :class:`RunConfig` from nested plain values (YAML after overrides)."""
    cfg = build_sections(RunConfig, values, _build_model_section)
    _validate(cfg)
    cfg.model_config()  # model overrides are validated now, not at the first step
    if cfg.train.objective == "rtd":
        cfg.generator_config(cfg.model_config())
    return cfg


def parse_overrides(overrides: list[str]) -> list[tuple[list[str], Any]]:
    """``["optim.lr=3e-4", ...]`` -> ``[(["optim", "lr"], 3e-4), ...]``; values are parsed as YAML."""
    parsed = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r}: expected dotted.key=value")
        value = load_yaml(text, f"override {key}") if text else ""
        parsed.append((key.split("."), value))
    return parsed


def _apply_override(values: dict[str, Any], path: list[str], value: Any) -> None:
    node = values
    for depth, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {'.'.join(path)}: {'.'.join(path[: depth + 1])} is not a section")
        node = child
    node[path[-1]] = value


def config_file(value: str | Path, kind: str = "run") -> Path:
    """``value`` if it is a file, else the installed preset of ``kind`` it names (``tiny-cpu``: presets.py)."""
    path = Path(value)
    if path.is_file():
        return path
    preset = presets.preset_file(str(value), kind)
    if preset is None:
        guess = closest(str(value), presets.preset_names(kind))
        raise ConfigError(f"config file not found: {value} (nor a {kind} preset of that name; presets: "
                          f"{', '.join(presets.preset_names(kind))}; `distaff presets` describes them)"
                          + (f"; did you mean {guess}?" if guess else ""))
    return preset


def read_config_values(path: str | Path | None, overrides: list[str] = (), kind: str = "run") -> dict[str, Any]:
    """The YAML file, or the preset of ``kind`` it names (values empty when ``path`` is None), with the dotted
    overrides applied."""
    values: dict[str, Any] = {}
    if path is not None:
        path = config_file(path, kind)
        values = load_yaml(read_text(path, error=ConfigError), str(path)) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: expected a mapping of sections")
    for keys, value in parse_overrides(list(overrides)):
        _apply_override(values, keys, value)
    return values


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML run config (or start from the defaults when ``path`` is None) and apply overrides."""
    return config_from_dict(read_config_values(path, overrides))


def source_dirs(cfg: RunConfig) -> dict[str, str]:
    """Every data dir the run reads, by the key that names it, in the order they first appear (data, then phases)."""
    named = {"data.dir": cfg.data.dir} if cfg.data.dir else {
        f"data.sources[{i}].dir": source.dir for i, source in enumerate(cfg.data.sources)}
    for j, phase in enumerate(cfg.phases):
        named.update({f"phases[{j}].sources[{i}].dir": source.dir for i, source in enumerate(phase.sources)})
    return named


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain nested values that :func:`config_from_dict` turns back into ``cfg``."""
    values = dataclasses.asdict(cfg)
    init_from = {"init_from": cfg.model.init_from} if cfg.model.init_from else {}
    values["model"] = {"preset": cfg.model.preset, **init_from, **cfg.model.overrides}
    return values


def save_config(cfg: RunConfig, path: str | Path, model_config: ModelConfig | None = None) -> None:
    """Write the resolved config; with ``model_config``, every model field is spelled out."""
    values = config_to_dict(cfg)
    if model_config is not None:
        values["model"] = {**values["model"], **model_config.to_dict()}
    Path(path).write_text(yaml.safe_dump(values, sort_keys=False))


# Keys that change what a run logs, where it writes and how it waits, never the numbers it produces: a run's
# fingerprint leaves them out, so renaming a W&B run, checkpointing more often or evaluating its checkpoints
# otherwise does not make it stale.
NOT_FINGERPRINTED = ("wandb", "logging", "checkpoint", "distributed", "evals", "run.name", "run.out_dir")


def fingerprinted(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A resolved config (``config_to_dict`` or the fine-tuning one) as flat ``section.key`` values, without
    :data:`NOT_FINGERPRINTED`."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = prefix + str(key)
        if name in NOT_FINGERPRINTED:
            continue
        if isinstance(value, dict) and value:
            flat.update(fingerprinted(value, name + "."))
        else:
            flat[name] = value
    return flat


def config_fingerprint(values: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of :func:`fingerprinted` ``values``: two runs with one fingerprint were
    asked for the same training."""
    text = json.dumps(fingerprinted(values), sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for every fingerprinted value that differs between two flat configs."""
    return [f"{key}: {shown(old.get(key))} -> {shown(new.get(key))}" for key in sorted(set(old) | set(new))
            if old.get(key) != new.get(key)]
