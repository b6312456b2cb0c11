"""RTD on packed documents (``cu_seqlens``) against the padded RTD model on the same documents: the same
replacements drawn, the same discriminator labels and logits per real token, the same losses, sums and
gradients of every parameter, for each embedding sharing; gradient-disentangled sharing keeps its gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from distaff.kernels import IGNORE_INDEX
from distaff.train.model import rtd
from distaff.train.model.config import load_model_config
from distaff.train.model.deberta import Packed

from test_model_packed import loss_and_grads, pack

pytestmark = pytest.mark.unit

VOCAB = 97
LENGTHS = (23, 9, 4, 17)      # uneven documents, one of 4 tokens


def configs(impl: str = "reference"):
    disc = load_model_config("tiny", vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                             num_hidden_layers=2, position_buckets=8, max_position_embeddings=32,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attention_impl=impl,
                             kernel_impl=impl)
    return disc.replace(num_hidden_layers=1, emd=True), disc


def documents(seed: int = 3, lengths=LENGTHS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded ``[B, N]`` masked ids, mask and labels; position 0 of each document (its [CLS]) is never masked."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    original = torch.randint(5, VOCAB, (len(lengths), width), generator=g)
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    original[mask == 0] = 0
    original[:, 0] = 1
    masked = (torch.rand(original.shape, generator=g) < 0.3) & mask.bool()
    masked[:, 0] = False
    labels = torch.where(masked, original, IGNORE_INDEX)
    return torch.where(masked, 4, original), mask, labels


def twins(sharing: str, impl: str = "reference") -> tuple[rtd.ReplacedTokenDetection, rtd.ReplacedTokenDetection]:
    """Two copies of one model (weights and sampler state), the GDES residual table made non-zero."""
    torch.manual_seed(0)
    model = rtd.ReplacedTokenDetection(*configs(), sharing=sharing, seed=5)
    with torch.no_grad():
        model.discriminator.deberta.embeddings.word_embeddings.weight.normal_(std=0.02)
    other = copy.deepcopy(model)
    if impl != "reference":
        other = rtd.ReplacedTokenDetection(*configs(impl), sharing=sharing, seed=5)
        other.load_state_dict(model.state_dict())
    return model, other


def check_equal(padded_model, packed_model, ids, mask, labels, atol: float) -> None:
    want, want_grads = loss_and_grads(padded_model, input_ids=ids, attention_mask=mask, labels=labels)
    got, got_grads = loss_and_grads(packed_model, **pack(ids, mask, labels))
    keep = mask.bool()
    assert torch.equal(got.discriminator_ids, want.discriminator_ids[keep])      # the same replacements
    assert torch.equal(got.replaced, want.replaced[keep])                        # the same labels
    assert got.replaced.any() and not got.replaced.all()
    torch.testing.assert_close(got.rtd_logits, want.rtd_logits[keep], atol=atol, rtol=1e-5)
    for name in ("loss", "generator_loss", "rtd_loss"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=atol, rtol=1e-5, msg=name)
    counts = len(rtd.SUM_NAMES)
    torch.testing.assert_close(got.sums[:counts], want.sums[:counts], atol=1e-3, rtol=1e-5)
    assert got.sums[4] == keep.sum()                  # every real token scored, and nothing else
    assert got.sums[counts:].sum() == want.sums[counts:].sum() == keep.sum()
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=atol, rtol=1e-4, msg=name)


@pytest.mark.parametrize("sharing", rtd.EMBEDDING_SHARING)
def test_packed_rtd_equals_padded_rtd_on_the_same_documents(sharing):
    check_equal(*twins(sharing), *documents(), atol=2e-6)


def test_packed_rtd_through_the_triton_kernels_equals_the_padded_reference():
    """The fused varlen attention and ops (the interpreter on CPU) against the padded reference model."""
    check_equal(*twins("gdes", impl="triton"), *documents(lengths=(11, 5, 8)), atol=3e-5)


def test_packed_gdes_keeps_the_disentangled_gradients():
    _, model = twins("gdes")
    batch = pack(*documents())
    for loss, updates_shared in (("rtd_loss", False), ("generator_loss", True)):
        model.zero_grad(set_to_none=True)
        getattr(model(**batch), loss).backward()
        shared = model.generator.word_embeddings.weight.grad
        residual = model.discriminator.deberta.embeddings.word_embeddings.weight.grad
        assert (shared is not None and bool(shared.abs().sum() > 0)) == updates_shared, loss
        assert (residual is not None and bool(residual.abs().sum() > 0)) != updates_shared, loss


def test_packed_rtd_head_reads_each_documents_own_cls():
    """The head alone: each packed token adds its own document's first state, as the padded head adds its row's."""
    _, disc = configs()
    head = rtd.RTDHead(disc).eval()
    ids, mask, labels = documents()
    hidden = torch.randn(*ids.shape, disc.hidden_size)
    layout = pack(ids, mask, labels)
    packed = Packed(layout["cu_seqlens"], layout["max_seqlen"], layout["position_ids"])
    with torch.no_grad():
        torch.testing.assert_close(head(hidden[mask.bool()], packed), head(hidden)[mask.bool()])
