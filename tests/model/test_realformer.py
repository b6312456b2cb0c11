"""RealFormer's residual attention (``model.realformer``): layer ``l`` softmaxes the sum of its own
pre-softmax scores and every earlier layer's.

The oracle materialises every layer's ``[B, H, N, N]`` scores (``attention_oracle.naive_scores``) and adds
them up explicitly, in float64; the model computes the same sums as one attention over queries and keys
concatenated along the head dimension (``train/model/realformer.py``), through the reference and through the
Triton kernels (interpreter on CPU), padded and packed, with the kernels' zero-padded widths and the
reference fallback past the widest head size.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from attention_oracle import masked_softmax_attention, naive_scores

from distaff import kernels
from distaff.train.model.config import ConfigError, ModelConfig
from distaff.train.model.deberta import DebertaForMaskedLM, Packed
from distaff.train.model.hf import to_hf
from distaff.train.model.realformer import extend, kernel_width, residual_attention
from distaff.train.tools.ablate import load_ablation, variant_config
from distaff.train.tools.grow import grow_model

pytestmark = pytest.mark.unit

SMALL = dict(vocab_size=50, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=32, position_buckets=8, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0, realformer=True)
POSITIONS = {"relative": {}, "c2p": dict(pos_att_type=["c2p"]),
             "content": dict(relative_attention=False, pos_att_type=[], position_biased_input=True),
             "rope+relative": dict(rope=True)}
LENGTHS = [9, 5]


def _model(**extra) -> DebertaForMaskedLM:
    """Query, key and position weights far larger than the initialisation's, so that scores (and their
    residual sums) move the softmax well away from uniform."""
    torch.manual_seed(0)
    model = DebertaForMaskedLM(ModelConfig(**{**SMALL, **extra}))
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(("query_proj.weight", "key_proj.weight", "rel_embeddings.weight")):
                weight.normal_(std=0.3)
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    n = max(LENGTHS)
    mask = (torch.arange(n)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    return torch.randint(3, 50, (len(LENGTHS), n)) * mask, mask


def explicit_encoder(model: DebertaForMaskedLM, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Every layer's scores built in full; layer ``l`` attends with the explicit sum of layers ``1..l``."""
    cfg, deberta = model.config, model.deberta
    hidden, rel = deberta.embeddings(ids, None, mask), deberta.encoder.rel_table()
    scale = (cfg.head_dim * (1 + len(cfg.pos_att_type))) ** -0.5
    total = 0.0
    for layer in deberta.encoder.layer:
        att = layer.attention.self
        heads = lambda proj, x: proj(x).unflatten(-1, (cfg.num_attention_heads, -1)).transpose(-3, -2)  # noqa: E731
        q, k, v = heads(att.query_proj, hidden), heads(att.key_proj, hidden), heads(att.value_proj, hidden)
        q, k = att._rotate(q, k, torch.arange(ids.shape[1]))
        pos_key = heads(att.key_proj, rel) if "c2p" in cfg.pos_att_type else None
        pos_query = heads(att.query_proj, rel) if "p2c" in cfg.pos_att_type else None
        total = total + naive_scores(q, k, pos_key, pos_query, position_buckets=cfg.position_buckets,
                                     max_relative_positions=cfg.resolved_max_relative_positions,
                                     softmax_scale=scale)
        out = masked_softmax_attention(total, v, attention_mask=mask).transpose(1, 2).flatten(2)
        attended = layer.attention.output(out, hidden)
        hidden = layer.output(layer.intermediate(attended), attended)
    return hidden


def _real_tokens(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x[mask.bool()]


def _output_and_grads(model: DebertaForMaskedLM, run, weights: torch.Tensor) -> tuple[torch.Tensor, list]:
    """Real tokens' hidden states from ``run(model)`` and every parameter's gradient of a weighted sum of them."""
    model.zero_grad()
    out = run(model)
    (out * weights).sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _compare(model_a, run_a, model_b, run_b, **tolerance) -> None:
    ids, mask = _batch()
    weights = torch.randn(int(mask.sum()), SMALL["hidden_size"], dtype=torch.float64)
    out_a, grads_a = _output_and_grads(model_a, run_a, weights.to(next(model_a.parameters()).dtype))
    out_b, grads_b = _output_and_grads(model_b, run_b, weights)
    torch.testing.assert_close(out_a.double(), out_b, **tolerance)
    assert len(grads_a) == len(grads_b)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a.double(), b, **tolerance)


def _padded(model):
    ids, mask = _batch()
    return _real_tokens(model.deberta(ids, mask), mask)


def _packed(model):
    ids, mask = _batch()
    lengths = torch.tensor(LENGTHS)
    packed = Packed(torch.cat([torch.zeros(1), lengths.cumsum(0)]).int(), max(LENGTHS),
                    torch.cat([torch.arange(n) for n in LENGTHS]))
    return model.deberta(_real_tokens(ids, mask), packed)


def _explicit(model):
    ids, mask = _batch()
    return _real_tokens(explicit_encoder(model, ids, mask), mask)


@pytest.mark.parametrize("positions", POSITIONS)
def test_reference_equals_the_explicit_sum_of_scores(positions):
    """Outputs and every parameter's gradient, float64, padded (two lengths)."""
    model = _model(**POSITIONS[positions]).double()
    _compare(model, _padded, model, _explicit, atol=1e-10, rtol=1e-8)


