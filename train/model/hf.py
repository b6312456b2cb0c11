"""Moving models between distaff and Hugging Face ``transformers`` (``DebertaV2ForMaskedLM`` folders).

``from_hf`` reads ``config.json`` plus ``model.safetensors`` (single or sharded) or
``pytorch_model.bin`` (with ``torch.load(weights_only=True)``: nothing is unpickled). Both HF MLM
head layouts are understood: the default ``cls.predictions.*`` (``legacy=True``) and the original
DeBERTa ``lm_predictions.lm_head.*``. ``to_hf`` writes the ``cls.predictions`` layout, which also
covers ``embedding_size != hidden_size``; the Enhanced Mask Decoder is a pretraining-only part
and is not exported.

RTD discriminators (:class:`~distaff.train.model.rtd.Discriminator`) are ``DebertaV2Model`` folders
whose weights also hold the replaced-token head under the official names ``mask_predictions.*``
(transformers has no class for it and ignores it; ``AutoModelForSequenceClassification`` adds a
fresh head): ``discriminator_to_hf`` writes one, ``discriminator_from_hf`` reads one, the public
DeBERTa-v3 checkpoints included, keeping the head so RTD pretraining can continue from it.

This module does not import ``transformers``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from distaff.train.core.files import chmod_default, read_json
from distaff.train.core.safe_load import UnsafeCheckpointError, safe_load
from distaff.train.model.config import ConfigError, ModelConfig
from distaff.train.model.deberta import DebertaForMaskedLM
from distaff.train.model.rtd import Discriminator

# DebertaV2Config's defaults, used for fields a config.json leaves out (they differ from ours).
HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=128100, hidden_size=1536, num_hidden_layers=24, num_attention_heads=24, intermediate_size=6144,
    hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, max_position_embeddings=512,
    type_vocab_size=0, initializer_range=0.02, layer_norm_eps=1e-7, relative_attention=False,
    max_relative_positions=-1, pad_token_id=0, position_biased_input=True, pos_att_type=[], position_buckets=-1,
    share_att_key=False, norm_rel_ebd="none", embedding_size=None,
)

# Head parameters: distaff name -> name in each HF layout.
HEAD_KEYS = {
    "legacy": {"lm_head.dense.weight": "cls.predictions.transform.dense.weight",
               "lm_head.dense.bias": "cls.predictions.transform.dense.bias",
               "lm_head.LayerNorm.weight": "cls.predictions.transform.LayerNorm.weight",
               "lm_head.LayerNorm.bias": "cls.predictions.transform.LayerNorm.bias",
               "lm_head.bias": "cls.predictions.bias"},
    "original": {"lm_head.dense.weight": "lm_predictions.lm_head.dense.weight",
                 "lm_head.dense.bias": "lm_predictions.lm_head.dense.bias",
                 "lm_head.LayerNorm.weight": "lm_predictions.lm_head.LayerNorm.weight",
                 "lm_head.LayerNorm.bias": "lm_predictions.lm_head.LayerNorm.bias",
                 "lm_head.bias": "lm_predictions.lm_head.bias"},
}
# HF keys that carry no information of their own (tied copies, buffers, the RTD discriminator head).
IGNORED_HF_KEYS = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias",
                   "deberta.embeddings.position_ids")
IGNORED_HF_PREFIXES = ("mask_predictions.",)
# What a discriminator ignores: MLM heads (the public v3 checkpoints carry one).
DISCRIMINATOR_IGNORED_PREFIXES = ("lm_predictions.", "cls.predictions.")
RTD_HEAD_PREFIX = "mask_predictions."
# Fields that may differ between an HF folder and the model its weights initialise (no weight shape or
# computation depends on them at inference).
HF_FREE_FIELDS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "initializer_range", "pad_token_id")
# Absolute positions of the original DeBERTa-v3 checkpoints: unused by HF, EMD's table for us.
HF_ABSOLUTE_POSITIONS = "deberta.embeddings.position_embeddings.weight"


def model_config_from_hf(hf_config: dict[str, Any], source: str = "config.json", **overrides: Any) -> ModelConfig:
    """Our config from a ``DebertaV2Config`` dict; distaff-only fields come from ``overrides``."""
    if hf_config.get("model_type", "deberta-v2") != "deberta-v2":
        raise ConfigError(f"{source}: model_type is {hf_config['model_type']!r}, expected 'deberta-v2'")
    if hf_config.get("conv_kernel_size", 0):
        raise ConfigError(f"{source}: conv_kernel_size={hf_config['conv_kernel_size']} (the convolution layer of "
                          "DeBERTa-v2-xlarge) is not supported by distaff")
    hidden = hf_config.get("hidden_size", HF_DEFAULTS["hidden_size"])
    heads = hf_config.get("num_attention_heads", HF_DEFAULTS["num_attention_heads"])
    head_size = hf_config.get("attention_head_size")
    if head_size is not None and heads and head_size * heads != hidden:
        raise ConfigError(f"{source}: attention_head_size={head_size} with {heads} heads != hidden_size={hidden}; "
                          "distaff requires head size = hidden_size / num_attention_heads")
    values = {name: hf_config.get(name, default) for name, default in HF_DEFAULTS.items()}
    values["pos_att_type"] = values["pos_att_type"] or []
    if values["pad_token_id"] is None:
        values["pad_token_id"] = 0
    return ModelConfig.from_dict({**values, **overrides}, source)


# distaff's switches DebertaV2Model cannot run, each with what it is.
NO_HF_EQUIVALENT = {
    "rope": "rotary position embeddings",
    "entropy_scale_length": "the entropy-invariant attention scale (log n / log n_train per sequence)",
    "realformer": "RealFormer's residual attention (every earlier layer's scores added to a layer's own)",
    "tta": "T-TA's attention (no token attends to itself, keys and values from the embeddings, position queries)",
}


def hf_config_dict(cfg: ModelConfig, architecture: str = "DebertaV2ForMaskedLM") -> dict[str, Any]:
    """``config.json`` contents for ``architecture`` (``DebertaV2ForMaskedLM``, ``DebertaV2Model``); a model
    HF cannot run is refused."""
    for name, what in NO_HF_EQUIVALENT.items():
        value = getattr(cfg, name)
        if value:
            shown = "" if value is True else f"={value}"
            raise ConfigError(f"model.{name}{shown}: {what} has no Hugging Face DeBERTa-v2 equivalent "
                              "(DebertaV2Model would run the weights without it and silently compute something "
                              "else); such a model cannot be exported to HF, keep its distaff checkpoint")
    values = {name: getattr(cfg, name) for name in HF_DEFAULTS}
    return {"architectures": [architecture], "model_type": "deberta-v2", "legacy": True,
            "tie_word_embeddings": True, **values}


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF folder, without unpickling anything."""
    single, index, legacy_bin = folder / "model.safetensors", folder / "model.safetensors.index.json", \
        folder / "pytorch_model.bin"
    if single.is_file():
        return load_file(single)
    if index.is_file():
        index_values = read_json(index, error=ConfigError)
        weight_map = index_values.get("weight_map") if isinstance(index_values, dict) else None
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{index}: no weight_map of tensor names to files")
        shards = sorted(set(map(str, weight_map.values())))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            if not (folder / shard).is_file():
                raise FileNotFoundError(f"{index} names shard {shard}, which is missing from {folder}")
            state.update(load_file(folder / shard))
        return state
    if legacy_bin.is_file():
        try:
            return safe_load(legacy_bin)
        except UnsafeCheckpointError as err:
            raise UnsafeCheckpointError(f"{err}; {folder} has no model.safetensors: where you trust the file, convert "
                                        "it (transformers: from_pretrained, then save_pretrained) and use that "
                                        "folder") from None
    raise FileNotFoundError(f"no weights in {folder}: expected model.safetensors, model.safetensors.index.json "
                            "or pytorch_model.bin")


