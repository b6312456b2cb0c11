"""Published measurements the time model is checked against (``distaff plan --anchors``): plan / published.

Each anchor is a configuration distaff can express, planned here exactly as ``distaff plan`` would, and the
figure its authors measured (facts only, with their source):

- NVIDIA DeepLearningExamples, BERT for PyTorch (PyTorch/LanguageModeling/BERT/README.md, "Pre-training NVIDIA
  DGX A100 (8x A100 80GB)", pytorch:21.11-py3 container): BERT-large pretraining, mixed precision, 8 GPUs;
  sequence 128: 4591 sequences/s at 256 per GPU x 32 accumulation steps; sequence 512: 1657 sequences/s at
  32 per GPU x 128 steps. BERT-large in distaff's terms: 24 layers, hidden 1024, 16 heads, FFN 4096,
  absolute positions (``position_biased_input``), no relative attention, no EMD, 2 token types, vocabulary
  30528; fp16, no ZeRO (NVIDIA's run is data-parallel with an all-reduce).
- The same table in NVIDIA's PaddlePaddle BERT (PaddlePaddle/LanguageModeling/BERT/README.md, 22.12-py3
  container, cuDNN fused attention): 5541 and 2109 sequences/s.
- DeBERTa (He et al., ICLR 2021, sec. 5.1): DeBERTa-large pretrained on 6 DGX-2 (96 V100), batch 2K, 1M steps,
  about 20 days; DeBERTa-base on 4 DGX-2 (64 V100), batch 2048, 1M steps, 10 days; sequences of 512, mixed
  precision. DeBERTa (v1) in distaff's terms: the v3 presets' sizes with the GPT-2 BPE vocabulary (50265),
  relative positions up to 512 without buckets, separate position projections (``share_att_key: false``), no
  LayerNorm on the position table, EMD; fp16 data parallel (ZeRO 0). Large takes micro-batch 21 on 96 GPUs
  (2016 sequences, the nearest to 2K), base 32 on 64 (2048); published sequences/s = batch x 1M / the days.
- ModernBERT (Warner et al., 2024, arXiv:2412.13663, https://arxiv.org/abs/2412.13663): ModernBERT-base, 1.7T
  tokens of its stable phase at sequence 1024 on 8 x H100 in 194 h (the figure issue 50 quotes from the paper:
  2.43M tokens/s). Nearest distaff run: 22 layers, hidden 768, 12 heads, RoPE, content-only attention, vocabulary
  50368, unpadded (``data.packing=varlen``), 30 % masking, bf16, ZeRO 1, 4608 sequences per step (micro-batch 64 x
  9 x 8 GPUs). Differences: ModernBERT's GeGLU feed-forward (2 x 1152 in, 1152 out) is planned as a GELU one of
  the same FLOPs (1728); its pre-norm, bias-free layers and StableAdamW are not expressed; two of every three of
  its layers attend within a 128-token window, which distaff cannot express (planned as global attention, which
  costs more); its samples are shorter than 1024 on average (planned full).
- AzNEOBERT (R. Ibishov, https://raufibishov.com/projects/az-neobert/, a project page, read 2026): NeoBERT's
  architecture trained on 8 x H200 at 1.24M tokens/s, DeepSpeed ZeRO 2, FlashAttention 3, torch.compile, bf16,
  sequence 1024: 28 layers, hidden 768, 12 heads, SwiGLU 3072, RoPE, 64k vocabulary. Nearest distaff run: those
  sizes with a GELU feed-forward of the same FLOPs (4608), content-only attention, NeoBERT's 20 % masking,
  micro-batch 32 (not published); differences: pre-RMSNorm, no biases, SwiGLU.
- DisentangledFlash's README (v1.1.1): an attention layer at N=8192, B=2, H=12, d=64, bf16, no dropout on an H200:
  forward 8.48 ms + backward 45.26 ms. The plan's attention for the same layer is distaff's kernels as the static
  judge (``benchmarks/attention_judge.py``) estimates them: the same judge every A100 (sm_80) and H100 (sm_90)
  attention figure of the plan comes from (``attention_table.json``). The judge is fitted to this README's forward
  (and to DisentangledFlash's bundled H200 profile), not to its backward, which that profile contradicts (about
  83 ms at the same 24 sequence-heads, against 45.26); so the ratio says how the judge ranks distaff's kernels
  against DisentangledFlash's published layer, not an independent check of the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from distaff.train.plan.gpus import kind
from distaff.train.plan.planner import make_plan
from distaff.train.plan.gpu_time import Assumptions, attention_seconds
from distaff.train.run.config import config_from_dict

BERT_LARGE = {"preset": "deberta-v3-large", "vocab_size": 30528, "relative_attention": False, "pos_att_type": [],
              "position_biased_input": True, "type_vocab_size": 2, "max_position_embeddings": 512, "emd": False,
              "layer_norm_eps": 1e-12}


@dataclass(frozen=True)
class Anchor:
    name: str
    published: float
    unit: str
    source: str


def bert_large_run(micro_batch: int, grad_accum: int) -> dict:
    return {"model": dict(BERT_LARGE), "data": {"dir": "unused", "batch_size": micro_batch},
            "train": {"precision": "fp16", "grad_accum": grad_accum, "max_steps": 1}, "zero": {"stage": 0}}


DEBERTA_V1 = {"vocab_size": 50265, "position_buckets": -1, "max_relative_positions": -1, "share_att_key": False,
              "norm_rel_ebd": "none", "emd": True}
DEBERTA_PAPER = "DeBERTa paper (He et al., ICLR 2021), sec. 5.1: pretraining on DGX-2 (V100) machines"
NVIDIA_PYTORCH = "NVIDIA DeepLearningExamples PyTorch BERT README, DGX A100 80GB pretraining table (21.11)"
NVIDIA_PADDLE = "NVIDIA DeepLearningExamples PaddlePaddle BERT README, DGX A100 80GB pretraining table (22.12)"
DF_README = "DisentangledFlash README v1.1.1 (H200 attention layer)"
MODERNBERT = "ModernBERT paper (arXiv:2412.13663): base, 1.7T tokens in 194 h on 8 x H100"
AZNEOBERT = "AzNEOBERT project page (raufibishov.com/projects/az-neobert): 1.24M tokens/s on 8 x H200"
# encoders with content-only attention and rotary positions, the sizes of each anchor (see the module docstring)
MODERNBERT_BASE = {"preset": "deberta-v3-base", "num_hidden_layers": 22, "intermediate_size": 1728,
                   "vocab_size": 50368, "relative_attention": False, "pos_att_type": [], "rope": True,
                   "max_position_embeddings": 8192, "emd": False, "hidden_dropout_prob": 0.0,
                   "attention_probs_dropout_prob": 0.0}
NEOBERT = {**MODERNBERT_BASE, "num_hidden_layers": 28, "intermediate_size": 4608, "vocab_size": 64000,
           "max_position_embeddings": 4096}


def bert_rows() -> list[tuple[Anchor, float]]:
    """(anchor, the plan's estimate in the anchor's unit) for NVIDIA's BERT-large figures."""
    rows = []
    for seq_len, micro, accum, pytorch, paddle in ((128, 256, 32, 4591, 5541), (512, 32, 128, 1657, 2109)):
        plan = make_plan(config_from_dict(bert_large_run(micro, accum)), "8xA100-80GB", seq_len=seq_len)
        estimate = plan.tokens_per_s / seq_len
        rows.append((Anchor(f"BERT-large seq {seq_len}, 8xA100-80GB, fp16", pytorch, "sequences/s",
                            NVIDIA_PYTORCH), estimate))
        rows.append((Anchor(f"BERT-large seq {seq_len}, 8xA100-80GB, fp16 (Paddle)", paddle, "sequences/s",
                            NVIDIA_PADDLE), estimate))
    return rows


