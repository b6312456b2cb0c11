"""Two optional features of the disentangled attention (issue 16): a per-sequence softmax scale
(``softmax_scale`` as a float32 ``[B]`` / ``[S]`` tensor, used by the entropy-invariant scale) and
the diagonal mask (``mask_diagonal=True``: query ``i`` never attends key ``i``, for T-TA).

The reference is checked in float64 against the naive oracle (explicit ``N x N`` scores, ``-inf``
on the diagonal); the Triton kernels (interpreter, fp32 / fp16) against the float64 reference,
values and all five gradients.
"""

from __future__ import annotations

import pytest
import torch
from attention_oracle import naive_attention
from test_attention_triton import TOL, assert_close, dropout_against_oracle, make_inputs, run_with_grads

from distaff.kernels import attention, disentangled_attention, disentangled_attention_varlen, reference

pytestmark = pytest.mark.unit

BUCKETS, MAX_REL = 8, 32
KW = dict(position_buckets=BUCKETS, max_relative_positions=MAX_REL)


def _float64_inputs(batch, heads, n, d, c2p=True, p2c=True, seed=0):
    return [None if t is None else t.double() for t in
            make_inputs(torch.device("cpu"), batch, heads, n, d, BUCKETS, c2p, p2c, seed)]


def _padding_mask(batch: int, n: int) -> torch.Tensor:
    """Row 0 full, row 1 a padded tail, row 2 a single real token, row 3 (if any) fully padded."""
    mask = torch.ones(batch, n, dtype=torch.long)
    mask[1, n // 2:] = 0
    mask[2, 1:] = 0
    if batch > 3:
        mask[3] = 0
    return mask


def _grads(out, inputs, seed=1):
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    leaves = [t for t in inputs if t is not None]
    return torch.autograd.grad(out, leaves, grad)


def _leaves(inputs):
    return [None if t is None else t.detach().clone().requires_grad_() for t in inputs]


# --------------------------------------------------------------------------- reference, float64


@pytest.mark.parametrize("c2p,p2c", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("scaled,diagonal", [(True, False), (False, True), (True, True)],
                         ids=["scale", "diagonal", "scale+diagonal"])
def test_reference_matches_the_naive_oracle(c2p, p2c, scaled, diagonal):
    inputs = _leaves(_float64_inputs(4, 2, 13, 8, c2p, p2c))
    scale = torch.tensor([0.21, 0.5, 1.7, 0.9]) if scaled else None
    kw = dict(KW, attention_mask=_padding_mask(4, 13), softmax_scale=scale, mask_diagonal=diagonal)
    got = disentangled_attention(*inputs, impl="reference", **kw)
    want = naive_attention(*inputs, **kw)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    for a, b in zip(_grads(got, inputs), _grads(want, inputs)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_per_sequence_scale_is_each_sequence_with_its_float_scale():
    inputs = _float64_inputs(3, 2, 11, 8)
    scales = torch.tensor([0.3, 1.0, 2.5])
    mask = _padding_mask(3, 11)
    out = disentangled_attention(*inputs, **KW, attention_mask=mask, softmax_scale=scales)
    for b in range(3):
        single = disentangled_attention(*(t[b:b + 1] for t in inputs[:3]), *inputs[3:], **KW,
                                        attention_mask=mask[b:b + 1], softmax_scale=float(scales[b]))
        torch.testing.assert_close(out[b:b + 1], single, atol=0, rtol=0)
    assert not torch.allclose(out, disentangled_attention(*inputs, **KW, attention_mask=mask))


def test_diagonal_is_really_masked():
    """With v = I, ``out[i, j]`` is the probability of key ``j`` for query ``i``: the diagonal must be
    exactly 0 and every row (of length > 1) still sums to 1; without the mask the diagonal is not 0."""
    n = 9
    q, k, _, kr, qr = _float64_inputs(1, 2, n, n)
    eye = torch.eye(n, dtype=torch.float64).expand(1, 2, n, n).contiguous()
    out = disentangled_attention(q, k, eye, kr, qr, **KW, mask_diagonal=True)
    assert (out.diagonal(dim1=-2, dim2=-1) == 0).all()
    torch.testing.assert_close(out.sum(-1), torch.ones(1, 2, n, dtype=torch.float64))
    unmasked = disentangled_attention(q, k, eye, kr, qr, **KW)
    assert (unmasked.diagonal(dim1=-2, dim2=-1) > 1e-4).all()


def test_one_token_sequence_without_its_diagonal_outputs_zero_with_zero_gradients():
    inputs = _leaves(_float64_inputs(1, 2, 1, 8))
    out = disentangled_attention(*inputs, **KW, mask_diagonal=True)
    assert (out == 0).all()
    for grad in _grads(out, inputs):
        assert torch.isfinite(grad).all() and (grad == 0).all()


def test_reference_varlen_with_scales_and_diagonal_equals_each_sequence():
    lengths = [5, 1, 12, 3]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v, kr, qr = _float64_inputs(1, 2, sum(lengths), 8)
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]
    scales = torch.tensor([0.4, 0.0, 1.3, 0.8])
    out = disentangled_attention_varlen(*packed, kr, qr, cu_seqlens=cu, max_seqlen=max(lengths), **KW,
                                        softmax_scale=scales, mask_diagonal=True)
    for s in range(len(lengths)):
        seq = [t[cu[s]:cu[s + 1]].transpose(0, 1)[None] for t in packed]
        single = naive_attention(*seq, kr, qr, **KW, softmax_scale=float(scales[s]), mask_diagonal=True)
        torch.testing.assert_close(out[cu[s]:cu[s + 1]], single[0].transpose(0, 1), atol=1e-12, rtol=1e-10)
    assert (out[cu[1]:cu[2]] == 0).all(), "the one-token sequence has no key left"


@pytest.mark.parametrize("scale,message", [
    (torch.ones(3), r"softmax_scale as a tensor must be float32 \[B\] = \(2,\)"),
    (torch.ones(2, dtype=torch.float64), "must be float32"),
    (torch.ones(2, 1), "must be float32"),
    (torch.ones(2, requires_grad=True), "no gradient flows into it"),
])
def test_bad_scale_tensors_name_the_argument(scale, message):
    q = torch.zeros(2, 1, 4, 8)
    with pytest.raises(ValueError, match=message):
        disentangled_attention(q, q, q, **KW, softmax_scale=scale)


def test_varlen_scale_needs_one_per_sequence():
    q = torch.zeros(6, 1, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"\[S\] \(len\(cu_seqlens\) - 1\) = \(2,\)"):
        disentangled_attention_varlen(q, q, q, cu_seqlens=cu, max_seqlen=4, **KW, softmax_scale=torch.ones(6))


# --------------------------------------------------------------------------- Triton (interpreter: fp32, fp16)

FEATURES = {"scale": (True, False), "diagonal": (False, True), "scale+diagonal": (True, True)}


def _features(name: str, num_seqs: int) -> dict:
    scaled, diagonal = FEATURES[name]
    scales = torch.linspace(0.15, 1.4, num_seqs, dtype=torch.float32) if scaled else None
    return dict(softmax_scale=scales, mask_diagonal=diagonal)


@pytest.mark.parametrize("features,c2p,p2c,dtype", [
    ("scale", True, True, torch.float32), ("diagonal", True, True, torch.float32),
    ("scale+diagonal", True, True, torch.float16), ("scale+diagonal", True, False, torch.float32),
    ("scale+diagonal", False, True, torch.float16), ("scale+diagonal", False, False, torch.float32),
])
def test_triton_padded_matches_reference(features, c2p, p2c, dtype):
    """Four sequences: full, padded tail, one real token, fully padded; 45 tokens = 2 x 2 tiles of 32,
    so diagonal tiles and off-diagonal tiles both occur."""
    n = 45
    inputs = make_inputs(torch.device("cpu"), 4, 1, n, 32, BUCKETS, c2p, p2c, seed=2)
    kw = dict(KW, attention_mask=_padding_mask(4, n), **_features(features, 4))
    got = run_with_grads(attention.disentangled_attention, inputs, dtype, **kw)
    want = run_with_grads(reference.disentangled_attention, inputs, torch.float64, **kw)
    assert_close(got, want, TOL[dtype])
    if kw["mask_diagonal"]:  # the one-token sequence has no key: exact zeros, no NaN
        for value in got[:4]:
            assert (value[2, :, 0] == 0).all()


@pytest.mark.parametrize("features,c2p,dtype", [
    ("scale", True, torch.float32), ("diagonal", False, torch.float16), ("scale+diagonal", True, torch.float16),
    ("scale+diagonal", False, torch.float32),
])
def test_triton_varlen_matches_reference(features, c2p, dtype):
    lengths = [5, 1, 40, 33]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(sum(lengths), 2, 32, generator=gen) for _ in range(3)]
    inputs += [torch.randn(2, 2 * BUCKETS, 32, generator=gen) if c2p else None,
               torch.randn(2, 2 * BUCKETS, 32, generator=gen)]
    kw = dict(KW, cu_seqlens=cu, max_seqlen=max(lengths), **_features(features, len(lengths)))
    got = run_with_grads(attention.disentangled_attention_varlen, inputs, dtype, **kw)
    want = run_with_grads(reference.disentangled_attention_varlen, inputs, torch.float64, **kw)
    assert_close(got, want, TOL[dtype])


def test_triton_against_the_brute_force_oracle_with_saturated_tiles():
    """Explicit N x N float64 scores with -inf on the diagonal and per-sequence scales; at 130 tokens
    with 8 buckets most tiles are saturated (the rank-1 fast path) and the diagonal ones are not."""
    n = 130
    paths = attention.tile_paths(n, attention.INTERPRETER_TILES, BUCKETS, MAX_REL)
    assert paths.saturated > 0 and paths.general > 0, paths
    inputs = _float64_inputs(2, 1, n, 32, seed=6)
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, 100:] = 0
    kw = dict(KW, attention_mask=mask, softmax_scale=torch.tensor([0.11, 0.3]), mask_diagonal=True)
    got = run_with_grads(attention.disentangled_attention, inputs, torch.float32, **kw)
    want = run_with_grads(naive_attention, inputs, torch.float64, **kw)
    assert_close(got, want, TOL[torch.float32])
    # The same kernel without the diagonal mask is far from this oracle: the check can fail.
    unmasked = run_with_grads(attention.disentangled_attention, inputs, torch.float32, **{**kw, "mask_diagonal": False})
    with pytest.raises(AssertionError, match="out: relative L2 error"):
        assert_close(unmasked, want, TOL[torch.float32])


