"""The padding mask's one-launch packing (kernels/attention/mask.py) against its torch form and against the mask
itself, read back bit by bit."""

from __future__ import annotations

import pytest
import torch

from distaff.kernels.attention import mask_bits, mask_bits_reference
from distaff.kernels.attention.mask import WORDS_PER_PROGRAM, mask_words

pytestmark = pytest.mark.unit


def _unpacked(words: torch.Tensor, n_ctx: int) -> torch.Tensor:
    """Bit ``j % 32`` of word ``j // 32`` of each row, for every token ``j`` (bool ``[B, n_ctx]``)."""
    bits = (words.long().unsqueeze(-1) >> torch.arange(32)) & 1
    return bits.flatten(1)[:, :n_ctx].bool()


@pytest.mark.parametrize("n_ctx", [1, 31, 32, 33, 200, 32 * WORDS_PER_PROGRAM, 32 * WORDS_PER_PROGRAM + 5])
@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float32])
def test_the_packed_words_hold_every_token_of_the_mask_and_nothing_past_it(n_ctx, dtype) -> None:
    torch.manual_seed(n_ctx)
    mask = (torch.rand(3, n_ctx) < 0.6).to(dtype)
    mask[0] = 1  # a full row: bit 31 of every word set (the word's sign bit)
    words = mask_bits(mask, n_ctx)
    assert words.dtype == torch.int32 and words.shape == (3, mask_words(n_ctx))
    assert torch.equal(_unpacked(words, n_ctx), mask.ne(0))
    past = (words.long().unsqueeze(-1) >> torch.arange(32) & 1).flatten(1)[:, n_ctx:]
    assert not past.any()  # the padding past the last token and the word after it are clear
    assert torch.equal(words, mask_bits_reference(mask, n_ctx))


def test_a_strided_mask_is_read_through_its_strides() -> None:
    torch.manual_seed(0)
    base = torch.rand(70, 4) < 0.5
    for mask in (base.t(), base.t()[::2], torch.ones(1, 70, dtype=torch.bool).expand(3, 70)):
        assert not mask.is_contiguous()
        assert torch.equal(mask_bits(mask, 70), mask_bits_reference(mask.contiguous(), 70))


def test_nonzero_values_of_any_sign_are_real_tokens() -> None:
    mask = torch.tensor([[1.0, 0.0, -2.0, 0.5, 0.0]])
    assert _unpacked(mask_bits(mask, 5), 5).tolist() == [[True, False, True, True, False]]
