"""The DeBERTa-v2/v3 model configuration: Hugging Face's field names plus distaff's own switches.

Presets live in ``configs/model/<name>.yaml``; :func:`load_model_config` reads one and applies
overrides. Every field is validated at construction, and configurations that
``transformers.DebertaV2Config`` allows but distaff does not implement fail with an error naming
the field.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


from distaff.kernels import IMPLS, attention_span
from distaff.train.core import presets
from distaff.train.core.config_yaml import load_yaml
from distaff.train.core.errors import ConfigError, closest, reject_unknown_keys, shown
from distaff.train.core.files import read_text

POSITION_TERMS = ("c2p", "p2c")

@dataclass
class ModelConfig:
    # ---- fields shared with transformers.DebertaV2Config (same names, same meaning)
    vocab_size: int = 128100
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 0
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-7
    relative_attention: bool = True
    max_relative_positions: int = -1
    pad_token_id: int = 0
    position_biased_input: bool = False
    pos_att_type: list[str] = field(default_factory=lambda: ["p2c", "c2p"])
    position_buckets: int = 256
    share_att_key: bool = True
    norm_rel_ebd: str = "layer_norm"
    embedding_size: int | None = None
    # ---- distaff's own
    emd: bool = False                     # Enhanced Mask Decoder before the MLM head (pretraining)
    emd_layers: int = 2                   # applications of the shared last-layer weights (paper: n = 2)
    attention_impl: str = "auto"          # disentangled attention: auto | triton | reference
    kernel_impl: str = "auto"             # LayerNorm, bias+GELU, MLM loss: auto | triton | reference
    activation_checkpointing: bool = False
    # The Triton attention keeps its forward's dense position scores (C2P, P2C: 2 x heads x tokens x 2k elements a
    # layer) for the backward instead of recomputing them with two GEMMs; false frees them (docs/kernels.md).
    keep_position_scores: bool = True
    rope: bool = False                    # rotary position embedding of q and k (RoFormer); no HF equivalent
    rope_theta: float = 10000.0           # RoPE base: plane i turns by position * rope_theta^(-2i/d)
    # Entropy-invariant softmax scale (Su, 2021): scores of a sequence of n real tokens are scaled by
    # log(n) / log(entropy_scale_length) on top of the usual scale; 0 = off. No HF equivalent.
    entropy_scale_length: int = 0
    # RealFormer (He et al., 2021): each layer adds every earlier layer's pre-softmax scores to its own.
    # No HF equivalent.
    realformer: bool = False
    # T-TA (Shin et al., ACL 2020): diagonal attention mask, keys/values from the embeddings at every layer,
    # first-layer queries from positions. Set by train.objective=tta (the all-token objective). No HF equivalent.
    tta: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.pos_att_type, str):
            self.pos_att_type = [t.strip() for t in self.pos_att_type.lower().split("|") if t.strip()]
        self.pos_att_type = list(self.pos_att_type or [])
        if self.embedding_size is None:
            self.embedding_size = self.hidden_size
        self._validate()

    def _validate(self) -> None:
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), f.type)
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                    "max_position_embeddings", "embedding_size", "emd_layers")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                              f"({self.num_attention_heads})")
        unknown = [t for t in self.pos_att_type if t not in POSITION_TERMS]
        if unknown:
            raise ConfigError(f"pos_att_type: unsupported term(s) {unknown}; allowed: {list(POSITION_TERMS)}")
        if self.hidden_act != "gelu":
            raise ConfigError(f"hidden_act: only 'gelu' (exact erf GELU) is supported, got {self.hidden_act!r}")
        if self.norm_rel_ebd not in ("layer_norm", "none"):
            raise ConfigError(f"norm_rel_ebd must be 'layer_norm' or 'none', got {self.norm_rel_ebd!r}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        for name in ("attention_impl", "kernel_impl"):
            if getattr(self, name) not in IMPLS:
                raise ConfigError(f"{name} must be one of {IMPLS}, got {getattr(self, name)!r}")
        if self.rope_theta <= 0:
            raise ConfigError(f"rope_theta must be positive, got {self.rope_theta}")
        if self.rope and self.head_dim % 2:
            raise ConfigError(f"rope: needs an even head size, but hidden_size / num_attention_heads = "
                              f"{self.hidden_size} / {self.num_attention_heads} = {self.head_dim}")
        if self.entropy_scale_length < 0 or self.entropy_scale_length == 1:
            raise ConfigError(f"entropy_scale_length must be 0 (off) or a training length >= 2 (log of it divides the "
                              f"scale), got {self.entropy_scale_length}")
        for switch in ("realformer", "tta"):
            if getattr(self, switch) and self.emd:
                raise ConfigError(f"{switch} with emd: the Enhanced Mask Decoder re-runs the last layer with other "
                                  f"queries, which {switch} does not define; set emd: false (pretraining turns it on "
                                  f"by default)")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ConfigError(f"pad_token_id {self.pad_token_id} is outside the vocabulary (size {self.vocab_size})")

    # ---- derived quantities
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def resolved_max_relative_positions(self) -> int:
        """``max_relative_positions``, with HF's rule that values < 1 mean ``max_position_embeddings``."""
        return self.max_relative_positions if self.max_relative_positions >= 1 else self.max_position_embeddings

    @property
    def att_span(self) -> int:
        """Half the rows of the relative-position table (``position_buckets`` or the max distance)."""
        return attention_span(self.position_buckets, self.resolved_max_relative_positions)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "model config") -> "ModelConfig":
        reject_unknown_keys(values, (f.name for f in fields(cls)), f"{source}: unknown field(s)")
        return cls(**values)


