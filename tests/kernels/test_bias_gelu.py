"""Triton fused bias-add + erf GELU against the PyTorch reference run in float64."""

from __future__ import annotations

import pytest
import torch
from helpers import TRITON_DTYPES, assert_close

import distaff.kernels
from distaff.kernels import reference
from distaff.kernels.gelu import BLOCK_M, bias_gelu

pytestmark = pytest.mark.unit

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float16: dict(rtol=2e-3, atol=2e-3),
             torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _check(shape, device, dtype, bias_dtype=None):
    torch.manual_seed(shape[-1] * 31 + shape[0])
    x = (torch.randn(shape, device=device) * 3).to(dtype).requires_grad_()
    bias = torch.randn(shape[-1], device=device).to(bias_dtype or dtype).requires_grad_()
    out = distaff.kernels.bias_gelu(x, bias, impl="triton")
    grad_out = torch.randn(shape, device=device).to(out.dtype)
    out.backward(grad_out)

    x64, bias64 = (t.detach().double().requires_grad_() for t in (x, bias))
    expected = reference.bias_gelu(x64, bias64)
    expected.backward(grad_out.double())
    assert out.dtype == torch.promote_types(x.dtype, bias.dtype) and out.shape == x.shape
    tol = TOLERANCE[dtype]
    assert_close(out, expected, **tol)
    assert x.grad.dtype == x.dtype and bias.grad.dtype == bias.dtype
    assert_close(x.grad, x64.grad, **tol, what="grad of x")
    # The bias gradient sums every row: compare relative to the size of that sum.
    assert_close(bias.grad, bias64.grad, rtol=tol["rtol"], atol=tol["atol"] * shape[0] ** 0.5, what="grad of bias")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [384, 768, 1024, 200])
def test_bias_gelu_matches_reference(dtype, hidden, device):
    # 37 rows: three row tiles of 16, the last partial, split over two backward programs (2 + 1 tiles).
    assert 37 % BLOCK_M != 0 and 37 > 2 * BLOCK_M
    _check((37, hidden), device, dtype)


@pytest.mark.timeout(120)
def test_bias_gelu_feed_forward_shape_and_mixed_dtypes(device):
    _check((2, 3, 3072), device, torch.float32)          # DeBERTa-base intermediate size, batched
    _check((5, 200), device, torch.float16, torch.float32)  # fp32 bias promotes like x + bias


def test_bias_gelu_is_exact_erf_not_tanh(device):
    # At u = -3 the tanh approximation is off by ~4e-4; the erf form matches the closed form.
    x = torch.tensor([[-3.0, 0.0, 1.0]], device=device)
    out = bias_gelu(x, torch.zeros(3, device=device))
    u = x.double()
    exact = 0.5 * u * (1 + torch.erf(u / 2 ** 0.5))
    assert_close(out, exact, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bias", [torch.zeros(199), None])
def test_bias_of_the_wrong_shape_is_named(bias, device):
    with pytest.raises(ValueError, match="bias must be"):
        bias_gelu(torch.ones(3, 200, device=device), None if bias is None else bias.to(device))
