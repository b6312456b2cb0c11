"""The ``distaff::`` custom ops check their own inputs (issue 41, cause 1): a bad shape, dtype, device or ``impl``
is refused, naming the argument, through every entry point: the public op (reference and Triton), the custom op
called directly (``torch.ops.distaff.*``, forward and backward, both implementations) and its fake implementation
under ``FakeTensorMode`` (what ``torch.compile`` traces; the compiled case is in ``compile_layer_cases.py``).
Before the checks, k and v of 4 tokens against q of 8 returned values up to 1.7e38, and a short weight, bias,
residual, position table or mask an output read past the end of a tensor; on a GPU, out-of-bounds reads.

Every refusal comes before any kernel runs, so the Triton implementation is exercised on CPU without the
interpreter ever starting.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import distaff.kernels as kernels

pytestmark = pytest.mark.unit

OPS = torch.ops.distaff
IMPLS = ("reference", "triton")
H, N, D = 2, 8, 16
SPAN = dict(position_buckets=8, max_relative_positions=16)       # 2 * span = 16 table rows


def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


def _attention_args(**bad) -> dict:
    args = dict(q=_t(1, H, N, D), k=_t(1, H, N, D), v=_t(1, H, N, D), pos_key=_t(H, 16, D), pos_query=_t(H, 16, D),
                mask=torch.ones(1, N, dtype=torch.long))
    args.update(bad)
    return args


ATTENTION_CASES = {
    "k of 4 tokens against q of 8": (dict(k=_t(1, H, 4, D)), "k must have the shape of q"),
    "v of another head count": (dict(v=_t(1, 1, N, D)), "v must have the shape of q"),
    "a short position table": (dict(pos_key=_t(H, 8, D)), r"pos_key must be \[H, 2\*span, d\]"),
    "a short mask": (dict(mask=torch.ones(1, 4, dtype=torch.long)), r"attention_mask must be \[B, N\]"),
    "k in another dtype": (dict(k=_t(1, H, N, D, dtype=torch.float64)), "k must have the dtype of q"),
    "v on another device": (dict(v=_t(1, H, N, D, device="meta")), "v is on meta but q is on cpu"),
    "integer q": (dict(q=torch.ones(1, H, N, D, dtype=torch.long), k=torch.ones(1, H, N, D, dtype=torch.long),
                       v=torch.ones(1, H, N, D, dtype=torch.long)), "q must be a floating-point tensor"),
}


def _op_attention(a: dict, impl: str):
    return OPS.attention(a["q"], a["k"], a["v"], a["pos_key"], a["pos_query"], a["mask"], None, None, 0.1, 0, 8, 16,
                         0.0, False, True, impl)


def _public_attention(a: dict, impl: str):
    return kernels.disentangled_attention(a["q"], a["k"], a["v"], a["pos_key"], a["pos_query"],
                                          attention_mask=a["mask"], impl=impl, **SPAN)


def _fake(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``'s shape, dtype and device as a tensor of the active FakeTensorMode."""
    return None if t is None else torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _on_meta(args: dict) -> bool:
    """Whether a tensor is on another device (``meta``): the public ops' reference path would run torch on it."""
    return any(t is not None and t.device.type == "meta" for t in args.values())


@contextlib.contextmanager
def _fake_or_not(fake: bool):
    with FakeTensorMode() if fake else contextlib.nullcontext():
        yield


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_attention_refuses_bad_inputs_on_every_path(case):
    bad, message = ATTENTION_CASES[case]
    for impl in IMPLS:
        with pytest.raises((ValueError, TypeError), match=message):
            _op_attention(_attention_args(**bad), impl)                 # the custom op, called directly
        if not _on_meta(bad):
            with pytest.raises((ValueError, TypeError), match=message):
                _public_attention(_attention_args(**bad), impl)         # the public op (eager)
    with FakeTensorMode(), pytest.raises((ValueError, TypeError), match=message):
        fake = {name: _fake(t) for name, t in _attention_args(**bad).items()}
        _op_attention(fake, "triton")                                   # what torch.compile traces


