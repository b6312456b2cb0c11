"""Replaced-token detection: embedding-sharing gradient semantics, ELECTRA's labelling, the sampler
(distribution, reproducibility, checkpointed state, rank streams), the metrics, the config and FLOPs."""

from __future__ import annotations

import itertools

import pytest
import torch

from distaff.kernels import IGNORE_INDEX
from distaff.train.model.config import load_model_config
from distaff.train.model import rtd
from distaff.train.model.flops import train_flops_per_token
from distaff.train.pretrain.objectives import ReplacedTokenDetectionObjective, objective_for, sampling_seed
from distaff.train.run.config import ConfigError, config_from_dict

pytestmark = pytest.mark.unit

VOCAB = 97


def configs():
    disc = load_model_config("tiny", vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                             num_hidden_layers=2, position_buckets=8, max_position_embeddings=32,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attention_impl="reference",
                             kernel_impl="reference")
    return disc.replace(num_hidden_layers=1, emd=True), disc


def model(sharing: str = "gdes", seed: int = 0) -> rtd.ReplacedTokenDetection:
    torch.manual_seed(0)
    return rtd.ReplacedTokenDetection(*configs(), sharing=sharing, seed=seed)


def batch(seed: int = 1, batch_size: int = 3, length: int = 20):
    """Masked ids, labels (originals at masked positions) and a padding mask (last row padded)."""
    g = torch.Generator().manual_seed(seed)
    original = torch.randint(5, VOCAB, (batch_size, length), generator=g)
    mask = torch.ones_like(original)
    mask[-1, length - 6:] = 0
    masked = (torch.rand(original.shape, generator=g) < 0.3) & mask.bool()
    masked[:, 0] = False
    labels = torch.where(masked, original, torch.full_like(original, IGNORE_INDEX))
    ids = torch.where(masked, torch.full_like(original, 4), original)
    return ids, mask, labels


def grads_after(loss: torch.Tensor, m: rtd.ReplacedTokenDetection) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    m.zero_grad(set_to_none=True)
    loss.backward()
    return m.generator.word_embeddings.weight.grad, m.discriminator.deberta.embeddings.word_embeddings.weight.grad


def nonzero(grad: torch.Tensor | None) -> bool:
    return grad is not None and bool(grad.abs().sum() > 0)


def test_gdes_rtd_loss_updates_only_the_residual_and_mlm_only_the_shared_table():
    m = model("gdes")
    assert not m.discriminator.deberta.embeddings.word_embeddings.weight.any()   # E_delta starts at zero
    ids, mask, labels = batch()
    shared, residual = grads_after(m(ids, mask, labels=labels).rtd_loss, m)
    assert not nonzero(shared) and nonzero(residual)
    # no RTD gradient reaches any generator parameter (the sampling is not differentiable)
    assert all(not nonzero(p.grad) for p in m.generator.parameters())
    shared, residual = grads_after(m(ids, mask, labels=labels).generator_loss, m)
    assert nonzero(shared) and not nonzero(residual)


def test_es_shares_one_table_that_both_losses_update():
    m = model("es")
    table = m.generator.word_embeddings.weight
    assert m.discriminator.deberta.embeddings.word_embeddings.weight is table
    assert sum(p is table for p in m.parameters()) == 1
    ids, mask, labels = batch()
    shared, _ = grads_after(m(ids, mask, labels=labels).rtd_loss, m)
    assert nonzero(shared)
    shared, _ = grads_after(m(ids, mask, labels=labels).generator_loss, m)
    assert nonzero(shared)


def test_none_keeps_two_tables_each_updated_by_its_own_loss():
    m = model("none")
    ids, mask, labels = batch()
    gen_table, disc_table = grads_after(m(ids, mask, labels=labels).rtd_loss, m)
    assert not nonzero(gen_table) and nonzero(disc_table)
    gen_table, disc_table = grads_after(m(ids, mask, labels=labels).generator_loss, m)
    assert nonzero(gen_table) and not nonzero(disc_table)