def _distaff_state(hf_state: dict[str, torch.Tensor], model: DebertaForMaskedLM,
                   source: str) -> dict[str, torch.Tensor]:
    """Rename HF keys to ours and check that every parameter is present with the right shape."""
    layout = "original" if any(k.startswith("lm_predictions.") for k in hf_state) else "legacy"
    renames = {hf: ours for ours, hf in HEAD_KEYS[layout].items()}
    if model.emd is not None and HF_ABSOLUTE_POSITIONS in hf_state and not model.config.position_biased_input:
        renames[HF_ABSOLUTE_POSITIONS] = "emd.position_embeddings.weight"
    # EMD is ours: an HF checkpoint never has it, so it keeps its initialisation.
    return _matched_state(hf_state, model.state_dict(), renames, IGNORED_HF_PREFIXES, "emd.", source)


def _matched_state(hf_state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], renames: dict[str, str],
                   ignored_prefixes: tuple[str, ...], optional_prefix: str, source: str) -> dict[str, torch.Tensor]:
    """``hf_state`` under our names (``renames``), checked against ``expected``: every key used or
    ignored, every expected key present (but those under ``optional_prefix``), shapes equal."""
    state, unexpected = {}, []
    for key, tensor in hf_state.items():
        ours = renames.get(key, key)
        if ours in expected:
            state[ours] = tensor
        elif key not in IGNORED_HF_KEYS and not key.startswith(ignored_prefixes) and key != HF_ABSOLUTE_POSITIONS:
            unexpected.append(key)
    if unexpected:
        raise ValueError(f"{source}: weights not used by a model of this config: {sorted(unexpected)[:10]}"
                         f"{' ...' if len(unexpected) > 10 else ''} (does config.json match the weights?)")
    missing = [k for k in expected if k not in state and not k.startswith(optional_prefix)]
    if missing:
        raise ValueError(f"{source}: missing weights {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    for key, tensor in state.items():
        if tensor.shape != expected[key].shape:
            raise ValueError(f"{source}: {key} has shape {tuple(tensor.shape)} in the checkpoint but "
                             f"{tuple(expected[key].shape)} in the model built from its config")
    return state


def _read_hf_config(folder: Path, **overrides: Any) -> ModelConfig:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    return model_config_from_hf(read_json(config_path, error=ConfigError), str(config_path), **overrides)


def from_hf(path: str | Path, **overrides: Any) -> DebertaForMaskedLM:
    """Load an HF ``DebertaV2ForMaskedLM`` folder; ``overrides`` set distaff fields (``emd=True`` ...)."""
    folder = Path(path)
    model = DebertaForMaskedLM(_read_hf_config(folder, **overrides))
    state = _distaff_state(read_hf_weights(folder), model, str(folder))
    model.load_state_dict(state, strict=False)
    return model


def discriminator_from_hf(path: str | Path, **overrides: Any) -> tuple[Discriminator, bool]:
    """An RTD discriminator from an HF DeBERTa-v2/v3 folder (``deberta.*`` weights, or a bare
    ``DebertaV2Model``'s), with its ``mask_predictions.*`` head when the folder has one (the public v3
    checkpoints do); returns the model and whether the head was loaded (else it is freshly initialised)."""
    folder = Path(path)
    model = Discriminator(_read_hf_config(folder, **overrides))
    state = discriminator_hf_state(folder, model)
    model.load_state_dict(state, strict=False)
    return model, any(key.startswith(RTD_HEAD_PREFIX) for key in state)


def _comparable(value: Any) -> Any:
    return sorted(value) if isinstance(value, list) else value   # pos_att_type's order means nothing


def discriminator_hf_state(path: str | Path, model: Discriminator) -> dict[str, torch.Tensor]:
    """The weights of an HF folder under ``model``'s names (the RTD head only if the folder has one),
    after checking that the folder's config.json describes ``model``'s architecture."""
    folder = Path(path)
    theirs = _read_hf_config(folder)
    differ = [f"{name}: {getattr(theirs, name)!r} there, {getattr(model.config, name)!r} here"
              for name in HF_DEFAULTS if name not in HF_FREE_FIELDS
              and _comparable(getattr(theirs, name)) != _comparable(getattr(model.config, name))]
    if differ:
        raise ConfigError(f"{folder / 'config.json'} describes another model: {'; '.join(differ)}")
    hf_state = {key if key.startswith((RTD_HEAD_PREFIX, "deberta.")) else f"deberta.{key}": tensor
                for key, tensor in read_hf_weights(folder).items()
                if not key.startswith(DISCRIMINATOR_IGNORED_PREFIXES)}
    return _matched_state(hf_state, model.state_dict(), {}, (), RTD_HEAD_PREFIX, str(folder))


def hf_state_dict(model: DebertaForMaskedLM) -> dict[str, torch.Tensor]:
    """Our weights under HF's ``cls.predictions`` names, EMD left out."""
    renames = HEAD_KEYS["legacy"]
    return {renames.get(k, k): t.detach().cpu().contiguous().clone()
            for k, t in model.state_dict().items() if not k.startswith("emd.")}


def to_hf(model: DebertaForMaskedLM, path: str | Path, tokenizer: str | Path | None = None) -> Path:
    """Write an HF folder that ``AutoModelForMaskedLM.from_pretrained`` loads with no missing or
    unexpected keys; ``tokenizer`` is a tokenizer folder whose files are copied alongside."""
    config = hf_config_dict(model.config)  # first: a model HF cannot run leaves no files behind
    return write_hf_folder(hf_state_dict(model), config, path, tokenizer)


def discriminator_to_hf(model: Discriminator, path: str | Path, tokenizer: str | Path | None = None,
                        word_embeddings: torch.Tensor | None = None) -> Path:
    """Write a ``DebertaV2Model`` folder (``AutoModel``; ``AutoModelForSequenceClassification`` adds a
    fresh head) whose weights also hold the RTD head as ``mask_predictions.*``. ``word_embeddings``
    replaces the model's own table (with GDES, the sum of the generator's and the residual)."""
    state = {key: tensor.detach().cpu().contiguous().clone() for key, tensor in model.state_dict().items()}
    if word_embeddings is not None:
        state["deberta.embeddings.word_embeddings.weight"] = word_embeddings.detach().cpu().contiguous().clone()
    return write_hf_folder(state, hf_config_dict(model.config, "DebertaV2Model"), path, tokenizer)


def classifier_to_hf(model, path: str | Path, tokenizer: str | Path | None, label_names: list[str] | None) -> Path:
    """Write a ``DebertaV2ForSequenceClassification`` folder (``AutoModelForSequenceClassification``, the
    ``text-classification`` pipeline) for a :class:`~distaff.train.model.classifier.DebertaForSequenceClassification`,
    whose parameters already carry HF's names; ``label_names`` (None: regression) become id2label/label2id."""
    config = hf_config_dict(model.config, "DebertaV2ForSequenceClassification")
    names = label_names or ["LABEL_0"]
    config.update(num_labels=model.num_labels, id2label={str(i): name for i, name in enumerate(names)},
                  label2id={name: i for i, name in enumerate(names)},
                  problem_type="regression" if model.regression else "single_label_classification",
                  pooler_hidden_size=model.config.hidden_size, pooler_dropout=model.pooler_dropout,
                  pooler_hidden_act="gelu", cls_dropout=model.cls_dropout)
    state = {key: tensor.detach().cpu().contiguous().clone() for key, tensor in model.state_dict().items()}
    return write_hf_folder(state, config, path, tokenizer)


def write_hf_folder(state: dict[str, torch.Tensor], config: dict[str, Any], path: str | Path,
                    tokenizer: str | Path | None) -> Path:
    """``model.safetensors``, ``config.json`` and a copy of the ``tokenizer`` folder's files."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    chmod_default(out / "model.safetensors")  # safetensors writes it 0600
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        source = Path(tokenizer)
        if not source.is_dir():
            raise FileNotFoundError(f"tokenizer folder not found: {source}")
        shutil.copytree(source, out, dirs_exist_ok=True)
    return out
