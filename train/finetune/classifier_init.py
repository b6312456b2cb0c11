"""Where a fine-tuning run's encoder and tokenizer come from (``model.init_from``, ``data.tokenizer``).

``model.init_from`` is a distaff checkpoint, run directory or model folder (the pretraining head and
the Enhanced Mask Decoder are dropped), or a Hugging Face DeBERTa-v2/v3 folder (``DebertaV2ForMaskedLM``,
``DebertaV2Model``, ``DebertaV2ForSequenceClassification``: only ``deberta.*`` is kept). The classifier
head always starts fresh. The tokenizer is ``data.tokenizer`` or the one saved with the weights; a
tokenizer whose vocabulary the encoder cannot embed, or another one than the weights were trained
with, is a :class:`ConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from distaff.train.data.tokenizer import TokenizerInfo, load_tokenizer_info
from distaff.train.core.files import read_json
from distaff.train.model.config import ConfigError, ModelConfig
from distaff.train.model.hf import _matched_state, model_config_from_hf, read_hf_weights
from distaff.train.run.model_folder import MODEL_CONFIG_FILE, _tokenizer_beside, load_model

# HF heads (MLM, RTD, sequence classification) a fine-tuning run does not start from
HEAD_PREFIXES = ("cls.", "lm_predictions.", "mask_predictions.", "pooler.", "classifier.")
ENCODER_PREFIX = "deberta."


@dataclass
class EncoderSource:
    config: ModelConfig                     # the encoder's architecture, EMD off
    weights: dict[str, torch.Tensor]        # ``deberta.*`` state for DebertaForSequenceClassification
    tokenizer_dir: Path | None              # the tokenizer saved with the weights


def load_encoder(path: str | Path, overrides: dict, field: str = "model.init_from") -> EncoderSource:
    """The encoder at ``path`` (see the module doc) with the free ``overrides`` (dropouts, kernels) applied;
    errors name ``field``, where the path came from."""
    folder = Path(path)
    if not folder.exists():
        raise ConfigError(f"{field}: {folder} does not exist")
    try:
        if (folder / "config.json").is_file() and not (folder / MODEL_CONFIG_FILE).is_file():
            source = _hf_encoder(folder)
        else:
            model, tokenizer_dir = load_model(folder)
            weights = {ENCODER_PREFIX + key: t for key, t in model.deberta.state_dict().items()}
            source = EncoderSource(model.config.replace(emd=False), weights, tokenizer_dir)
    except (FileNotFoundError, ValueError, KeyError, RuntimeError) as err:  # RuntimeError: load_state_dict's
        raise ConfigError(f"{field}: {err}") from None
    source.config = source.config.replace(**overrides)
    return source


def _hf_encoder(folder: Path) -> EncoderSource:
    config = model_config_from_hf(read_json(folder / "config.json", error=ConfigError), str(folder / "config.json"))
    from distaff.train.model.deberta import DebertaModel

    expected = {ENCODER_PREFIX + k: t for k, t in DebertaModel(config).state_dict().items()}
    weights = {key if key.startswith(HEAD_PREFIXES + (ENCODER_PREFIX,)) else ENCODER_PREFIX + key: tensor
               for key, tensor in read_hf_weights(folder).items()}   # a bare DebertaV2Model has no prefix
    state = _matched_state(weights, expected, {}, HEAD_PREFIXES, "\0", str(folder))
    tokenizer_dir = _tokenizer_beside(folder)
    return EncoderSource(config, state, tokenizer_dir)


def resolve_tokenizer(source: EncoderSource, tokenizer: str, init_from: str) -> TokenizerInfo:
    """``data.tokenizer`` (or the weights' own), checked against the encoder's vocabulary."""
    if not tokenizer and source.tokenizer_dir is None:
        raise ConfigError(f"data.tokenizer: model.init_from ({init_from}) has no distaff tokenizer beside it; "
                          "name the tokenizer folder the model was trained with")
    try:
        info = load_tokenizer_info(tokenizer or source.tokenizer_dir)
        own = load_tokenizer_info(source.tokenizer_dir) if tokenizer and source.tokenizer_dir else None
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"data.tokenizer: {err}") from None
    if own is not None and own.fingerprint != info.fingerprint:
        raise ConfigError(f"data.tokenizer: {info.path} is not the tokenizer model.init_from ({init_from}) was "
                          f"trained with ({own.path}: another spm.model, sha256 {own.fingerprint[:12]} vs "
                          f"{info.fingerprint[:12]}); its token ids would index the wrong embeddings")
    config = source.config
    if info.vocab_size > config.vocab_size:
        raise ConfigError(f"data.tokenizer: {info.path} has {info.vocab_size} pieces but model.init_from ({init_from}) "
                          f"embeds only vocab_size={config.vocab_size}: not the vocabulary the model was trained with")
    if info.pad_id != config.pad_token_id:
        raise ConfigError(f"data.tokenizer: {info.path} pads with id {info.pad_id} but model.init_from ({init_from}) "
                          f"has pad_token_id={config.pad_token_id}")
    return info
