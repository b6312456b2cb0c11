"""distaff's sequence classifier against ``transformers``' ``DebertaV2ForSequenceClassification`` on the
same weights: logits, loss and every parameter's gradient, padded and packed."""

from __future__ import annotations

import pytest
import torch
from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

from distaff.train.model.classifier import DebertaForSequenceClassification
from distaff.train.model.config import ConfigError
from distaff.train.model.hf import model_config_from_hf

pytestmark = pytest.mark.unit

BASE = dict(vocab_size=211, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
            max_position_embeddings=64, relative_attention=True, position_buckets=8, max_relative_positions=24,
            pos_att_type="p2c|c2p", norm_rel_ebd="layer_norm", share_att_key=True, position_biased_input=False,
            type_vocab_size=0, layer_norm_eps=1e-7, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _pair(num_labels: int, seed: int = 0):
    torch.manual_seed(seed)
    hf = DebertaV2ForSequenceClassification(DebertaV2Config(**BASE, num_labels=num_labels)).eval()
    ours = DebertaForSequenceClassification(model_config_from_hf(hf.config.to_dict()), num_labels).eval()
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not missing and set(unexpected) <= {"deberta.embeddings.position_ids"}, (missing, unexpected)
    return hf, ours


def _batch(num_labels: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, BASE["vocab_size"], (3, 30), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 21:] = 0
    mask[2, 6:] = 0
    ids[mask == 0] = 0
    labels = torch.randn(3, generator=gen) if num_labels == 1 else torch.randint(0, num_labels, (3,), generator=gen)
    return ids, mask, labels


@pytest.mark.parametrize("num_labels", [1, 2, 5], ids=["regression", "binary", "5-class"])
def test_logits_loss_and_gradients_equal_hf(num_labels):
    hf, ours = _pair(num_labels)
    ids, mask, labels = _batch(num_labels)
    expected = hf(input_ids=ids, attention_mask=mask, labels=labels)
    got = ours(ids, mask, labels=labels)
    torch.testing.assert_close(got.logits, expected.logits.squeeze(-1) if num_labels == 1 else expected.logits,
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.loss, expected.loss.float(), atol=1e-5, rtol=1e-4)
    expected.loss.backward()
    got.loss.backward()
    hf_grads = dict(hf.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, hf_grads[name].grad, atol=1e-5, rtol=1e-3, msg=lambda m: f"{name}: {m}")


def test_packed_batch_pools_each_sequence_first_token():
    _, ours = _pair(3)
    ids, mask, labels = _batch(3)
    padded = ours(ids, mask, labels=labels)
    lengths = mask.sum(1)
    flat = ids[mask.bool()]
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
    positions = torch.cat([torch.arange(int(n)) for n in lengths])
    packed = ours(flat, labels=labels, position_ids=positions, cu_seqlens=cu, max_seqlen=int(lengths.max()))
    torch.testing.assert_close(packed.logits, padded.logits, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(packed.loss, padded.loss, atol=1e-6, rtol=1e-5)


def test_bad_heads_are_refused():
    _, ours = _pair(2)
    with pytest.raises(ConfigError, match="num_labels"):
        DebertaForSequenceClassification(ours.config, 0)
    with pytest.raises(ConfigError, match="emd"):
        DebertaForSequenceClassification(ours.config.replace(emd=True), 2)


def test_mean_pooling_averages_each_sequence_real_tokens_padded_and_packed():
    _, cls_model = _pair(3)
    model = DebertaForSequenceClassification(cls_model.config, 3, pooling="mean").eval()
    model.load_state_dict(cls_model.state_dict())
    ids, mask, labels = _batch(3)
    with torch.no_grad():
        hidden = model.deberta(ids, mask)
        # independent: a per-sequence loop over the unpadded positions
        means = torch.stack([hidden[b, : int(mask[b].sum())].mean(0) for b in range(len(ids))])
        expected = model.classifier(model.pooler(means))
        padded = model(ids, mask, labels=labels)
        lengths = mask.sum(1)
        packed = model(ids[mask.bool()], labels=labels, position_ids=torch.cat([torch.arange(int(n)) for n in lengths]),
                       cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()]),
                       max_seqlen=int(lengths.max()))
        first_token = cls_model(ids, mask).logits
    torch.testing.assert_close(padded.logits, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(packed.logits, expected, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(padded.logits, first_token, atol=1e-3)   # it is not the first token's head
    with pytest.raises(ConfigError, match="pooling must be one of"):
        DebertaForSequenceClassification(cls_model.config, 2, pooling="max")
