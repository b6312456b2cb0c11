"""``torch.compile(fullgraph=True)`` of a DeBERTa layer through the fused ops (issue 30): the ``distaff::``
custom ops trace with no graph break (fullgraph raises on one), the compiled layer's output and every
parameter gradient equal eager's, and the MLM loss compiles too; so does a user's Hugging Face model with the
kernels patched in. Both implementations run inside the ops, on CPU the Triton one through the interpreter;
``aot_eager`` traces forward and backward (AOT autograd) without generating code.
"""

from __future__ import annotations

import copy

import pytest
import torch

import distaff.kernels as kernels
from distaff.train.model.config import ModelConfig
from distaff.train.model.deberta import DebertaForMaskedLM, Layer

pytestmark = pytest.mark.unit

# Both implementations run inside the ops, the Triton one through the interpreter on CPU. (Its crashes there, once
# put down to the interpreter, came from a second registration of the ops: kernels/__init__.py.)
IMPLS = ["reference", "triton"]

CONFIG = dict(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
              max_position_embeddings=64, position_buckets=8, max_relative_positions=16, hidden_dropout_prob=0.0,
              attention_probs_dropout_prob=0.0)


def _inputs(cfg: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 20, cfg.hidden_size, generator=gen)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, 13:] = 0
    rel = torch.randn(2 * cfg.att_span, cfg.hidden_size, generator=gen)
    return hidden.to(device), mask.to(device), rel.to(device)


def _run(layer: Layer, hidden, mask, rel) -> tuple[torch.Tensor, list]:
    hidden, rel = hidden.clone().requires_grad_(), rel.clone().requires_grad_()
    out, _ = layer(hidden, mask, rel)
    loss = (out * torch.linspace(-1, 1, out.shape[-1], device=out.device)).square().sum()
    grads = torch.autograd.grad(loss, [hidden, rel, *layer.parameters()])
    return out, list(grads)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_layer_compiles_whole_and_matches_eager(impl, device) -> None:
    """``triton``: the Triton implementation inside the ops."""
    torch._dynamo.reset()
    cfg = ModelConfig(**CONFIG, attention_impl=impl, kernel_impl=impl)
    torch.manual_seed(0)
    layer = Layer(cfg).train().to(device)
    compiled = torch.compile(copy.deepcopy(layer), fullgraph=True, backend="aot_eager")
    inputs = _inputs(cfg, device)
    want_out, want_grads = _run(layer, *inputs)
    got_out, got_grads = _run(compiled, *inputs)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_graph_holds_the_custom_ops_and_no_break(device) -> None:
    torch._dynamo.reset()
    cfg = ModelConfig(**CONFIG)
    layer = Layer(cfg).train().to(device)
    explanation = torch._dynamo.explain(layer)(*_inputs(cfg, device))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    code = explanation.graphs[0].code
    for op in ("distaff.attention", "distaff.layer_norm", "distaff.bias_gelu"):
        assert op in code, f"{op} is not in the traced graph"


_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.transpose.int,
          torch.ops.aten.permute.default, torch.ops.aten.t.default, torch.ops.aten.unsqueeze.default}
_COPIES = {torch.ops.aten.clone.default, torch.ops.aten._to_copy.default, torch.ops.aten.copy.default,
           torch.ops.aten.copy_.default}


def _through_views(node):
    """The node a chain of views starts from."""
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return node