_TYPE_CHECKS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    # nan and inf pass every range check below (and come from config.json files as NaN / Infinity)
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "int | None": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
}


def _check_type(name: str, value: Any, annotation: str) -> None:
    if not _TYPE_CHECKS[str(annotation)](value):
        kind = "a finite number" if str(annotation) == "float" else f"of type {annotation}"
        raise ConfigError(f"{name} must be {kind}, got {shown(value)} ({type(value).__name__})")


def preset_names() -> list[str]:
    return presets.preset_names("model")


def load_model_config(preset_or_path: str | Path, **overrides: Any) -> ModelConfig:
    """A preset name (``tiny``, ``deberta-v3-base`` ...) or a YAML file, with field overrides."""
    path = Path(preset_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise FileNotFoundError(f"model config file not found: {path}")
        text, source = read_text(path, error=ConfigError), str(path)
    else:
        resource = presets.preset_file(str(preset_or_path), "model")
        if resource is None:
            guess = closest(str(preset_or_path), preset_names())
            raise ConfigError(f"unknown model preset {str(preset_or_path)!r}; available: {preset_names()}"
                              + (f"; did you mean {guess!r}?" if guess else ""))
        text, source = resource.read_text(), f"preset {preset_or_path}"
    values = load_yaml(text, source) or {}
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: expected a mapping of fields, got {type(values).__name__}")
    return ModelConfig.from_dict({**values, **overrides}, source)


def check_data_fits_model(model_cfg: ModelConfig, seq_len: int, length: str, remedy: str,
                          section: str = "model") -> None:
    """Absolute position embeddings (``position_biased_input``, the Enhanced Mask Decoder, T-TA's queries) have
    ``max_position_embeddings`` rows: longer sequences (``length`` says where their length is set) would
    fail at the first step with a shape error."""
    users = [f"{section}.{name}" for name, on in (("position_biased_input", model_cfg.position_biased_input),
                                                  ("emd", model_cfg.emd), ("tta", model_cfg.tta)) if on]
    if users and seq_len > model_cfg.max_position_embeddings:
        raise ConfigError(f"{section}.max_position_embeddings: {model_cfg.max_position_embeddings} is shorter than "
                          f"the data's sequences ({length}), and {' and '.join(users)} use absolute positions; "
                          f"{remedy}")
