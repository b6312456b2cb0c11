"""T-TA (``train.objective=tta``, ``model.tta``): a diagonal attention mask, keys and values from the
embedding output at every layer, the first layer's queries from positions, every token a target.

Checked: no output depends on its own input token (perturb token i, output i stays put, across the
whole model; with the diagonal unmasked it moves), the model against T-TA computed by hand with an
explicitly masked softmax, the Triton kernels' in-kernel diagonal mask against the reference (padded
and packed, with gradients), the all-token collator on real text, and the config errors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from attention_oracle import naive_attention
from helpers import assert_same_loss_and_grads

from distaff.train.data.collator import IGNORE_INDEX, MLMCollator
from distaff.train.data.manifest import read_manifest
from distaff.train.data.shards import iter_shard
from distaff.train.data.tokenizer import load_tokenizer_info
from distaff.train.model.config import ConfigError, ModelConfig
from distaff.train.model.deberta import DebertaForMaskedLM, Packed
from distaff.train.model.hf import to_hf
from distaff.train.pretrain.objectives import objective_for
from distaff.train.run.config import config_from_dict
from distaff.train.tools.grow import grow_model

SMALL = dict(vocab_size=50, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=32, position_buckets=8, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0, tta=True)
POSITIONS = {"relative": {}, "absolute": dict(relative_attention=False, pos_att_type=[], position_biased_input=True),
             "rope": dict(relative_attention=False, pos_att_type=[], rope=True),
             "relative+realformer": dict(realformer=True)}
LENGTHS = [9, 5]


def _model(**extra) -> DebertaForMaskedLM:
    torch.manual_seed(0)
    return DebertaForMaskedLM(ModelConfig(**{**SMALL, **extra}))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    n = max(LENGTHS)
    mask = (torch.arange(n)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    return torch.randint(3, 50, (len(LENGTHS), n)) * mask, mask


def _packed_layout() -> Packed:
    lengths = torch.tensor(LENGTHS)
    return Packed(torch.cat([torch.zeros(1), lengths.cumsum(0)]).int(), max(LENGTHS),
                  torch.cat([torch.arange(n) for n in LENGTHS]))


def _moved_by_own_token(model: DebertaForMaskedLM) -> tuple[float, float]:
    """The largest change of token i's logits when token i alone is replaced, over every real token of
    both sequences, and the largest change of the other tokens' logits (which must see it)."""
    ids, mask = _batch()
    with torch.no_grad():
        base = model(ids, mask).logits
        own = others = 0.0
        for b, length in enumerate(LENGTHS):
            for i in range(length):
                changed = ids.clone()
                changed[b, i] = 3 + (ids[b, i] - 3 + 17) % 47
                diff = (model(changed, mask).logits - base)[b, :length].abs().amax(-1)
                own = max(own, float(diff[i]))
                others = max(others, float(torch.cat([diff[:i], diff[i + 1:]]).max()))
    return own, others


@pytest.mark.unit
@pytest.mark.parametrize("positions", POSITIONS)
def test_no_output_depends_on_its_own_token(positions):
    model = _model(**POSITIONS[positions]).double().eval()
    own, others = _moved_by_own_token(model)
    assert own == 0.0
    assert others > 1e-4
    for layer in model.deberta.encoder.layer:  # the control: with the diagonal visible, token i reaches output i
        layer.attention.self.mask_diagonal = False
    assert _moved_by_own_token(model)[0] > 1e-4


@pytest.mark.unit
def test_packed_outputs_do_not_depend_on_their_own_token_and_equal_padded():
    model = _model().double().eval()
    ids, mask = _batch()
    flat = ids[mask.bool()]
    with torch.no_grad():
        padded = model.deberta(ids, mask)[mask.bool()]
        packed = model.deberta(flat, _packed_layout())
        torch.testing.assert_close(packed, padded, atol=1e-12, rtol=1e-10)
        changed = flat.clone()
        changed[LENGTHS[0] + 2] = 3 + (flat[LENGTHS[0] + 2] - 3 + 17) % 47
        moved = (model.deberta(changed, _packed_layout()) - packed).abs().amax(-1)
    assert moved[LENGTHS[0] + 2] == 0.0 and moved[LENGTHS[0]:].max() > 1e-4


