"""distaff's fused kernels inside a user's own Hugging Face DeBERTa-v2/v3 model, patched in place.

``apply_distaff_kernels(model)`` walks any ``transformers`` ``DebertaV2*`` model (``Model``,
``ForMaskedLM``, ``ForSequenceClassification``, ``ForTokenClassification``,
``ForQuestionAnswering``, ...) and swaps, module by module, the forward of

* ``DisentangledSelfAttention`` for :func:`distaff.kernels.disentangled_attention` (no ``N x N``
  scores, dropout in the kernel);
* the residual ``LayerNorm`` of ``DebertaV2SelfOutput`` / ``DebertaV2Output`` for
  :func:`distaff.kernels.layer_norm` with the residual add fused;
* ``DebertaV2Intermediate`` with an erf GELU for :func:`distaff.kernels.bias_gelu`.

Weights, state dicts and ``save_pretrained`` are untouched: only bound methods change (and the encoder's
``get_rel_pos`` and ``get_attention_mask``, which mark what the encoder builds itself: Hugging Face's encoder
hands every layer a ``relative_pos`` and a ``[B, 1, N, N]`` pair mask, and only its own are what the kernel
computes from the token positions and the ``[B, N]`` token mask). So the patched forward decides from marks,
never from values: no ``N x N`` comparison, no host read of a device value, one graph under ``torch.compile``.
It falls back to the original forward for what the kernel does not compute: ``output_attentions=True``,
caller-given ``relative_pos``, and caller-given 3-D or 4-D masks (whether one is a padding mask's product is a
question about its values).
Padded query rows output zeros instead of Hugging Face's average over every key (their values
are ignored downstream; real tokens are equal).
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass

import torch
from torch import nn

from distaff import kernels


@dataclass
class PatchReport:
    """How many modules of each kind were switched to the fused kernels."""

    attention: int = 0
    layer_norm: int = 0
    gelu: int = 0


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[..., N, H*d]`` -> ``[..., H, N, d]``."""
    return x.unflatten(-1, (heads, -1)).transpose(-3, -2)


