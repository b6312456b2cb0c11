"""Chunked Triton masked-LM loss against the PyTorch reference run in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import TRITON_DTYPES, assert_close
from torch.utils._python_dispatch import TorchDispatchMode

import distaff.kernels
from distaff.kernels import reference
from distaff.kernels.mlm_loss import masked_lm_loss

pytestmark = pytest.mark.unit

# Relative to the largest expected magnitude of each compared tensor.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _assert_close(actual, expected, rel, what):
    scale = expected.abs().max().item() if expected.numel() else 0.0
    assert_close(actual, expected, rtol=rel, atol=rel * max(scale, 1e-30), what=what)


def _problem(device, batch_shape, hidden, vocab, dtype, with_bias=True, seed=0):
    """Inputs with ~40% of positions labelled, the first batch row unlabelled, and a third of
    the labels set to the argmax so the correct count is not trivially zero."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(*batch_shape, hidden, generator=gen)
    weight = torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5 * 4
    bias = torch.randn(vocab, generator=gen) if with_bias else None
    labels = torch.randint(0, vocab, batch_shape, generator=gen)
    labels[torch.rand(batch_shape, generator=gen) > 0.4] = -100
    labels.reshape(-1, batch_shape[-1])[0] = -100
    # Argmax of the logits as the half-precision kernel sees them (rounded inputs).
    logits = F.linear(*(None if t is None else t.to(dtype).double() for t in (h, weight, bias)))
    hit = (labels != -100) & (torch.rand(batch_shape, generator=gen) < 0.33)
    labels[hit] = logits.argmax(-1)[hit]
    tensors = [h, weight, bias]
    return [None if t is None else t.to(device, dtype).requires_grad_() for t in tensors], labels.to(device)


def _grads(tensors):
    return [None if t is None else t.grad for t in tensors]


def _check(device, batch_shape, hidden, vocab, dtype, row_chunk=None, vocab_block=None, with_bias=True):
    tensors, labels = _problem(device, batch_shape, hidden, vocab, dtype, with_bias)
    result = masked_lm_loss(*tensors, labels, row_chunk=row_chunk, vocab_block=vocab_block)
    (result.loss * 1.5).backward()  # a non-unit upstream gradient

    oracle = [None if t is None else t.detach().double().requires_grad_() for t in tensors]
    expected = reference.masked_lm_loss(*oracle, labels)
    (expected.loss * 1.5).backward()

    rel = TOLERANCE[dtype]
    assert result.loss.dtype == torch.float32 and torch.isfinite(result.loss)
    _assert_close(result.loss, expected.loss.double(), rel, "loss")
    assert result.num_labelled.item() == expected.num_labelled.item() > 0
    assert result.num_correct.item() == expected.num_correct.item() > 0
    assert result.accuracy.item() == pytest.approx(expected.accuracy.item())
    for name, grad, grad64, t in zip(("hidden", "weight", "bias"), _grads(tensors), _grads(oracle), tensors):
        if t is None:
            continue
        assert grad.dtype == t.dtype and grad.shape == t.shape, name
        _assert_close(grad, grad64, rel, f"grad of {name}")
    unlabelled = (labels == -100).reshape(-1)
    assert not tensors[0].grad.reshape(-1, hidden)[unlabelled].any(), "unlabelled positions got a gradient"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("hidden, vocab, row_chunk, vocab_block", [
    (384, 1000, 5, 256),    # vocab not a multiple of the block; labelled rows not a multiple of the chunk
    (768, 333, None, None),  # default chunking: one chunk, one padded vocab block
    (1024, 130, 4, 64),
    (200, 77, 3, 32),
])
def test_masked_lm_loss_matches_reference(dtype, hidden, vocab, row_chunk, vocab_block, device):
    _check(device, (3, 9), hidden, vocab, dtype, row_chunk, vocab_block)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_masked_lm_loss_without_bias(dtype, device):
    _check(device, (2, 11), 200, 150, dtype, row_chunk=2, vocab_block=64, with_bias=False)