def deberta_rows() -> list[tuple[Anchor, float]]:
    """(anchor, the plan's sequences/s) for the DeBERTa paper's base and large pretraining on DGX-2 machines."""
    rows = []
    for preset, nodes, micro, days in (("deberta-v3-base", 4, 32, 10), ("deberta-v3-large", 6, 21, 20)):
        run = {"model": {"preset": preset, **DEBERTA_V1}, "data": {"dir": "unused", "batch_size": micro},
               "train": {"precision": "fp16", "max_steps": 1}, "zero": {"stage": 0}}
        plan = make_plan(config_from_dict(run), "16xV100-32GB", nodes, seq_len=512,
                         assumptions=Assumptions(attention="hf_eager"))  # the eager attention those runs ran
        name = preset.replace("-v3", "")
        published = 2048 * 1e6 / (days * 86400)
        rows.append((Anchor(f"{name} (v1) seq 512, {nodes}x16xV100-32GB, fp16", published, "sequences/s",
                            DEBERTA_PAPER), plan.tokens_per_s / 512))
    return rows


def hopper_rows() -> list[tuple[Anchor, float]]:
    """(anchor, the plan's tokens/s) for the published H100 and H200 encoder trainings."""
    modernbert = {"model": MODERNBERT_BASE, "data": {"dir": "unused", "batch_size": 64, "packing": "varlen",
                                                     "masking": {"mlm_probability": 0.3}},
                  "train": {"precision": "bf16", "grad_accum": 9, "max_steps": 1}, "zero": {"stage": 1}}
    neobert = {"model": NEOBERT, "data": {"dir": "unused", "batch_size": 32, "masking": {"mlm_probability": 0.2}},
               "train": {"precision": "bf16", "max_steps": 1}, "zero": {"stage": 2}}
    rows = []
    for name, run, gpus, published, source in (
            ("ModernBERT-base seq 1024 packed, 8xH100-SXM, bf16", modernbert, "8xH100-SXM", 1.7e12 / (194 * 3600),
             MODERNBERT),
            ("NeoBERT sizes (AzNEOBERT) seq 1024, 8xH200, bf16", neobert, "8xH200", 1.24e6, AZNEOBERT)):
        plan = make_plan(config_from_dict(run), gpus, seq_len=1024)
        rows.append((Anchor(name, published, "tokens/s", source), plan.tokens_per_s))
    return rows


def attention_row() -> tuple[Anchor, float]:
    """DisentangledFlash's published H200 attention layer against the plan's attention for that layer."""
    model = config_from_dict({"model": {"preset": "deberta-v3-base", "attention_probs_dropout_prob": 0.0,
                                        "num_hidden_layers": 1, "emd": False},
                              "data": {"dir": "unused"}}).model_config()
    seconds = attention_seconds(model, kind("H200"), 8192, 2 * 8192).seconds
    return Anchor("attention layer N=8192 B=2 H=12 d=64, H200 (fwd+bwd)", 8.48 + 45.26, "ms", DF_README), seconds * 1e3


def anchor_lines() -> list[str]:
    rows = [*bert_rows(), *deberta_rows(), *hopper_rows(), attention_row()]
    lines = ["# The plan's ESTIMATES against published measurements (ratio = plan / published)", "",
             "| anchor | published | plan (estimate) | plan / published | source |", "|---|---|---|---|---|"]
    for anchor, estimate in rows:
        lines.append(f"| {anchor.name} | {anchor.published:,.2f} {anchor.unit} | {estimate:,.2f} {anchor.unit} | "
                     f"{estimate / anchor.published:.2f} | {anchor.source} |")
    return lines
