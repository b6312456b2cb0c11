"""The time model's costs on a GPU kind, part by part (train/plan/step_time.py adds them into a step and its
stages); every figure is an ESTIMATE.

- GEMMs: the model's matrix-multiply FLOPs (:mod:`distaff.train.model.flops`, forward + backward) less the
  attention's score and value products, at ``gemm_efficiency`` of the dense bf16/fp16 peak (fp32 runs: the
  fp32 peak);
- attention: the static judge's estimate of distaff's fused kernels (``attention_table.json``, written by
  ``python benchmarks/attention_table.py``) for the kind's architecture, head dim and sequence length, scaled
  by tokens x heads x layer applications; kinds without a table row are scaled from the nearest architecture
  by the ratio of dense peaks, and say so; content-only attention (no c2p/p2c) is distaff's kernels without
  their position terms, a FlashAttention kernel: the table's content-only reference when it has one, else its
  score and value products as GEMMs;
- fused ops (LayerNorm, bias-GELU, dropout, residual adds, embeddings, the MLM loss's softmax): bytes moved at
  ``bandwidth_efficiency`` of HBM bandwidth;
- optimizer: AdamW reads and writes ~ 4+4+4 fp32 bytes per parameter of the rank's shard twice, plus the
  gradient read and the weight write, at ``bandwidth_efficiency`` of HBM; offloaded: a CPU Adam at
  ``CPU_ADAM_PARAMS_S`` parameters/s per rank plus the PCIe copies;
- ZeRO communication (ring collectives, ``(W-1)/W`` of the volume crosses each GPU's slowest link, at
  ``link_efficiency``): ZeRO 0 all-reduces the gradients after the last micro-step (2x the volume, not
  overlapped); ZeRO 1 and 2 all-reduce them too (DeepSpeed's ``use_multi_rank_bucket_allreduce``), in the
  accumulation boundary's backward (ZeRO 1) or every backward (ZeRO 2), overlapped with it on GPUs
  (``overlap_comm``; only what exceeds the backward shows), and all-gather the updated weights after the step
  (not overlapped); ZeRO 3 gathers the weights for the forward (kept for the backward: DeepSpeed's reuse
  distance) and reduce-scatters the gradients every micro-step, prefetched and overlapped with compute (only what
  exceeds it shows); CPU ranks take the same parts from measured costs (train/plan/cpu_time.py).

The types the CPU costs share (Assumptions, AttentionTime, Compute) live here: train/plan/cpu_time.py imports this
module, never the reverse.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from distaff.train.model.config import ModelConfig
from distaff.train.model.flops import layer_applications, train_flops_per_token
from distaff.train.plan.gpus import GpuKind
from distaff.train.plan.memory import Setting

TABLE = Path(__file__).with_name("attention_table.json")
CPU_ADAM_PARAMS_S = 1.0e9      # DeepSpeed CPU Adam, parameters per second per rank (many cores, AVX-512)
PCIE_GB_S = 25.0               # host <-> GPU copies of the offloaded optimizer


@dataclass(frozen=True)
class Assumptions:
    gemm_efficiency: float = 0.65
    bandwidth_efficiency: float = 0.7
    link_efficiency: float = 0.8
    # Whose disentangled attention the step runs: distaff's kernels, or Hugging Face's eager attention (the
    # judge's column of it): what a run without distaff's kernels ran, as the published runs the plan is checked
    # against (train/plan/anchors.py), so that check does not move with distaff's own kernels.
    attention: str = "distaff"  # "distaff" | "hf_eager"

    def lines(self, cpu: bool = False, zero: int = 0) -> list[str]:
        """The assumptions behind a plan's step time, as printed under it (``zero``: the plan's ZeRO stage)."""
        if cpu:
            return ["GEMMs at the probed GEMM rate for the model's hidden size; attention, the ops around the GEMMs "
                    "and AdamW at their measured costs (train/plan/cpu_table.json) scaled by the probed rates; gloo's "
                    "collectives at the probed loopback rate, none hidden",
                    "the probe's rates are an idle machine's: other processes on these cores slow the run",
                    "no data-loading, logging, evaluation or checkpoint time; steady state after warm-up"]
        return [f"GEMMs at {self.gemm_efficiency:.0%} of the dense peak; fused ops and the optimizer at "
                f"{self.bandwidth_efficiency:.0%} of HBM bandwidth; collectives at {self.link_efficiency:.0%} of "
                f"the link",
                "attention: the static judge's estimate (no GPU ran), see the attention row's source"
                + ("" if self.attention == "distaff" else f"; {ATTENTION_KEYS[self.attention][2]}"),
                *(["ZeRO 3: prefetched gathers hidden under compute when it is long enough; its per-module hook "
                   "and gather latency is not modelled (ZeRO 3 is an upper bound on speed)"] if zero == 3 else []),
                "no data-loading, logging, evaluation or checkpoint time; steady state after warm-up"]


@lru_cache(maxsize=1)
def attention_table() -> dict:
    return json.loads(TABLE.read_text())


def _rows_for(arch: int, head_dim: int, dropout: float) -> list[dict]:
    rows = [r for r in attention_table()["rows"] if r["cc"] == arch and r["head_dim"] == head_dim]
    if not rows:   # another head dim: the nearest one, scaled by d (work per score is linear in d)
        dims = sorted({r["head_dim"] for r in attention_table()["rows"] if r["cc"] == arch},
                      key=lambda d: abs(d - head_dim))
        rows = [{**r, **{key: value * head_dim / dims[0] for key, value in r.items() if key.endswith("_ms")}}
                for r in attention_table()["rows"] if r["cc"] == arch and r["head_dim"] == dims[0]]
    chosen = min({r["dropout"] for r in rows}, key=lambda p: abs(p - dropout))
    return sorted((r for r in rows if r["dropout"] == chosen), key=lambda r: r["n"])


def per_token_head_ms(rows: list[dict], n: int, keys: tuple[str, ...] = ("fwd_ms", "bwd_ms")) -> float:
    """The ``keys``' ms per token per head at length ``n``: linear in ``n`` between the table's lengths,
    proportional to ``n`` beyond them (the score work per token grows with ``n``)."""
    cost = [(r["n"], sum(r[k] for k in keys) / (r["tokens"] * r["heads"])) for r in rows]
    if n <= cost[0][0]:
        return cost[0][1] * n / cost[0][0]
    for (n0, c0), (n1, c1) in zip(cost, cost[1:]):
        if n <= n1:
            return c0 + (c1 - c0) * (n - n0) / (n1 - n0)
    return cost[-1][1] * n / cost[-1][0]


# Where a kind's architecture has no judge rows: Ada (sm_89) has Ampere's SM (mma.sync, no wgmma or TMA), so it
# is read from sm_80, and so is Volta (sm_70: mma.sync on its first tensor cores); Blackwell (sm_100), when absent, from Hopper (sm_90); others from the nearest number.
FALLBACK = {70: 80, 89: 80, 86: 80, 100: 90, 120: 90}


def table_arch(gpu: GpuKind) -> tuple[int, float, str]:
    """The architecture whose table rows stand for ``gpu``, the time factor, and how that was chosen: the
    kind's own when the judge has it (scaled by dense peak when the kind is slower than the judge's GPU of
    that architecture), else the related architecture's scaled by the ratio of dense peaks."""
    archs = {r["cc"] for r in attention_table()["rows"]}
    arch = gpu.arch
    if arch not in archs:
        arch = FALLBACK.get(arch) if FALLBACK.get(arch) in archs else min(archs, key=lambda a: (abs(a - gpu.arch), a))
    reference = attention_table()["gpus"][str(arch)]
    factor = reference["tensor_tflops"] / gpu.tflops
    scaled = f"times the dense-peak ratio {reference['tensor_tflops']:g}/{gpu.tflops:g} TFLOP/s"
    if arch != gpu.arch:
        return arch, factor, f"judge has no sm_{gpu.arch} target: scaled from sm_{arch} ({reference['name']}) {scaled}"
    return arch, factor, f"judge, sm_{arch} ({reference['name']})" + ("" if abs(factor - 1) < 0.01 else f", {scaled}")