def test_gdes_discriminator_reads_the_sum_of_both_tables():
    m = model("gdes").eval()
    with torch.no_grad():
        m.discriminator.deberta.embeddings.word_embeddings.weight.normal_()
    ids, mask, labels = batch()
    out = m(ids, mask, labels=labels)
    alone = rtd.Discriminator(m.discriminator.config).eval()
    state = m.discriminator.state_dict()
    state["deberta.embeddings.word_embeddings.weight"] = m.discriminator_word_embeddings().detach()
    alone.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(alone(out.discriminator_ids, mask), out.rtd_logits, rtol=1e-5, atol=1e-5)


def test_total_loss_is_mlm_plus_weight_times_rtd_over_real_tokens():
    m = model()
    ids, mask, labels = batch()
    out = m(ids, mask, labels=labels)
    real = mask.bool()
    expected_rtd = torch.nn.functional.binary_cross_entropy_with_logits(out.rtd_logits[real].float(),
                                                                        out.replaced[real].float())
    torch.testing.assert_close(out.rtd_loss, expected_rtd)
    torch.testing.assert_close(out.loss, out.generator_loss + 50.0 * out.rtd_loss)
    assert out.sums[4] == real.sum()                       # every real token, no padding


def test_a_sampled_token_equal_to_the_original_counts_as_original():
    m = model().eval()
    ids, mask, labels = batch()
    favourite = 11
    with torch.no_grad():   # the generator all but always samples `favourite`
        m.generator.lm_head.bias.fill_(-1e4)
        m.generator.lm_head.bias[favourite] = 1e4
    labels = torch.where((labels != IGNORE_INDEX) & (torch.arange(labels.numel()).view_as(labels) % 2 == 0),
                         torch.full_like(labels, favourite), labels)
    out = m(ids, mask, labels=labels)
    masked = labels != IGNORE_INDEX
    assert (out.discriminator_ids[masked] == favourite).all()
    assert torch.equal(out.replaced, masked & (labels != favourite))
    assert out.replaced.any() and (masked & ~out.replaced).any()
    # unmasked positions keep the original token, never labelled replaced
    assert torch.equal(out.discriminator_ids[~masked], ids[~masked])


def test_sampler_draws_from_the_softmax_in_chunks(monkeypatch):
    monkeypatch.setattr(rtd, "SAMPLE_CHUNK_ELEMENTS", 5 * 7)   # 7 rows per chunk
    sampler = rtd.ReplacementSampler(3)
    weight = torch.randn(5, 4)
    row = torch.randn(4)
    rows = row.expand(20000, 4).contiguous()
    drawn = sampler.sample(rows, weight, None, training=True)
    freq = torch.bincount(drawn, minlength=5).double() / len(drawn)
    probs = torch.softmax(weight @ row, -1).double()
    assert (freq - probs).abs().max() < 0.015, (freq, probs)


def test_sampling_is_reproducible_per_seed_and_differs_across_ranks():
    ids, mask, labels = batch()
    runs = {}
    for seed in (sampling_seed(7, 0), sampling_seed(7, 0), sampling_seed(7, 1)):
        m = model(seed=seed)
        runs.setdefault(seed, []).append(m(ids, mask, labels=labels).discriminator_ids)
    first, again = runs[sampling_seed(7, 0)]
    assert torch.equal(first, again)
    assert not torch.equal(first, runs[sampling_seed(7, 1)][0])


def test_sampler_state_resumes_the_stream_and_evaluation_never_moves_it():
    sampler = rtd.ReplacementSampler(5)
    rows, weight = torch.randn(64, 4), torch.randn(50, 4)
    sampler.sample(rows, weight, None, training=True)
    saved = sampler.state_dict()
    expected = [sampler.sample(rows, weight, None, training=True) for _ in range(2)]
    resumed = rtd.ReplacementSampler(0)
    resumed.load_state_dict(saved)
    assert all(torch.equal(a, resumed.sample(rows, weight, None, training=True)) for a in expected)

    m = model(seed=9)
    ids, mask, labels = batch()
    m.eval()
    first_eval = m(ids, mask, labels=labels).discriminator_ids
    m.train()
    state = m.sampler.state_dict()
    m.eval()
    assert torch.equal(m(ids, mask, labels=labels).discriminator_ids, first_eval)   # restarts each evaluation
    assert m.sampler.state_dict() == state                                           # training stream untouched