def test_triton_one_token_sequences_give_zeros_not_nan():
    for fn, shape, kw in ((attention.disentangled_attention, (1, 2, 1, 32), {}),
                          (attention.disentangled_attention_varlen, (2, 2, 32),
                           dict(cu_seqlens=torch.tensor([0, 1, 2], dtype=torch.int32), max_seqlen=1))):
        gen = torch.Generator().manual_seed(0)
        inputs = [torch.randn(shape, generator=gen) for _ in range(3)]
        inputs += [torch.randn(2, 2 * BUCKETS, 32, generator=gen) for _ in range(2)]
        for value in run_with_grads(fn, inputs, torch.float32, **KW, **kw, mask_diagonal=True):
            assert (value == 0).all(), "no key left: output and every gradient are exactly 0"


def test_triton_zero_scale_of_a_one_token_sequence_is_not_nan():
    """The entropy-invariant scale of a one-token sequence is log(1) / log(n) = 0: its scores are all 0, and
    the padding beside it must stay -inf (not -inf * 0 = NaN), in the output and in every gradient."""
    gen = torch.Generator().manual_seed(5)
    inputs = [torch.randn(3, 2, 12, 32, generator=gen) for _ in range(3)]
    inputs += [torch.randn(2, 2 * BUCKETS, 32, generator=gen) for _ in range(2)]
    mask = (torch.arange(12)[None, :] < torch.tensor([12, 5, 1])[:, None]).long()
    kw = dict(KW, attention_mask=mask, softmax_scale=torch.tensor([0.2, 0.1, 0.0]))
    got = run_with_grads(attention.disentangled_attention, inputs, torch.float32, **kw)
    want = run_with_grads(reference.disentangled_attention, inputs, torch.float64, **kw)
    assert not any(torch.isnan(value).any() for value in got)
    assert_close(got, want, TOL[torch.float32])


