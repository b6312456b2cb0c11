"""The judge's Hugging Face eager column (benchmarks/attention_recording.py ``record_hf_eager``): transformers'
``DisentangledSelfAttention`` recorded on fake tensors, op by op, with the bytes each pass moves. Asserted on
the shapes the issue judges: the N x N passes HF makes (two gathers of the c2p/p2c products, the mask's cast
and fill, softmax, dropout only when p > 0), their bytes against the sizes they must move, and the backward's
gather gradients (a zero-fill and a scatter_add each)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


_DISTAFF_BACKWARD = """
import json, sys
sys.path.insert(0, "benchmarks")
import attention_recording as rec
from distaff.kernels.aot.compile_check import launch_name
passes = rec.record_distaff(rec.Workload(512, 32, 64, 0.0, int(sys.argv[1])), keep_scores=sys.argv[2] == "keep")
print(json.dumps(dict(
    gemms=[(op.name, op.bytes, op.flops) for op in passes["bwd"].outside if op.name in ("bmm", "baddbmm_")],
    efficiency=passes["bwd"].gemm_efficiency, cublas=rec.CUBLAS_EFFICIENCY[int(sys.argv[1])], heads=rec.HEADS,
    dense={launch_name(k, kwargs): kwargs.get("DENSE") for k, _, kwargs, _ in passes["bwd"].launches},
    scores={launch_name(k, kwargs): kwargs.get("DENSE_SCORES") for k, _, kwargs, _ in passes["bwd"].launches})))
"""


@pytest.mark.integration
@pytest.mark.parametrize("cc,dense,keep", [(90, True, True), (90, True, False), (80, True, True), (100, False, True)])
def test_distaff_dense_backward_records_its_gemms_at_cublas_efficiency(cc, dense, keep) -> None:
    """At N = 512 the planner runs the dense position gradients on sm_80 and sm_90 and the fused ones on sm_100,
    and sm_80 and sm_90 read their scores densely (issue 47): the dense gradients' four GEMMs, and the dense
    scores' two where the forward did not keep them (``keep_scores`` off), are recorded as outside work, priced at
    cuBLAS's efficiency like HF eager's, each reading or writing a whole ``[H, tokens, 2k]`` bf16 buffer. Recorded
    as the judge records (real JIT kernels, not the interpreter: in a fresh process without
    ``TRITON_INTERPRET``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _DISTAFF_BACKWARD, str(cc), "keep" if keep else "recompute"],
                         cwd=BENCH.parent, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["dense"]["_attn_bwd_dq"] is dense and got["dense"]["_attn_bwd_dkdv"] is dense, got["dense"]
    scores = cc < 100  # sm_100 reads fused scores (planning.backward_scores_design)
    assert got["scores"]["_attn_bwd_dq"] is scores and got["scores"]["_attn_bwd_dkdv"] is scores, got["scores"]
    assert got["efficiency"] == got["cublas"]
    tokens, two_span, d = 512 * 32, 512, 64
    buffer = got["heads"] * tokens * two_span * 2
    assert len(got["gemms"]) == (4 if dense else 0) + (2 if scores and not keep else 0)
    assert all(nbytes >= buffer and flops == 2 * got["heads"] * tokens * two_span * d
               for _, nbytes, flops in got["gemms"])
    # In the model's layout dQ and dK take their position products in place (no separate sum pass): each
    # accumulating GEMM reads and writes its [B, H, N, d] gradient besides the buffer and the table.
    accumulating = [nbytes for name, nbytes, _ in got["gemms"] if name == "baddbmm_"]
    assert len(accumulating) == (2 if dense else 0)
    grad = tokens * got["heads"] * d * 2
    assert all(nbytes == buffer + 2 * grad + got["heads"] * two_span * d * 2 for nbytes in accumulating)


@pytest.mark.unit
def test_outside_work_charges_what_each_op_reads_and_writes() -> None:
    """The recorder's byte rule on fake tensors: an op reads its inputs and writes its output; in place it reads
    and writes its first argument (``add_``: three tensors' bytes), and an op that only overwrites it reads it
    not (``zero_``: one; ``copy_``: two); views cost nothing; a GEMM's FLOPs count in place too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rec = _recording()
    size = 1024 * 4  # one float32 [1024] tensor
    with FakeTensorMode():
        a, b = torch.empty(1024), torch.empty(1024)
        m = torch.empty(4, 8, 16)
        sink, syncs = [], []
        with rec._OutsideWork(sink, syncs):
            a + b
            a.add_(b)
            a.zero_()
            a.copy_(b)
            a.view(32, 32).t()
            m.baddbmm_(torch.empty(4, 8, 2), torch.empty(4, 2, 16))
    costs = {op.name: op for op in sink}
    assert [op.name for op in sink] == ["add", "add_", "zero_", "copy_", "baddbmm_"] and not syncs
    assert costs["add"].bytes == 3 * size and costs["add_"].bytes == 3 * size
    assert costs["zero_"].bytes == size and costs["copy_"].bytes == 2 * size
    assert costs["baddbmm_"].flops == 2 * 4 * 8 * 2 * 16
    assert costs["baddbmm_"].bytes == 4 * (2 * m.numel() + 4 * 8 * 2 + 4 * 2 * 16)


@pytest.mark.unit
def test_the_judge_hands_distaff_the_layout_the_model_does(monkeypatch) -> None:
    """The judge charges distaff for the q, k, v and output gradient a model layer gives the op: read off a real
    layer (``train/model/deberta.py``) on CPU, the strides the op sees equal ``_model_heads``' at the same shape."""
    from distaff.train.model import deberta
    from distaff.train.model.config import ModelConfig

    rec = _recording()
    heads, d, batch, n = rec.HEADS, 8, 2, 16
    cfg = ModelConfig(vocab_size=97, hidden_size=heads * d, num_hidden_layers=1, num_attention_heads=heads,
                      intermediate_size=64, max_position_embeddings=64, position_buckets=8, max_relative_positions=16,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    seen = {}
    attend = deberta.kernels.disentangled_attention

    def spy(q, k, v, *args, **kwargs):
        seen["qkv"] = [t.stride() for t in (q, k, v)]
        out = attend(q, k, v, *args, **kwargs)
        out.register_hook(lambda grad: seen.update(grad=grad.stride()))  # None: the gradient unchanged
        return out

    monkeypatch.setattr(deberta.kernels, "disentangled_attention", spy)
    layer = deberta.Layer(cfg).train()
    hidden = torch.randn(batch, n, cfg.hidden_size, requires_grad=True)
    out, _ = layer(hidden, torch.ones(batch, n, dtype=torch.long), torch.randn(2 * cfg.att_span, cfg.hidden_size))
    out.sum().backward()
    want = rec._model_heads(rec.Workload(n, batch, d, 0.0, 90)).stride()
    assert seen["qkv"] == [want] * 3 and seen["grad"] == want