@pytest.mark.timeout(60)
def test_public_dispatch_runs_the_triton_path(device):
    tensors, labels = _problem(device, (2, 8), 64, 50, torch.float32)
    fused = distaff.kernels.masked_lm_loss(*tensors, labels, impl="triton")
    expected = reference.masked_lm_loss(*tensors, labels)
    assert isinstance(fused, reference.MaskedLMLoss)
    torch.testing.assert_close(fused.loss, expected.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_all_positions_ignored_gives_zero_loss_and_zero_gradients(with_bias, device):
    tensors, _ = _problem(device, (2, 5), 200, 40, torch.float32, with_bias)
    labels = torch.full((2, 5), -100, device=device)
    result = masked_lm_loss(*tensors, labels)
    result.loss.backward()
    assert result.loss.item() == 0.0 and result.num_labelled.item() == 0 and result.num_correct.item() == 0
    assert result.accuracy.item() == 0.0
    for t in tensors:
        if t is not None:
            assert t.grad is not None and t.grad.shape == t.shape and not t.grad.any()


@pytest.mark.timeout(60)
def test_argmax_ties_count_the_first_index_like_torch(device):
    # Zero hidden rows make the logits equal the bias, whose maximum is tied at 2, 9 (same
    # 16-wide vocab block) and 21 (a later block).
    vocab = 40
    bias = torch.zeros(vocab, device=device)
    bias[[2, 9, 21]] = 3.0
    hidden = torch.zeros(4, 8, device=device)
    weight = torch.randn(vocab, 8, device=device)
    labels = torch.tensor([2, 9, 21, 2], device=device)
    result = masked_lm_loss(hidden, weight, bias, labels, vocab_block=16)
    assert F.linear(hidden, weight, bias).argmax(-1).tolist() == [2, 2, 2, 2]
    assert result.num_correct.item() == 2


@pytest.mark.timeout(60)
def test_tied_embedding_weight_gets_the_unfused_gradient(device):
    # weight is both the input embedding and the output projection: its gradient sums both uses.
    vocab, hidden = 97, 200
    gen = torch.Generator().manual_seed(3)
    embedding = torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5
    mix = torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5
    ids = torch.randint(0, vocab, (2, 7), generator=gen)
    labels = torch.where(torch.rand(2, 7, generator=gen) < 0.5, ids, -100).to(device)

    def tied_loss(weight, loss_fn, **options):
        h = torch.tanh(F.embedding(ids.to(device), weight) @ mix.to(weight))
        return loss_fn(h, weight, None, labels, **options).loss

    fused_weight = embedding.to(device).requires_grad_()
    tied_loss(fused_weight, masked_lm_loss, row_chunk=3, vocab_block=32).backward()
    oracle = embedding.detach().double().to(device).requires_grad_()
    tied_loss(oracle, reference.masked_lm_loss).backward()
    _assert_close(fused_weight.grad, oracle.grad, 1e-5, "tied weight grad")


@pytest.mark.timeout(60)
def test_logits_are_never_materialised_for_all_labelled_rows(device):
    # Record every tensor torch allocates during forward + backward: none may be as large as
    # the [labelled, vocab] logits; the largest ones are one [row_chunk, vocab] chunk and the
    # [vocab, hidden] weight gradient.
    vocab, hidden, row_chunk = 1000, 16, 4
    tensors, labels = _problem(device, (4, 16), hidden, vocab, torch.float32)
    labelled = int((labels != -100).sum())
    assert labelled > 3 * row_chunk

    class LargestAllocation(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    LargestAllocation.largest = max(LargestAllocation.largest, t.numel())
            return out

    with LargestAllocation():
        masked_lm_loss(*tensors, labels, row_chunk=row_chunk).loss.backward()
    assert LargestAllocation.largest == max(row_chunk * vocab, vocab * hidden) < labelled * vocab


@pytest.mark.timeout(60)
def test_autocast_projects_in_the_autocast_dtype_and_returns_fp32_grads(device):
    tensors, labels = _problem(device, (2, 9), 200, 120, torch.float32)
    with torch.autocast(device.type, dtype=torch.float16):
        result = masked_lm_loss(*tensors, labels, row_chunk=4)
        expected = reference.masked_lm_loss(*tensors, labels)
    result.loss.backward()
    torch.testing.assert_close(result.loss, expected.loss, rtol=2e-3, atol=2e-3)
    assert all(t.grad.dtype == torch.float32 and torch.isfinite(t.grad).all() for t in tensors)


@pytest.mark.parametrize("labels, message", [
    (torch.tensor([[1, 50, -100]]), "label 50 is outside the vocabulary"),
    (torch.tensor([[1, -3, -100]]), "label -3 is outside the vocabulary"),
    (torch.tensor([1, 2, 3]), "labels shape"),
    (torch.tensor([[1.0, 2.0, 3.0]]), "labels must be an integer tensor"),
])
def test_bad_labels_are_named(labels, message, device):
    with pytest.raises(ValueError, match=message):
        masked_lm_loss(torch.randn(1, 3, 8, device=device), torch.randn(50, 8, device=device), None, labels.to(device))


def test_mixed_dtypes_outside_autocast_are_named(device):
    with pytest.raises(ValueError, match="one dtype"):
        masked_lm_loss(torch.randn(1, 3, 8, device=device), torch.randn(50, 8, dtype=torch.float16, device=device),
                       None, torch.tensor([[1, 2, 3]], device=device))



@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_rows_already_selected_need_no_second_selection(impl: str, device) -> None:
    """``ignore_index=None``: every row carries a target (the model selected them), with the same
    loss and gradients as selecting them here."""
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 10, 32, generator=gen).to(device)
    weight = torch.randn(50, 32, generator=gen).to(device)
    labels = torch.randint(0, 50, (3, 10), generator=gen).to(device)
    labels[0, :4] = -100
    chosen = labels.reshape(-1) != -100
    results = []
    selected = (hidden.reshape(-1, 32)[chosen], labels.reshape(-1)[chosen], None)
    for rows, targets, ignore in ((hidden, labels, -100), selected):
        rows, w = rows.detach().requires_grad_(), weight.detach().clone().requires_grad_()
        out = distaff.kernels.masked_lm_loss(rows, w, None, targets, ignore_index=ignore, impl=impl)
        out.loss.backward()
        results.append((out.loss, out.num_labelled, w.grad))
    torch.testing.assert_close(results[0][0], results[1][0])
    assert int(results[0][1]) == int(results[1][1]) == int(chosen.sum())
    torch.testing.assert_close(results[0][2], results[1][2])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        distaff.kernels.masked_lm_loss(hidden, weight, None, torch.full((3, 10), -100, device=device),
                                       ignore_index=None, impl=impl)
