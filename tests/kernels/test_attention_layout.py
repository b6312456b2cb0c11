"""The memory layouts the Triton attention takes and gives (``contract.kernel_strides``, ``planning.plan``).

A model's q, k and v are its ``[B, N, H*d]`` projections viewed as ``[B, H, N, d]``; the kernels read them as
they lie (no copy in) and write the output and the gradients in the same layout (the output viewed back as
``[B, N, H*d]`` is no copy out). Any other layout is copied once into a contiguous one. The custom ops' fakes
must give exactly the strides the real ops return: a compiled graph takes the fake's strides for granted.
Run in the interpreter (fp32) against the float64 reference, values and all five gradients."""

from __future__ import annotations

import pytest
import torch
from test_attention_triton import TOL, assert_close, make_inputs, run_with_grads
from torch._subclasses.fake_tensor import FakeTensorMode

import distaff.kernels as kernels
from distaff.kernels import reference
from distaff.kernels.attention import planning
from distaff.kernels.attention.dense import HeadMajor
from distaff.kernels.attention.mask import mask_bits_reference
from distaff.kernels.contract import AttentionCall, kernel_strides

pytestmark = pytest.mark.unit

B, H, N, D, BUCKETS, MAX_REL = 2, 2, 24, 16, 8, 32
KW = dict(position_buckets=BUCKETS, max_relative_positions=MAX_REL)


def projection(t: torch.Tensor) -> torch.Tensor:
    """``t`` ([B, H, N, d]) as a model gives it: a ``[B, N, H*d]`` tensor viewed as ``[B, H, N, d]``."""
    return t.transpose(1, 2).contiguous().flatten(2).unflatten(-1, (H, -1)).transpose(1, 2)


def table_projection(t: torch.Tensor) -> torch.Tensor:
    """A position table ``[H, 2k, d]`` as a model gives it: a ``[2k, H*d]`` projection viewed as ``[H, 2k, d]``."""
    return t.transpose(0, 1).contiguous().flatten(1).unflatten(-1, (H, -1)).transpose(0, 1)


