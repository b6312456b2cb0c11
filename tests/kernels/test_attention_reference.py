"""The PyTorch reference attention against a naive float64 autograd oracle, and the bucket table
against transformers' own function."""

from __future__ import annotations

import pytest
import torch
from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position

from attention_oracle import naive_attention
from distaff.kernels import bucket_table, disentangled_attention, disentangled_attention_varlen, reference
from distaff.kernels.relative_position import relative_position_index

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("buckets,max_rel", [(256, 512), (8, 32), (32, 128), (256, 8192), (-1, 24), (-1, 512)])
def test_relative_index_matches_transformers_for_every_distance(buckets, max_rel):
    n = 1200
    probe = torch.empty(1, n, 1)
    theirs = build_relative_position(probe, probe, bucket_size=buckets, max_position=max_rel)[0]
    span = buckets if buckets > 0 else max_rel
    expected = (theirs + span).clamp(0, 2 * span - 1)
    assert torch.equal(relative_position_index(n, n, buckets, max_rel), expected)
    # The O(N) per-distance form kernels load must agree with the N x N table.
    table = bucket_table(n - 1, buckets, max_rel)
    distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    assert torch.equal(table[distance + n - 1].long(), expected)


def _inputs(batch, heads, n, d, span, c2p=True, p2c=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    def make(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()
    q, k, v = make(batch, heads, n, d), make(batch, heads, n, d), make(batch, heads, n, d)
    return q, k, v, make(heads, 2 * span, d) if c2p else None, make(heads, 2 * span, d) if p2c else None


CASES = {
    "buckets+padding": dict(n=37, buckets=8, max_rel=16, pad=True),
    "saturated-plain": dict(n=29, buckets=-1, max_rel=6, pad=False),
    "c2p-only": dict(n=17, buckets=8, max_rel=32, pad=True, p2c=False),
    "p2c-only": dict(n=17, buckets=8, max_rel=32, pad=False, c2p=False),
    "no-position": dict(n=9, buckets=4, max_rel=8, pad=True, c2p=False, p2c=False),
    "single-token": dict(n=1, buckets=8, max_rel=16, pad=False),
}


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_naive_oracle_values_and_gradients(case):
    c = CASES[case]
    span = c["buckets"] if c["buckets"] > 0 else c["max_rel"]
    q, k, v, kr, qr = _inputs(2, 3, c["n"], 8, span, c.get("c2p", True), c.get("p2c", True))
    mask = torch.ones(2, c["n"])
    if c["pad"]:
        mask[0, c["n"] // 2:] = 0   # padded tail: empty query rows
        mask[1] = 0                 # a fully padded sequence
    kw = dict(position_buckets=c["buckets"], max_relative_positions=c["max_rel"], attention_mask=mask)
    got = disentangled_attention(q, k, v, kr, qr, impl="reference", **kw)
    expected = naive_attention(q, k, v, kr, qr, **kw)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)
    assert torch.isfinite(got).all()
    grad = torch.randn_like(got)
    inputs = [t for t in (q, k, v, kr, qr) if t is not None]
    for a, b in zip(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(expected, inputs, grad)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_reference_dropout_gradients_pass_gradcheck():
    """With a fixed seed the dropped-out attention is a deterministic function: its backward must
    regenerate exactly the forward's mask."""
    q, k, v, kr, qr = _inputs(1, 2, 11, 4, 4)
    mask = torch.ones(1, 11)
    mask[0, 9:] = 0

    def attention(*tensors):
        torch.manual_seed(1234)
        return reference.disentangled_attention(*tensors, position_buckets=4, max_relative_positions=8,
                                                attention_mask=mask, dropout_p=0.3)
    assert torch.autograd.gradcheck(attention, (q, k, v, kr, qr))
    out = attention(q, k, v, kr, qr)
    torch.manual_seed(99)
    other = reference.disentangled_attention(q, k, v, kr, qr, position_buckets=4, max_relative_positions=8,
                                             attention_mask=mask, dropout_p=0.3)
    assert not torch.allclose(out, other), "a different seed must drop different probabilities"


def test_reference_dropout_keep_rate():
    n, p = 64, 0.25
    v = torch.eye(n).expand(1, 1, n, n).contiguous()   # output row i = the kept, rescaled P[i, :]
    q = torch.zeros(1, 1, n, n)
    torch.manual_seed(0)
    out = reference.disentangled_attention(q, q, v, position_buckets=8, max_relative_positions=16, dropout_p=p)
    kept = (out > 0).double().mean().item()
    assert abs(kept - (1 - p)) < 0.02, kept
    torch.testing.assert_close(out[out > 0], torch.full_like(out[out > 0], 1 / (n * (1 - p))))


def test_row_blocks_give_the_same_result(monkeypatch):
    """Long sequences are processed in row blocks; the blocking must not change the result."""
    q, k, v, kr, qr = _inputs(1, 2, 50, 8, 8)
    kw = dict(position_buckets=8, max_relative_positions=16)
    whole = disentangled_attention(q, k, v, kr, qr, **kw)
    grads = torch.autograd.grad(whole.sum(), (q, k, v, kr, qr))
    monkeypatch.setattr(reference, "_BLOCK_ELEMENTS", 2 * 50 * 7)  # 7 rows per block
    blocked = disentangled_attention(q, k, v, kr, qr, **kw)
    torch.testing.assert_close(blocked, whole)
    for a, b in zip(torch.autograd.grad(blocked.sum(), (q, k, v, kr, qr)), grads):
        torch.testing.assert_close(a, b)


def test_varlen_equals_padded_batch():
    lengths = [5, 13, 1, 9]
    heads, d, span = 2, 8, 8
    q, k, v, kr, qr = _inputs(1, heads, sum(lengths), d, span)
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]   # [total, H, d]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    kw = dict(position_buckets=span, max_relative_positions=32)
    out = disentangled_attention_varlen(*packed, kr, qr, cu_seqlens=cu, max_seqlen=max(lengths), **kw)
    for s, n in enumerate(lengths):
        seq = [t[cu[s]:cu[s + 1]].transpose(0, 1)[None] for t in packed]
        single = disentangled_attention(*seq, kr, qr, **kw)
        torch.testing.assert_close(out[cu[s]:cu[s + 1]], single[0].transpose(0, 1))


@pytest.mark.parametrize("bad,message", [
    (dict(k=torch.zeros(2, 3, 5, 8)), "k must have the shape of q"),
    (dict(pos_key=torch.zeros(3, 7, 4)), "pos_key must be"),
    (dict(attention_mask=torch.ones(2, 5)), "attention_mask must be"),
    (dict(dropout_p=1.0), "dropout_p"),
    (dict(impl="cuda"), "impl must be one of"),
])
def test_bad_attention_arguments_name_the_argument(bad, message):
    args = dict(q=torch.zeros(2, 3, 4, 4), k=torch.zeros(2, 3, 4, 4), v=torch.zeros(2, 3, 4, 4),
                pos_key=torch.zeros(3, 8, 4), pos_query=None)
    kw = dict(position_buckets=4, max_relative_positions=8)
    kw.update({key: bad.pop(key) for key in list(bad) if key in ("attention_mask", "dropout_p", "impl")})
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        disentangled_attention(*args.values(), **kw)
