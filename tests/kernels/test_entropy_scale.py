"""The entropy-invariant attention scale (``model.entropy_scale_length``): scores of a sequence of
``n`` real tokens are multiplied by ``log(n) / log(n_train)`` on top of the usual scale.

Checked against attention computed by hand per sequence, padded against packed, against the plain
model where ``n = n_train``, with RoPE / relative / absolute positions, the Triton path against the
reference, and the config and HF-export errors.
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_oracle import naive_attention
from helpers import assert_same_loss_and_grads

from distaff.train.model.config import ConfigError, ModelConfig
from distaff.train.model.deberta import DebertaForMaskedLM
from distaff.train.model.hf import to_hf

pytestmark = pytest.mark.unit

N_TRAIN = 8
SMALL = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=32, position_buckets=8, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0, entropy_scale_length=N_TRAIN)
LENGTHS = [12, 5, 1]  # real tokens of each sequence: longer than, shorter than, and one token
# The op takes per-sequence scales in float32 (the contract): a float64 model sees them rounded.
FLOAT32_SCALE = dict(atol=1e-9, rtol=1e-6)


def _padding_mask(n: int) -> torch.Tensor:
    return (torch.arange(n)[None, :] < torch.tensor(LENGTHS)[:, None]).long()


def _self_attention(**extra):
    torch.manual_seed(0)
    model = DebertaForMaskedLM(ModelConfig(**{**SMALL, **extra})).double()
    return model.deberta.encoder.layer[0].attention.self


def test_content_attention_equals_the_formula_by_hand():
    """softmax(q k^T / sqrt(d) * log(n) / log(n_train)) v over each sequence's real tokens."""
    attention = _self_attention(relative_attention=False, pos_att_type=[])
    n = max(LENGTHS)
    hidden = torch.randn(len(LENGTHS), n, 32, dtype=torch.float64)
    out, _ = attention(hidden, _padding_mask(n), None, hidden)
    for b, length in enumerate(LENGTHS):
        x = hidden[b, :length]
        q, k, v = (proj(x).view(length, 2, 16).transpose(0, 1)
                   for proj in (attention.query_proj, attention.key_proj, attention.value_proj))
        scores = q @ k.transpose(-1, -2) / math.sqrt(16) * (math.log(length) / math.log(N_TRAIN))
        expected = (torch.softmax(scores, -1) @ v).transpose(0, 1).reshape(length, 32)
        torch.testing.assert_close(out[b, :length], expected, **FLOAT32_SCALE)
    plain = _self_attention(relative_attention=False, pos_att_type=[], entropy_scale_length=0)
    plain.load_state_dict(attention.state_dict())
    assert not torch.allclose(plain(hidden, _padding_mask(n), None, hidden)[0][0], out[0])


def test_relative_attention_equals_the_naive_oracle_with_each_sequences_scale():
    attention = _self_attention()
    n = max(LENGTHS)
    hidden = torch.randn(len(LENGTHS), n, 32, dtype=torch.float64)
    rel = torch.randn(2 * 8, 32, dtype=torch.float64)
    out, _ = attention(hidden, _padding_mask(n), rel, hidden)
    pos_key, pos_query = attention._position_tables(rel)
    heads = lambda proj, x: proj(x).view(1, -1, 2, 16).transpose(1, 2)  # noqa: E731
    base = (16 * 3) ** -0.5
    for b, length in enumerate(LENGTHS):
        x = hidden[b:b + 1, :length]
        expected = naive_attention(heads(attention.query_proj, x), heads(attention.key_proj, x),
                                   heads(attention.value_proj, x), pos_key, pos_query, position_buckets=8,
                                   max_relative_positions=32,
                                   softmax_scale=base * math.log(length) / math.log(N_TRAIN))
        torch.testing.assert_close(out[b, :length], expected[0].transpose(0, 1).reshape(length, 32),
                                   **FLOAT32_SCALE)


@pytest.mark.parametrize("positions", ["relative", "rope+relative", "absolute"])
def test_packed_equals_padded(positions):
    extra = {"relative": {}, "rope+relative": dict(rope=True),
             "absolute": dict(relative_attention=False, pos_att_type=[], position_biased_input=True)}[positions]
    torch.manual_seed(1)
    model = DebertaForMaskedLM(ModelConfig(**SMALL, **extra)).double().eval()
    n = max(LENGTHS)
    ids = torch.randint(5, 50, (len(LENGTHS), n))
    mask = _padding_mask(n)
    padded = model(ids, mask).last_hidden_state
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    packed = model(ids[mask.bool()], cu_seqlens=cu, max_seqlen=n,
                   position_ids=torch.cat([torch.arange(length) for length in LENGTHS])).last_hidden_state
    torch.testing.assert_close(packed, padded[mask.bool()], atol=1e-10, rtol=1e-8)


def test_training_length_gives_the_plain_model():
    """n = n_train: log(n) / log(n_train) is exactly 1, so a float32 model is bit-identical to the plain one."""
    torch.manual_seed(2)
    scaled = DebertaForMaskedLM(ModelConfig(**{**SMALL, "entropy_scale_length": 16})).eval()
    plain = DebertaForMaskedLM(ModelConfig(**{**SMALL, "entropy_scale_length": 0})).eval()
    plain.load_state_dict(scaled.state_dict())
    ids = torch.randint(5, 50, (2, 16))
    torch.testing.assert_close(scaled(ids).last_hidden_state, plain(ids).last_hidden_state, atol=0, rtol=0)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0  # a shorter sequence is scaled down: the outputs differ there only
    diff = (scaled(ids, mask).last_hidden_state - plain(ids, mask).last_hidden_state).abs().amax(-1)
    assert diff[0].max() == 0 and diff[1, :10].min() > 1e-6


def test_triton_path_matches_the_reference_with_gradients():
    """The model's per-sequence scale tensor through the fused kernel (interpreter on CPU)."""
    torch.manual_seed(3)
    fused = DebertaForMaskedLM(ModelConfig(**SMALL, attention_impl="triton"))
    plain = DebertaForMaskedLM(ModelConfig(**SMALL, attention_impl="reference"))
    plain.load_state_dict(fused.state_dict())
    n = max(LENGTHS)
    ids = torch.randint(5, 50, (len(LENGTHS), n))
    mask = _padding_mask(n)
    labels = torch.where(mask.bool() & (torch.arange(n) % 2 == 0), ids, -100)
    assert_same_loss_and_grads(fused, plain, ids, mask, labels=labels)


@pytest.mark.parametrize("value", [-1, 1])
def test_bad_training_length_names_the_field(value):
    with pytest.raises(ConfigError, match=f"entropy_scale_length must be 0 .* got {value}"):
        ModelConfig(**{**SMALL, "entropy_scale_length": value})


def test_hf_export_refuses_the_entropy_scale(tmp_path):
    with pytest.raises(ConfigError, match="model.entropy_scale_length=8: .*no Hugging Face"):
        to_hf(DebertaForMaskedLM(ModelConfig(**SMALL)), tmp_path / "hf")
    assert not (tmp_path / "hf" / "model.safetensors").exists()