def explicit_tta(model: DebertaForMaskedLM, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """T-TA by hand: queries start as the position table, keys and values are the embedding output
    at every layer, attention is an explicit softmax with the diagonal (and padding) masked."""
    cfg, deberta = model.config, model.deberta
    keys_from = deberta.embeddings(ids, None, mask)
    stream = deberta.position_queries.weight[: ids.shape[1]].expand_as(keys_from)
    rel = deberta.encoder.rel_table()
    for layer in deberta.encoder.layer:
        att = layer.attention.self
        heads = lambda proj, x: proj(x).unflatten(-1, (cfg.num_attention_heads, -1)).transpose(-3, -2)  # noqa: E731
        out = naive_attention(heads(att.query_proj, stream), heads(att.key_proj, keys_from),
                              heads(att.value_proj, keys_from), heads(att.key_proj, rel), heads(att.query_proj, rel),
                              position_buckets=cfg.position_buckets,
                              max_relative_positions=cfg.resolved_max_relative_positions,
                              attention_mask=mask, mask_diagonal=True)
        attended = layer.attention.output(out.transpose(1, 2).flatten(2), stream)
        stream = layer.output(layer.intermediate(attended), attended)
    return stream


@pytest.mark.unit
def test_model_equals_tta_by_hand():
    model = _model().double()
    ids, mask = _batch()
    real = mask.bool()
    torch.testing.assert_close(model.deberta(ids, mask)[real], explicit_tta(model, ids, mask)[real],
                               atol=1e-12, rtol=1e-10)


@pytest.mark.unit
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_triton_diagonal_mask_equals_the_reference(packed):
    """Loss and every parameter's gradient, float32, Triton (interpreter) against the reference."""
    fused, plain = _model(attention_impl="triton"), _model(attention_impl="reference")
    ids, mask = _batch()
    labels = torch.where(mask.bool(), ids, IGNORE_INDEX)
    if packed:
        real, layout = mask.bool(), _packed_layout()
        assert_same_loss_and_grads(fused, plain, ids[real], None, None, labels=labels[real],
                                   position_ids=layout.position_ids, cu_seqlens=layout.cu_seqlens,
                                   max_seqlen=layout.max_seqlen)
    else:
        assert_same_loss_and_grads(fused, plain, ids, mask, labels=labels)


@pytest.mark.integration
def test_collator_labels_every_non_special_token_and_masks_nothing(tokenizer_dir: Path, data_dir: Path):
    manifest = read_manifest(data_dir)
    shard = manifest.splits["train"].shards[0]
    with open(data_dir / shard.path, "rb") as f:
        samples = [a for _, a in iter_shard(f, shard.path, np.dtype(manifest.dtype))][:64]
    info = load_tokenizer_info(tokenizer_dir)
    collator = MLMCollator(info, None, manifest.seq_len)
    batch = collator(samples, np.random.default_rng(0))
    original = torch.from_numpy(collator.pad(samples))
    special = torch.isin(original, torch.tensor(info.special_ids))
    assert torch.equal(batch["input_ids"], original)
    assert torch.equal(batch["labels"], torch.where(special, IGNORE_INDEX, original))
    assert (batch["labels"] != IGNORE_INDEX).sum() > 0.8 * (original != info.pad_id).sum()
    packed = collator.packed(samples, np.random.default_rng(0))
    real = original != info.pad_id
    assert torch.equal(packed["input_ids"], original[real]) and torch.equal(packed["labels"], batch["labels"][real])


def _run_config(**train) -> dict:
    return {"run": {"out_dir": "runs/x"}, "data": {"dir": "data/x"}, "train": train}


@pytest.mark.unit
def test_objective_sets_tta_and_drops_emd():
    cfg = config_from_dict(_run_config(objective="tta"))
    model_cfg = cfg.model_config()
    assert model_cfg.emd and not model_cfg.tta  # the pretraining default, before the objective
    objective = objective_for(cfg, model_cfg)
    assert objective.model_cfg.tta and not objective.model_cfg.emd and objective.masking is None


@pytest.mark.unit
def test_refusals_name_both_keys(tmp_path):
    with pytest.raises(ConfigError, match="model.tta with train.objective=mlm"):
        config_from_dict({**_run_config(objective="mlm"), "model": {"tta": True}})
    with pytest.raises(ConfigError, match="model.init_from with train.objective=tta"):
        config_from_dict({**_run_config(objective="tta"), "model": {"init_from": str(tmp_path)}})
    with pytest.raises(ConfigError, match="tta with emd"):
        ModelConfig(**SMALL, emd=True)
    with pytest.raises(ConfigError, match="model.tta: .*no Hugging Face"):
        to_hf(_model(), tmp_path / "hf")
    with pytest.raises(ConfigError, match="model.tta with distaff grow"):
        grow_model(_model(), 32, 4)
