"""A run config on a cluster -> the plan: memory per GPU, what fits, step time, tokens/s, MFU, GPU-hours.

:func:`make_plan` reads the run config (model, micro-batch, precision, ZeRO, objective, max_steps), the
sequence length (the prepared data's manifest when its folder exists, else ``--seq-len``, else the model's
``max_position_embeddings``) and the GPU kind; :func:`plan_summary_line` is the one line the launchers print.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from distaff.train.core.errors import ConfigError
from distaff.train.model.config import ModelConfig, check_data_fits_model
from distaff.train.model.flops import train_flops_per_token
from distaff.train.plan import gpus as gpu_kinds
from distaff.train.plan.gpus import GpuKind
from distaff.train.plan.memory import GIB, Breakdown, Setting, parameter_summary, step_peak
from distaff.train.plan.gpu_time import Assumptions
from distaff.train.plan.step_time import StepTime, step_time
from distaff.train.run.config import RunConfig

MAX_MICRO_BATCH = 1 << 16


@dataclass
class Plan:
    gpu: GpuKind
    per_node: int
    nodes: int
    setting: Setting
    memory: Breakdown
    largest_micro_batch: int
    zero_fits: dict[int, float]          # ZeRO stage -> bytes per GPU (peak + margin) at this micro-batch
    time: StepTime
    grad_accum: int
    max_steps: int
    seq_source: str
    assumptions: Assumptions
    token_budget: float | None = None    # --tokens: max_steps was derived from it
    sample_source: str = ""              # where the mean sample length came from (the manifest, or assumed)
    without_kept_scores: float | None = None  # bytes per GPU with model.keep_position_scores off (when it is on)

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.gpu.memory_bytes

    def kept_scores_advice(self) -> str:
        """When the run does not fit and only the attention's kept position scores stand in the way: how to free
        them; else ""."""
        if self.fits or self.without_kept_scores is None or self.without_kept_scores > self.gpu.memory_bytes:
            return ""
        return (f"model.keep_position_scores=false fits: {self.without_kept_scores / GIB:.1f} GiB per GPU (the "
                "attention's backward then recomputes its position scores)")

    @property
    def tokens_per_step(self) -> float:
        """Tokens of the data per optimizer step (padding not counted)."""
        return self.setting.real_tokens * self.grad_accum * self.setting.ranks

    @property
    def global_batch(self) -> float:
        """Samples per optimizer step: micro-batch x accumulation steps x GPUs (packed: the budget's samples)."""
        s = self.setting
        per_micro = s.real_tokens / s.mean_sample if s.packed else s.micro_batch
        return per_micro * self.grad_accum * s.ranks

    def batch_line(self) -> str:
        s = self.setting
        micro = (f"a packed micro-batch of {s.tokens:,} tokens (~{s.real_tokens / s.mean_sample:,.1f} samples)"
                 if s.packed else f"micro-batch {s.micro_batch}")
        return (f"global batch {self.global_batch:,.0f} {'samples' if s.packed else 'sequences'} = {micro} x "
                f"{self.grad_accum} accumulation step(s) x {s.ranks} GPUs, {self.tokens_per_step:,.0f} tokens of "
                f"data per step")

    def tokens_line(self) -> str:
        """What one micro-batch holds, and where its sample length came from."""
        s = self.setting
        if s.packed:
            return (f"packed (data.packing=varlen): {s.tokens:,} tokens per micro-batch, samples of "
                    f"{s.mean_sample:,.0f} tokens on average ({self.sample_source}), attention per sample")
        return (f"padded: {s.micro_batch} x {s.seq_len} positions per micro-batch, samples of {s.mean_sample:,.0f} "
                f"tokens on average ({self.sample_source}), {1 - s.real_tokens / s.tokens:.0%} padding")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.time.total

    @property
    def flops_per_token(self) -> float:
        s = self.setting
        return sum(train_flops_per_token(cfg, s.attention_len, s.labelled if n == 0 else 0.0)
                   for n, cfg in enumerate(s.models))

    @property
    def mfu(self) -> float:
        peak = self.gpu.fp32_tflops if self.setting.precision == "fp32" else self.gpu.tflops
        return self.tokens_per_s * self.flops_per_token / (self.setting.ranks * peak * 1e12)

    @property
    def hours(self) -> float:
        return self.max_steps * self.time.total / 3600

    @property
    def gpu_hours(self) -> float:
        return self.hours * self.setting.ranks


def sequence_length(cfg: RunConfig, model: ModelConfig, given: int | None) -> tuple[int, str]:
    """The run's sequence length and where it came from."""
    if given is not None:
        if given < 1:
            raise ConfigError(f"--seq-len: must be positive, got {given}")
        return given, "--seq-len"
    manifest = prepared(cfg)
    if manifest is not None:
        return manifest.seq_len, f"{Path(cfg.data.first_dir) / 'manifest.json'}"
    return model.max_position_embeddings, "model.max_position_embeddings (no prepared data; --seq-len sets it)"


def check_positions(cfg: RunConfig, models: tuple[ModelConfig, ...], length: int, source: str) -> None:
    """Refuse, in one line, a sequence longer than a model's absolute positions (the run would fail at its first
    step; train/pretrain/trainer.py refuses it with the same check)."""
    sections = ("rtd.generator", "model") if cfg.train.objective == "rtd" else ("model",)
    where = "--seq-len" if source == "--seq-len" else f"data.dir's seq_len ({source})"
    for section, model in zip(sections, models):
        check_data_fits_model(model, length, f"{where}: {length}", "plan a shorter --seq-len, or raise "
                              f"{section}.max_position_embeddings", section)


def prepared(cfg: RunConfig):
    """The prepared data's manifest (``data.dir``, or the first source's), read as a run reads it (every field
    range-checked); None when the data is not prepared yet. Its reader (numpy, webdataset and so torch) is
    imported only when there is a folder to read."""
    if not Path(cfg.data.first_dir).is_dir():
        return None
    from distaff.train.data.manifest import MANIFEST_FILE, read_manifest

    return read_manifest(cfg.data.first_dir) if (Path(cfg.data.first_dir) / MANIFEST_FILE).is_file() else None


def sample_length(cfg: RunConfig) -> tuple[float, str]:
    """Real tokens per sample on average: the prepared training split's tokens over its samples (as the manifest
    counts them), or 0 (full sequences) with the assumption said."""
    manifest = prepared(cfg)
    split = None if manifest is None else manifest.splits.get("train")
    if split is None or not split.samples:
        return 0.0, "assumed full sequences: no prepared data to read sample lengths from"
    return split.tokens / split.samples, f"the manifest's training split: {split.tokens:,} tokens in {split.samples:,} samples"


def prepared_vocabulary(cfg: RunConfig) -> dict:
    """What the trainer takes from the prepared data's tokenizer (train/pretrain/trainer.py build_model_config):
    its vocabulary size, unless ``model.vocab_size`` is set; nothing when the data is not prepared yet."""
    manifest = None if "vocab_size" in cfg.model.overrides else prepared(cfg)
    return {} if manifest is None else {"vocab_size": manifest.vocab_size}


def models_of(cfg: RunConfig) -> tuple[ModelConfig, ...]:
    """The models the engine trains: the MLM model, or the RTD generator and discriminator (with the prepared
    data's vocabulary, as the trainer builds them)."""
    model = cfg.model_config(**prepared_vocabulary(cfg),
                             **({"tta": True, "emd": False} if cfg.train.objective == "tta" else {}))
    if cfg.train.objective == "rtd":
        return cfg.generator_config(model), replace(model, emd=False)
    return (model,)


def base_setting(cfg: RunConfig, ranks: int, seq_len: int, micro_batch: int | None, zero: int | None,
                 offload: bool | None, sample_len: float = 0.0) -> Setting:
    """The memory model's inputs for ``cfg`` on ``ranks`` GPUs, with the command line's overrides; ``sample_len``
    the data's real tokens per sample (0: full sequences)."""
    models = models_of(cfg)
    stage = cfg.zero.stage if zero is None else zero
    offload_optimizer = cfg.zero.offload_optimizer if offload is None else offload
    if offload_optimizer and stage == 0:
        raise ConfigError("--offload: optimizer offload needs ZeRO >= 1; add --zero 1 (or 2, 3)")
    batch = cfg.data.batch_size if micro_batch is None else micro_batch
    if batch < 1:
        raise ConfigError(f"--micro-batch: must be positive, got {batch}")
    sharing = cfg.rtd.embedding_sharing if cfg.train.objective == "rtd" else None
    sizes = parameter_summary(models, sharing)
    return Setting(models=models, params=sizes.total, largest_param=sizes.largest,
                   persistent_params=sizes.persistent, param_tensors=sizes.tensors, seq_len=seq_len, micro_batch=batch,
                   precision=cfg.train.precision, zero=stage, ranks=ranks, offload_optimizer=offload_optimizer,
                   offload_param=cfg.zero.offload_param and stage == 3, fused=True, overlap_comm=True,
                   dropout=any(m.hidden_dropout_prob > 0 for m in models),
                   labelled=1.0 if cfg.train.objective == "tta" else cfg.data.masking.mlm_probability,
                   packed=cfg.data.packing == "varlen", token_budget=cfg.data.tokens_per_batch, sample_len=sample_len)


def largest_micro_batch(s: Setting, gpu: GpuKind) -> int:
    """The largest micro-batch whose peak plus margin fits ``gpu`` (0 when not even one sequence fits)."""
    def fits(batch: int) -> bool:
        return step_peak(replace(s, micro_batch=batch)).total <= gpu.memory_bytes

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= MAX_MICRO_BATCH and fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def devices(text: str, extra: GpuKind | None = None) -> tuple[int, GpuKind]:
    """``--gpus``: ``8xA100-80GB`` -> (8, the GPU kind); ``2xcpu`` -> (2, this machine's CPU ranks: the probe's
    figures, or ``extra`` when ``--gpu-spec`` names a cpu)."""
    count, name = gpu_kinds.split_gpus(text)
    if gpu_kinds.names_cpu(name):
        from distaff.train.plan.cpu import cpu_kind    # the probe needs torch: only when CPU ranks are planned

        return count, cpu_kind(count, extra if extra is not None and extra.is_cpu else None)
    return gpu_kinds.parse_gpus(text, extra)


def make_plan(cfg: RunConfig, gpus: str, nodes: int = 1, *, micro_batch: int | None = None,
              zero: int | None = None, offload: bool | None = None, seq_len: int | None = None,
              gpu_spec: GpuKind | None = None, assumptions: Assumptions = Assumptions(),
              tokens: float | None = None) -> Plan:
    """The plan of ``cfg`` on ``nodes`` nodes of ``gpus`` (``8xA100-80GB``); with ``tokens``, the steps to train
    on that many tokens at the run's global batch instead of ``train.max_steps``."""
    if nodes < 1:
        raise ConfigError(f"--nodes: must be positive, got {nodes}")
    per_node, gpu = devices(gpus, gpu_spec)
    models = models_of(cfg)
    length, source = sequence_length(cfg, models[-1], seq_len)
    check_positions(cfg, models, length, source)
    sample_len, sample_source = sample_length(cfg)
    s = base_setting(cfg, per_node * nodes, length, micro_batch, zero, offload, sample_len)
    if gpu.is_cpu:       # the PyTorch reference kernels, torch's foreach AdamW, no overlap (train/run/engine.py)
        s = replace(s, fused=False, overlap_comm=False)
    memory = step_peak(s)
    stages = {stage: step_peak(replace(s, zero=stage, offload_optimizer=s.offload_optimizer and stage > 0)).total
              for stage in (0, 1, 2, 3)}
    steps = cfg.train.max_steps
    if tokens is not None:
        steps = max(1, math.ceil(tokens / (s.real_tokens * cfg.train.grad_accum * s.ranks)))
    freed = tuple(replace(m, keep_position_scores=False) for m in s.models)
    without = step_peak(replace(s, models=freed)).total if any(m.keep_position_scores for m in s.models) else None
    return Plan(gpu=gpu, per_node=per_node, nodes=nodes, setting=s, memory=memory, without_kept_scores=without,
                largest_micro_batch=largest_micro_batch(s, gpu), zero_fits=stages,
                time=step_time(s, gpu, nodes, cfg.train.grad_accum, assumptions), grad_accum=cfg.train.grad_accum,
                max_steps=steps, seq_source=source, assumptions=assumptions, token_budget=tokens,
                sample_source=sample_source)


def summary(plan: Plan) -> str:
    """One line: memory per GPU against the card, micro-batch room, tokens/s, MFU and GPU-hours (estimates)."""
    s = plan.setting
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    goal = f"{plan.max_steps:,} steps"
    if plan.token_budget is not None:
        goal = f"{format_tokens(plan.token_budget)} tokens = {goal} ({plan.batch_line()})"
    batch = (f"packed micro-batch of {s.tokens:,} tokens" if s.packed
             else f"micro-batch {s.micro_batch} x {s.seq_len} tokens")
    advice = plan.kept_scores_advice()
    verdict += f" ({advice})" if advice else ""
    return (f"plan: {plan.nodes}x{plan.per_node}x{plan.gpu.name}, ZeRO {s.zero}, {batch}: {plan.memory.total / GIB:.1f} of {plan.gpu.memory_gib:.1f} GiB per GPU, {verdict} "
            f"(largest micro-batch {plan.largest_micro_batch}); estimate {plan.tokens_per_s:,.0f} tokens/s, MFU "
            f"{plan.mfu:.0%}, {plan.hours:,.1f} h = {plan.gpu_hours:,.0f} GPU-hours for {goal}")


SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
MAX_TOKENS = 1e18           # a million T: some 100,000 times the largest pretraining runs


def parse_tokens(text: str) -> float:
    """``--tokens``: a count with an optional K/M/B/T suffix (``20B``, ``500M``) or a plain number (``2e10``)."""
    value = text.strip().upper().replace(",", "").replace("_", "")
    scale = SUFFIXES.get(value[-1:], 1.0)
    try:
        tokens = float(value[:-1] if value[-1:] in SUFFIXES else value) * scale
    except ValueError:
        raise ConfigError(f"--tokens: expected a token count such as 20B, 500M or 2e10, got {text!r}") from None
    if not 1 <= tokens <= MAX_TOKENS:        # nan and inf fail too
        raise ConfigError(f"--tokens: expected a finite count of at least 1 token and at most {MAX_TOKENS:.0e} "
                          f"(1M T), got {text!r}")
    return tokens


def format_tokens(tokens: float) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if tokens >= scale:
            return f"{tokens / scale:g}{suffix}"
    return f"{tokens:g}"


def plan_summary_line(cfg: RunConfig, gpus: str, nodes: int = 1) -> tuple[str, bool]:
    """The launchers' line for the job they write, and whether it fits (a warning follows when not)."""
    plan = make_plan(cfg, gpus, nodes)
    return summary(plan), plan.fits


def cpu_run_setting(cfg: RunConfig, ranks: int, seq_len: int) -> Setting:
    """The setting of ``cfg`` run on CPU ranks (what :mod:`distaff.train.plan.measure` measures): the PyTorch
    reference kernels, and no communication overlap (gloo; train/run/engine.py turns it off without CUDA)."""
    return replace(base_setting(cfg, ranks, seq_len, None, None, None), fused=False, overlap_comm=False)


DEFAULT_KIND = "A100-80GB"


def print_launch_summary(target, gpus_per_node: int, nodes: int, gpu_kind: str | None, prog: str) -> None:
    """What the launchers print (stderr) for the pretraining job they write: the plan's line, and a warning when
    the job does not fit. ``target`` is the launcher's ``LaunchTarget`` (config, overrides, task)."""
    if target.task != "pretrain":
        return
    from distaff.train.run.config import load_config

    cfg = load_config(target.config, list(target.overrides))
    plan = make_plan(cfg, f"{gpus_per_node}x{gpu_kind or DEFAULT_KIND}", nodes)
    assumed = "" if gpu_kind else f" [GPU kind assumed {DEFAULT_KIND}: --gpu-kind sets it]"
    print(f"{prog}: {summary(plan)}{assumed}", file=sys.stderr)
    if not plan.fits:
        print(f"{prog}: warning: the plan says micro-batch {plan.setting.micro_batch} needs "
              f"{plan.memory.total / GIB:.1f} GiB per GPU, more than a {plan.gpu.name} has (largest that fits: "
              f"{plan.largest_micro_batch}); lower data.batch_size and raise train.grad_accum, or raise zero.stage "
              f"(distaff plan --config ... --gpus ... shows each)"
              + (f"; or set {plan.kept_scores_advice()}" if plan.kept_scores_advice() else ""), file=sys.stderr)
