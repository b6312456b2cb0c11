"""distaff's DeBERTa against the pinned Hugging Face ``transformers`` on the same random weights."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import save_file
from transformers import DebertaV2Config, DebertaV2ForMaskedLM, DebertaV2Model

from distaff.train.model.config import ModelConfig
from distaff.train.model.deberta import DebertaForMaskedLM
from distaff.train.model.hf import from_hf, hf_state_dict, model_config_from_hf, to_hf

pytestmark = pytest.mark.unit

BASE = dict(vocab_size=211, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
            max_position_embeddings=64, relative_attention=True, position_buckets=8, max_relative_positions=24,
            pos_att_type="p2c|c2p", norm_rel_ebd="layer_norm", share_att_key=True, position_biased_input=False,
            type_vocab_size=0, layer_norm_eps=1e-7)

CONFIGS = {
    "v3-like": {},
    "no-buckets": dict(position_buckets=-1, max_relative_positions=16),
    "separate-pos-proj": dict(share_att_key=False),
    "c2p-only": dict(pos_att_type="c2p", share_att_key=False),
    "p2c-only": dict(pos_att_type="p2c"),
    "embedding-size": dict(embedding_size=32),
    "absolute-positions": dict(position_biased_input=True, type_vocab_size=2, norm_rel_ebd="none"),
    "no-relative": dict(relative_attention=False, pos_att_type=None),
}

SEQ_LEN = 40  # past max_relative_positions for every config: saturated distances are exercised


def _inputs(vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (3, SEQ_LEN), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 29:] = 0   # padded tail
    mask[2, 4:] = 0    # mostly padding
    ids[mask == 0] = 0
    types = torch.randint(0, 2, ids.shape, generator=gen)
    return ids, mask, types


def _assert_close(ours: torch.Tensor, theirs: torch.Tensor, mask: torch.Tensor, atol: float = 1e-4) -> None:
    """Compare real tokens only: padded queries attend to nothing in distaff (see distaff.train.model.deberta)."""
    valid = mask.bool()
    diff = (ours[valid] - theirs[valid]).abs().max().item()
    assert diff <= atol, f"max abs difference {diff:.3g} > {atol}"


def _hf_model(name: str, seed: int = 0) -> DebertaV2ForMaskedLM:
    torch.manual_seed(seed)
    return DebertaV2ForMaskedLM(DebertaV2Config(**{**BASE, **CONFIGS[name]})).eval()


@pytest.mark.parametrize("name", CONFIGS)
def test_hf_to_distaff(name, tmp_path):
    hf = _hf_model(name)
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path).eval()
    ids, mask, types = _inputs(hf.config.vocab_size)
    types = types if hf.config.type_vocab_size else None
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
        got = ours(ids, mask, types)
    _assert_close(got.logits, expected.logits, mask)
    _assert_close(got.last_hidden_state, expected.hidden_states[-1], mask)


@pytest.mark.parametrize("name", CONFIGS)
def test_distaff_to_hf(name, tmp_path):
    cfg = _hf_model(name).config
    torch.manual_seed(1)
    ours = from_hf_config_model(cfg)
    to_hf(ours, tmp_path)
    hf, info = DebertaV2ForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    encoder = DebertaV2Model.from_pretrained(tmp_path).eval()
    ids, mask, types = _inputs(cfg.vocab_size, seed=3)
    types = types if cfg.type_vocab_size else None
    with torch.no_grad():
        got = ours(ids, mask, types)
        expected = hf.eval()(input_ids=ids, attention_mask=mask, token_type_ids=types)
        hidden = encoder(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    _assert_close(got.logits, expected.logits, mask)
    _assert_close(got.last_hidden_state, hidden, mask)


def from_hf_config_model(hf_config: DebertaV2Config) -> DebertaForMaskedLM:
    """A freshly initialised distaff model with the architecture of ``hf_config``."""
    return DebertaForMaskedLM(model_config_from_hf(hf_config.to_dict())).eval()


def test_original_head_layout_and_bin_weights(tmp_path):
    """The ``lm_predictions`` layout of the released DeBERTa checkpoints, from a ``pytorch_model.bin``."""
    torch.manual_seed(0)
    hf = DebertaV2ForMaskedLM(DebertaV2Config(**BASE, legacy=False)).eval()
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    ours = from_hf(tmp_path).eval()
    ids, mask, _ = _inputs(BASE["vocab_size"])
    with torch.no_grad():
        _assert_close(ours(ids, mask).logits, hf(input_ids=ids, attention_mask=mask).logits, mask)


def test_loss_and_gradients_match_hf(tmp_path):
    """Training parity: the fused-path loss and every parameter gradient (tied decoder included)."""
    hf = _hf_model("v3-like")
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path).eval()
    ids, mask, _ = _inputs(BASE["vocab_size"])
    labels = torch.full_like(ids, -100)
    labels[:, 3:30:4] = ids[:, 3:30:4]
    labels[mask == 0] = -100
    expected = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
    got = ours(ids, mask, labels=labels)
    assert abs(got.loss.item() - expected.item()) < 1e-5
    assert got.num_labelled.item() == (labels != -100).sum().item()
    expected.backward()
    got.loss.backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    head = {"lm_head.dense": "cls.predictions.transform.dense", "lm_head.LayerNorm": "cls.predictions.transform.LayerNorm",
            "lm_head.bias": "cls.predictions.bias"}
    for name, param in ours.named_parameters():
        hf_name = next((name.replace(k, v) for k, v in head.items() if name.startswith(k)), name)
        torch.testing.assert_close(param.grad, hf_grads[hf_name], atol=1e-5, rtol=1e-4, msg=name)


def test_enhanced_mask_decoder_matches_hf_layer_applied_twice(tmp_path):
    """EMD: queries H+P through HF's own last layer twice, keys/values H (the last layer's input)."""
    hf = _hf_model("v3-like")
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path, emd=True).eval()
    ids, mask, _ = _inputs(BASE["vocab_size"])
    with torch.no_grad():
        states = hf.deberta(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        hidden = states[-2]
        encoder = hf.deberta.encoder
        query = hidden + ours.emd.position_embeddings.weight[:SEQ_LEN]
        for _ in range(2):
            query = encoder.layer[-1](hidden, encoder.get_attention_mask(mask), query_states=query,
                                      relative_pos=encoder.get_rel_pos(hidden),
                                      rel_embeddings=encoder.get_rel_embedding())[0]
        expected = hf.cls(query)
        got = ours(ids, mask)
    _assert_close(got.last_hidden_state, hidden, mask)
    _assert_close(got.logits, expected, mask)


def test_emd_is_dropped_from_exports_and_seeded_from_absolute_positions(tmp_path):
    cfg = ModelConfig(**{**{k: v for k, v in BASE.items() if k != "pos_att_type"}, "emd": True})
    model = DebertaForMaskedLM(cfg).eval()
    to_hf(model, tmp_path / "export")
    plain = from_hf(tmp_path / "export")
    assert plain.emd is None
    assert not any(k.startswith("emd.") for k in plain.state_dict())
    # Released DeBERTa-v3 checkpoints keep absolute position embeddings: EMD starts from them.
    state = hf_state_dict(plain)
    state["deberta.embeddings.position_embeddings.weight"] = torch.randn(BASE["max_position_embeddings"], 48)
    save_file(state, tmp_path / "export" / "model.safetensors")
    with_emd = from_hf(tmp_path / "export", emd=True)
    torch.testing.assert_close(with_emd.emd.position_embeddings.weight,
                               state["deberta.embeddings.position_embeddings.weight"])


def test_activation_checkpointing_gives_identical_gradients():
    cfg = ModelConfig(**{**{k: v for k, v in BASE.items() if k != "pos_att_type"}, "emd": True,
                         "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1})
    torch.manual_seed(0)
    plain = DebertaForMaskedLM(cfg).train()
    ckpt = copy.deepcopy(plain)
    ckpt.deberta.encoder.activation_checkpointing = True
    ids, mask, _ = _inputs(cfg.vocab_size)
    labels = torch.where(mask.bool(), ids, -100)
    for model in (plain, ckpt):
        torch.manual_seed(7)  # same dropout masks, replayed by checkpointing's RNG restore
        model(ids, mask, labels=labels).loss.backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_triton_paths_in_the_model_match_hf(tmp_path):
    """attention_impl / kernel_impl = triton (interpreter on CPU): same logits and loss gradients."""
    torch.manual_seed(0)
    hf = DebertaV2ForMaskedLM(DebertaV2Config(**{**BASE, "hidden_size": 64, "num_attention_heads": 2,
                                                 "num_hidden_layers": 1})).eval()
    hf.save_pretrained(tmp_path)
    ids, mask, _ = _inputs(BASE["vocab_size"])
    ids, mask = ids[:, :24], mask[:, :24]
    labels = torch.where(mask.bool() & (torch.arange(24) % 3 == 0), ids, -100)
    with torch.no_grad():
        fused = from_hf(tmp_path, attention_impl="triton", kernel_impl="triton").eval()
        _assert_close(fused(ids, mask).logits, hf(input_ids=ids, attention_mask=mask).logits, mask)
    fused = from_hf(tmp_path, attention_impl="triton", kernel_impl="triton", emd=True).eval()
    plain = from_hf(tmp_path, attention_impl="reference", kernel_impl="reference", emd=True).eval()
    plain.load_state_dict(fused.state_dict())
    for model in (fused, plain):
        model(ids, mask, labels=labels).loss.backward()
    for (name, a), (_, b) in zip(fused.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=name)
