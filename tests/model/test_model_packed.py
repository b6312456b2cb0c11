"""The model on packed batches (``cu_seqlens``) against the padded model on the same sequences."""

from __future__ import annotations

import copy

import pytest
import torch

from distaff.kernels import IGNORE_INDEX
from distaff.train.model.config import ModelConfig
from distaff.train.model.deberta import DebertaForMaskedLM

pytestmark = pytest.mark.unit

BASE = dict(vocab_size=211, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
            max_position_embeddings=64, relative_attention=True, position_buckets=8, max_relative_positions=24,
            pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm", share_att_key=True,
            position_biased_input=False, type_vocab_size=0, layer_norm_eps=1e-7,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

CONFIGS = {
    "v3-emd": dict(emd=True),
    "v3-no-emd": dict(emd=False),
    "absolute-positions": dict(position_biased_input=True, norm_rel_ebd="none", share_att_key=False),
    "no-buckets-emd": dict(position_buckets=-1, max_relative_positions=16, emd=True),
    "rope-emd": dict(rope=True, relative_attention=False, pos_att_type=[], emd=True),
    "rope-on-relative": dict(rope=True),
}
LENGTHS = (40, 29, 4, 17)  # past the bucket span (saturated distances) down to a 4-token sequence


def padded_batch(vocab: int, lengths=LENGTHS, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``[B, N]`` ids, mask and labels (every third real token labelled, a different offset per row)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(5, vocab, (len(lengths), width), generator=gen)
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    ids[mask == 0] = 0
    pick = (torch.arange(width) + torch.arange(len(lengths))[:, None]) % 3 == 0
    labels = torch.where(mask.bool() & pick, ids, IGNORE_INDEX)
    return ids, mask, labels


def pack(ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> dict:
    """The padded batch in ``MLMCollator.packed``'s layout."""
    keep = mask.bool()
    lengths = keep.sum(1)
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    return dict(input_ids=ids[keep], labels=labels[keep], position_ids=positions[keep], cu_seqlens=cu_seqlens,
                max_seqlen=int(lengths.max()))


def _models(overrides: dict, **impls) -> tuple[DebertaForMaskedLM, DebertaForMaskedLM]:
    torch.manual_seed(0)
    model = DebertaForMaskedLM(ModelConfig(**{**BASE, **overrides, **impls})).eval()
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("name", CONFIGS)
def test_packed_outputs_equal_padded_outputs(name):
    padded_model, _ = _models(CONFIGS[name])
    ids, mask, labels = padded_batch(BASE["vocab_size"])
    packed = pack(ids, mask, labels)
    inputs = {k: v for k, v in packed.items() if k != "labels"}
    with torch.no_grad():
        want = padded_model(ids, mask)
        got = padded_model(**inputs)
    keep = mask.bool()
    assert got.logits.shape == (int(keep.sum()), BASE["vocab_size"])
    torch.testing.assert_close(got.logits, want.logits[keep], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state[keep], atol=2e-5, rtol=1e-5)


def loss_and_grads(model: torch.nn.Module, **batch) -> tuple[object, dict[str, torch.Tensor]]:
    """The model's output on ``batch`` after its loss's backward, and its parameters' gradients by name."""
    out = model(**batch)
    out.loss.backward()
    return out, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _check_loss_and_gradients(padded_model, packed_model, ids, mask, labels, atol: float) -> None:
    want, want_grads = loss_and_grads(padded_model, input_ids=ids, attention_mask=mask, labels=labels)
    got, got_grads = loss_and_grads(packed_model, **pack(ids, mask, labels))
    assert int(got.num_labelled) == int(want.num_labelled) == int((labels != IGNORE_INDEX).sum())
    assert int(got.num_correct) == int(want.num_correct)
    torch.testing.assert_close(got.loss, want.loss, atol=atol, rtol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=atol, rtol=1e-4, msg=name)


@pytest.mark.parametrize("name", ["v3-emd", "absolute-positions"])
def test_packed_loss_and_gradients_equal_padded(name):
    padded_model, packed_model = _models(CONFIGS[name])
    _check_loss_and_gradients(padded_model, packed_model, *padded_batch(BASE["vocab_size"]), atol=2e-6)


def test_packed_triton_paths_equal_padded_reference():
    """Through the Triton kernels (the interpreter on CPU): packed loss and gradients equal the
    padded reference model's."""
    overrides = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, emd=True, emd_layers=1)
    torch.manual_seed(0)
    padded_model = DebertaForMaskedLM(ModelConfig(**{**BASE, **overrides, "attention_impl": "reference",
                                                     "kernel_impl": "reference"}))
    packed_model = DebertaForMaskedLM(ModelConfig(**{**BASE, **overrides, "attention_impl": "triton",
                                                     "kernel_impl": "triton"}))
    packed_model.load_state_dict(padded_model.state_dict())
    batch = padded_batch(BASE["vocab_size"], lengths=(19, 6, 11))
    _check_loss_and_gradients(padded_model, packed_model, *batch, atol=2e-5)


def test_packed_input_errors_name_the_missing_field():
    model, _ = _models({})
    packed = pack(*padded_batch(BASE["vocab_size"]))
    with pytest.raises(ValueError, match="position_ids and max_seqlen"):
        model(packed["input_ids"], cu_seqlens=packed["cu_seqlens"], max_seqlen=packed["max_seqlen"])
    with pytest.raises(ValueError, match="max_seqlen"):
        model(**{**packed, "max_seqlen": 3})


def test_packed_activation_checkpointing_gives_identical_gradients():
    """The packed layout passes through torch's checkpointing (dropout on: its RNG is replayed)."""
    dropout = dict(emd=True, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    plain, ckpt = (model.train() for model in _models(dropout))
    ckpt.deberta.encoder.activation_checkpointing = True
    packed = pack(*padded_batch(BASE["vocab_size"]))
    grads = []
    for model in (plain, ckpt):
        torch.manual_seed(7)
        grads.append(loss_and_grads(model, **packed)[1])
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)
