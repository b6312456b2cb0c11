"""Masked-LM loss that never materialises the ``[labelled_tokens, vocab]`` logits.

``masked_lm_loss(hidden, weight, bias, labels, ignore_index)``:

1. picks the labelled positions (``labels != ignore_index``) and gathers their hidden rows;
2. walks those rows in chunks of ``row_chunk`` rows: one cuBLAS ``addmm`` gives the chunk's
   ``[row_chunk, V]`` logits, one Triton program per row makes two passes over the vocabulary in
   ``vocab_block`` slices (online max / sum-exp / first argmax, then ``softmax - onehot`` written
   over the logits in place), and two more cuBLAS products turn that logit gradient into the
   chunk's hidden-row gradient and its contribution to the weight gradient;
3. keeps only the gradients (hidden rows, weight and bias, scaled by ``1 / labelled``) for
   backward, which multiplies them by the incoming scalar gradient.

The gradients are computed in forward (as Liger-Kernel's fused linear cross-entropy does) because
the loss is a scalar at the end of the graph: recomputing the logits in backward would cost one
more vocabulary projection for nothing. Forward skips the gradient work when no input needs it.

Extra memory beyond the inputs: one logits chunk (``row_chunk x V`` in the compute dtype), the
hidden-row gradient ``[labelled, E]``, a float32 weight gradient ``[V, E]`` (plus one ``[V, E]``
product per chunk in the compute dtype when that is not float32) and float32 bias gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .contract import IGNORE_INDEX, MaskedLMLoss, check_masked_lm_inputs, check_targets

LOGITS_CHUNK_ELEMENTS = 1 << 26  # default row_chunk: about 64 Mi logits (128 MiB in bf16) per chunk
MAX_VOCAB_BLOCK = 4096


@triton.jit
def _cross_entropy_rows(logits_ptr, targets_ptr, row_loss_ptr, correct_ptr, n_vocab, grad_scale,
                        COMPUTE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    """Loss, argmax hit and (optionally, in place) ``(softmax - onehot) * grad_scale`` of one row."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * n_vocab
    target = tl.load(targets_ptr + row)
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.full([], 0.0, tl.float32)
    best = tl.full([], float("-inf"), tl.float32)
    best_index = tl.full([], 0, tl.int64)
    for start in range(0, n_vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        logits = tl.load(row_ptr + cols, mask=cols < n_vocab, other=float("-inf")).to(tl.float32)
        block_max = tl.max(logits, axis=0)
        # Strictly greater: on ties the earlier block keeps the first maximal index, as torch.argmax.
        best_index = tl.where(block_max > best, start + tl.argmax(logits, axis=0).to(tl.int64), best_index)
        best = tl.maximum(best, block_max)
        new_max = tl.maximum(running_max, block_max)
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(logits - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    tl.store(row_loss_ptr + row, lse - tl.load(row_ptr + target).to(tl.float32))
    tl.store(correct_ptr + row, (best_index == target).to(tl.int32))
    if COMPUTE_GRAD:
        for start in range(0, n_vocab, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            in_vocab = cols < n_vocab
            logits = tl.load(row_ptr + cols, mask=in_vocab, other=float("-inf")).to(tl.float32)
            grad = (tl.exp(logits - lse) - (cols == target).to(tl.float32)) * grad_scale
            tl.store(row_ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=in_vocab)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.dtype:
    """The dtype the projection runs in: autocast's when it is on, else the (common) input dtype."""
    if torch.is_autocast_enabled(hidden.device.type):
        return torch.get_autocast_dtype(hidden.device.type)
    dtypes = {hidden.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    if len(dtypes) != 1:
        raise ValueError(f"masked_lm_loss needs hidden, weight and bias in one dtype outside autocast, got "
                         f"hidden={hidden.dtype}, weight={weight.dtype}, bias={None if bias is None else bias.dtype}")
    return hidden.dtype


def _labelled_rows(hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int | None, n_vocab: int):
    """Flat indices of the labelled positions (None: all of them), their hidden rows and targets."""
    flat_labels = labels.reshape(-1)
    rows = hidden.reshape(-1, hidden.shape[-1])
    positions = None if ignore_index is None else (flat_labels != ignore_index).nonzero().squeeze(1)
    targets = flat_labels.long() if positions is None else flat_labels.index_select(0, positions).long()
    check_targets(targets, n_vocab, ignore_index)
    return positions, rows if positions is None else rows.index_select(0, positions), targets


def _chunk_gradients(logits_grad, chunk, weight, grads, start: int, end: int) -> None:
    """Add one chunk's logit gradient into the hidden-row, weight and bias gradients (cuBLAS)."""
    grad_rows, grad_weight, grad_bias = grads
    if grad_rows is not None:
        torch.mm(logits_grad, weight, out=grad_rows[start:end])
    if grad_weight is not None and logits_grad.dtype == torch.float32:
        grad_weight.addmm_(logits_grad.t(), chunk)
    elif grad_weight is not None:  # half-precision product, summed over chunks in float32
        grad_weight += logits_grad.t() @ chunk
    if grad_bias is not None:
        grad_bias += logits_grad.sum(0, dtype=torch.float32)


def masked_lm_loss_forward(rows: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None, needs_grad: tuple[bool, bool, bool], row_chunk: int,
                           vocab_block: int):
    """Per-row loss and argmax hit of the labelled ``rows``, and the gradients ``needs_grad`` asks
    for (hidden rows, weight, bias; scaled by ``1 / rows``), walking ``row_chunk`` rows at a time."""
    n_labelled, n_vocab, device = targets.numel(), weight.shape[0], rows.device
    need_rows, need_weight, need_bias = needs_grad
    row_loss = torch.empty(n_labelled, dtype=torch.float32, device=device)
    correct = torch.empty(n_labelled, dtype=torch.int32, device=device)
    grads = (torch.empty_like(rows) if need_rows else None,
             torch.zeros(weight.shape, dtype=torch.float32, device=device) if need_weight else None,
             torch.zeros(n_vocab, dtype=torch.float32, device=device) if need_bias else None)
    grad_scale = 1.0 / max(n_labelled, 1)
    for start in range(0, n_labelled, row_chunk):
        end = min(start + row_chunk, n_labelled)
        chunk = rows[start:end]
        logits = chunk @ weight.t() if bias is None else torch.addmm(bias, chunk, weight.t())
        _cross_entropy_rows[(end - start,)](logits_ptr=logits, targets_ptr=targets[start:end],
                                            row_loss_ptr=row_loss[start:end], correct_ptr=correct[start:end],
                                            n_vocab=n_vocab, grad_scale=grad_scale, COMPUTE_GRAD=any(needs_grad),
                                            BLOCK_V=vocab_block, num_warps=8 if vocab_block >= 2048 else 4)
        if any(needs_grad):  # `logits` now holds d loss / d logits
            _chunk_gradients(logits, chunk, weight, grads, start, end)
    return row_loss, correct, grads


def loss_and_grads(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                   ignore_index: int | None, needs_grad: tuple[bool, bool, bool], row_chunk: int, vocab_block: int):
    """``loss, num_labelled, num_correct`` and the loss's gradients (hidden's in its full shape, weight's
    and bias's in float32; None where not needed). Gradients are computed even when nothing is labelled:
    they are then zero."""
    with torch.autocast(hidden.device.type, enabled=False):  # the inputs are in the compute dtype already
        positions, rows, targets = _labelled_rows(hidden, labels, ignore_index, weight.shape[0])
        row_loss, correct, (grad_rows, grad_weight, grad_bias) = masked_lm_loss_forward(
            rows, targets, weight, bias, needs_grad, row_chunk, vocab_block)
    loss = row_loss.sum() / max(targets.numel(), 1)
    num_labelled = torch.full((), targets.numel(), dtype=torch.int64, device=hidden.device)  # no host copy
    if grad_rows is not None and positions is None:  # every row was labelled
        grad_rows = grad_rows.reshape(hidden.shape)
    elif grad_rows is not None:
        grad_rows = grad_rows.new_zeros(hidden.shape).view(-1, hidden.shape[-1]).index_copy_(
            0, positions, grad_rows).view(hidden.shape)
    return loss, num_labelled, correct.sum(dtype=torch.int64), [grad_rows, grad_weight, grad_bias]


class _MaskedLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, row_chunk, vocab_block):
        loss, num_labelled, num_correct, grads = loss_and_grads(hidden, weight, bias, labels, ignore_index,
                                                                ctx.needs_input_grad[:3], row_chunk, vocab_block)
        ctx.save_for_backward(*grads)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(num_labelled, num_correct)
        return loss, num_labelled, num_correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_num_labelled, _grad_num_correct):
        grads = [None if g is None else (g * grad_loss).to(dtype) for g, dtype in zip(ctx.saved_tensors, ctx.dtypes)]
        return (*grads, None, None, None, None)


def prepare(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, row_chunk: int | None = None,
            vocab_block: int | None = None) -> tuple[tuple, tuple[int, int]]:
    """The inputs in the compute dtype and the resolved ``(row_chunk, vocab_block)``."""
    n_vocab = weight.shape[0]
    if row_chunk is None:
        row_chunk = max(1, LOGITS_CHUNK_ELEMENTS // n_vocab)
        row_chunk = row_chunk // 64 * 64 or row_chunk
    if vocab_block is None:
        vocab_block = min(triton.next_power_of_2(n_vocab), MAX_VOCAB_BLOCK)
    if row_chunk < 1 or vocab_block < 16 or vocab_block & (vocab_block - 1):
        raise ValueError(f"row_chunk must be >= 1 and vocab_block a power of two >= 16, got {row_chunk}, {vocab_block}")
    dtype = _compute_dtype(hidden, weight, bias)
    inputs = (hidden.to(dtype), weight.to(dtype).contiguous(), None if bias is None else bias.to(dtype))
    return inputs, (int(row_chunk), int(vocab_block))


def masked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                   ignore_index: int | None = IGNORE_INDEX, *, row_chunk: int | None = None,
                   vocab_block: int | None = None) -> MaskedLMLoss:
    """Mean cross-entropy of ``hidden @ weight.T + bias`` over the positions whose label is not
    ``ignore_index``, with the labelled and correctly predicted (first argmax) counts.

    ``hidden``: ``[..., E]``; ``weight``: ``[V, E]``; ``bias``: ``[V]`` or None; ``labels``:
    ``[...]``; ``ignore_index=None`` when every row is labelled (rows selected by the caller: no
    second selection, and no host sync; with ``ignore_index`` the labelled rows are found with one).
    ``row_chunk`` labelled rows are projected at a time (default: about ``LOGITS_CHUNK_ELEMENTS / V``, a
    multiple of 64); ``vocab_block`` is the softmax kernel's slice of the vocabulary (a power of two,
    default ``min(next_pow2(V), MAX_VOCAB_BLOCK)``).
    """
    check_masked_lm_inputs(hidden, weight, bias, labels)
    (hidden, weight, bias), (row_chunk, vocab_block) = prepare(hidden, weight, bias, row_chunk=row_chunk,
                                                               vocab_block=vocab_block)
    return MaskedLMLoss(*_MaskedLMLoss.apply(hidden, weight, bias, labels, ignore_index, row_chunk, vocab_block))