def test_triton_dropout_mask_is_unchanged_by_the_features():
    """The keep mask recovered from the kernel without the features, applied by a float64 oracle with
    them, matches the kernel with them: the features do not move the dropout stream."""
    inputs = _float64_inputs(2, 1, 64, 32, seed=7)
    got, want = dropout_against_oracle(inputs, 5, **KW, softmax_scale=torch.tensor([0.2, 0.45]), mask_diagonal=True)
    assert_close(got, want, TOL[torch.float32])


@pytest.mark.parametrize("layout", ["padded", "varlen"])
def test_triton_tensor_of_one_scale_is_bit_identical_to_the_float(layout):
    """The per-sequence specialisation only changes where the scale comes from, not the arithmetic."""
    scale = 0.37
    if layout == "padded":
        inputs = make_inputs(torch.device("cpu"), 2, 1, 40, 32, BUCKETS, seed=9)
        mask = (torch.arange(40)[None, :] < torch.tensor([[40], [25]])).long()
        fn, kw, seqs = attention.disentangled_attention, dict(KW, attention_mask=mask), 2
    else:
        inputs = [t[0].transpose(0, 1).contiguous() if t.dim() == 4 else t
                  for t in make_inputs(torch.device("cpu"), 1, 1, 40, 32, BUCKETS, seed=9)]
        cu = torch.tensor([0, 7, 40], dtype=torch.int32)
        fn, kw, seqs = attention.disentangled_attention_varlen, dict(KW, cu_seqlens=cu, max_seqlen=33), 2
    with_float = run_with_grads(fn, inputs, torch.float16, **kw, softmax_scale=scale)
    with_tensor = run_with_grads(fn, inputs, torch.float16, **kw, softmax_scale=torch.full((seqs,), scale))
    for a, b in zip(with_float, with_tensor):
        assert torch.equal(a, b)
