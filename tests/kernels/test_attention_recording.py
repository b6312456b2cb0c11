"""The judge's Hugging Face eager column (benchmarks/attention_recording.py ``record_hf_eager``): transformers'
``DisentangledSelfAttention`` recorded on fake tensors, op by op, with the bytes each pass moves. Asserted on
the shapes the issue judges: the N x N passes HF makes (two gathers of the c2p/p2c products, the mask's cast
and fill, softmax, dropout only when p > 0), their bytes against the sizes they must move, and the backward's
gather gradients (a zero-fill and a scatter_add each)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _recording():
    """The sibling script as a module (its dataclasses need it in ``sys.modules``)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("attention_recording")


@pytest.mark.unit
def test_hf_eager_is_recorded_pass_by_pass_with_its_bytes() -> None:
    pytest.importorskip("transformers")
    rec = _recording()
    n, batch = 512, 32
    scores = batch * rec.HEADS * n * n * 2                       # one bf16 N x N tensor of every head
    for dropout in (0.0, 0.1):
        passes = rec.record_hf_eager(rec.Workload(n, batch, 64, dropout, 90))
        fwd = [op.name for op in passes["fwd"].outside]
        bwd = [op.name for op in passes["bwd"].outside]
        assert fwd.count("bmm") == 4 and bwd.count("bmm") == 8  # QK^T, c2p, p2c, PV; two per product back
        assert fwd.count("gather") == 2 and bwd.count("scatter_add") == 2
        assert fwd.count("_softmax") == 1 and bwd.count("_softmax_backward_data") == 1
        assert fwd.count("native_dropout") == (2 if dropout else 0)  # the probabilities and the position rows
        gather = next(op for op in passes["fwd"].outside if op.name == "gather")
        # reads a [B*H, N, 2k] product (2k = 512 here: as big as the scores) and writes the scores; its index is
        # a broadcast view of one N x N table, read once
        assert gather.bytes == pytest.approx(2 * scores + n * n * 8)
        cast = next(op for op in passes["fwd"].outside if op.name == "_to_copy" and op.bytes > 0)
        assert cast.bytes == batch * n * n * (8 + 1)  # the int64 [B, 1, N, N] mask to bool
        assert all(op.flops == 0 for op in passes["fwd"].outside if op.name != "bmm")
        assert passes["fwd"].gemm_efficiency == rec.CUBLAS_EFFICIENCY[90] and not passes["fwd"].launches
