"""distaff's kernels patched into users' own Hugging Face DeBERTa-v2 models: outputs and gradients
equal the unpatched model (fp32), through the reference path and the Triton interpreter, and the
HF ``Trainer`` trains a patched model."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import DebertaV2Config

from distaff.train.model.hf_kernels import PatchReport, apply_distaff_kernels

HEADS = ["DebertaV2Model", "DebertaV2ForMaskedLM", "DebertaV2ForSequenceClassification",
         "DebertaV2ForTokenClassification", "DebertaV2ForQuestionAnswering"]


def _config(**overrides) -> DebertaV2Config:
    settings = dict(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=96,
                    max_position_embeddings=64, relative_attention=True, position_buckets=8,
                    max_relative_positions=32, pos_att_type=["p2c", "c2p"], share_att_key=True,
                    norm_rel_ebd="layer_norm", position_biased_input=False, num_labels=3, pad_token_id=0)
    return DebertaV2Config(**{**settings, **overrides})


def _batch(n: int = 40):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 120, (2, n), generator=gen)
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, n - 9:] = 0  # a padded sequence
    return ids, mask


def _outputs_and_grads(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask)
    first = out[0]
    real = mask.bool() if first.dim() == 3 or first.shape[:2] == mask.shape else None
    value = first[real] if real is not None else first
    value.pow(2).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return value.detach(), grads


# The Triton interpreter runs every program in Python: those cases belong to the slower tier.
CASES = [pytest.param(head, "reference", marks=pytest.mark.unit) for head in HEADS] + [
    pytest.param(head, "triton", marks=pytest.mark.integration) for head in HEADS]


@pytest.mark.parametrize("head,impl", CASES)
def test_patched_model_matches_hugging_face(head: str, impl: str) -> None:
    torch.manual_seed(0)
    model = getattr(transformers, head)(_config(num_labels=2 if "Question" in head else 3)).eval()
    patched = copy.deepcopy(model)
    report = apply_distaff_kernels(patched, impl=impl)
    assert (report.attention, report.layer_norm, report.gelu) == (2, 4, 2)
    ids, mask = _batch()
    want, want_grads = _outputs_and_grads(model, ids, mask)
    got, got_grads = _outputs_and_grads(patched, ids, mask)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.unit
@pytest.mark.parametrize("overrides", [dict(share_att_key=False), dict(pos_att_type=["c2p"]),
                                       dict(relative_attention=False, position_biased_input=True)],
                         ids=["own-position-projections", "c2p-only", "absolute-positions"])
def test_patched_variants_match(overrides: dict) -> None:
    torch.manual_seed(0)
    model = transformers.DebertaV2ForMaskedLM(_config(**overrides)).eval()
    patched = copy.deepcopy(model)
    apply_distaff_kernels(patched, impl="reference")
    ids, mask = _batch()
    torch.testing.assert_close(_outputs_and_grads(patched, ids, mask)[0], _outputs_and_grads(model, ids, mask)[0],
                               atol=1e-4, rtol=1e-4)


@pytest.mark.unit
def test_what_the_kernel_cannot_express_falls_back_to_hugging_face() -> None:
    torch.manual_seed(0)
    model = transformers.DebertaV2Model(_config()).eval()
    patched = copy.deepcopy(model)
    apply_distaff_kernels(patched, impl="reference")
    ids, mask = _batch()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        got = patched(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert got.attentions is not None and len(got.attentions) == 2
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state)
    assert apply_distaff_kernels(patched) == PatchReport()  # patching twice changes nothing
    with pytest.raises(TypeError, match="no DeBERTa-v2 attention"):
        apply_distaff_kernels(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="impl must be one of"):
        apply_distaff_kernels(model, impl="cuda")


@pytest.mark.integration
def test_hugging_face_trainer_trains_a_patched_model(tmp_path) -> None:
    torch.manual_seed(0)
    model = transformers.DebertaV2ForSequenceClassification(_config())
    apply_distaff_kernels(model, impl="reference")
    ids, mask = _batch()
    rows = [{"input_ids": ids[i % 2], "attention_mask": mask[i % 2], "labels": torch.tensor(i % 3)} for i in range(8)]
    before = model.classifier.weight.detach().clone()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
                                          learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no",
                                          logging_steps=1)
    result = transformers.Trainer(model=model, args=args, train_dataset=rows).train()
    assert result.global_step == 3 and torch.isfinite(torch.tensor(result.training_loss))
    assert not torch.equal(model.classifier.weight, before)


@pytest.mark.unit
@pytest.mark.parametrize("keep", [True, False])
def test_the_patched_attention_passes_keep_scores_to_the_op(keep: bool, monkeypatch) -> None:
    """``apply_distaff_kernels(..., keep_scores=False)`` reaches every patched attention call (the switch that frees
    the forward's dense position scores); the default keeps them, as distaff's own model does."""
    from distaff.train.model import hf_kernels

    seen, original = [], hf_kernels.kernels.disentangled_attention

    def recorded(*args, **kwargs):
        seen.append(kwargs["keep_scores"])
        return original(*args, **kwargs)

    monkeypatch.setattr(hf_kernels.kernels, "disentangled_attention", recorded)
    model = transformers.DebertaV2ForMaskedLM(_config()).eval()
    apply_distaff_kernels(model, impl="reference", **({} if keep else {"keep_scores": False}))
    model(*_batch())
    assert seen == [keep, keep]  # both layers


@pytest.mark.unit
def test_only_the_encoders_own_relative_positions_take_the_kernel() -> None:
    """Hugging Face's encoder hands every layer a ``relative_pos``: the one it builds itself (from the length, the
    kernel's ``i - j``) is marked and taken by the kernel; a caller's own, or one for queries of another length, is
    not, and the layer falls back to Hugging Face's forward (which reads it)."""
    model = transformers.DebertaV2ForMaskedLM(_config()).eval()
    apply_distaff_kernels(model, impl="reference")
    encoder, hidden = model.deberta.encoder, torch.zeros(2, 40, 64)
    built = encoder.get_rel_pos(hidden)
    assert getattr(built, "_distaff_standard", False) and built.shape[-1] == 40
    given = torch.zeros(1, 40, 40, dtype=torch.long)
    assert encoder.get_rel_pos(hidden, None, given) is given and not hasattr(given, "_distaff_standard")
    assert not hasattr(encoder.get_rel_pos(hidden, torch.zeros(2, 10, 64)), "_distaff_standard")
    apply_distaff_kernels(model, impl="reference")  # patching twice wraps the encoder once
    from transformers.models.deberta_v2.modeling_deberta_v2 import DebertaV2Encoder
    assert encoder._distaff_original_get_rel_pos.__func__ is DebertaV2Encoder.get_rel_pos
    assert encoder._distaff_original_get_attention_mask.__func__ is DebertaV2Encoder.get_attention_mask


@pytest.mark.unit
def test_only_the_encoders_own_pair_mask_takes_the_kernel() -> None:
    """The pair mask the encoder builds from a ``[B, N]`` token mask is marked with that mask (the kernel's input:
    no ``N x N`` comparison, no host read); a pair mask a caller built, even a padding mask's product, is not, and
    the layer runs Hugging Face's forward: its padded query rows average every key, where the kernel's are zero."""
    torch.manual_seed(0)
    model = transformers.DebertaV2Model(_config()).eval()
    patched = copy.deepcopy(model)
    apply_distaff_kernels(patched, impl="reference")
    ids, mask = _batch()
    encoder = patched.encoder
    assert encoder.get_attention_mask(mask)._distaff_tokens is mask
    pairs = (mask[:, None, :, None] * mask[:, None, None, :]).to(torch.long)
    assert encoder.get_attention_mask(pairs) is pairs and not hasattr(pairs, "_distaff_tokens")
    hidden = torch.randn(2, ids.shape[1], 64)
    rel = encoder.get_rel_embedding()
    with torch.no_grad():
        want, _ = model.encoder.layer[0].attention.self(hidden, pairs, rel_embeddings=rel)
        got, _ = encoder.layer[0].attention.self(hidden, pairs, rel_embeddings=rel)
        fused, _ = encoder.layer[0].attention.self(hidden, encoder.get_attention_mask(mask), rel_embeddings=rel)
    torch.testing.assert_close(got, want)  # every row, the padded ones included: Hugging Face's forward ran
    padded = ~mask.bool()
    assert want[padded].abs().amax() > 0 and fused[padded].abs().amax() == 0  # the kernel's zeros, told apart
    torch.testing.assert_close(fused[~padded], want[~padded])


_PROBE = """
import sys
import torch
import transformers.activations  # its probe for the Hugging Face ``kernels`` package imports any ``kernels`` found
import distaff.kernels
print(sorted(name for name in sys.modules if name.split(".")[0] == "kernels"))
try:
    import kernels.library
except ImportError as error:
    print(error)
"""


@pytest.mark.integration
def test_a_checkouts_kernels_folder_seen_as_top_level_registers_no_second_copy_of_the_ops() -> None:
    """Python started at the checkout's root (``python -c``, ``python -m pytest``) can import ``kernels/`` as a
    top-level ``kernels``, and ``transformers`` does (its hub-kernels probe): that copy must not register the
    ``distaff::`` ops again (a second registration made later traces of them crash at random), and importing its
    ``library`` directly is refused with a message naming ``distaff.kernels``."""
    run = subprocess.run([sys.executable, "-c", _PROBE], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    imported, refusal = run.stdout.strip().splitlines()[-2:]
    assert "'kernels'" in imported and "kernels.library" not in imported, imported  # the probe did import it
    assert "imported as 'kernels.library'" in refusal and "import distaff.kernels" in refusal, refusal
