"""The DeepSpeed engine: a DeepSpeed config built from ours, the optimizer, and ``deepspeed.initialize``.

Batch size, accumulation, precision, clipping and ZeRO come from :class:`RunConfig`; experts can
deep-merge a raw DeepSpeed JSON (``deepspeed.config``) over the generated one, except the keys
the training loop itself depends on. The learning rate is not DeepSpeed's business: the loop
sets it every step from :mod:`distaff.train.run.schedule`, so there is no scheduler state to save.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distaff.train.core.files import read_json
from distaff.train.run.config import ConfigError, RunConfig

# Keys the training loop relies on; a passthrough JSON may not change them.
LOOP_OWNED_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                   "scheduler")


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _zero_config(cfg: RunConfig) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": cfg.zero.stage}
    if cfg.zero.stage >= 1:
        # Overlapping gradient reduction with backward pays on GPUs (NCCL streams); gloo gains nothing.
        zero.update(contiguous_gradients=True, overlap_comm=torch.cuda.is_available(), reduce_scatter=True)
    if cfg.zero.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if cfg.zero.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if cfg.zero.stage == 3:
        # gather full weights only at export time (zero_to_fp32), not at every save
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    return zero


def build_deepspeed_config(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    """The DeepSpeed JSON for ``cfg`` on ``world_size`` ranks (passthrough merged in)."""
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.data.batch_size,
        "gradient_accumulation_steps": cfg.train.grad_accum,
        "train_batch_size": cfg.data.batch_size * cfg.train.grad_accum * world_size,
        "gradient_clipping": cfg.train.grad_clip,
        "zero_optimization": _zero_config(cfg),
        "steps_per_print": 10**9,  # our metrics module reports progress
        "wall_clock_breakdown": False,
        "checkpoint": {"tag_validation": "FAIL"},
    }
    if cfg.train.precision == "bf16":
        ds["bf16"] = {"enabled": True}
    elif cfg.train.precision == "fp16":
        # loss_scale 0 = dynamic loss scaling
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                      "hysteresis": 2, "min_loss_scale": 1}
    if cfg.zero.offload_optimizer:
        # ZeRO-Offload steps on the CPU with DeepSpeed's CPU Adam (a C++ op compiled on first use)
        ds["optimizer"] = {"type": "AdamW", "params": {"lr": cfg.optim.lr, "betas": cfg.optim.betas,
                                                       "eps": cfg.optim.eps, "weight_decay": cfg.optim.weight_decay}}
    if cfg.deepspeed.config:
        ds = _deep_merge(ds, _read_passthrough(Path(cfg.deepspeed.config)))
    return ds


def _read_passthrough(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"deepspeed.config: file not found: {path}")
    raw = read_json(path, error=ConfigError)
    if not isinstance(raw, dict):
        raise ConfigError(f"deepspeed.config: {path} must hold a JSON object")
    owned = sorted(set(raw) & set(LOOP_OWNED_KEYS))
    if owned:
        raise ConfigError(f"deepspeed.config: {path} sets {owned}; set data.batch_size / train.grad_accum / "
                          "optim.* in the run config instead")
    return raw


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices (linear and embedding weights), none on biases and LayerNorm scales."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def layer_decay_groups(model: nn.Module, weight_decay: float, layer_decay: float) -> list[dict[str, Any]]:
    """Layer-wise learning-rate decay for an encoder with ``deberta.embeddings`` and ``deberta.encoder.layer.<i>``
    (``L`` layers): the embeddings get ``lr * layer_decay ** L``, layer ``i`` (1-based, ``deberta.encoder.layer.
    <i-1>``) ``lr * layer_decay ** (L - i)``, everything else (the encoder's relative-position embeddings and
    their norm, the task head) ``lr``: the top layer learns as fast as the head, each layer below a factor
    ``layer_decay`` slower. Each group carries its factor as ``lr_scale``, which :func:`set_lr` applies;
    weight decay as in :func:`parameter_groups`."""
    num_layers = len(model.deberta.encoder.layer)
    groups: dict[tuple[int, bool], dict[str, Any]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        depth = _layer_depth(name, num_layers)
        decays = param.ndim >= 2
        group = groups.setdefault((depth, decays), {"params": [], "weight_decay": weight_decay if decays else 0.0,
                                                    "lr_scale": layer_decay ** (num_layers - depth)})
        group["params"].append(param)
    return [groups[key] for key in sorted(groups)]


def _layer_depth(name: str, num_layers: int) -> int:
    """0 for the embeddings, i for encoder layer i (1-based), num_layers for everything else."""
    if name.startswith("deberta.embeddings."):
        return 0
    prefix = "deberta.encoder.layer."
    if name.startswith(prefix):
        return int(name[len(prefix):].split(".", 1)[0]) + 1
    return num_layers


def build_optimizer(model: nn.Module, cfg: RunConfig, param_groups: list[dict[str, Any]] | None = None
                    ) -> torch.optim.Optimizer:
    """torch AdamW: fused kernels on CUDA, foreach on CPU (DeepSpeed's FusedAdam would JIT-compile).
    ``param_groups`` default to :func:`parameter_groups`."""
    fused = torch.cuda.is_available()
    groups = param_groups if param_groups is not None else parameter_groups(model, cfg.optim.weight_decay)
    return torch.optim.AdamW(groups, lr=cfg.optim.lr,
                             betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
                             fused=fused, foreach=None if fused else True)


def disable_cpu_shm_comm() -> None:
    """Keep DeepSpeed from building its shared-memory allreduce op for CPU ranks.

    DeepSpeed builds it whenever its communication backend starts on the CPU accelerator, even
    when torch.distributed is already initialised, and the first build compiles C++ for 60-90 s.
    Marking the op incompatible makes DeepSpeed fall back to plain torch.distributed (gloo).
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def check_precision_supported(ds_config: dict[str, Any], accelerator) -> None:
    """Refuse a half precision the accelerator lacks before DeepSpeed does, naming the keys that chose it.

    DeepSpeed's CPU accelerator has fp16 only where oneDNN reports fp16 support (CPUs with AVX512-FP16 or
    AMX-FP16); elsewhere its own error ("Type fp16 is not supported on your device") names no setting.
    """
    checks = {"fp16": accelerator.is_fp16_supported, "bf16": accelerator.is_bf16_supported}
    for precision, supported in checks.items():
        if ds_config.get(precision, {}).get("enabled") and not supported():
            raise ConfigError(f"train.precision (or deepspeed.config): {precision} is not supported by DeepSpeed's "
                              f"{accelerator.device_name()} accelerator on this machine; use "
                              f"{'bf16 or ' if precision == 'fp16' and accelerator.is_bf16_supported() else ''}fp32")


def initialize(model: nn.Module, cfg: RunConfig, world_size: int, param_groups: list[dict[str, Any]] | None = None):
    """``deepspeed.initialize`` on an already-initialised process group; returns the engine. ``param_groups``
    (default :func:`parameter_groups`) may carry an ``lr_scale`` each (layer-wise decay)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu" and not cfg.deepspeed.cpu_shm_comm:
        disable_cpu_shm_comm()
    ds_config = build_deepspeed_config(cfg, world_size)
    check_precision_supported(ds_config, get_accelerator())
    groups = param_groups if param_groups is not None else parameter_groups(model, cfg.optim.weight_decay)
    if "optimizer" in ds_config:
        engine, *_ = deepspeed.initialize(model=model, config=ds_config, dist_init_required=False,
                                          model_parameters=groups)
    else:
        engine, *_ = deepspeed.initialize(model=model, optimizer=build_optimizer(model, cfg, groups),
                                          config=ds_config, dist_init_required=False)
    return engine


def set_lr(engine, lr: float) -> None:
    """``lr`` times each group's ``lr_scale`` (1 when it has none)."""
    for group in engine.optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def set_accumulation(engine, micro_batches: int, batch_size: int) -> None:
    """Make the next optimizer step accumulate ``micro_batches`` micro-batches of ``batch_size`` per rank (the
    batch ramp, a phase's global batch), without rebuilding the engine: DeepSpeed divides each micro-batch's loss
    by this count, and the ZeRO optimizer keeps its own copy. The step marks its last micro-batch as the
    accumulation boundary itself (``train_step``), so the count may change from one step to the next."""
    if (engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()) == (micro_batches, batch_size):
        return
    engine.set_train_micro_batch_size(batch_size)
    engine.set_train_batch_size(batch_size * micro_batches * engine.dp_world_size)
    if hasattr(engine.optimizer, "gradient_accumulation_steps"):
        engine.optimizer.gradient_accumulation_steps = micro_batches


def loss_scale(engine) -> float | None:
    """The current fp16 loss scale (None without dynamic scaling)."""
    if not engine.fp16_enabled():
        return None
    for name in ("cur_scale", "loss_scale"):
        value = getattr(engine.optimizer, name, None)
        if value is not None:
            return float(value)
    return None
