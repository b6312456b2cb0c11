"""The Triton disentangled-attention kernel against float64 references (CPU under TRITON_INTERPRET=1,
or CUDA with DISTAFF_TEST_GPU=1).

Outputs and all five gradients are compared by relative L2 error. Shapes are small because the
interpreter runs programs one after another; together they cover odd lengths, saturation, both
bucket modes, c2p/p2c alone, padding, fp16/bf16, head dims 32/64/128, the packed form and dropout.
"""

from __future__ import annotations

import pytest
import torch
from attention_oracle import naive_attention
from helpers import BF16_NEEDS_GPU

import distaff.kernels as kernels
from distaff.kernels import attention, reference
from distaff.kernels.contract import dropout_seed

pytestmark = pytest.mark.unit

# bf16 keeps 8 bits of mantissa to fp16's 11: eight times fp16's bound.
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}
NAMES = ("out", "dq", "dk", "dv", "dpos_key", "dpos_query")


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative L2 error; absolute where the reference is exactly zero (a one-token softmax has
    zero dQ and dK, which the kernels reproduce only up to rounding)."""
    expected = expected.double()
    scale = expected.norm()
    return ((actual.double() - expected).norm() / (scale if scale > 0 else 1.0)).item()


def make_inputs(device, batch, heads, n, d, span, c2p=True, p2c=True, seed=0):
    """q, k, v, pos_key, pos_query on ``device``, drawn on the CPU so every device sees the same values."""
    gen = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(batch, heads, n, d, generator=gen) for _ in range(3)]
    kr = torch.randn(heads, 2 * span, d, generator=gen) if c2p else None
    qr = torch.randn(heads, 2 * span, d, generator=gen) if p2c else None
    return [None if t is None else t.to(device) for t in (*qkv, kr, qr)]


def run_with_grads(fn, inputs, dtype, grad_out_seed=1, **kwargs):
    """Output and gradients of all given inputs (leaves cast to ``dtype``) for a fixed random dO."""
    leaves = [None if t is None else t.detach().to(dtype).requires_grad_() for t in inputs]
    out = fn(*leaves, **kwargs)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_out_seed)).to(out.device, dtype)
    out.backward(grad_out)
    return [out] + [None if t is None else t.grad for t in leaves]


def assert_close(actual, expected, tol):
    for name, a, e in zip(NAMES, actual, expected):
        if e is None:
            assert a is None, name
            continue
        assert torch.isfinite(a).all(), f"{name} has non-finite values"
        err = rel_l2(a, e)
        assert err <= tol, f"{name}: relative L2 error {err:.2e} > {tol:.0e}"


CASES = [
    # (batch, heads, n, d, position_buckets, max_relative_positions, c2p, p2c, dtype)
    pytest.param(1, 2, 1, 32, 8, 32, True, True, torch.float32, id="n1"),
    pytest.param(2, 1, 17, 32, 8, 32, True, True, torch.float32, id="n17"),
    pytest.param(1, 2, 130, 32, 8, 32, True, True, torch.float32, id="n130-log-saturated"),
    pytest.param(1, 1, 257, 32, 64, 128, True, True, torch.float32, id="n257-identity-log-saturated"),
    pytest.param(1, 2, 130, 32, 0, 24, True, True, torch.float32, id="n130-plain-clamped"),
    pytest.param(1, 2, 70, 64, 0, 128, True, True, torch.float32, id="d64-plain-identity"),
    pytest.param(1, 2, 130, 32, 8, 32, True, False, torch.float32, id="c2p-only"),
    pytest.param(1, 2, 130, 32, 8, 32, False, True, torch.float32, id="p2c-only"),
    pytest.param(1, 2, 45, 32, 8, 32, False, False, torch.float32, id="content-only"),
    pytest.param(1, 2, 130, 32, 8, 32, True, True, torch.float16, id="fp16"),
    pytest.param(1, 2, 130, 32, 8, 32, True, True, torch.bfloat16, id="bf16", marks=BF16_NEEDS_GPU),
    pytest.param(1, 1, 40, 128, 16, 64, True, True, torch.float32, id="d128"),
]


@pytest.mark.parametrize("batch,heads,n,d,buckets,max_rel,c2p,p2c,dtype", CASES)
def test_matches_reference_in_float64(batch, heads, n, d, buckets, max_rel, c2p, p2c, dtype, device):
    span = buckets if buckets > 0 else max_rel
    inputs = make_inputs(device, batch, heads, n, d, span, c2p, p2c)
    kw = dict(position_buckets=buckets, max_relative_positions=max_rel)
    got = run_with_grads(attention.disentangled_attention, inputs, dtype, **kw)
    want = run_with_grads(reference.disentangled_attention, inputs, torch.float64, **kw)
    assert got[0].dtype == dtype
    assert_close(got, want, TOL[dtype])


def test_padding_empty_rows_and_fully_padded_sequence(device):
    inputs = make_inputs(device, 3, 2, 50, 32, 8)
    mask = torch.ones(3, 50, dtype=torch.long, device=device)
    mask[0, 31:] = 0          # trailing padding
    mask[1, ::3] = 0          # holes, including row 0
    mask[2] = 0               # nothing visible at all
    kw = dict(position_buckets=8, max_relative_positions=32, attention_mask=mask)
    got = run_with_grads(attention.disentangled_attention, inputs, torch.float32, **kw)
    want = run_with_grads(reference.disentangled_attention, inputs, torch.float64, **kw)
    assert_close(got, want, TOL[torch.float32])
    padded_rows = ~mask.bool()[:, None, :].expand(3, 2, 50)
    assert (got[0][padded_rows] == 0).all(), "padded query rows must output exactly 0"
    for grad in got[1:4]:
        assert (grad[padded_rows] == 0).all(), "padded tokens must get zero gradients"


def test_matches_independent_naive_oracle(device):
    inputs = [t.double() for t in make_inputs(device, 1, 2, 70, 32, 8)]
    mask = torch.ones(1, 70, dtype=torch.long, device=device)
    mask[0, 60:] = 0
    kw = dict(position_buckets=8, max_relative_positions=32, attention_mask=mask)
    got = run_with_grads(attention.disentangled_attention, inputs, torch.float32, **kw)
    want = run_with_grads(naive_attention, inputs, torch.float64, **kw)
    assert_close(got, want, TOL[torch.float32])


def test_public_dispatch_runs_triton_path(monkeypatch, device):
    calls = []
    real = attention.disentangled_attention
    monkeypatch.setattr(attention, "disentangled_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, k, v, kr, qr = make_inputs(device, 1, 1, 20, 32, 8)
    out = kernels.disentangled_attention(q, k, v, kr, qr, position_buckets=8, max_relative_positions=32,
                                         impl="triton")
    assert calls == [1]
    want = reference.disentangled_attention(q, k, v, kr, qr, position_buckets=8, max_relative_positions=32)
    assert rel_l2(out, want) <= 1e-5


# --------------------------------------------------------------------------- packed form


def test_varlen_matches_reference_varlen(device):
    lengths = [5, 40, 1, 70]
    cu_seqlens = torch.tensor([0, 5, 45, 46, 116], dtype=torch.int32, device=device)
    total, heads, d = sum(lengths), 2, 32
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(total, heads, d, generator=gen) for _ in range(3)]
    inputs += [torch.randn(heads, 16, d, generator=gen), torch.randn(heads, 16, d, generator=gen)]
    inputs = [t.to(device) for t in inputs]
    kw = dict(cu_seqlens=cu_seqlens, max_seqlen=max(lengths), position_buckets=8, max_relative_positions=32)
    got = run_with_grads(attention.disentangled_attention_varlen, inputs, torch.float32, **kw)
    want = run_with_grads(reference.disentangled_attention_varlen, inputs, torch.float64, **kw)
    assert_close(got, want, TOL[torch.float32])


def test_varlen_rejects_bad_cu_seqlens(device):
    q = torch.randn(10, 1, 32, device=device)
    kw = dict(max_seqlen=10, position_buckets=8, max_relative_positions=32)
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        attention.disentangled_attention_varlen(q, q, q, cu_seqlens=torch.tensor([0, 6, 4, 10], device=device), **kw)
    with pytest.raises(ValueError, match="max_seqlen=4"):
        attention.disentangled_attention_varlen(q, q, q, cu_seqlens=torch.tensor([0, 6, 10], device=device),
                                                **{**kw, "max_seqlen": 4})


def test_rejects_unsupported_inputs(device):
    q = torch.randn(1, 1, 8, 24, device=device)
    with pytest.raises(ValueError, match="head dim d must be"):
        attention.disentangled_attention(q, q, q, position_buckets=8, max_relative_positions=32)
    q = torch.randn(1, 2, 8, 32, device=device)
    with pytest.raises(ValueError, match="pos_key must be"):
        attention.disentangled_attention(q, q, q, torch.randn(2, 10, 32, device=device), position_buckets=8,
                                         max_relative_positions=32)


# --------------------------------------------------------------------------- dropout

DROP = 0.25


def recover_keep_mask(device, batch, heads, n, seed):
    """The kernel's keep mask for (seed, shape): with q = k = 0 every row is uniform, and v = I
    makes out[i, j] = keep[i, j] / (n * (1 - p))."""
    zeros = torch.zeros(batch, heads, n, n, device=device)
    eye = torch.eye(n, device=device).expand(batch, heads, n, n).contiguous()
    torch.manual_seed(seed)
    out = attention.disentangled_attention(zeros, zeros, eye, position_buckets=8, max_relative_positions=32,
                                           dropout_p=DROP)
    scaled = out * n * (1 - DROP)
    keep = scaled.round()
    assert ((scaled - keep).abs() < 1e-4).all() and set(keep.unique().tolist()) <= {0.0, 1.0}
    return keep


def dropout_against_oracle(inputs, seed, **kwargs):
    """Output and gradients of the kernel with dropout ``DROP`` drawn from ``seed``, and of a float64 oracle
    that applies the kernel's own keep mask for that seed (``recover_keep_mask``); ``kwargs`` go to both.
    The pair to compare."""
    batch, heads, n, _ = inputs[0].shape
    device = inputs[0].device
    keep = recover_keep_mask(device, batch, heads, n, seed).double()
    eye = torch.eye(n, dtype=torch.float64, device=device).expand(batch, heads, n, n)

    def oracle(q, k, v, kr, qr):
        return (naive_attention(q, k, eye, kr, qr, **kwargs) * keep / (1 - DROP)) @ v

    def kernel(q, k, v, kr, qr):
        torch.manual_seed(seed)  # the kernel's seed comes from torch's global generator
        return attention.disentangled_attention(q, k, v, kr, qr, dropout_p=DROP, **kwargs)

    return run_with_grads(kernel, inputs, torch.float32), run_with_grads(oracle, inputs, torch.float64)


def test_dropout_keep_rate_and_seeding(device):
    batch, heads, n = 2, 2, 64
    keep = recover_keep_mask(device, batch, heads, n, seed=11)
    samples = keep.numel()
    std = (DROP * (1 - DROP) / samples) ** 0.5
    assert abs(keep.mean().item() - (1 - DROP)) < 5 * std
    # Rows and heads draw different masks (no repeated stream).
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0, 0], keep[0, 0, 1])
    assert torch.equal(keep, recover_keep_mask(device, batch, heads, n, seed=11)), "same seed, same mask"
    assert not torch.equal(keep, recover_keep_mask(device, batch, heads, n, seed=12)), "new seed, new mask"


def _lowbias32(x: torch.Tensor, last_shift: bool = True) -> torch.Tensor:
    """Wellons' lowbias32 on int64 tensors holding uint32 values (an implementation independent of the kernels')."""
    m = 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & m
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16) if last_shift else x


def test_the_keep_mask_is_the_documented_hash_of_seed_row_and_column(device):
    """Every bit of the kernel's keep mask is the documented draw (docs/kernels.md, ``scores._dropout_keep``):
    ``(i, j)`` of sequence ``s``, head ``h`` keeps iff lowbias32 of ``(i << 16) ^ j ^ mix32(seed + s*H + h)``
    without its last xor-shift is at least ``p * 2**32`` (the kernels split its first xor-shift into a row and a
    column part: the same bits)."""
    batch, heads, n, seed = 2, 3, 64, 5
    keep = recover_keep_mask(device, batch, heads, n, seed).cpu()
    torch.manual_seed(seed)
    kernel_seed = dropout_seed(DROP)  # as the kernel's call drew it
    streams = (kernel_seed + torch.arange(batch * heads)) & 0xFFFFFFFF
    key = _lowbias32(streams).view(batch, heads, 1, 1)
    i, j = torch.arange(n).view(n, 1), torch.arange(n).view(1, n)
    drawn = _lowbias32((i << 16) ^ j ^ key, last_shift=False)
    assert torch.equal(keep.bool(), drawn >= int(DROP * 2 ** 32))


def test_dropout_forward_and_backward_match_oracle_with_same_mask(device):
    inputs = [t.double() for t in make_inputs(device, 1, 2, 64, 32, 8)]
    got, want = dropout_against_oracle(inputs, 5, position_buckets=8, max_relative_positions=32)
    assert_close(got, want, TOL[torch.float32])