@dataclass(frozen=True)
class AttentionTime:
    seconds: float                 # forward + backward, every layer application
    forward: float                 # of which the forward
    source: str
    reference: float | None        # the content-only reference (FlashAttention-2) at the same shapes, when known


CONTENT_KEYS = ("content_fwd_ms", "content_bwd_ms")
RECOMPUTED_KEY = "bwd_recomputed_ms"  # distaff's backward with model.keep_position_scores=false
# Assumptions.attention -> the table's (forward, backward) keys for disentangled attention, and what they are.
ATTENTION_KEYS = {"distaff": ("fwd_ms", "bwd_ms", "distaff's kernels"),
                  "hf_eager": ("hf_eager_fwd_ms", "hf_eager_bwd_ms",
                               "Hugging Face eager attention in place of distaff's kernels (the judge's HF eager column)")}


def attention_seconds(cfg: ModelConfig, gpu: GpuKind, seq_len: int, tokens: int,
                      a: Assumptions = Assumptions()) -> AttentionTime:
    """Forward + backward attention seconds of ``tokens`` tokens through every layer application.

    Disentangled attention (c2p/p2c) is the judge's estimate of distaff's kernels (the backward reading the scores
    its forward kept, or with ``model.keep_position_scores`` off recomputing them). Content-only attention
    compiles those kernels without their position terms (``HAS_C2P``/``HAS_P2C`` are constexpr): a FlashAttention
    kernel, read from the table's content-only reference where the table has one, else its score and value
    products charged as GEMMs (at ``gemm_efficiency`` of the dense peak)."""
    arch, factor, how = table_arch(gpu)
    rows = _rows_for(arch, cfg.head_dim, cfg.attention_probs_dropout_prob)
    if rows[0]["dropout"] != cfg.attention_probs_dropout_prob or rows[0]["head_dim"] != cfg.head_dim:
        how += (f"; read from the table's d={rows[0]['head_dim']}, dropout {rows[0]['dropout']:g} rows (time linear "
                f"in d) for d={cfg.head_dim}, dropout {cfg.attention_probs_dropout_prob:g}")
    applications = layer_applications(cfg) if cfg.emd else cfg.num_hidden_layers
    scale = factor * tokens * cfg.num_attention_heads * applications / 1e3
    has_reference = all(k in r for r in rows for k in CONTENT_KEYS)
    reference = per_token_head_ms(rows, seq_len, CONTENT_KEYS) * scale if has_reference else None
    terms = len(cfg.pos_att_type) if cfg.relative_attention else 0
    if terms == 0 and reference is not None:
        forward = per_token_head_ms(rows, seq_len, CONTENT_KEYS[:1]) * scale
        return AttentionTime(reference, forward, how + "; content-only: the table's FlashAttention-2 reference",
                             reference)
    if terms == 0:
        flops = attention_flops_per_token(cfg, seq_len) * tokens
        seconds = flops / (gpu.tflops * 1e12 * a.gemm_efficiency)
        return AttentionTime(seconds, seconds / 3, "content-only: a FlashAttention kernel's score and value "
                             f"products as GEMMs at {a.gemm_efficiency:.0%} of the dense peak", None)
    if a.attention not in ATTENTION_KEYS:
        raise ValueError(f"Assumptions.attention must be one of {sorted(ATTENTION_KEYS)}, got {a.attention!r}")
    fwd, bwd, whose = ATTENTION_KEYS[a.attention]
    how += "" if a.attention == "distaff" else f"; {whose}"
    if a.attention == "distaff" and not cfg.keep_position_scores:
        bwd = RECOMPUTED_KEY
        how += "; the backward recomputing its position scores (model.keep_position_scores=false)"
    forward = per_token_head_ms(rows, seq_len, (fwd,)) * scale
    return AttentionTime(per_token_head_ms(rows, seq_len, (fwd, bwd)) * scale, forward, how, reference)


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token of the score and value products (in flops.py's count)."""
    terms = len(cfg.pos_att_type) if cfg.relative_attention else 0
    per_layer = 4 * seq_len * cfg.hidden_size + terms * 2 * cfg.hidden_size * min(seq_len, 2 * cfg.att_span)
    applications = layer_applications(cfg) if cfg.emd else cfg.num_hidden_layers
    return 3.0 * per_layer * applications


def fused_bytes_per_token(cfg: ModelConfig, act_bytes: int, labelled: float) -> tuple[float, float]:
    """HBM bytes per token of the elementwise and normalisation kernels, (forward, backward): per layer two
    residual LayerNorms (read 2, write 1; backward read 3, write 2), two dropouts (read 1 write 2; backward 2,1),
    the bias-GELU (read 1 write 1 of I; backward read 2 write 1), the attention relayout copies (2 of D each
    way); the MLM loss writes the float32 logits of labelled rows and reads them twice in its backward."""
    d, i = cfg.hidden_size, cfg.intermediate_size
    applications = layer_applications(cfg) if cfg.emd else cfg.num_hidden_layers
    forward = ((2 * 3 + 2 * 3 + 2) * d + 2 * i) * applications * act_bytes + 4 * cfg.embedding_size * act_bytes
    backward = ((2 * 5 + 2 * 3 + 2) * d + 3 * i) * applications * act_bytes + 4 * cfg.embedding_size * act_bytes
    head = labelled * cfg.vocab_size * 4
    return forward + head, backward + 2 * head


def _link_bytes_s(gpu: GpuKind, nodes: int, a: Assumptions) -> float:
    """Bytes/s of a ring collective's slowest hop: NVLink/PCIe inside a node, the NIC between nodes."""
    link = gpu.intra_gb_s if nodes == 1 else min(gpu.intra_gb_s, gpu.inter_gb_s)
    return link * 1e9 * a.link_efficiency


@dataclass
class Compute:
    """Seconds of one micro-batch by part (GEMMs, attention, fused ops), of which the forward (recomputation
    belongs to the backward), the attention's source and its content-only reference."""

    parts: dict[str, float]
    forward: float
    source: str
    reference: float | None


def compute_seconds(s: Setting, gpu: GpuKind, a: Assumptions) -> Compute:
    """GEMM, attention and fused-op seconds of one micro-batch (recomputation included)."""
    tokens, act, n = s.tokens, (4 if s.precision == "fp32" else 2), s.attention_len
    peak = (gpu.fp32_tflops if s.precision == "fp32" else gpu.tflops) * 1e12
    parts, forward, source, reference = {"GEMMs": 0.0, "attention": 0.0, "fused ops": 0.0}, 0.0, "", None
    for index, cfg in enumerate(s.models):
        labelled = s.labelled_share if index == 0 else 0.0     # an RTD discriminator has no MLM head
        gemm = train_flops_per_token(cfg, n, labelled) - attention_flops_per_token(cfg, n)
        gemm_s = gemm * tokens / (peak * a.gemm_efficiency)
        recompute = 4 / 3 if cfg.activation_checkpointing else 1.0
        attn = attention_seconds(cfg, gpu, n, tokens, a)
        precision = gpu.tflops / gpu.fp32_tflops if s.precision == "fp32" else 1.0
        source = attn.source + ("; fp32 scaled by the bf16/fp32 peak ratio" if precision != 1.0 else "")
        if attn.reference is not None:
            reference = (reference or 0.0) + attn.reference * precision * recompute
        fused_fwd, fused_bwd = (b * tokens / (gpu.hbm_tb_s * 1e12 * a.bandwidth_efficiency)
                                for b in fused_bytes_per_token(cfg, act, labelled))
        parts["GEMMs"] += gemm_s * recompute
        parts["attention"] += attn.seconds * precision * recompute
        parts["fused ops"] += fused_fwd * recompute + fused_bwd
        forward += gemm_s / 3 + attn.forward * precision + fused_fwd
    return Compute(parts, forward, source, reference)


def communication_seconds(s: Setting, gpu: GpuKind, nodes: int, grad_accum: int, backward_s: float,
                          micro_s: float, a: Assumptions) -> dict[str, float]:
    """Seconds of ZeRO communication per optimizer step that no computation hides, by the stage it shows in:
    the gradients' reduction, the weights' all-gathers after the step (in the optimizer's stage) and ZeRO 3's
    gathers (in the forward). ``overlap_comm`` (GPUs) hides a reduction under the backward it follows."""
    w = s.ranks
    found = {"gradient communication": 0.0, "optimizer": 0.0, "forward": 0.0}
    if w == 1:
        return found
    one_pass = (w - 1) / w * s.params * (4 if s.precision == "fp32" else 2) / _link_bytes_s(gpu, nodes, a)
    hidden = backward_s if s.overlap_comm else 0.0
    # ZeRO 0 all-reduces after the last backward (engine.py:3073); ZeRO 1-2 reduce with an all-reduce of every
    # gradient too (use_multi_rank_bucket_allreduce, on by default: stage_1_and_2.py:1636), in the boundary's
    # backward (ZeRO 1) or every backward (ZeRO 2), and all-gather the new weights after the step
    if s.zero == 0:
        found["gradient communication"] = 2 * one_pass
    elif s.zero in (1, 2):
        found["gradient communication"] = max(0.0, 2 * one_pass - hidden) * (grad_accum if s.zero == 2 else 1)
        found["optimizer"] = one_pass
    else:                            # gathered once for the forward and kept for the backward, reduce-scattered
        overlap = micro_s if s.overlap_comm else 0.0
        exposed = max(0.0, 2 * one_pass - overlap) * grad_accum
        found["forward"], found["gradient communication"] = exposed / 2, exposed / 2
    return found


def optimizer_seconds(s: Setting, gpu: GpuKind, a: Assumptions) -> float:
    shard = s.params / s.ranks if s.zero >= 1 else s.params
    weight_bytes = 4 if s.precision == "fp32" else 2
    if s.offload_optimizer:
        return shard / CPU_ADAM_PARAMS_S + shard * (4 + weight_bytes) / (PCIE_GB_S * 1e9)
    return shard * (4 * 6 + 4 + weight_bytes) / (gpu.hbm_tb_s * 1e12 * a.bandwidth_efficiency)