def test_the_attention_backward_op_refuses_a_gradient_of_another_shape():
    for fake in (False, True):
        with _fake_or_not(fake), pytest.raises(ValueError, match="grad_out must be the shape of q"):
            a = _attention_args()
            out, lse, end, seed, *kept = _op_attention(a, "reference")
            OPS.attention_backward(_t(1, H, 4, D), a["q"], a["k"], a["v"], a["pos_key"], a["pos_query"], a["mask"],
                                   None, None, out, lse, end, seed, *kept, 0.1, 0, 8, 16, 0.0, False, True,
                                   "reference")
    a = _attention_args()
    out, lse, end, seed, *kept = _op_attention(a, "reference")
    with pytest.raises(ValueError, match="lse must be the forward's row statistics"):
        OPS.attention_backward(_t(1, H, N, D), a["q"], a["k"], a["v"], a["pos_key"], a["pos_query"], a["mask"],
                               None, None, out, _t(3), _t(4, 1, H, N), seed, *kept, 0.1, 0, 8, 16, 0.0, False, True,
                               "triton")


def test_packed_attention_refuses_a_mask_and_bad_offsets():
    q = _t(10, H, D)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="attention_mask must be None in the packed form"):
        OPS.attention(q, q, q, None, None, torch.ones(2, 10), cu, None, 0.1, 6, 8, 16, 0.0, False, True, "reference")
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to total_tokens=10"):
        OPS.attention(q, q, q, None, None, None, torch.tensor([0, 4, 12], dtype=torch.int32), None, 0.1, 8, 8, 16,
                      0.0, False, True, "reference")
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D int32/int64 tensor"):
        OPS.attention(q, q, q, None, None, None, cu.float(), None, 0.1, 6, 8, 16, 0.0, False, True, "triton")
    with pytest.raises(ValueError, match="k must have the shape of q"):
        kernels.disentangled_attention_varlen(q, q[:9], q, cu_seqlens=cu, max_seqlen=6, impl="reference", **SPAN)


@pytest.mark.parametrize("impl", ["cuda", "auto", "Triton", ""])
def test_an_unknown_impl_is_refused_not_run_as_triton(impl):
    calls = [lambda: _op_attention(_attention_args(), impl),
             lambda: OPS.layer_norm(_t(3, 16), _t(16), _t(16), 1e-5, None, impl),
             lambda: OPS.bias_gelu(_t(3, 16), _t(16), impl),
             lambda: OPS.masked_lm_loss(_t(3, 16), _t(40, 16), None, torch.zeros(3, dtype=torch.long), None, 64, 64,
                                        [False] * 3, impl)]
    for call in calls:
        for fake in (False, True):
            with _fake_or_not(fake), pytest.raises(ValueError, match=r"impl must be one of \('triton', 'reference'\)"):
                call()


LAYER_NORM_CASES = {
    "a short weight": (dict(weight=_t(8)), r"weight must be \[16\]"),
    "a short bias": (dict(bias=_t(15)), r"bias must be \[16\]"),
    "a short residual": (dict(residual=_t(2, 16)), "residual must have the shape of x"),
    "a weight on another device": (dict(weight=_t(16, device="meta")), "weight is on meta but x is on cpu"),
    "integer x": (dict(x=torch.ones(3, 16, dtype=torch.long)), "x must be a floating-point tensor"),
}


@pytest.mark.parametrize("case", sorted(LAYER_NORM_CASES))
def test_layer_norm_refuses_bad_inputs_on_every_path(case):
    bad, message = LAYER_NORM_CASES[case]
    a = dict(x=_t(3, 16), weight=_t(16), bias=_t(16), residual=None, **{})
    a.update(bad)
    for impl in IMPLS:
        with pytest.raises((ValueError, TypeError), match=message):
            OPS.layer_norm(a["x"], a["weight"], a["bias"], 1e-5, a["residual"], impl)
        with pytest.raises((ValueError, TypeError), match=message):
            OPS.layer_norm_backward(_t(3, 16), a["x"], a["weight"], a["bias"], 1e-5, a["residual"], _t(3), _t(3),
                                    impl)
    if not _on_meta(a):
        with pytest.raises((ValueError, TypeError), match=message):     # the public Triton op (eager)
            kernels.layer_norm(a["x"], a["weight"], a["bias"], 1e-5, a["residual"], impl="triton")
    with FakeTensorMode(), pytest.raises((ValueError, TypeError), match=message):
        fake = {name: _fake(t) for name, t in a.items()}
        OPS.layer_norm(fake["x"], fake["weight"], fake["bias"], 1e-5, fake["residual"], "triton")


