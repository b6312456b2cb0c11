"""No op reads a device value on the host (issue 30): the Triton host path of every op, forward and
backward, runs under ``FakeTensorMode``, where any ``.item()``, ``int(tensor)``, ``.tolist()``,
``bool(tensor)`` or data-dependent shape (``nonzero``) raises, and a dispatch mode counts any
``aten._local_scalar_dense`` (what each of those reads goes through). Kernel launches are recorded,
not run (the suite's interpreter tiles), so this needs no GPU; every launch the real call makes is planned.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode, is_fake
from torch.utils._python_dispatch import TorchDispatchMode

from distaff.kernels import attention, fused_layer_norm, gelu, mlm_loss
from distaff.kernels.aot.compile_check import launch_name

pytestmark = pytest.mark.unit

READS = {"_local_scalar_dense", "item", "nonzero", "equal", "is_nonzero"}


class _HostReads(TorchDispatchMode):
    """Records every operation that hands the value of one of the op's tensors to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Host planning reads real CPU tensors (the bucket table); only the op's own tensors are fake.
        if func.overloadpacket.__name__ in READS and any(is_fake(a) for a in args if isinstance(a, torch.Tensor)):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def planned_only():
    """Triton launches recorded (their count returned in the list), nothing run, host reads recorded."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches: list = []
    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(launch_name(self.fn, kwargs))

    for cls in originals:
        cls.run = record
    try:
        with FakeTensorMode(), _HostReads() as reads:
            yield launches, reads
    finally:
        for cls, run in originals.items():
            cls.run = run


def _grads(out: torch.Tensor, inputs: list) -> tuple:
    leaves = [t for t in inputs if t is not None and t.requires_grad]
    return torch.autograd.grad(out.float().sum(), leaves)


def _leaf(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype).requires_grad_()


ATTENTION = dict(position_buckets=256, max_relative_positions=512)


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("n", [200, 1100], ids=["no-tile-saturates", "saturated-tiles"])
def test_padded_attention_plans_forward_and_backward_without_reading_the_device(n, dropout_p) -> None:
    with planned_only() as (launches, reads):
        q, k, v = (_leaf(2, 4, n, 64) for _ in range(3))
        kr, qr = _leaf(4, 512, 64), _leaf(4, 512, 64)
        mask = torch.ones(2, n, dtype=torch.int64)
        out = attention.disentangled_attention(q, k, v, kr, qr, attention_mask=mask, dropout_p=dropout_p, **ATTENTION)
        grads = _grads(out, [q, k, v, kr, qr])
    assert reads.reads == []
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, kr.shape, qr.shape]
    assert {"_attn_fwd", "_attn_bwd_dq", "_attn_bwd_dkdv", "_attn_bwd_delta"} <= set(launches)
    assert ("_attn_end_terms" in launches) == (n > 512)  # only saturated tiles read the end terms


def test_packed_attention_checks_its_offsets_on_the_device() -> None:
    with planned_only() as (launches, reads):
        q, k, v = (_leaf(300, 4, 64) for _ in range(3))
        kr = _leaf(4, 512, 64)
        cu = torch.zeros(4, dtype=torch.int32)  # a fake tensor: its values cannot be read on the host
        out = attention.disentangled_attention_varlen(q, k, v, kr, None, cu_seqlens=cu, max_seqlen=128,
                                                      dropout_p=0.1, **ATTENTION)
        _grads(out, [q, k, v, kr])
    assert reads.reads == [] and "_attn_bwd_dq" in launches


def test_layer_norm_gelu_and_the_masked_lm_loss_read_nothing_back() -> None:
    with planned_only() as (launches, reads):
        x, res = _leaf(8, 16, 96), _leaf(8, 16, 96)
        w, b = _leaf(96, dtype=torch.float32), _leaf(96, dtype=torch.float32)
        _grads(fused_layer_norm.layer_norm(x, w, b, 1e-7, res), [x, res, w, b])
        bias = _leaf(96)
        _grads(gelu.bias_gelu(x, bias), [x, bias])
        rows, weight, vbias = _leaf(40, 96), _leaf(1000, 96), _leaf(1000)
        targets = torch.zeros(40, dtype=torch.int64)
        result = mlm_loss.masked_lm_loss(rows, weight, vbias, targets, ignore_index=None)
        _grads(result.loss, [rows, weight, vbias])
    assert reads.reads == []
    assert {"_layer_norm_forward", "_layer_norm_backward", "_bias_gelu_forward", "_bias_gelu_backward",
            "_cross_entropy_rows"} <= set(launches)


def test_the_harness_catches_a_host_read() -> None:
    """The check can fail: a device value read on the host (as the band planning once did) raises."""
    with pytest.raises(DataDependentOutputException), planned_only():
        int(torch.zeros(3, dtype=torch.int32).sum())
    with planned_only() as (_, reads), contextlib.suppress(Exception):
        torch.zeros(3).sum().item()
    assert reads.reads, "the dispatch mode saw no _local_scalar_dense"