def _padding_mask(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """The ``[B, N]`` token mask behind the encoder's own ``[B, 1, N, N]`` pair mask (marked by
    :func:`_marked_attention_mask`), or None for a pair mask a caller built."""
    return getattr(attention_mask, "_distaff_tokens", None)


def _position_tables(self, rel_embeddings: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``Kr`` and ``Qr`` as ``[H, 2*span, d]`` (None for terms the config leaves out)."""
    rel = self.pos_dropout(rel_embeddings[: 2 * self.pos_ebd_size])
    key_proj = self.key_proj if self.share_att_key else getattr(self, "pos_key_proj", None)
    query_proj = self.query_proj if self.share_att_key else getattr(self, "pos_query_proj", None)
    pos_key = _heads(key_proj(rel), self.num_attention_heads) if "c2p" in self.pos_att_type else None
    pos_query = _heads(query_proj(rel), self.num_attention_heads) if "p2c" in self.pos_att_type else None
    return pos_key, pos_query


def _marked_rel_pos(self, hidden_states, query_states=None, relative_pos=None):
    """The encoder's ``get_rel_pos``, its own positions (built here from the layer's length, not given by a caller
    or for queries of another length) marked as the kernel's: ``i - j`` bucketed with the layer's settings."""
    built = relative_pos is None and (query_states is None or query_states.shape[-2] == hidden_states.shape[-2])
    relative_pos = self._distaff_original_get_rel_pos(hidden_states, query_states, relative_pos)
    if built and relative_pos is not None:
        relative_pos._distaff_standard = True
    return relative_pos


def _marked_attention_mask(self, attention_mask):
    """The encoder's ``get_attention_mask``; the pair mask it builds from a ``[B, N]`` token mask (the product of
    its rows and columns) marked with that token mask, which the kernel reads as it is (nonzero = token)."""
    pairs = self._distaff_original_get_attention_mask(attention_mask)
    if attention_mask.dim() == 2:
        pairs._distaff_tokens = attention_mask
    return pairs


def _fused_attention(self, hidden_states, attention_mask, output_attentions=False, query_states=None,
                     relative_pos=None, rel_embeddings=None):
    standard = relative_pos is None or getattr(relative_pos, "_distaff_standard", False)
    mask = None if output_attentions or not standard else _padding_mask(attention_mask)
    if mask is None:
        return self._distaff_original_forward(hidden_states, attention_mask, output_attentions, query_states,
                                              relative_pos, rel_embeddings)
    heads = self.num_attention_heads
    q = _heads(self.query_proj(hidden_states if query_states is None else query_states), heads)
    k, v = _heads(self.key_proj(hidden_states), heads), _heads(self.value_proj(hidden_states), heads)
    pos_key = pos_query = None
    if self.relative_attention:
        pos_key, pos_query = _position_tables(self, rel_embeddings)
    # Hugging Face scales by the configured terms, whether or not relative attention is on.
    terms = 1 + ("c2p" in self.pos_att_type) + ("p2c" in self.pos_att_type)
    out = kernels.disentangled_attention(
        q, k, v, pos_key, pos_query, position_buckets=getattr(self, "position_buckets", -1),
        max_relative_positions=getattr(self, "max_relative_positions", 1), attention_mask=mask,
        dropout_p=self.dropout.p if self.training else 0.0, softmax_scale=1.0 / math.sqrt(q.shape[-1] * terms),
        keep_scores=self._distaff_keep_scores, impl=self._distaff_impl)
    return out.transpose(1, 2).flatten(2), None


def _fused_residual_norm(self, hidden_states, input_tensor):
    hidden_states = self.dropout(self.dense(hidden_states))
    norm = self.LayerNorm
    return kernels.layer_norm(hidden_states, norm.weight, norm.bias, norm.eps, input_tensor, impl=self._distaff_impl)


def _fused_intermediate(self, hidden_states):
    return kernels.bias_gelu(nn.functional.linear(hidden_states, self.dense.weight), self.dense.bias,
                             impl=self._distaff_impl)


def _patch(module: nn.Module, forward, impl: str) -> None:
    module._distaff_original_forward = module.forward
    module._distaff_impl = impl
    module.forward = types.MethodType(forward, module)


def apply_distaff_kernels(model: nn.Module, impl: str = "auto", keep_scores: bool = True) -> PatchReport:
    """Swap the attention, residual LayerNorms and GELU of a ``transformers`` DeBERTa-v2 model for
    distaff's fused kernels, in place; ``impl`` as in :mod:`distaff.kernels`, ``keep_scores`` as the attention's
    (the forward's dense position scores kept for the backward: faster, ``2 x H x tokens x 2k`` elements a layer
    more between the passes; ``False`` frees them). Modules already patched are left alone. Returns how many
    modules of each kind were switched by this call."""
    from transformers.models.deberta_v2 import modeling_deberta_v2 as hf

    if impl not in kernels.IMPLS:
        raise ValueError(f"impl must be one of {kernels.IMPLS}, got {impl!r}")
    if not any(isinstance(module, hf.DisentangledSelfAttention) for module in model.modules()):
        raise TypeError(f"{type(model).__name__} has no DeBERTa-v2 attention to patch")
    report = PatchReport()
    for module in model.modules():
        if isinstance(module, hf.DebertaV2Encoder) and not hasattr(module, "_distaff_original_get_rel_pos"):
            module._distaff_original_get_rel_pos = module.get_rel_pos
            module.get_rel_pos = types.MethodType(_marked_rel_pos, module)
            module._distaff_original_get_attention_mask = module.get_attention_mask
            module.get_attention_mask = types.MethodType(_marked_attention_mask, module)
        if hasattr(module, "_distaff_original_forward"):
            continue
        if isinstance(module, hf.DisentangledSelfAttention):
            _patch(module, _fused_attention, impl)
            module._distaff_keep_scores = bool(keep_scores)
            report.attention += 1
        elif isinstance(module, (hf.DebertaV2SelfOutput, hf.DebertaV2Output)) and \
                type(module.LayerNorm) is nn.LayerNorm and module.LayerNorm.elementwise_affine:
            _patch(module, _fused_residual_norm, impl)
            report.layer_norm += 1
        elif isinstance(module, hf.DebertaV2Intermediate) and isinstance(module.intermediate_act_fn, nn.Module) \
                and type(module.intermediate_act_fn).__name__ == "GELUActivation":
            _patch(module, _fused_intermediate, impl)
            report.gelu += 1
    return report