def exact_auc(pos: torch.Tensor, neg: torch.Tensor) -> float:
    diff = pos[:, None] - neg[None, :]
    return float((diff > 0).double().mean() + 0.5 * (diff == 0).double().mean())


def test_histogram_auc_matches_the_exact_auc():
    g = torch.Generator().manual_seed(0)
    pos, neg = torch.randn(300, generator=g) + 1.0, torch.randn(900, generator=g)
    logits, replaced = torch.cat([pos, neg]), torch.cat([torch.ones(300), torch.zeros(900)]).bool()
    hist = rtd.batch_sums(fake_mlm(), torch.tensor(0.5), logits, replaced, FIXED_WEIGHTS)[len(rtd.SUM_NAMES):].tolist()
    assert abs(rtd.histogram_auc(hist[:rtd.AUC_BINS], hist[rtd.AUC_BINS:]) - exact_auc(pos, neg)) < 0.01
    assert rtd.histogram_auc([1.0, 0.0], [0.0, 0.0]) is None


FIXED_WEIGHTS = torch.tensor([1.0, 50.0], dtype=torch.float64)   # the generator's and the discriminator's


def fake_mlm():
    from distaff.kernels import MaskedLMLoss

    return MaskedLMLoss(torch.tensor(2.0), torch.tensor(10), torch.tensor(4))


def test_report_from_sums():
    logits = torch.tensor([3.0, -2.0, 1.0, -1.0, -4.0])
    replaced = torch.tensor([True, False, False, True, False])
    sums = rtd.batch_sums(fake_mlm(), torch.tensor(0.25), logits, replaced, FIXED_WEIGHTS).tolist()
    values = rtd.report(sums, weight=50.0)
    assert values["gen_loss"] == 2.0 and values["gen_accuracy"] == 0.4
    assert values["rtd_loss"] == pytest.approx(0.25) and values["loss"] == pytest.approx(2.0 + 50 * 0.25)
    assert values["rtd_accuracy"] == 3 / 5 and values["replaced_rate"] == 2 / 5
    assert values["rtd_precision"] == 1 / 2 and values["rtd_recall"] == 1 / 2
    assert values["rtd_baseline_accuracy"] == 3 / 5 and values["masked_replaced_rate"] == 2 / 10
    assert values["rtd_auc"] == pytest.approx(exact_auc(logits[replaced], logits[~replaced]))
    assert values["weight_gen"] == 1.0 and values["weight_rtd"] == 50.0


def run_config(**rtd_section):
    return config_from_dict({"data": {"dir": "x"}, "model": {"preset": "tiny"},
                             "train": {"objective": "rtd"}, "rtd": rtd_section})


