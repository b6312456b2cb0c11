"""DeBERTa-v2/v3 for masked-language modelling, readable in one sitting.

Parameter names follow Hugging Face's ``DebertaV2ForMaskedLM`` (``deberta.embeddings...``,
``deberta.encoder.layer.N.attention.self.query_proj`` ...) so checkpoints map one to one; only the
MLM head (``lm_head``) and the Enhanced Mask Decoder (``emd``) are named by distaff and mapped in
:mod:`distaff.train.model.hf`.

The pieces: embeddings -> L post-LN transformer layers with disentangled self-attention over a
shared relative-position table -> (EMD) -> MLM head tied to the word embeddings. Attention and
the fused ops go through :mod:`distaff.kernels`, which picks Triton on CUDA and the PyTorch
reference elsewhere (``attention_impl`` / ``kernel_impl`` in the config).

Padded positions: their embeddings are zeroed (as in HF) and, as queries, they attend to nothing,
so their hidden states are not meaningful; every real token's output equals HF's.

Packed sequences (``cu_seqlens``): ``input_ids`` is 1-D over the tokens of several sequences laid end
to end, with no padding; attention runs per sequence (``disentangled_attention_varlen``), and relative
and absolute positions restart in every sequence (``position_ids``). Every token's output equals the
padded model's for the same sequence.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from distaff import kernels
from distaff.train.model.config import ModelConfig
from distaff.train.model import realformer
from distaff.train.model.realformer import ScoreHistory
from distaff.train.model.rope import apply_rope, rope_angles


class Packed(NamedTuple):
    """Where each sequence lies in a packed (1-D) batch; stands in for the padding mask.

    A NamedTuple so ZeRO-3 and activation checkpointing see its tensors."""

    cu_seqlens: torch.Tensor    # int32 [S + 1]: sequence s is tokens cu_seqlens[s]:cu_seqlens[s+1]
    max_seqlen: int             # the longest sequence
    position_ids: torch.Tensor  # long [T]: each token's position inside its sequence


Layout = torch.Tensor | Packed  # a [B, N] padding mask, or the packed sequences' offsets


class LayerNorm(nn.Module):
    """LayerNorm with an optional fused residual add (``LN(x + residual)``)."""

    def __init__(self, size: int, eps: float, impl: str):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size))
        self.eps, self.impl = eps, impl

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return kernels.layer_norm(x, self.weight, self.bias, self.eps, residual, impl=self.impl)


def batch_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                 cu_seqlens: torch.Tensor | None, max_seqlen: int | None) -> Layout:
    """A model's batch arguments as a :data:`Layout`: the padding mask (all ones when absent), or
    :class:`Packed` when ``cu_seqlens`` is given."""
    if cu_seqlens is None:
        return torch.ones_like(input_ids) if attention_mask is None else attention_mask
    if attention_mask is not None or position_ids is None or max_seqlen is None:
        raise ValueError("a packed batch (cu_seqlens) needs position_ids and max_seqlen, and no attention_mask")
    return Packed(cu_seqlens, int(max_seqlen), position_ids)


def absolute_positions(table: nn.Embedding, tokens: torch.Tensor, mask: Layout) -> torch.Tensor:
    """Each token's absolute position embedding: ``[N, D]`` (broadcast over the batch) when padded,
    ``[T, D]`` restarting in every sequence when packed."""
    if isinstance(mask, Packed):
        return table(mask.position_ids)
    return table.weight[: tokens.shape[1]]


class Embeddings(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.embedding_size, padding_idx=cfg.pad_token_id)
        self.position_embeddings = (nn.Embedding(cfg.max_position_embeddings, cfg.embedding_size)
                                    if cfg.position_biased_input else None)
        self.token_type_embeddings = (nn.Embedding(cfg.type_vocab_size, cfg.embedding_size)
                                      if cfg.type_vocab_size > 0 else None)
        self.embed_proj = (nn.Linear(cfg.embedding_size, cfg.hidden_size, bias=False)
                           if cfg.embedding_size != cfg.hidden_size else None)
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, cfg.kernel_impl)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None, mask: Layout,
                word_offset: torch.Tensor | None = None) -> torch.Tensor:
        """``word_offset`` (same shape as the word vectors) is added to them (gradient-disentangled
        embedding sharing adds the generator's detached vectors to this table's residual)."""
        x = self.word_embeddings(input_ids)
        if word_offset is not None:
            x = x + word_offset
        if self.position_embeddings is not None:
            x = x + absolute_positions(self.position_embeddings, input_ids, mask)
        if self.token_type_embeddings is not None:
            types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            x = x + self.token_type_embeddings(types)
        if self.embed_proj is not None:
            x = self.embed_proj(x)
        x = self.LayerNorm(x)
        if not isinstance(mask, Packed):  # a packed batch holds no padding
            x = x * mask.unsqueeze(-1).to(x.dtype)
        return self.dropout(x)


class DisentangledSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden, self.heads = cfg.hidden_size, cfg.num_attention_heads
        self.query_proj = nn.Linear(hidden, hidden)
        self.key_proj = nn.Linear(hidden, hidden)
        self.value_proj = nn.Linear(hidden, hidden)
        self.c2p, self.p2c = "c2p" in cfg.pos_att_type, "p2c" in cfg.pos_att_type
        self.relative = cfg.relative_attention
        if self.relative and not cfg.share_att_key:
            self.pos_key_proj = nn.Linear(hidden, hidden) if self.c2p else None
            self.pos_query_proj = nn.Linear(hidden, hidden) if self.p2c else None
        self.share_att_key = cfg.share_att_key
        self.pos_dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.attn_dropout = cfg.attention_probs_dropout_prob
        # HF scales by the configured position terms even when relative attention is off.
        self.scale = (cfg.head_dim * (1 + len(cfg.pos_att_type))) ** -0.5
        self.position_buckets = cfg.position_buckets
        self.max_relative_positions = cfg.resolved_max_relative_positions
        self.impl = cfg.attention_impl
        self.keep_scores = cfg.keep_position_scores
        self.rope_theta = cfg.rope_theta if cfg.rope else None
        self.entropy_scale_length = cfg.entropy_scale_length
        self.realformer = cfg.realformer
        self.mask_diagonal = cfg.tta  # T-TA: no token attends to itself

    def _softmax_scale(self, mask: Layout) -> float | torch.Tensor:
        """The scale, or with ``entropy_scale_length`` one per sequence: ``scale * log(n) / log(n_train)``
        with ``n`` the sequence's real tokens (padding excluded), at least 1. ``n = 1`` gives scale 0, which
        changes nothing: a one-token sequence attends only to itself (a fully padded row outputs 0)."""
        if not self.entropy_scale_length:
            return self.scale
        lengths = mask.cu_seqlens.diff() if isinstance(mask, Packed) else mask.ne(0).sum(-1)
        ratio = lengths.clamp_min(1).double().log() / math.log(self.entropy_scale_length)
        return (self.scale * ratio).float()

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., N, H*d]`` -> ``[..., H, N, d]``."""
        return x.unflatten(-1, (self.heads, -1)).transpose(-3, -2)

    def _split(self, x: torch.Tensor, mask: Layout) -> torch.Tensor:
        """``[..., H*d]`` in the op's layout: ``[T, H, d]`` packed, ``[B, H, N, d]`` padded."""
        return x.unflatten(-1, (self.heads, -1)) if isinstance(mask, Packed) else self._heads(x)

    def _op(self, mask: Layout) -> Callable[..., torch.Tensor]:
        """The attention op for this layout, its layout arguments bound."""
        if isinstance(mask, Packed):
            return partial(kernels.disentangled_attention_varlen, cu_seqlens=mask.cu_seqlens,
                           max_seqlen=mask.max_seqlen)
        return partial(kernels.disentangled_attention, attention_mask=mask)

    def _attend(self, hidden: torch.Tensor, mask: Layout, query_states: torch.Tensor, pos_key: torch.Tensor | None,
                pos_query: torch.Tensor | None,
                history: ScoreHistory | None) -> tuple[torch.Tensor, ScoreHistory | None]:
        """Attention output, ``[B, N, H*d]`` padded or ``[T, H*d]`` packed, and with ``realformer`` the
        score history including this layer."""
        q, k, v = (self._split(proj(x), mask) for proj, x in
                   ((self.query_proj, query_states), (self.key_proj, hidden), (self.value_proj, hidden)))
        positions = mask.position_ids if isinstance(mask, Packed) else torch.arange(q.shape[-2], device=q.device)
        q, k = self._rotate(q, k, positions)
        options = dict(position_buckets=self.position_buckets, max_relative_positions=self.max_relative_positions,
                       dropout_p=self.attn_dropout if self.training else 0.0, softmax_scale=self._softmax_scale(mask),
                       mask_diagonal=self.mask_diagonal, keep_scores=self.keep_scores)
        if self.realformer:
            history = realformer.extend(history, q, k, pos_key, pos_query)
            out = realformer.residual_attention(history, v, self._op(mask), self.impl, **options)
        else:
            out = self._op(mask)(q, k, v, pos_key, pos_query, impl=self.impl, **options)
        return (out.flatten(1) if isinstance(mask, Packed) else out.transpose(1, 2).flatten(2)), history

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE (``model.rope``) at each token's position in its sequence; ``q``, ``k`` unchanged without it."""
        if self.rope_theta is None:
            return q, k
        cos, sin = rope_angles(positions, q.shape[-1], self.rope_theta)
        if q.dim() == 3:  # packed [T, H, d]: one angle per token, shared by the heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def _position_tables(self, rel: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``Kr`` and ``Qr`` as ``[H, 2*span, d]`` from the (normalised) relative embeddings."""
        if not self.relative:
            return None, None
        rel = self.pos_dropout(rel)
        key_proj = self.key_proj if self.share_att_key else self.pos_key_proj
        query_proj = self.query_proj if self.share_att_key else self.pos_query_proj
        pos_key = self._heads(key_proj(rel)) if self.c2p else None
        pos_query = self._heads(query_proj(rel)) if self.p2c else None
        return pos_key, pos_query

    def forward(self, hidden: torch.Tensor, mask: Layout, rel: torch.Tensor | None, query_states: torch.Tensor,
                history: ScoreHistory | None = None) -> tuple[torch.Tensor, ScoreHistory | None]:
        pos_key, pos_query = self._position_tables(rel)
        return self._attend(hidden, mask, query_states, pos_key, pos_query, history)