def test_layer_norm_backward_refuses_a_short_gradient_or_row_statistics():
    x, w, b = _t(3, 16), _t(16), _t(16)
    with pytest.raises(ValueError, match="grad_out must be the shape of x"):
        OPS.layer_norm_backward(_t(2, 16), x, w, b, 1e-5, None, _t(3), _t(3), "reference")
    with pytest.raises(ValueError, match="mean must be one float32 per row of x"):
        OPS.layer_norm_backward(_t(3, 16), x, w, b, 1e-5, None, _t(2), _t(3), "triton")
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        OPS.layer_norm(x, w, b, float("nan"), None, "reference")


def test_bias_gelu_refuses_a_short_bias_and_gradient_on_every_path():
    x = _t(3, 16)
    for impl in IMPLS:
        with pytest.raises(ValueError, match=r"bias must be \[16\]"):
            OPS.bias_gelu(x, _t(4), impl)
        with pytest.raises(ValueError, match="grad_out must be the shape of x"):
            OPS.bias_gelu_backward(_t(2, 16), x, _t(16), impl)
    with pytest.raises(ValueError, match=r"bias must be \[16\]"):
        kernels.bias_gelu(x, _t(4), impl="triton")
    with FakeTensorMode(), pytest.raises(ValueError, match=r"bias must be \[16\]"):
        OPS.bias_gelu(_t(3, 16), _t(4), "triton")


MLM_CASES = {
    "float labels": (dict(labels=_t(5)), "labels must be an integer tensor"),
    "labels of another shape": (dict(labels=torch.zeros(4, dtype=torch.long)), r"labels shape \(4,\) does not match"),
    "a weight of another width": (dict(weight=_t(40, 8)), r"weight must be \[vocab, 16\]"),
    "a short bias": (dict(bias=_t(39)), r"bias must be \[vocab=40\]"),
    "labels on another device": (dict(labels=torch.zeros(5, dtype=torch.long, device="meta")),
                                 "labels is on meta but hidden is on cpu"),
}


@pytest.mark.parametrize("case", sorted(MLM_CASES))
def test_the_masked_lm_loss_refuses_bad_inputs_on_every_path(case):
    bad, message = MLM_CASES[case]
    a = dict(hidden=_t(5, 16), weight=_t(40, 16), bias=_t(40), labels=torch.randint(0, 40, (5,)))
    a.update(bad)
    for impl in IMPLS:
        with pytest.raises((ValueError, TypeError), match=message):
            OPS.masked_lm_loss(a["hidden"], a["weight"], a["bias"], a["labels"], None, 64, 64, [True] * 3, impl)
        if not _on_meta(a):
            with pytest.raises((ValueError, TypeError), match=message):
                kernels.masked_lm_loss(a["hidden"], a["weight"], a["bias"], a["labels"], None, impl=impl)
    with FakeTensorMode(), pytest.raises((ValueError, TypeError), match=message):
        fake = {name: _fake(t) for name, t in a.items()}
        OPS.masked_lm_loss(fake["hidden"], fake["weight"], fake["bias"], fake["labels"], None, 64, 64, [True] * 3,
                           "triton")


def test_the_triton_masked_lm_loss_op_takes_one_dtype_and_a_valid_tiling():
    hidden, labels = _t(5, 16), torch.randint(0, 40, (5,))
    with pytest.raises(TypeError, match="weight must have the dtype of hidden"):
        OPS.masked_lm_loss(hidden, _t(40, 16, dtype=torch.float64), None, labels, None, 64, 64, [False] * 3, "triton")
    with pytest.raises(ValueError, match="vocab_block a power of two"):
        OPS.masked_lm_loss(hidden, _t(40, 16), None, labels, None, 64, 48, [False] * 3, "triton")


def test_valid_inputs_still_pass_every_check():
    """The checks can pass: the ops run on good inputs (reference) and trace under FakeTensorMode (Triton)."""
    a = _attention_args()
    out = _op_attention(a, "reference")[0]
    torch.testing.assert_close(out, kernels.disentangled_attention(a["q"], a["k"], a["v"], a["pos_key"], a["pos_query"],
                                                                   attention_mask=a["mask"], softmax_scale=0.1,
                                                                   impl="reference", **SPAN))
    with FakeTensorMode():
        fake = {name: _fake(t) for name, t in a.items()}
        assert _op_attention(fake, "triton")[0].shape == (1, H, N, D)
        assert OPS.layer_norm(_t(3, 16), _t(16), _t(16), 1e-5, None, "triton")[1].shape == (3,)
