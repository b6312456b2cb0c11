"""Rotary position embeddings: the closed form, the relative-position property, the model's
attention with RoPE computed by hand, the Triton path, config errors and the HF export refusal."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import assert_same_loss_and_grads

from distaff.train.model.config import ConfigError, ModelConfig
from distaff.train.model.deberta import DebertaForMaskedLM
from distaff.train.model.hf import to_hf
from distaff.train.model.rope import apply_rope, rope_angles

pytestmark = pytest.mark.unit

SMALL = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=32, position_buckets=8, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0, rope=True)


def closed_form(x: np.ndarray, theta: float) -> np.ndarray:
    """Plane i of position m, as the complex number x_i + j x_{i+d/2}, times exp(j m theta^(-2i/d))."""
    n, d = x.shape[-2], x.shape[-1]
    z = x[..., : d // 2] + 1j * x[..., d // 2:]
    freq = np.array([theta ** (-2.0 * i / d) for i in range(d // 2)])
    turned = z * np.exp(1j * np.outer(np.arange(n), freq))
    return np.concatenate([turned.real, turned.imag], axis=-1)


@pytest.mark.parametrize("theta", [10000.0, 37.5])
def test_rope_matches_the_complex_closed_form(theta):
    x = torch.randn(2, 3, 11, 8, dtype=torch.float64)
    cos, sin = rope_angles(torch.arange(11), 8, theta)
    np.testing.assert_allclose(apply_rope(x, cos, sin).numpy(), closed_form(x.numpy(), theta), rtol=0, atol=1e-5)


def test_rotated_scores_depend_on_the_offset_only():
    """The same q and k at every position: score(m, n) is a function of m - n (a Toeplitz matrix)."""
    q, k = torch.randn(16), torch.randn(16)
    cos, sin = rope_angles(torch.arange(20), 16, 10000.0)
    qr = apply_rope(q.expand(1, 1, 20, 16), cos, sin)[0, 0]
    kr = apply_rope(k.expand(1, 1, 20, 16), cos, sin)[0, 0]
    scores = qr @ kr.T
    torch.testing.assert_close(scores[1:, 1:], scores[:-1, :-1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(scores[0, 1], scores[0, 5], atol=1e-3)  # but it does depend on the offset
    torch.testing.assert_close(scores.diagonal(), torch.full((20,), float(q @ k)), atol=1e-5, rtol=1e-5)


def test_model_attention_equals_the_rotary_formula_by_hand():
    """RoPE alone (content-only attention): softmax(R(q) R(k)^T / sqrt(d)) v, with R from the closed form."""
    torch.manual_seed(0)
    cfg = ModelConfig(**SMALL, relative_attention=False, pos_att_type=[])
    attention = DebertaForMaskedLM(cfg).double().deberta.encoder.layer[0].attention.self
    hidden = torch.randn(1, 9, 32, dtype=torch.float64)
    out, _ = attention(hidden, torch.ones(1, 9, dtype=torch.long), None, hidden)
    heads = lambda proj: proj(hidden).view(9, 2, 16).transpose(0, 1).detach().numpy()  # noqa: E731
    q, k, v = (closed_form(heads(attention.query_proj), 10000.0), closed_form(heads(attention.key_proj), 10000.0),
               heads(attention.value_proj))
    scores = q @ k.transpose(0, 2, 1) / math.sqrt(16)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    expected = (probs / probs.sum(-1, keepdims=True)) @ v
    np.testing.assert_allclose(out[0].detach().numpy(), expected.transpose(1, 0, 2).reshape(9, 32), atol=1e-10)


def test_rope_changes_a_position_free_model_and_composes_with_relative_attention():
    torch.manual_seed(0)
    ids = torch.randint(5, 50, (2, 12))
    plain = DebertaForMaskedLM(ModelConfig(**{**SMALL, "rope": False}, relative_attention=False, pos_att_type=[]))
    rotary = DebertaForMaskedLM(ModelConfig(**SMALL, relative_attention=False, pos_att_type=[]))
    with torch.no_grad():  # sharper attention than the 0.02 initialisation gives, so positions matter
        for layer in plain.deberta.encoder.layer:
            layer.attention.self.query_proj.weight.mul_(30)
            layer.attention.self.key_proj.weight.mul_(30)
    rotary.load_state_dict(plain.state_dict())
    assert (plain(ids).last_hidden_state - rotary(ids).last_hidden_state).abs().max() > 1e-2
    both = DebertaForMaskedLM(ModelConfig(**SMALL, emd=True))  # RoPE on top of c2p/p2c, plus EMD
    labels = torch.where(torch.rand(2, 12) < 0.3, ids, -100)
    both(ids, labels=labels).loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in both.parameters() if p.requires_grad)


@pytest.mark.parametrize("relative", [False, True])
def test_triton_attention_with_rope_matches_the_reference(relative, device):
    """The fused kernel (interpreter on CPU) runs unchanged on rotated q and k: content-only or with c2p/p2c."""
    torch.manual_seed(1)
    extra = dict(relative_attention=relative, pos_att_type=["p2c", "c2p"] if relative else [])
    fused = DebertaForMaskedLM(ModelConfig(**SMALL, **extra, attention_impl="triton")).to(device)
    plain = DebertaForMaskedLM(ModelConfig(**SMALL, **extra, attention_impl="reference")).to(device)
    plain.load_state_dict(fused.state_dict())
    ids = torch.randint(5, 50, (2, 16), device=device)
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    labels = torch.where((torch.arange(16, device=device) % 3 == 0) & mask.bool(), ids, -100)
    assert_same_loss_and_grads(fused, plain, ids, mask, labels=labels)


def test_rope_config_errors_name_the_fields():
    with pytest.raises(ConfigError, match="rope: needs an even head size.*hidden_size / num_attention_heads"):
        ModelConfig(**{**SMALL, "hidden_size": 30, "num_attention_heads": 2})
    with pytest.raises(ConfigError, match="rope_theta must be positive"):
        ModelConfig(**SMALL, rope_theta=0.0)
    with pytest.raises(ConfigError, match="rope must be of type bool"):
        ModelConfig(**{**SMALL, "rope": "yes"})


def test_hf_export_refuses_rope(tmp_path):
    with pytest.raises(ConfigError, match="model.rope: .*no Hugging Face"):
        to_hf(DebertaForMaskedLM(ModelConfig(**SMALL)), tmp_path / "hf")
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def test_packed_layout_rotates_like_the_padded_one():
    """``[T, H, d]`` (packed, positions restarting per sequence) equals ``[1, H, N, d]`` per sequence."""
    attention = DebertaForMaskedLM(ModelConfig(**SMALL)).deberta.encoder.layer[0].attention.self
    q, k = torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16)
    padded = attention._rotate(q, k, torch.arange(7))
    packed_q, packed_k = (x[0].transpose(0, 1).repeat(2, 1, 1) for x in (q, k))  # two copies of the sequence
    packed = attention._rotate(packed_q, packed_k, torch.arange(7).repeat(2))
    for p, r in zip(packed, padded):
        torch.testing.assert_close(p, r[0].transpose(0, 1).repeat(2, 1, 1))