class SelfOutput(nn.Module):
    """``LN(dropout(dense(x)) + residual)``; HF's ``attention.output`` and (shape aside) ``output``."""

    def __init__(self, in_size: int, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(in_size, cfg.hidden_size)
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, cfg.kernel_impl)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)), residual)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self = DisentangledSelfAttention(cfg)
        self.output = SelfOutput(cfg.hidden_size, cfg)

    def forward(self, hidden: torch.Tensor, mask: Layout, rel: torch.Tensor | None, query_states: torch.Tensor,
                history: ScoreHistory | None = None) -> tuple[torch.Tensor, ScoreHistory | None]:
        attended, history = self.self(hidden, mask, rel, query_states, history)
        return self.output(attended, query_states), history


def _dense_gelu(dense: nn.Linear, x: torch.Tensor, impl: str) -> torch.Tensor:
    """``gelu(x W^T + b)`` with the bias add fused into the GELU; under autocast the bias is cast
    to the activation dtype so the (large) output is not promoted to float32."""
    h = F.linear(x, dense.weight)
    return kernels.bias_gelu(h, dense.bias.to(h.dtype), impl=impl)


class Intermediate(nn.Module):
    """The feed-forward expansion: fused ``gelu(x W^T + b)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.impl = cfg.kernel_impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _dense_gelu(self.dense, x, self.impl)


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = SelfOutput(cfg.intermediate_size, cfg)

    def forward(self, hidden: torch.Tensor, mask: Layout, rel: torch.Tensor | None,
                query_states: torch.Tensor | None = None,
                history: ScoreHistory | None = None) -> tuple[torch.Tensor, ScoreHistory | None]:
        """Keys and values come from ``hidden``; queries from ``query_states`` (EMD, T-TA) or ``hidden``.
        Returns the layer's output and, with ``realformer``, the score history including this layer."""
        attended, history = self.attention(hidden, mask, rel, hidden if query_states is None else query_states,
                                           history)
        return self.output(self.intermediate(attended), attended), history


class Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layer = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.rel_embeddings = nn.Embedding(2 * cfg.att_span, cfg.hidden_size) if cfg.relative_attention else None
        # Present whenever norm_rel_ebd asks for it (as in HF), even if unused without relative attention.
        self.LayerNorm = (LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, cfg.kernel_impl)
                          if cfg.norm_rel_ebd == "layer_norm" else None)
        self.activation_checkpointing = cfg.activation_checkpointing

    def rel_table(self) -> torch.Tensor | None:
        """The shared relative-position table, normalised once per forward for all layers."""
        if self.rel_embeddings is None:
            return None
        rel = self.rel_embeddings.weight
        return self.LayerNorm(rel) if self.LayerNorm is not None else rel

    def run_layer(self, layer: Layer, hidden: torch.Tensor, mask: Layout, rel: torch.Tensor | None,
                  query_states: torch.Tensor | None = None,
                  history: ScoreHistory | None = None) -> tuple[torch.Tensor, ScoreHistory | None]:
        if self.activation_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(layer, hidden, mask, rel, query_states, history, use_reentrant=False)
        return layer(hidden, mask, rel, query_states, history)

    def forward(self, hidden: torch.Tensor, mask: Layout, num_layers: int | None = None,
                query: torch.Tensor | None = None) -> torch.Tensor:
        """The first ``num_layers`` layers. With ``query`` (T-TA), every layer takes its keys and values
        from ``hidden`` and its queries from the previous layer's output, the first from ``query``."""
        rel, history = self.rel_table(), None
        stream = hidden if query is None else query
        for layer in self.layer[:num_layers]:
            stream, history = self.run_layer(layer, stream if query is None else hidden, mask, rel, stream, history)
        return stream

    def requery_last_layer(self, hidden: torch.Tensor, mask: Layout, query: torch.Tensor,
                           times: int) -> torch.Tensor:
        """The last layer ``times`` times over keys and values from ``hidden``, each output becoming
        the next ``query`` (the Enhanced Mask Decoder's computation)."""
        rel, last = self.rel_table(), self.layer[-1]
        for _ in range(times):
            query, _ = self.run_layer(last, hidden, mask, rel, query)
        return query


