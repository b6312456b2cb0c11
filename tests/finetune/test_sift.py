"""SiFT (scale-invariant fine-tuning) on a tiny DebertaForSequenceClassification: the perturbation sits
after the embedding LayerNorm (so scaling the embedding table changes nothing), the ascent raises the
divergence, the adversarial term's gradients reach the parameters and only through the final backward,
the divergences equal hand computations, and the config refuses bad values by name."""

from __future__ import annotations

import math

import pytest
import torch

from distaff.train.finetune.sift import SiFT, SiftConfig, _Perturbation, divergence, symmetric_kl
from distaff.train.model.classifier import DebertaForSequenceClassification
from distaff.train.model.config import ConfigError, ModelConfig

pytestmark = pytest.mark.unit

# DeBERTa-v3's embedding layout: the word vectors alone enter the LayerNorm (no absolute positions,
# no token types), which is what makes the normalised embeddings independent of the table's scale.
MODEL = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=32, position_buckets=8, type_vocab_size=0, position_biased_input=False,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
SIFT = dict(enabled=True, perturbation_size=0.05, step_size=0.05, adversarial_steps=2, loss_weight=1.0)


def _model(num_labels: int = 3, dropout: float = 0.0, seed: int = 0, **fields) -> DebertaForSequenceClassification:
    torch.manual_seed(seed)
    config = ModelConfig(**{**MODEL, "hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout, **fields})
    model = DebertaForSequenceClassification(config, num_labels)
    with torch.no_grad():
        # word vectors of norm ~sqrt(hidden): the LayerNorm's eps is negligible at every scale tried
        model.deberta.embeddings.word_embeddings.weight.normal_()
        # a head that separates the classes, so predictions (and their divergence) are far from uniform
        model.classifier.weight.normal_()
    return model


LENGTHS = (12, 8, 12, 5)  # real tokens per row of the test batch, the rest padding


def _batch(num_labels: int = 3):
    gen = torch.Generator().manual_seed(1)
    mask = (torch.arange(max(LENGTHS)) < torch.tensor(LENGTHS)[:, None]).long()
    ids = torch.randint(3, MODEL["vocab_size"], mask.shape, generator=gen) * mask
    rows = len(LENGTHS)
    labels = torch.randn(rows, generator=gen) if num_labels == 1 else torch.randint(0, num_labels, (rows,), generator=gen)
    return ids, mask, labels


def _packed(ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """The padded batch's sequences laid end to end (the classifier's packed layout)."""
    lengths = mask.sum(1)
    return {"input_ids": ids[mask.bool()], "position_ids": torch.cat([torch.arange(int(n)) for n in lengths]),
            "cu_seqlens": torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()]),
            "max_seqlen": int(lengths.max())}


def _adversarial_loss(model, sift: SiFT, num_labels: int = 3, seed: int = 5, packed: bool = False) -> torch.Tensor:
    ids, mask, _ = _batch(num_labels)
    inputs = _packed(ids, mask) if packed else {"input_ids": ids, "attention_mask": mask}
    clean = model(**inputs).logits
    torch.manual_seed(seed)  # the same initial noise for every call
    return sift.adversarial_loss(lambda: model(**inputs).logits, clean)


def _scaled(model, factor: float):
    with torch.no_grad():
        model.deberta.embeddings.word_embeddings.weight.mul_(factor)
    return model


@pytest.mark.parametrize("num_labels, packed", [(3, False), (1, False), (3, True)],
                         ids=["classification", "regression", "packed"])
def test_adversarial_loss_does_not_depend_on_the_embedding_scale(num_labels, packed):
    losses = {}
    for factor in (1.0, 10.0, 0.1):
        model = _scaled(_model(num_labels), factor)
        losses[factor] = _adversarial_loss(model, SiFT(SiftConfig(**SIFT), model), num_labels, packed=packed).item()
    assert losses[1.0] > 1e-3, losses
    for factor in (10.0, 0.1):
        assert losses[factor] == pytest.approx(losses[1.0], rel=1e-4), losses


def test_control_perturbing_the_raw_embeddings_depends_on_the_scale():
    """The assertion above fails when the same perturbation is added before the normalisation."""
    losses = {}
    for factor in (1.0, 10.0, 0.1):
        model = _scaled(_model(), factor)
        sift = SiFT(SiftConfig(**SIFT), model)
        sift.perturbed_module = model.deberta.embeddings.word_embeddings
        losses[factor] = _adversarial_loss(model, sift).item()
    for factor in (10.0, 0.1):
        assert losses[factor] != pytest.approx(losses[1.0], rel=1e-4), losses
    assert losses[10.0] < losses[1.0] < losses[0.1]  # relative to the table, the perturbation shrinks as it grows


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_ascent_steps_increase_the_divergence(packed):
    model = _model()
    by_steps = [_adversarial_loss(model, SiFT(SiftConfig(**{**SIFT, "adversarial_steps": k}), model),
                                  packed=packed).item() for k in range(4)]
    assert all(later > earlier for earlier, later in zip(by_steps, by_steps[1:])), by_steps
    assert by_steps[-1] > 2 * by_steps[0], by_steps


def test_step_size_zero_keeps_the_initial_noise():
    model = _model()
    still = SiftConfig(**{**SIFT, "step_size": 0.0, "adversarial_steps": 3})
    noise_only = SiftConfig(**{**SIFT, "adversarial_steps": 0})
    assert _adversarial_loss(model, SiFT(still, model)).item() == pytest.approx(
        _adversarial_loss(model, SiFT(noise_only, model)).item(), rel=1e-6)


def _task_gradients(model, sift: SiFT | None, num_labels: int = 3) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    ids, mask, labels = _batch(num_labels)
    out = model(ids, mask, labels=labels)
    loss = out.loss
    if sift is not None:
        torch.manual_seed(5)
        extra = sift.adversarial_loss(lambda: model(ids, mask).logits, out.logits)
        assert all(param.grad is None for param in model.parameters()), "the ascent leaked into parameter grads"
        loss = loss + extra
    loss.backward()
    return {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}


@pytest.mark.parametrize("num_labels, checkpointing", [(3, False), (1, False), (3, True)],
                         ids=["classification", "regression", "activation-checkpointing"])
def test_gradients_flow_through_the_adversarial_term(num_labels, checkpointing):
    model = _model(num_labels, activation_checkpointing=checkpointing)
    clean = _task_gradients(model, None, num_labels)
    with_sift = _task_gradients(model, SiFT(SiftConfig(**SIFT), model), num_labels)
    assert set(with_sift) == set(clean)
    for name, grad in with_sift.items():
        assert torch.isfinite(grad).all(), name
    changed = [name for name in clean if not torch.allclose(clean[name], with_sift[name], rtol=1e-5, atol=1e-8)]
    assert "deberta.embeddings.word_embeddings.weight" in changed
    assert "classifier.weight" in changed
    assert len(changed) >= len(clean) - 2, sorted(set(clean) - set(changed))


def test_disabled_adds_nothing_and_runs_no_forward():
    model = _model()
    sift = SiFT(SiftConfig(**{**SIFT, "enabled": False}), model)
    ids, mask, labels = _batch()
    out = model(ids, mask, labels=labels)
    calls = []
    extra = sift.adversarial_loss(lambda: calls.append(1) or model(ids, mask).logits, out.logits)
    assert calls == [] and extra.item() == 0.0 and extra.shape == ()
    assert torch.equal((out.loss + extra).detach(), out.loss.detach())
    assert not model.deberta.embeddings.LayerNorm._forward_hooks


def test_hook_is_removed_after_the_call_and_after_an_error():
    model = _model()
    sift = SiFT(SiftConfig(**SIFT), model)
    _adversarial_loss(model, sift)
    assert not model.deberta.embeddings.LayerNorm._forward_hooks

    def failing_forward():
        raise RuntimeError("planted")

    with pytest.raises(RuntimeError, match="planted"):
        sift.adversarial_loss(failing_forward, torch.zeros(4, 3))
    assert not model.deberta.embeddings.LayerNorm._forward_hooks


def test_non_finite_perturbation_gradient_skips_the_update_and_counts_it():
    model = _model()
    ids, mask, _ = _batch()
    clean = model(ids, mask).logits
    calls = []

    def poisoned_forward():  # the ascent forward's gradient is NaN; the final forward is clean
        calls.append(1)
        logits = model(ids, mask).logits
        return logits * float("nan") if len(calls) == 1 else logits

    sift = SiFT(SiftConfig(**{**SIFT, "adversarial_steps": 1}), model)
    torch.manual_seed(5)
    poisoned = sift.adversarial_loss(poisoned_forward, clean)
    noise_only = SiFT(SiftConfig(**{**SIFT, "adversarial_steps": 0}), model)
    assert sift.skipped_updates == 1 and len(calls) == 2
    assert torch.isfinite(poisoned)
    assert poisoned.item() == pytest.approx(_adversarial_loss(model, noise_only).item(), rel=1e-6)


def test_perturbed_forwards_share_one_dropout_draw():
    model = _model(dropout=0.2).train()
    ids, mask, _ = _batch()
    first, second = model(ids, mask).logits, model(ids, mask).logits
    assert not torch.allclose(first, second)  # dropout is live: two plain forwards differ
    seen = []
    sift = SiFT(SiftConfig(**{**SIFT, "step_size": 0.0, "adversarial_steps": 2}), model)
    sift.adversarial_loss(lambda: seen.append(model(ids, mask).logits) or seen[-1], first)
    assert len(seen) == 3
    torch.testing.assert_close(seen[1], seen[0], rtol=0, atol=0)
    torch.testing.assert_close(seen[2], seen[0], rtol=0, atol=0)
    assert not torch.allclose(seen[0], first)


def _first_ascent_step(model, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ascent step on the perturbation of a ``dtype`` model, and the plain gradient of the divergence
    w.r.t. the perturbation (what an unscaled backward gives)."""
    model = model.to(dtype)
    ids, mask, _ = _batch()
    clean = model(ids, mask).logits.detach()
    torch.manual_seed(5)
    perturbation = _Perturbation(0.01)
    handle = model.deberta.embeddings.LayerNorm.register_forward_hook(perturbation)
    logits = model(ids, mask).logits
    handle.remove()
    start = perturbation.delta.detach().clone()
    (plain,) = torch.autograd.grad(divergence(logits, clean, False), perturbation.delta, retain_graph=True)
    assert perturbation.ascend(logits, clean, False, step_size=1.0)
    real = mask.bool()
    return (perturbation.delta.detach() - start)[real], plain[real]


def test_fp16_ascent_step_matches_fp32_where_a_plain_backward_underflows():
    torch.manual_seed(0)  # the default initialisation: near-uniform predictions, a tiny divergence
    model = DebertaForSequenceClassification(ModelConfig(**MODEL), 3)
    step32, plain32 = _first_ascent_step(model, torch.float32)
    step16, plain16 = _first_ascent_step(model, torch.float16)
    assert torch.nn.functional.cosine_similarity(step16.flatten(), step32.flatten(), 0) > 0.95
    # every real token's largest coordinate moves by exactly step_size, in both precisions
    for step in (step32, step16):
        torch.testing.assert_close(step.abs().amax(-1), torch.ones(len(step)))
    # control: the unscaled fp16 gradient is zero for most tokens (fp32's is finite but tiny)
    assert (plain16.abs().amax(-1) == 0).float().mean() > 0.5
    assert 0 < plain32.abs().max() < 1e-5


def test_symmetric_kl_equals_a_hand_computation():
    a = [[1.0, 2.0, 0.0], [0.5, -1.0, 3.0]]
    b = [[0.0, 1.0, 3.0], [0.5, -1.0, 3.0]]

    def softmax(row):
        exps = [math.exp(x) for x in row]
        return [e / sum(exps) for e in exps]

    def kl(p, q):
        return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))

    expected = sum(kl(softmax(x), softmax(y)) + kl(softmax(y), softmax(x)) for x, y in zip(a, b)) / len(a)
    got = symmetric_kl(torch.tensor(a), torch.tensor(b))
    assert got.item() == pytest.approx(expected, rel=1e-6)
    assert symmetric_kl(torch.tensor(b), torch.tensor(a)).item() == pytest.approx(expected, rel=1e-6)
    assert divergence(torch.tensor(a), torch.tensor(b), regression=False).item() == pytest.approx(expected, rel=1e-6)


def test_divergence_is_float32_for_half_inputs():
    a, b = torch.randn(5, 4), torch.randn(5, 4)
    for dtype in (torch.float16, torch.bfloat16):
        got = symmetric_kl(a.to(dtype), b.to(dtype))
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, symmetric_kl(a.to(dtype).float(), b.to(dtype).float()))


def test_regression_divergence_is_the_squared_difference():
    a, b = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([1.5, -1.0, 0.0])
    assert divergence(a, b, regression=True).item() == pytest.approx((1.0 + 0.0 + 4.0) / 3)
    # ... the symmetric KL of two unit-variance Gaussians: 2 x (mu1 - mu2)^2 / 2
    mu, nu = torch.distributions.Normal(a, 1.0), torch.distributions.Normal(b, 1.0)
    gaussian = (torch.distributions.kl_divergence(mu, nu) + torch.distributions.kl_divergence(nu, mu)).mean()
    assert divergence(a, b, regression=True).item() == pytest.approx(gaussian.item())


def test_regression_model_uses_the_squared_difference():
    model = _model(num_labels=1)
    sift = SiFT(SiftConfig(**{**SIFT, "adversarial_steps": 0}), model)
    assert sift.regression
    ids, mask, _ = _batch(1)
    clean = model(ids, mask).logits
    seen = []
    torch.manual_seed(5)
    extra = sift.adversarial_loss(lambda: seen.append(model(ids, mask).logits) or seen[-1], clean)
    assert clean.shape == (4,)
    assert extra.item() == pytest.approx((seen[0] - clean).pow(2).mean().item(), rel=1e-6)


def test_loss_weight_scales_the_term():
    model = _model()
    one = _adversarial_loss(model, SiFT(SiftConfig(**SIFT), model)).item()
    three = _adversarial_loss(model, SiFT(SiftConfig(**{**SIFT, "loss_weight": 3.0}), model)).item()
    assert three == pytest.approx(3 * one, rel=1e-5)


@pytest.mark.parametrize("field, value", [
    ("enabled", "yes"), ("perturbation_size", 0.0), ("perturbation_size", -1e-3), ("perturbation_size", float("nan")),
    ("step_size", -1.0), ("step_size", float("inf")), ("adversarial_steps", -1), ("adversarial_steps", 1.5),
    ("adversarial_steps", True), ("loss_weight", -0.5), ("loss_weight", "1"),
])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"sift\.{field}\b") as err:
        SiftConfig(**{field: value})
    assert isinstance(err.value, ConfigError)


def test_config_defaults_and_int_values():
    cfg = SiftConfig(enabled=True, perturbation_size=1, loss_weight=2)
    assert cfg.perturbation_size == 1.0 and isinstance(cfg.perturbation_size, float)
    assert SiftConfig() == SiftConfig(enabled=False, perturbation_size=1e-2, step_size=1e-4, adversarial_steps=1,
                                      loss_weight=1.0)


def test_refuses_a_model_without_the_embedding_layer_norm():
    with pytest.raises(TypeError, match="engine.module"):
        SiFT(SiftConfig(enabled=True), torch.nn.Linear(2, 2))