def test_generator_defaults_to_half_the_discriminator_and_shares_its_embedding_width():
    cfg = run_config()
    disc = cfg.model_config(vocab_size=500)
    objective = objective_for(cfg, disc)
    assert isinstance(objective, ReplacedTokenDetectionObjective)
    assert not objective.model_cfg.emd and objective.generator_cfg.emd
    gen = objective.generator_cfg
    assert gen.num_hidden_layers == disc.num_hidden_layers // 2 and gen.hidden_size == disc.hidden_size
    assert gen.vocab_size == 500
    narrow = run_config(generator={"hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 256})
    gen = narrow.generator_config(disc)
    assert gen.hidden_size == 64 and gen.embedding_size == disc.embedding_size   # projected, shared table
    unshared = run_config(embedding_sharing="none", generator={"hidden_size": 64, "num_attention_heads": 2})
    assert unshared.generator_config(disc).embedding_size == 64
    preset = run_config(generator={"preset": "deberta-v3-xsmall", "num_hidden_layers": 3}).generator_config(disc)
    assert preset.num_hidden_layers == 3 and preset.hidden_size == 384 and preset.vocab_size == 500


@pytest.mark.parametrize("section, match", [
    ({"embedding_sharing": "tied"}, "rtd.embedding_sharing"),
    ({"weight": 0}, "rtd.weight"),
    ({"generator": {"hidden_layers": 3}}, "rtd.generator"),
    ({"generator": {"preset": "nope"}}, "rtd.generator"),
    ({"generator": 3}, "rtd.generator"),
])
def test_bad_rtd_config_names_the_key(section, match):
    with pytest.raises(ConfigError, match=match):
        run_config(**section)


def test_objective_must_be_known():
    with pytest.raises(ConfigError, match="train.objective"):
        config_from_dict({"data": {"dir": "x"}, "train": {"objective": "electra"}})


def test_flops_count_both_networks():
    cfg = run_config()
    objective = objective_for(cfg, cfg.model_config(vocab_size=8000))
    gen, disc = objective.generator_cfg, objective.model_cfg
    total = objective.flops_per_token(128)
    both = train_flops_per_token(gen, 128, 0.15) + train_flops_per_token(disc, 128, 0.0)
    assert both < total < both * 1.2


def test_discriminator_head_builds_nothing_of_vocabulary_size():
    m = model()
    ids, mask, labels = batch()
    seen = []
    def record(_module, _inputs, out):  # attention layers return (output, RealFormer history or None)
        seen.extend(t.shape for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor))

    hooks = [mod.register_forward_hook(record) for mod in itertools.chain(m.discriminator.modules())]
    m(ids, mask, labels=labels)
    for hook in hooks:
        hook.remove()
    assert seen and all(VOCAB not in shape for shape in seen)


def test_shipped_rtd_presets():
    from pathlib import Path

    from distaff.train.run.config import load_config

    run_dir = Path(__file__).resolve().parents[2] / "configs" / "run"
    tiny = load_config(run_dir / "tiny-rtd-cpu.yaml")
    mlm = load_config(run_dir / "tiny-cpu.yaml")
    assert tiny.train.objective == "rtd" and mlm.train.objective == "mlm"
    # the same token budget as the MLM demo run
    assert (tiny.train.max_steps, tiny.data.batch_size, tiny.data.dir) == (mlm.train.max_steps, mlm.data.batch_size,
                                                                          mlm.data.dir)
    assert tiny.generator_config(tiny.model_config()).num_hidden_layers == 2
    base = load_config(run_dir / "deberta-v3-rtd-base.yaml")
    disc = base.model_config(vocab_size=128100)
    gen = base.generator_config(disc)
    assert (disc.num_hidden_layers, gen.num_hidden_layers, gen.hidden_size) == (12, 6, 768)
    assert base.rtd.embedding_sharing == "gdes" and base.rtd.weight == 50.0


def test_progress_lines_and_plot_show_the_objectives_metrics(tmp_path):
    import json

    from distaff.train.run.metrics import format_line, plot_metrics

    common = {"lr": 1e-3, "tokens_per_s": 10.0, "tokens_per_s_per_device": 5.0, "samples_per_s": 1.0,
              "peak_mem_gb": 0.1, "eta_s": 3.0}
    rtd_record = {"step": 3, **rtd.report(rtd.batch_sums(fake_mlm(), torch.tensor(0.25), torch.tensor([1.0, -1.0]),
                                                         torch.tensor([True, False]), FIXED_WEIGHTS).tolist(), 50.0),
                  **common}
    line = format_line(rtd_record, 10)
    assert "gen 2.0000" in line and "rtd 0.2500" in line and "auc 1.0000" in line and "acc" in line
    mlm_line = format_line({"step": 3, "loss": 4.0, "accuracy": 0.25, **common}, 10)
    assert "loss 4.0000 | acc 0.2500" in mlm_line and "auc" not in mlm_line
    evaluation = {"step": 3, **{f"eval_{k}": v for k, v in rtd.report([0.0] * rtd.NUM_SUMS, 50.0).items()},
                  "eval_perplexity": 1.0, "eval_tokens": 0}
    assert "eval step 3" in format_line(evaluation, 10) and "auc" not in format_line(evaluation, 10)
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in (rtd_record, {**rtd_record, "step": 4}, evaluation)) + "\n")
    assert plot_metrics(jsonl, tmp_path / "m.png").stat().st_size > 1000