class DebertaModel(nn.Module):
    """Embeddings + encoder; ``DebertaV2Model``'s computation for 2-D padding masks, or for packed sequences.

    With ``tta`` (T-TA, Shin et al., ACL 2020) every layer's keys and values are the embedding output,
    the first layer's queries a learned vector per position, and no token attends to itself, so no
    output depends on its own input token: every token can be a prediction target."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        # T-TA: the first layer's queries, one learned vector per position (no token information)
        self.position_queries = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size) if cfg.tta else None

    def forward(self, input_ids: torch.Tensor, attention_mask: Layout | None = None,
                token_type_ids: torch.Tensor | None = None, num_layers: int | None = None,
                word_offset: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the first ``num_layers`` layers (all by default); ``attention_mask``
        may be a :class:`Packed` layout for 1-D ``input_ids``."""
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        hidden = self.embeddings(input_ids, token_type_ids, mask, word_offset)
        if self.position_queries is None:
            return self.encoder(hidden, mask, num_layers)
        query = absolute_positions(self.position_queries, input_ids, mask).expand_as(hidden).contiguous()
        return self.encoder(hidden, mask, num_layers, query=query)


class EnhancedMaskDecoder(nn.Module):
    """EMD (DeBERTa paper, sec. 3.2): absolute positions enter just before the MLM head.

    Queries ``H + P`` (the last layer's input plus absolute position embeddings) attend over
    ``H`` through the last encoder layer's weights, ``n`` times, each output becoming the next
    query. Only its output feeds the MLM head, so the encoder's own pass through the last layer
    is skipped when EMD is on (the paper's computation, one layer cheaper).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.applications = cfg.emd_layers

    def forward(self, encoder: Encoder, hidden: torch.Tensor, mask: Layout) -> torch.Tensor:
        query = hidden + absolute_positions(self.position_embeddings, hidden, mask)
        return encoder.requery_last_layer(hidden, mask, query, self.applications)


class MLMHead(nn.Module):
    """Transform (dense, GELU, LayerNorm) then the decoder tied to the word embeddings, plus a bias."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.embedding_size)
        self.LayerNorm = LayerNorm(cfg.embedding_size, cfg.layer_norm_eps, cfg.kernel_impl)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.impl = cfg.kernel_impl

    def transform(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(_dense_gelu(self.dense, hidden, self.impl))


def init_weights(module: nn.Module, std: float) -> None:
    """HF's initialisation: N(0, std) weights, zero biases and padding row."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=std)
        if module.padding_idx is not None:
            nn.init.zeros_(module.weight[module.padding_idx])


class MaskedLMOutput(NamedTuple):
    """A NamedTuple, not a dataclass: ZeRO-3 finds the tensors of tuples (and re-gathers
    parameters for backward through them) but not those of a dataclass."""

    # [B, N, D] ([T, D] packed): the encoder output; with EMD, the last layer's input (what EMD decodes from)
    last_hidden_state: torch.Tensor
    logits: torch.Tensor | None = None          # [B, N, V] ([T, V]); only computed when no labels are given
    loss: torch.Tensor | None = None            # mean cross-entropy over labelled tokens
    num_labelled: torch.Tensor | None = None
    num_correct: torch.Tensor | None = None


class DebertaForMaskedLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.deberta = DebertaModel(config)
        self.emd = EnhancedMaskDecoder(config) if config.emd else None
        self.lm_head = MLMHead(config)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        init_weights(module, self.config.initializer_range)

    @property
    def word_embeddings(self) -> nn.Embedding:
        return self.deberta.embeddings.word_embeddings

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                max_seqlen: int | None = None) -> MaskedLMOutput:
        """With ``labels`` (``IGNORE_INDEX`` = no target): the loss, computed on labelled positions
        only, without building the logits. Without: ``[B, N, V]`` logits.

        Packed batches (``MLMCollator.packed``) give ``cu_seqlens``, ``max_seqlen`` and ``position_ids``
        instead of ``attention_mask``; ``input_ids``, ``labels`` and the outputs are then 1-D over tokens."""
        mask = batch_layout(input_ids, attention_mask, position_ids, cu_seqlens, max_seqlen)
        hidden, decoded = self.decode(input_ids, mask, token_type_ids)
        if labels is None:
            logits = F.linear(self.lm_head.transform(decoded), self.word_embeddings.weight, self.lm_head.bias)
            return MaskedLMOutput(hidden, logits=logits)
        labelled = labelled_positions(labels)
        result = self.labelled_loss(self.lm_head.transform(decoded.flatten(0, -2).index_select(0, labelled)),
                                    labels.reshape(-1).index_select(0, labelled))
        return MaskedLMOutput(hidden, loss=result.loss, num_labelled=result.num_labelled,
                              num_correct=result.num_correct)

    def decode(self, input_ids: torch.Tensor, mask: Layout,
               token_type_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder output and what the MLM head reads (EMD's output, or the encoder's)."""
        skip_last = 1 if self.emd is not None else 0
        hidden = self.deberta(input_ids, mask, token_type_ids, num_layers=self.config.num_hidden_layers - skip_last)
        return hidden, self.emd(self.deberta.encoder, hidden, mask) if self.emd is not None else hidden

    def labelled_loss(self, rows: torch.Tensor, targets: torch.Tensor) -> kernels.MaskedLMLoss:
        """The fused MLM loss of head-transformed ``rows`` ``[M, E]`` against ``targets`` ``[M]``."""
        return kernels.masked_lm_loss(rows, self.word_embeddings.weight, self.lm_head.bias, targets,
                                      ignore_index=None, impl=self.config.kernel_impl)


def labelled_positions(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices of the labelled positions. Only those (~15%) go through the MLM head transform
    and the vocabulary projection; they are found once (one host sync)."""
    return (labels.reshape(-1) != kernels.IGNORE_INDEX).nonzero().squeeze(1)