def fused_qkv_slice(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one third of a fused ``[B, N, 3, H, d]`` projection: not dense (every token skips the others)."""
    fused = torch.zeros(B, N, 3, H, D, dtype=t.dtype, device=t.device)
    fused[:, :, 1] = t.transpose(1, 2)
    return fused[:, :, 1].transpose(1, 2)


def head_dim_strided(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its head dim not contiguous: ``[B, H, d, N]`` memory viewed as ``[B, H, N, d]``."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


LAYOUTS = {"contiguous": lambda t: t.contiguous(), "projection": projection, "fused-qkv": fused_qkv_slice,
           "head-dim-strided": head_dim_strided}


def test_the_kernel_layout_keeps_dense_layouts_and_replaces_the_others() -> None:
    q = torch.randn(B, H, N, D)
    assert kernel_strides(projection(q)) == projection(q).stride() == (N * H * D, D, H * D, 1)
    assert kernel_strides(q) == q.stride()
    contiguous = q.contiguous().stride()
    assert kernel_strides(fused_qkv_slice(q)) == contiguous
    assert kernel_strides(head_dim_strided(q)) == contiguous
    one = torch.randn(1, N, H * D).unflatten(-1, (H, -1)).transpose(1, 2)  # a size-1 batch: any stride is dense
    assert kernel_strides(one) == one.stride()


def test_a_projection_layout_is_read_and_written_in_place() -> None:
    """No copy of q, k or v before the kernels, none for the dense products' head-major operands, and the
    output comes back in the projections' layout."""
    q, k, v, kr, qr = (projection(t) if t.dim() == 4 else t for t in make_inputs("cpu", B, H, N, D, BUCKETS))
    call = AttentionCall(q, k, v, kr, qr, BUCKETS, MAX_REL, 0.0, D ** -0.5)
    planned_q, planned_k, planned_v, _ = planning.plan(call)
    assert planned_q is q and planned_k is k and planned_v is v
    heads = HeadMajor(q, k)
    assert heads.q.data_ptr() == q.data_ptr() and heads.q._base is not None  # a view, not a copy
    out = kernels.disentangled_attention(q, k, v, kr, qr, impl="triton", **KW)
    assert out.stride() == q.stride()
    assert out.transpose(1, 2).flatten(2)._base is not None  # [B, N, H*d] without a copy


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_matches_the_reference_with_gradients(layout) -> None:
    inputs = make_inputs("cpu", B, H, N, D, BUCKETS)
    laid = [LAYOUTS[layout](t) if t.dim() == 4 else t for t in inputs]

    def laid_out(q, k, v, kr, qr):  # the leaves in the layout under test, the gradients flowing back through it
        return kernels.disentangled_attention(*(LAYOUTS[layout](t) for t in (q, k, v)), kr, qr, impl="triton", **KW)

    got = run_with_grads(laid_out, laid, torch.float32)
    want = run_with_grads(reference.disentangled_attention, inputs, torch.float64, **KW)
    assert_close(got, want, TOL[torch.float32])


def test_mixed_layouts_meet_in_one() -> None:
    q, k, v, kr, qr = make_inputs("cpu", B, H, N, D, BUCKETS)
    got = kernels.disentangled_attention(projection(q), k.contiguous(), fused_qkv_slice(v), kr, qr, impl="triton",
                                         **KW)
    want = reference.disentangled_attention(q.double(), k.double(), v.double(), kr.double(), qr.double(), **KW)
    assert (got.double() - want).abs().max() <= 1e-4


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_fakes_give_the_strides_the_ops_return(layout, impl) -> None:
    """``distaff::attention`` and ``distaff::attention_backward``: real and fake outputs share strides, the
    position tables as a model gives them (``[2k, H*d]`` projections viewed as ``[H, 2k, d]``)."""
    q, k, v, kr, qr = (LAYOUTS[layout](t) if t.dim() == 4 else table_projection(t)
                       for t in make_inputs("cpu", B, H, N, D, BUCKETS))
    scalars = (D ** -0.5, N, BUCKETS, MAX_REL, 0.0, False, True, impl)
    real = torch.ops.distaff.attention(q, k, v, kr, qr, None, None, None, *scalars)
    grad_out = projection(torch.randn(B, H, N, D))
    real_grads = torch.ops.distaff.attention_backward(grad_out, q, k, v, kr, qr, None, None, None, *real, *scalars)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_in = [mode.from_tensor(t) for t in (q, k, v, kr, qr, grad_out)]
        fake = torch.ops.distaff.attention(*fake_in[:5], None, None, None, *scalars)
        fake_saved = [mode.from_tensor(t) for t in real]
        fake_grads = torch.ops.distaff.attention_backward(fake_in[5], *fake_in[:5], None, None, None, *fake_saved,
                                                          *scalars)
    assert fake[0].stride() == real[0].stride()
    # the position scores the forward keeps (the interpreter plans sm_90's dense designs: kept with Triton)
    assert [t.shape for t in fake[4:]] == [t.shape for t in real[4:]]
    assert all(t.numel() > 0 for t in real[4:6]) == (impl == "triton")
    assert real[6].shape == (0,)        # no padding mask: no packed words
    for name, got, want in zip(("dq", "dk", "dv", "d_pos_key", "d_pos_query"), fake_grads, real_grads):
        assert got.shape == want.shape and got.stride() == want.stride(), name


def test_the_backward_op_reads_the_forwards_packed_mask_instead_of_packing_it_again(monkeypatch) -> None:
    """``distaff::attention`` returns the padding mask packed into words (``mask.mask_bits``, one launch) and
    ``distaff::attention_backward`` reads them: a forward and backward through the ops (what a compiled graph
    runs) packs once, not once a pass. The words are the mask's, the fake gives their shape, the gradients are
    those of a backward that packs the mask again (empty words), and words of another shape, or words without a
    mask, are refused."""
    q, k, v, kr, qr = make_inputs("cpu", B, H, N, D, BUCKETS)
    mask = torch.ones(B, N, dtype=torch.int64)
    mask[0, N - 5:], mask[1, 7:] = 0, 0
    packs, pack = [], planning.mask_bits
    monkeypatch.setattr(planning, "mask_bits", lambda *args: packs.append(args) or pack(*args))
    leaves = [t.clone().requires_grad_() for t in (q, k, v, kr, qr)]
    scalars = (D ** -0.5, N, BUCKETS, MAX_REL, 0.0, False, True, "triton")
    saved = torch.ops.distaff.attention(*leaves, mask, None, None, *scalars)
    grad_out = torch.randn_like(saved[0])
    grads = torch.autograd.grad(saved[0], leaves, grad_out)
    assert len(packs) == 1
    assert torch.equal(saved[-1], mask_bits_reference(mask, N))

    repacked = torch.ops.distaff.attention_backward(grad_out, q, k, v, kr, qr, mask, None, None,
                                                    *(t.detach() for t in saved[:-1]),
                                                    torch.empty(0, dtype=torch.int32), *scalars)
    assert len(packs) == 2
    for name, got, want in zip(("dq", "dk", "dv", "d_pos_key", "d_pos_query"), grads, repacked):
        assert torch.equal(got, want), name
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.ops.distaff.attention(q, k, v, kr, qr, mask, None, None, *scalars)
    assert fake[-1].shape == saved[-1].shape and fake[-1].dtype == torch.int32
    with pytest.raises(ValueError, match=r"mask_words must be the forward's packed mask \(int32 \(2, 2\)"):
        torch.ops.distaff.attention_backward(grad_out, q, k, v, kr, qr, mask, None, None,
                                             *(t.detach() for t in saved[:-1]), saved[-1][:1], *scalars)
    with pytest.raises(ValueError, match="mask_words must be empty without a padding mask"):
        torch.ops.distaff.attention_backward(grad_out, q, k, v, kr, qr, None, None, None,
                                             *(t.detach() for t in saved[:-1]), saved[-1], *scalars)


def test_a_model_layer_copies_no_activation_in_the_attention() -> None:
    """Forward and backward of the op on projection-layout inputs, the output viewed back as ``[B, N, H*d]``
    and its gradient arriving in that layout (what a model's output projection gives): no aten op copies a
    tensor of q's size (the dense products' GEMM operands included: both dense designs forced)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.copy_, torch.ops.aten.clone, torch.ops.aten._to_copy):
                if isinstance(out, torch.Tensor) and out.numel() == B * H * N * D:
                    self.seen.append(str(func))
            return out

    q, k, v, kr, qr = (projection(t) if t.dim() == 4 else t for t in make_inputs("cpu", B, H, N, D, BUCKETS))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    grad = torch.randn(B, N, H * D)
    with pytest.MonkeyPatch.context() as patch:
        for rule in ("forward_design", "backward_design", "backward_scores_design"):
            patch.setattr(planning, rule, lambda *args: "dense")
        with Copies() as copies:
            out = kernels.disentangled_attention(*leaves, kr, qr, impl="triton", **KW)
            torch.autograd.backward(out.transpose(1, 2).flatten(2), grad)
    assert copies.seen == [], copies.seen
    assert all(t.grad.stride() == q.stride() for t in leaves)