def test_the_oracle_can_tell_residual_attention_from_plain():
    model = _model().double()
    plain = _model(realformer=False).double()
    plain.load_state_dict(model.state_dict())
    assert (_padded(plain) - _explicit(model)).abs().max() > 1e-2  # vs the 1e-10 agreement above


def test_packed_and_checkpointed_equal_the_explicit_sum():
    model = _model().double()
    _compare(model, _packed, model, _explicit, atol=1e-10, rtol=1e-8)
    checkpointed = _model(activation_checkpointing=True).double().train()
    _compare(checkpointed, _padded, model, _explicit, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("layout", [_padded, _packed], ids=["padded", "packed"])
def test_triton_equals_the_explicit_sum_of_scores(layout):
    """Head size 16 over 3 layers: concatenated widths 16, 32 and 48 (zero-padded to 64) in the kernel."""
    fused = _model(attention_impl="triton")
    oracle = _model().double()
    oracle.load_state_dict(fused.state_dict())
    _compare(fused, layout, oracle, _explicit, atol=2e-5, rtol=2e-4)


def test_widths_past_the_kernel_run_the_reference():
    """Head size 64 over 3 layers: 64 and 128 run Triton, 192 the reference; all equal the oracle."""
    assert kernel_width(48, "triton", torch.device("cpu")) == ("triton", 64)
    assert kernel_width(192, "triton", torch.device("cpu")) == ("reference", 192)
    assert kernel_width(48, "reference", torch.device("cpu")) == ("reference", 48)
    wide = dict(hidden_size=128, intermediate_size=128)
    fused = _model(attention_impl="triton", **wide)
    oracle = _model(**wide).double()
    oracle.load_state_dict(fused.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(_padded(fused).double(), _explicit(oracle), atol=2e-5, rtol=2e-4)


def test_refusals_name_both_keys(tmp_path):
    with pytest.raises(ConfigError, match="realformer with emd"):
        ModelConfig(**SMALL, emd=True)
    with pytest.raises(ConfigError, match="model.realformer: .*no Hugging Face"):
        to_hf(_model(), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ConfigError, match="model.realformer with distaff grow"):
        grow_model(_model(), 32, 4)


def test_bundled_switches_ablation_validates(monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # its paths are relative to the repository root
    cfg = load_ablation("configs/ablation/switches-cpu.yaml")
    models = [variant_config(cfg, variant, 1).model_config(vocab_size=4000) for variant in cfg.variants]
    assert [(m.realformer, m.rope, m.emd) for m in models] == [(False, False, False), (True, False, False),
                                                               (True, True, False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("per_sequence_scale", [False, True], ids=["float-scale", "tensor-scale"])
def test_residual_attention_op_equals_the_explicit_sum(dtype, per_sequence_scale):
    """The op alone, through the Triton kernels: 3 layers of random queries, keys and position tables at
    head size 16 (concatenated widths 16, 32, 48 -> 64), in float32 and float16, with one scale or one per
    sequence, against the float64 sum of the three layers' explicit scores; output and every gradient."""
    torch.manual_seed(2)
    batch, heads, n, d, span = 2, 2, 12, 16, 8
    mask = (torch.arange(n)[None, :] < torch.tensor([12, 7])[:, None]).long()
    layers = [[torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in
               ((batch, heads, n, d), (batch, heads, n, d), (heads, 2 * span, d), (heads, 2 * span, d))]
              for _ in range(3)]
    v = torch.randn(batch, heads, n, d, dtype=torch.float64, requires_grad=True)
    scale = torch.tensor([0.2, 0.3]) if per_sequence_scale else 0.25
    geometry = dict(position_buckets=span, max_relative_positions=32)

    def fused() -> torch.Tensor:
        history = None
        for q, k, pos_key, pos_query in layers:
            history = extend(history, *(t.to(dtype) for t in (q, k, pos_key, pos_query)))
        op = partial(kernels.disentangled_attention, attention_mask=mask)
        return residual_attention(history, v.to(dtype), op, "triton", softmax_scale=scale, **geometry)

    def explicit() -> torch.Tensor:
        exact = scale.double() if per_sequence_scale else scale
        total = sum(naive_scores(*layer, softmax_scale=exact, **geometry) for layer in layers)
        return masked_softmax_attention(total, v, attention_mask=mask)

    weights = torch.randn(batch, heads, n, d, dtype=torch.float64) * mask[:, None, :, None]
    results = []
    for run in (fused, explicit):
        tensors = [v, *(t for layer in layers for t in layer)]
        for t in tensors:
            t.grad = None
        out = run()
        (out.double() * weights).sum().backward()
        results.append([out.detach().double(), *(t.grad.clone() for t in tensors)])
    # largest error relative to the largest value: measured 7e-7 (float32) and 1.5e-3 (float16, rounded inputs)
    bound = 5e-3 if dtype == torch.float16 else 5e-6
    for name, got, expected in zip(("out", "dv", *(f"layer{i}.{t}" for i in range(3) for t in "q k Kr Qr".split())),
                                   *results):
        assert (got - expected).abs().max() <= bound * expected.abs().max(), name
