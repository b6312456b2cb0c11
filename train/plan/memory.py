"""Bytes per GPU of one training step: model states under ZeRO, every saved activation, the peak's transients.

Model states (per rank, ``W`` data-parallel ranks, ``P`` parameters, weights in the run's precision):

- weights: ``P`` (ZeRO 0-2) or ``P / W`` (ZeRO 3, plus the prefetch bucket of gathered weights) in the run
  precision;
- gradients: ZeRO 0-1 keep every gradient (``P``, run precision); ZeRO 2-3 keep their partition (``P / W``)
  plus DeepSpeed's contiguous reduce bucket (``reduce_bucket_size`` = 5e8 elements, two with ``overlap_comm``
  on GPUs): allocated whole, whatever the model's size, so small models see it dominate;
- optimizer (torch AdamW): the fp32 master partition DeepSpeed clones (ZeRO >= 1, even in fp32), ``exp_avg``
  and ``exp_avg_sq`` in fp32 over ``P / W`` (ZeRO >= 1); without ZeRO ``P`` of them: fp16 runs DeepSpeed's
  FP16 optimizer (fp32 masters and moments), bf16 plain AdamW on the bf16 weights (bf16 moments, no masters);
  offloaded to the host with ``zero.offload_optimizer``; the step's temporary (one moment-sized buffer).

Activations (what autograd keeps from the forward for the backward), per layer application, for ``T`` tokens
of hidden ``D``, feed-forward ``I``, ``H`` heads, activation bytes ``a``: the layer input, Q/K/V, the attention
output and its ``[B, N, D]`` relayout, the attention's float32 log-sum-exp, two LayerNorm inputs with float32
mean and 1/std, the feed-forward input, the pre-GELU and post-GELU ``[T, I]`` tensors, the dropout masks
(one byte per element, when dropout is on) and the per-layer position tables ``Kr``/``Qr``. The PyTorch
reference path (the CPU) adds the relative-position index and keeps the attention output in the heads'
layout (no relayout copy). The MLM head keeps the labelled rows (15 %) and, fused, the float32 gradient of
the ``V x E`` decoder computed in the forward; the reference keeps the float32 log-softmax of ``[M, V]``.
The peak is the larger of the end of the forward (states + activations + the head's transients) and the
optimizer step (states + gradients + the step's temporaries).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from distaff.train.model.config import ModelConfig
from distaff.train.model.flops import layer_applications

REDUCE_BUCKET = 500_000_000         # DeepSpeed's default zero_optimization.reduce_bucket_size (elements)
PREFETCH_BUCKET = 50_000_000       # DeepSpeed's default stage3_prefetch_bucket_size (elements)
LABELLED = 0.15                     # masked fraction of the collator's default
LOGITS_CHUNK = 1 << 24              # the fused MLM loss's logits chunk (kernels/mlm_loss.py LOGITS_CHUNK_ELEMENTS)
GIB = 1024 ** 3


@dataclass(frozen=True)
class Setting:
    """What the memory model reads of a run: the model(s), the micro-batch, precision, ZeRO, the ranks."""

    models: tuple[ModelConfig, ...]  # the MLM model, or (generator, discriminator) for RTD
    params: int                      # trainable parameters of everything the engine holds
    seq_len: int
    micro_batch: int
    precision: str                   # fp32 | bf16 | fp16
    zero: int
    ranks: int                       # data-parallel ranks (all GPUs)
    offload_optimizer: bool = False
    offload_param: bool = False
    fused: bool = True               # Triton kernels (GPU) or the PyTorch reference (CPU)
    overlap_comm: bool = True        # DeepSpeed's ZeRO setting: True on GPUs (train/run/engine.py)
    dropout: bool = True
    labelled: float = LABELLED       # fraction of tokens the MLM head reads (T-TA: all)


@dataclass
class Breakdown:
    """Bytes per rank by item, the peak, and what each item is."""

    items: dict[str, float] = field(default_factory=dict)
    peak: float = 0.0
    margin: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.peak + self.margin


def count_params(models: tuple[ModelConfig, ...], rtd_sharing: str | None = None) -> int:
    """Exact parameter count, from the model built on the meta device (no memory, no time)."""
    from distaff.train.model.deberta import DebertaForMaskedLM

    with torch.device("meta"):
        built = [DebertaForMaskedLM(cfg) for cfg in models]
    total = sum(p.numel() for model in built for p in model.parameters())
    if rtd_sharing == "es":    # one word table for both
        total -= models[0].vocab_size * models[0].embedding_size
    return total


def _act_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def model_states(s: Setting) -> dict[str, float]:
    """Weights, gradients, optimizer states and their buffers per rank (bytes)."""
    a, p, w = _act_bytes(s.precision), s.params, s.ranks
    shard = p / w if s.zero >= 1 else p
    states = {"weights": p * a / (w if s.zero == 3 else 1) * (0 if s.offload_param else 1)}
    states["gradients"] = p * a / (w if s.zero >= 2 else 1)
    if s.zero >= 2:
        states["reduce bucket"] = REDUCE_BUCKET * a * (2 if s.overlap_comm else 1)
    if s.zero == 3:   # the weights gathered ahead of use (stage3_prefetch_bucket_size, 5e7 elements)
        states["gathered weights (prefetch)"] = min(p, PREFETCH_BUCKET) * a
    # ZeRO >= 1 steps an fp32 partition; without ZeRO, fp16 runs DeepSpeed's FP16 optimizer (fp32 masters)
    # and bf16 plain AdamW on the bf16 weights (moments in bf16)
    fp32_moments = s.zero >= 1 or s.precision != "bf16"
    on_gpu = 0 if s.offload_optimizer else 1
    states["fp32 master weights"] = (shard * 4 if s.zero >= 1 or s.precision == "fp16" else 0) * on_gpu
    states["Adam moments"] = 2 * shard * (4 if fp32_moments else 2) * on_gpu
    return states


def layer_activations(cfg: ModelConfig, s: Setting, tokens: int) -> float:
    """Bytes one layer application keeps for its backward."""
    a, d, i, h = _act_bytes(s.precision), cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    mask = tokens * d if s.dropout and cfg.hidden_dropout_prob > 0 else 0
    # the layer input (also both residuals), Q, K, V (the fused op's contiguous copies; the reference keeps the
    # projections' outputs), the attention output, its [B, N, D] relayout as the output projection's input
    # (a view on the reference path), the LayerNorm-1 input, attended (LN-1 out), the LayerNorm-2 input
    hidden = (9 if s.fused else 8) * tokens * d * a
    ffn = 2 * tokens * i * a
    stats = 2 * tokens * 8 + tokens // s.seq_len * h * s.seq_len * 4          # LN mean/rstd, attention lse
    terms = len(cfg.pos_att_type) if cfg.relative_attention else 0
    tables = terms * 2 * cfg.att_span * d * a * (2 if mask else 1)           # Kr/Qr (+ the dropped-out rel)
    index = 0 if s.fused or not cfg.relative_attention else s.seq_len * s.seq_len * 8
    return hidden + ffn + stats + 2 * mask + tables + index


def head_activations(cfg: ModelConfig, s: Setting, tokens: int) -> tuple[float, float]:
    """The MLM head's saved bytes and its largest transient (bytes) for ``tokens`` positions."""
    a, d, e, v = _act_bytes(s.precision), cfg.hidden_size, cfg.embedding_size, cfg.vocab_size
    rows = round(tokens * s.labelled)
    kept = rows * (d + 2 * e) * a + rows * 8 * 2                                # dense in, GELU out, LN in, stats
    if s.fused:
        kept += v * e * 4 + v * 4 + rows * e * a                                 # decoder gradient, bias, rows
        return kept, min(rows, max(1, LOGITS_CHUNK // v)) * v * 4
    kept += rows * v * 4                                                         # log-softmax output
    return kept, rows * v * 4                                                    # the logits beside it


def activations(s: Setting) -> dict[str, float]:
    """Saved activations of one micro-batch (bytes), by part."""
    tokens = s.micro_batch * s.seq_len
    a, found = _act_bytes(s.precision), {}
    for n, cfg in enumerate(s.models):
        layers = layer_applications(cfg) if cfg.emd else cfg.num_hidden_layers
        scale = 1 if not cfg.activation_checkpointing else 0
        name = "" if len(s.models) == 1 else ("generator " if n == 0 else "discriminator ")
        per_layer = layer_activations(cfg, s, tokens)
        kept_inputs = layers * tokens * cfg.hidden_size * a       # a checkpointed layer keeps only its input
        found[f"{name}encoder layers"] = per_layer * layers * scale + kept_inputs * (1 - scale)
        embed_mask = tokens * cfg.hidden_size if s.dropout and cfg.hidden_dropout_prob > 0 else 0
        found[f"{name}embeddings"] = tokens * cfg.embedding_size * a + embed_mask + tokens * 8
        if cfg.emd:
            found[f"{name}EMD keys/values"] = tokens * cfg.hidden_size * a
        if n == 0:
            found[f"{name}MLM head"] = head_activations(cfg, s, tokens)[0]
    return found


def transients(s: Setting) -> dict[str, float]:
    """The largest short-lived buffers: one recomputed layer, the head's logits, the backward of one layer."""
    tokens = s.micro_batch * s.seq_len
    cfg = s.models[-1]
    a = _act_bytes(s.precision)
    out = {"MLM logits (transient)": head_activations(s.models[0], s, tokens)[1]}
    if cfg.activation_checkpointing:
        out["recomputed layer (transient)"] = layer_activations(cfg, s, tokens)
    # dq, dk, dv and the feed-forward's input gradient; the fused attention backward adds its partial sums and
    # scratch, at most PARTIAL_BUDGET (1.0, kernels/attention/backward.py) x the bytes of dq + dk + dv
    grads = 3 * tokens * cfg.hidden_size * a
    out["layer backward (transient)"] = grads * (2 if s.fused else 1) + tokens * cfg.intermediate_size * a
    if not s.fused:   # the reference backward's score blocks and per-row position gradients
        span = 2 * cfg.att_span
        out["layer backward (transient)"] += s.micro_batch * cfg.num_attention_heads * s.seq_len * (
            3 * s.seq_len + 2 * span) * 4
    return out


def _phases(s: Setting, states: dict[str, float], acts: dict[str, float], temp: dict[str, float]) -> dict[str, float]:
    """Bytes alive at the three candidate peaks of a step.

    The head's backward starts with every activation alive and the decoder's gradient (the tied word table's,
    ``V x E``) born. ZeRO 0-1 gradients are born in the backward as the activations die, so the end of the
    backward holds every gradient and the word table's two others (the lookup's, and the sum of the two);
    ZeRO 2 fills its reduce bucket as the backward goes and, the bucket larger than these models, reduces
    into the gradient partition only at its end, after the three word-table gradients were alive together.
    The optimizer step holds the states and its temporaries (ZeRO 0: the all-reduce's flat gradient copy;
    torch AdamW: one fp32 buffer of the partition)."""
    table = s.models[0].vocab_size * s.models[0].embedding_size * _act_bytes(s.precision)
    fixed = sum(states.values()) - states["gradients"]
    shard = s.params / s.ranks if s.zero >= 1 else s.params
    flat_copy = min(s.params, REDUCE_BUCKET) * _act_bytes(s.precision) if s.zero == 0 else 0
    step_temp = 0 if s.offload_optimizer else shard * (4 if s.zero >= 1 or s.precision != "bf16" else 2)
    return {"start of backward": fixed + table + sum(acts.values()) + max(temp.values()),
            "end of backward": fixed + (3 * table if s.zero >= 2 else states["gradients"] + 2 * table),
            "optimizer step": fixed + states["gradients"] + max(flat_copy, step_temp)}


def step_peak(s: Setting) -> Breakdown:
    """Bytes per rank at the step's peak, with every item, and the allocator margin on top."""
    states, acts, temp = model_states(s), activations(s), transients(s)
    phases = _phases(s, states, acts, temp)
    peak = max(phases.values())
    return Breakdown({**states, **acts, **temp}, peak, margin=margin(peak), phases=phases)


def margin(peak: float) -> float:
    """The caching allocator's fragmentation (5 % of the tensors) plus the CUDA context, kernels and NCCL
    buffers (1 GiB): assumptions, stated in the plan's output."""
    return 0.05 * peak + 1.0 * GIB