def test_a_compiled_layer_copies_no_activation_into_or_out_of_the_attention(device) -> None:
    """The attention takes q, k and v as the projections' views and gives its output and dq, dk, dv in that layout
    (docs/kernels.md, "Memory layout"); compiled, the graph must not copy them either: no copy between a projection
    and the op, none between the backward op's dq, dk, dv and the projections' backward. (The ops' wrapper made q, k
    and v contiguous: four copies in the forward (q, k and v in, the output out) and three in the backward (dq, dk,
    dv), each the size of the hidden states; the ops are tagged ``needs_exact_strides`` so a compiled graph hands
    them the strides their fakes saw.)"""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _example_inputs):
        graphs.append(gm.graph)
        return gm.forward

    torch._dynamo.reset()
    cfg = ModelConfig(**CONFIG)
    layer = Layer(cfg).train().to(device)
    compiled = torch.compile(layer, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    _run(compiled, *_inputs(cfg, device))
    forward, backward = graphs
    (attention,) = [n for n in forward.nodes if n.target is torch.ops.distaff.attention.default]
    assert [_through_views(a).target for a in attention.args[:3]] == [torch.ops.aten.addmm.default] * 3
    (gradients,) = [n for n in backward.nodes if n.target is torch.ops.distaff.attention_backward.default]
    copied = [n for n in backward.nodes if n.target in _COPIES
              and _through_views(n.args[0]).args[:2] in ((gradients, 0), (gradients, 1), (gradients, 2))]
    assert copied == [], [str(n) for n in copied]
    output = [n for n in forward.nodes if n.target in _COPIES and _through_views(n.args[0]).args[:2] == (attention, 0)]
    assert output == [], [str(n) for n in output]


def test_the_masked_lm_loss_on_selected_rows_compiles_whole(device) -> None:
    torch._dynamo.reset()
    cfg = ModelConfig(**CONFIG)
    model = DebertaForMaskedLM(cfg).to(device)
    gen = torch.Generator().manual_seed(2)
    rows = torch.randn(7, cfg.hidden_size, generator=gen).to(device).requires_grad_()
    targets = torch.randint(0, cfg.vocab_size, (7,), generator=gen).to(device)

    def loss_of(rows, targets):
        result = model.labelled_loss(model.lm_head.transform(rows), targets)
        return result.loss, result.num_correct

    compiled = torch.compile(loss_of, fullgraph=True, backend="aot_eager")
    (want, want_correct), (got, got_correct) = loss_of(rows, targets), compiled(rows, targets)
    torch.testing.assert_close(got, want)
    assert int(got_correct) == int(want_correct)
    torch.testing.assert_close(torch.autograd.grad(got, rows)[0], torch.autograd.grad(want, rows)[0])


@pytest.mark.parametrize("impl", IMPLS)
def test_opcheck_passes_for_every_op(impl, device) -> None:
    """Schema, fake implementation, autograd registration and AOT dispatch agree with the real op (the fake's
    outputs, shapes and strides, with the real op's: the end terms' one-element stand-in where no tile saturates)."""
    gen = torch.Generator().manual_seed(3)

    def t(*shape, grad=True):
        return torch.randn(*shape, generator=gen).to(device).requires_grad_(grad)

    q, k, v, kr, qr = t(1, 2, 8, 16), t(1, 2, 8, 16), t(1, 2, 8, 16), t(2, 16, 16), t(2, 16, 16)
    mask = torch.ones(1, 8, dtype=torch.long, device=device)
    cases = [
        (torch.ops.distaff.attention, (q, k, v, kr, qr, mask, None, None, 0.1, 0, 8, 16, 0.0, False, True, impl)),
        (torch.ops.distaff.layer_norm, (t(3, 16), t(16), t(16), 1e-5, t(3, 16), impl)),
        (torch.ops.distaff.bias_gelu, (t(3, 16), t(16), impl)),
        (torch.ops.distaff.masked_lm_loss, (t(5, 16), t(40, 16), t(40), torch.randint(0, 40, (5,), generator=gen).to(device),
                                            None, 64, 64, [True, True, True], impl)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_public_ops_keep_their_signatures() -> None:
    for name in ("disentangled_attention", "disentangled_attention_varlen", "layer_norm", "bias_gelu",
                 "masked_lm_loss"):
        op = getattr(kernels, name)
        assert op.__wrapped__ is getattr(kernels.reference, name)


def test_a_compiled_graph_refuses_bad_inputs_to_the_ops(device) -> None:
    """The ops check their inputs while torch.compile traces them (the fake implementation), so a compiled graph
    with k of 4 tokens against q of 8, or a short LayerNorm weight, fails naming it instead of reading past the end
    (issue 41; every other path: tests/kernels/test_op_contract.py)."""
    q, k = torch.randn(1, 2, 8, 16, device=device), torch.randn(1, 2, 4, 16, device=device)
    table = torch.randn(2, 16, 16, device=device)

    def direct(q, k):
        return torch.ops.distaff.attention(q, k, k, table, table, None, None, None, 0.1, 0, 8, 16, 0.0, False,
                                           True, "reference")[0]

    def public(q, k):
        return kernels.disentangled_attention(q, k, k, table, table, position_buckets=8, max_relative_positions=16)

    def layer_norm(x):
        return kernels.layer_norm(x, torch.ones(8, device=x.device), torch.zeros(8, device=x.device), 1e-5)

    for fn, args, message in ((direct, (q, k), "k must have the shape of q"), (public, (q, k), "k must have the shape"),
                              (layer_norm, (torch.randn(3, 16, device=device),), r"weight must be \[16\]")):
        with pytest.raises(Exception, match=message):
            torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
        torch._dynamo.reset()


def test_a_patched_hugging_face_model_compiles_to_one_graph_with_the_kernel_in_every_layer() -> None:
    """``torch.compile(fullgraph=True)`` of a ``transformers`` DeBERTa-v2 model patched by ``apply_distaff_kernels``,
    on a padded batch: one graph (the host read by which the patched attention once told a padding mask from another
    pair mask broke it at every layer), a ``distaff::attention`` op in each of the two layers, and the unpatched
    model's outputs on the real tokens."""
    transformers = pytest.importorskip("transformers")
    from distaff.train.model.hf_kernels import apply_distaff_kernels
    from test_hf_kernels import _batch, _config

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = transformers.DebertaV2Model(_config()).eval()
    patched = copy.deepcopy(model)
    apply_distaff_kernels(patched, impl="reference")
    ids, mask = _batch()
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        got = torch.compile(patched, backend=recording, fullgraph=True)(input_ids=ids, attention_mask=mask)
    ops = [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert len(graphs) == 1 and ops.count("distaff.attention.default") == 2, (len(graphs), ops)
    real = mask.bool()
    torch.testing.assert_close(got.last_hidden_state[real], want[real])
