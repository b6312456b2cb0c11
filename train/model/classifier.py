"""DeBERTa with a sequence classification or regression head, in Hugging Face's layout.

The parameters are named as in ``transformers``' ``DebertaV2ForSequenceClassification``
(``deberta.*``, ``pooler.dense.*``, ``classifier.*``), so a state dict moves between the two
unchanged. The head is HF's: the first token's final hidden state -> dropout -> ``pooler.dense``
-> GELU -> dropout -> ``classifier``. ``pooling="mean"`` feeds the head the mean of the sequence's
final hidden states instead (padding excluded); HF's class has no such option, so only ``"cls"``
models are HF-compatible. ``num_labels == 1`` is regression (mean squared error),
more labels single-label classification (cross-entropy).

Batches are padded (``attention_mask``), or packed (``cu_seqlens``, ``position_ids``,
``max_seqlen``): then each packed sequence is pooled on its own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from distaff.train.model.config import ConfigError, ModelConfig
from distaff.train.model.deberta import DebertaModel, Layout, Packed, batch_layout, init_weights


class ClassifierOutput(NamedTuple):
    """A NamedTuple so ZeRO-3 sees its tensors (see :class:`~distaff.train.model.deberta.MaskedLMOutput`)."""

    logits: torch.Tensor                # [B, num_labels]; [B] for regression
    loss: torch.Tensor | None = None    # mean over the batch's examples


class ContextPooler(nn.Module):
    """The first token's hidden state through a dense layer and GELU (HF's ``ContextPooler``)."""

    def __init__(self, hidden_size: int, dropout: float):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, first_tokens: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(self.dropout(first_tokens)))


POOLINGS = ("cls", "mean")


def pool(hidden: torch.Tensor, mask: Layout, pooling: str) -> torch.Tensor:
    """``[B, D]``: each sequence's first token, or the mean over its real tokens (``pooling``)."""
    if isinstance(mask, Packed):
        starts = mask.cu_seqlens[:-1].long()
        if pooling == "cls":
            return hidden[starts]
        lengths = mask.cu_seqlens.diff().long()
        sequence_of_token = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), lengths)
        sums = hidden.new_zeros(len(lengths), hidden.shape[-1]).index_add_(0, sequence_of_token, hidden[: int(lengths.sum())])
        return sums / lengths.unsqueeze(-1).to(hidden.dtype)
    if pooling == "cls":
        return hidden[:, 0]
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)


class DebertaForSequenceClassification(nn.Module):
    """``DebertaV2ForSequenceClassification``'s computation on distaff's encoder and fused kernels.

    ``pooler_dropout`` and ``cls_dropout`` are HF's config fields of the same names (``cls_dropout``
    None: the encoder's ``hidden_dropout_prob``); ``pooling`` is ``"cls"`` (HF's) or ``"mean"``."""

    def __init__(self, config: ModelConfig, num_labels: int, pooler_dropout: float = 0.0,
                 cls_dropout: float | None = None, pooling: str = "cls"):
        super().__init__()
        if pooling not in POOLINGS:
            raise ConfigError(f"pooling must be one of {list(POOLINGS)}, got {pooling!r}")
        if num_labels < 1:
            raise ConfigError(f"num_labels must be >= 1 (1: regression), got {num_labels}")
        if config.emd:
            raise ConfigError("emd: the Enhanced Mask Decoder is a pretraining part; a classifier is built with emd: false")
        self.config, self.num_labels, self.pooling = config, num_labels, pooling
        self.pooler_dropout = pooler_dropout
        self.cls_dropout = config.hidden_dropout_prob if cls_dropout is None else cls_dropout
        self.deberta = DebertaModel(config)
        self.pooler = ContextPooler(config.hidden_size, pooler_dropout)
        self.dropout = nn.Dropout(self.cls_dropout)
        self.classifier = nn.Linear(config.hidden_size, num_labels)
        self.apply(lambda module: init_weights(module, config.initializer_range))

    @property
    def regression(self) -> bool:
        return self.num_labels == 1

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                max_seqlen: int | None = None) -> ClassifierOutput:
        """Logits, and with ``labels`` (``[B]``: class ids, or targets for regression) the mean loss."""
        mask = batch_layout(input_ids, attention_mask, position_ids, cu_seqlens, max_seqlen)
        hidden = self.deberta(input_ids, mask, token_type_ids)
        logits = self.classifier(self.dropout(self.pooler(pool(hidden, mask, self.pooling))))
        if self.regression:
            logits = logits.squeeze(-1)
        if labels is None:
            return ClassifierOutput(logits)
        return ClassifierOutput(logits, self.loss(logits, labels))

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean squared error (regression) or cross-entropy, in float32."""
        if self.regression:
            return F.mse_loss(logits.float(), labels.float())
        return F.cross_entropy(logits.float(), labels.long())

