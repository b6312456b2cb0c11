"""Triton fused residual-add + LayerNorm against the PyTorch reference run in float64."""

from __future__ import annotations

import pytest
import torch
from helpers import TRITON_DTYPES, assert_close

import distaff.kernels
from distaff.kernels import reference
from distaff.kernels.fused_layer_norm import layer_norm as triton_layer_norm
from distaff.kernels.gelu import reduction_programs

pytestmark = pytest.mark.unit

IMPLS = {"triton": triton_layer_norm, "reference": reference.layer_norm}
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float16: dict(rtol=5e-3, atol=5e-3),
             torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}
EPS = 1e-7  # released DeBERTa checkpoints


def _inputs(shape, dtype, with_residual, device):
    hidden = shape[-1]
    x = torch.randn(shape, device=device) * 2 + 0.5
    x.view(-1, hidden)[0] = 1.25  # a constant row: variance 0, so eps alone sets 1/std
    tensors = {"x": x, "weight": torch.randn(hidden, device=device), "bias": torch.randn(hidden, device=device)}
    if with_residual:
        tensors["residual"] = torch.randn(shape, device=device)
    return {name: t.to(dtype).requires_grad_() for name, t in tensors.items()}


def _run(impl, tensors, grad_out):
    out = IMPLS[impl](tensors["x"], tensors["weight"], tensors["bias"], EPS, tensors.get("residual"))
    out.backward(grad_out.to(out.dtype))
    return out, {name: t.grad for name, t in tensors.items()}


def _check(dtype, shape, with_residual, device):
    torch.manual_seed(shape[-1] + len(shape))
    tensors = _inputs(shape, dtype, with_residual, device)
    grad_out = torch.randn(shape, device=device)
    out, grads = _run("triton", tensors, grad_out)
    oracle = {name: t.detach().double().requires_grad_() for name, t in tensors.items()}
    expected, expected_grads = _run("reference", oracle, grad_out.to(dtype).double())
    assert out.dtype == dtype and out.shape == shape
    assert_close(out, expected, **TOLERANCE[dtype])
    assert set(grads) == set(expected_grads)
    for name, grad in grads.items():
        assert grad.dtype == dtype, name
        assert_close(grad, expected_grads[name], **TOLERANCE[dtype], what=name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [384, 768, 1024, 200])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "plain"])
def test_layer_norm_matches_reference(dtype, hidden, with_residual, device):
    # 7 rows: not a multiple of the backward's row ranges (2 programs under the interpreter: 4 + 3 rows).
    _check(dtype, (7, hidden), with_residual, device)


@pytest.mark.timeout(120)
def test_layer_norm_batched_shape_single_row_and_many_rows(device):
    _check(torch.float32, (2, 3, 200), True, device)
    _check(torch.float16, (1, 384), True, device)
    # More rows than backward programs on any device (4 per SM on a GPU), with a remainder.
    _check(torch.float32, (reduction_programs(1 << 20, device) + 3, 200), True, device)


def test_interpreter_backward_splits_rows_with_a_remainder():
    # The 7-row cases above rely on this: one program owns 4 rows, the other the remaining 3.
    assert reduction_programs(7, torch.device("cpu")) == 2


@pytest.mark.timeout(60)
def test_residual_in_a_wider_dtype_promotes_like_the_reference(device):
    torch.manual_seed(1)
    x = torch.randn(5, 200, device=device, dtype=torch.float16, requires_grad=True)
    residual = torch.randn(5, 200, device=device, requires_grad=True)
    weight, bias = torch.randn(200, device=device), torch.randn(200, device=device)
    out = triton_layer_norm(x, weight, bias, EPS, residual)
    expected = reference.layer_norm(x.double(), weight.double(), bias.double(), EPS, residual.double())
    assert out.dtype == torch.float32
    assert_close(out, expected, rtol=1e-4, atol=1e-5)
    out.sum().backward()
    assert x.grad.dtype == torch.float16 and residual.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad.float(), residual.grad, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("bad, message", [
    (dict(weight=torch.ones(199)), "weight must be"),
    (dict(bias=None), "needs a bias"),
    (dict(residual=torch.ones(3, 201)), "residual must have the shape"),
])
def test_bad_shapes_are_named(bad, message, device):
    args = dict(x=torch.ones(3, 200), weight=torch.ones(200), bias=torch.zeros(200), residual=None)
    args.update(bad)
    args = {name: None if t is None else t.to(device) for name, t in args.items()}
    with pytest.raises(ValueError, match=message):
        triton_layer_norm(args["x"], args["weight"], args["bias"], EPS, args["residual"])


def test_public_layer_norm_stays_callable_after_the_triton_module_is_imported(device):
    x, weight, bias = torch.randn(3, 200, device=device), torch.ones(200, device=device), torch.zeros(200, device=device)
    first = distaff.kernels.layer_norm(x, weight, bias, EPS, impl="triton")
    again = distaff.kernels.layer_norm(x, weight, bias, EPS, impl="triton")
    torch.testing.assert_close(again, first)
