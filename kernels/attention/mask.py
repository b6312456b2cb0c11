"""The padding mask packed 32 tokens to an int32 word, as the attention kernels read it (``scores._mask_words``).

One Triton launch per call: the torch form (:func:`mask_bits_reference`, the test oracle) is six launches (a
compare, a pad, an ``arange``, a cast, a shift and a sum), each a GPU-side gap of its own in every layer's
forward. Bit ``j % 32`` of word ``j // 32`` is set where token ``j`` is real (a nonzero mask value); each row has
``ceil(n_ctx / 32) + 1`` words (``scores._mask_stride``): the last, past the last token, is always zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WORDS_PER_PROGRAM = 32  # 1,024 tokens a program: the [32, 32] tile of mask values is 8 per thread on 4 warps


@triton.jit
def _pack_mask_words(MASK, WORDS, n_ctx, n_words, stride_b, stride_n, BLOCK_WORDS: tl.constexpr):
    """Program (w, b) packs words ``w * BLOCK_WORDS ..`` of row ``b``: a [words, 32] tile of the mask's values,
    each nonzero one shifted to its bit and the row of 32 summed (distinct bits: the sum is their OR)."""
    b = tl.program_id(1).to(tl.int64)
    words = tl.program_id(0) * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)
    bit = tl.arange(0, 32)
    token = words[:, None] * 32 + bit[None, :]
    real = tl.load(MASK + b * stride_b + token * stride_n, mask=token < n_ctx, other=0) != 0
    packed = tl.sum(real.to(tl.int32) << bit[None, :], 1)
    tl.store(WORDS + b * n_words + words, packed, mask=words < n_words)


def mask_words(n_ctx: int) -> int:
    """Words per row of the packed mask (as ``scores._mask_stride``): one per 32 tokens, and one more."""
    return -(-n_ctx // 32) + 1


def mask_bits(mask: torch.Tensor, n_ctx: int) -> torch.Tensor:
    """The 2-D padding mask ``[B, n_ctx]`` (any dtype, any strides) packed 32 tokens to an int32 word: int32
    ``[B, mask_words(n_ctx)]``, one launch."""
    words = torch.empty((mask.shape[0], mask_words(n_ctx)), dtype=torch.int32, device=mask.device)
    grid = (triton.cdiv(words.shape[1], WORDS_PER_PROGRAM), mask.shape[0])
    _pack_mask_words[grid](mask, words, n_ctx, words.shape[1], mask.stride(0), mask.stride(1),
                           BLOCK_WORDS=WORDS_PER_PROGRAM, num_warps=4)
    return words


def mask_bits_reference(mask: torch.Tensor, n_ctx: int) -> torch.Tensor:
    """:func:`mask_bits` in torch ops (the oracle of its tests)."""
    words = mask_words(n_ctx)
    padded = torch.nn.functional.pad(mask.ne(0), (0, words * 32 - n_ctx)).view(mask.shape[0], words, 32)
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    return (padded.to(torch.int32) << shifts).sum(-1, dtype=torch.int32)
