"""Parameter sizes of the models distaff builds, read from their configs' shapes (no model is built).

The planner needs the parameter count, the largest parameter (ZeRO 3 gathers it whole) and the parameters
small enough for ZeRO 3 to keep whole on every rank, for every plan; building the model (even on the meta
device) costs seconds. Each function mirrors a module of :mod:`distaff.train.model.deberta` and
:mod:`distaff.train.model.rtd` parameter by parameter; ``tests/model/test_param_count.py`` holds them equal
to the built models' for every preset and switch.
"""

from __future__ import annotations

from distaff.train.model.config import ModelConfig


def _linear(fan_in: int, fan_out: int, bias: bool = True) -> list[int]:
    return [fan_in * fan_out] + ([fan_out] if bias else [])


def _embeddings(cfg: ModelConfig) -> list[int]:
    e, h = cfg.embedding_size, cfg.hidden_size
    sizes = [cfg.vocab_size * e]
    if cfg.position_biased_input:
        sizes.append(cfg.max_position_embeddings * e)
    if cfg.type_vocab_size > 0:
        sizes.append(cfg.type_vocab_size * e)
    if e != h:
        sizes += _linear(e, h, bias=False)
    return sizes + [h, h]                                          # LayerNorm


def _layer(cfg: ModelConfig) -> list[int]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    sizes = _linear(h, h) * 3                                      # query, key, value
    if cfg.relative_attention and not cfg.share_att_key:
        sizes += _linear(h, h) * len(cfg.pos_att_type)             # pos_key_proj / pos_query_proj
    sizes += _linear(h, h) + [h, h]                                # attention output dense, LayerNorm
    return sizes + _linear(h, i) + _linear(i, h) + [h, h]          # intermediate, output, LayerNorm


def encoder_parameter_sizes(cfg: ModelConfig) -> list[int]:
    """``DebertaModel``: embeddings, layers, relative-position table and its LayerNorm, T-TA's queries."""
    h = cfg.hidden_size
    sizes = _embeddings(cfg) + _layer(cfg) * cfg.num_hidden_layers
    if cfg.relative_attention:
        sizes.append(2 * cfg.att_span * h)
    if cfg.norm_rel_ebd == "layer_norm":
        sizes += [h, h]
    if cfg.tta:
        sizes.append(cfg.max_position_embeddings * h)
    return sizes


def mlm_parameter_sizes(cfg: ModelConfig) -> list[int]:
    """``DebertaForMaskedLM``: the encoder, EMD's position table, the MLM head (its decoder is the word table)."""
    e = cfg.embedding_size
    emd = [cfg.max_position_embeddings * cfg.hidden_size] if cfg.emd else []
    return encoder_parameter_sizes(cfg) + emd + _linear(cfg.hidden_size, e) + [e, e, cfg.vocab_size]


def rtd_parameter_sizes(generator: ModelConfig, discriminator: ModelConfig, sharing: str) -> list[int]:
    """``ReplacedTokenDetection``: the generator, then the discriminator (its RTD head: dense, LayerNorm, one
    logit); under ``es`` the discriminator's word table is the generator's (counted once)."""
    h = discriminator.hidden_size
    own = encoder_parameter_sizes(discriminator)
    if sharing == "es":
        own = own[1:]
    return mlm_parameter_sizes(generator) + own + _linear(h, h) + [h, h] + _linear(h, 1)
