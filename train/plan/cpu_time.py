"""The time model's costs on CPU ranks: the same parts as on a GPU, from this machine's measured costs.

A CPU rank runs the PyTorch reference kernels, one op at a time, on ``threads`` cores (train/plan/cpu.py):

- GEMMs: the model's matrix-multiply FLOPs (as on GPUs) at the probed GEMM rate for the model's hidden size
  (the rate of a CPU GEMM depends on its inner size far more than a GPU's does);
- attention: the reference kernels' measured forward and backward per token per head (``cpu_table.json``) at
  the model's head size, position span, sequence length (64-512; beyond, in proportion to it), dropout and
  inputs (fp32, or bf16 for half precision: computed in float32 there, but through float32 copies of its
  inputs), scaled by the ratio of the fp32 GEMM rate of the cores they were measured on (``attention_probe``)
  to this machine's;
- the ops around the GEMMs (on a GPU, the fused ops): each layer application's (its LayerNorms, GELU,
  dropouts, relayouts, residual adds and the framework's work per op: the table's measured layers less their
  GEMMs and attention), the embeddings' LayerNorm and dropout, the MLM head's and its loss per logit, the tied
  word table's gradient (a ``V x E`` zero-fill and sum every micro-batch), scaled by the ratio of copy
  bandwidths;
- the per-call work that does not grow with the tokens (Python, module calls, autograd and dispatch per op: a
  small model's step is mostly this, issue 50): each layer application's and each model's (embeddings, EMD, head
  and loss) forward and backward, and RTD's own around its two models, measured once on tiny models at a few
  tokens (``fixed_ms``), scaled by the ratio of the cores' small-GEMM rates (not bandwidth: it is Python and
  dispatch); the layer rows' own share of it is taken out of them, so it is counted once;
- RTD's draw of a replacement for every labelled token (the generator's logits again, Gumbel noise and an
  argmax: forward only, measured per logit, ``rtd_sampling``, with its own probe; random numbers cost several
  times a loss's work per logit, and at 4 x 64 the draw is a sixth of the pair's forward);
- optimizer and communication: DeepSpeed's optimizer step and gradient reduction on two CPU ranks, measured per
  parameter at each ZeRO stage (the table's, on a stack of linear layers): AdamW, ZeRO's copies and the weights'
  all-gather; gloo's all-reduce and the bucket's copies, none hidden (``overlap_comm`` is off on CPUs); and
  per parameter tensor (measured on many small ones), as DeepSpeed and AdamW loop over the tensors in Python;
  half precision from its own figures (the fp32 ones times the bf16 / fp32 ratios measured side by side:
  bf16's master copies cost more per tensor, its gradients move half the bytes). All of it is scaled by the
  ratio of the cores' small-GEMM rates, not of copy bandwidths: remeasured on a machine whose copies ran 2.36x
  and small GEMMs 1.32x faster than when the table was taken, DeepSpeed's per-parameter costs ran 1.35-1.51x
  faster, the elementwise rows 1.6-4.7x (``benchmarks/cpu_table.py --drift``,
  benchmarks/results/cpu_table_drift.json): AdamW's and gloo's loops over the parameters follow the core.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

from distaff.train.model.config import ModelConfig
from distaff.train.model.flops import layer_applications, train_flops_per_token
from distaff.train.plan.gpus import GpuKind
from distaff.train.plan.memory import Setting
from distaff.train.plan.gpu_time import (Assumptions, AttentionTime, Compute, attention_flops_per_token,
                                         per_token_head_ms)

CPU_TABLE = Path(__file__).with_name("cpu_table.json")      # CPU ranks' costs (benchmarks/cpu_table.py)


@lru_cache(maxsize=1)
def cpu_table() -> dict:
    return json.loads(CPU_TABLE.read_text())


def gemm_rate(curve: tuple, k: int, precision: str) -> float:
    """FLOP/s of GEMMs of inner size ``k`` on a ``(size, fp32 GFLOP/s, bf16 GFLOP/s)`` curve, log-linear between its
    sizes (fp16 runs read the bf16 column: both are half-precision GEMMs on CPUs)."""
    points = [(point[0], point[1 if precision == "fp32" else 2]) for point in curve]
    if k <= points[0][0] or len(points) == 1:
        return points[0][1] * 1e9
    for (k0, r0), (k1, r1) in zip(points, points[1:]):
        if k <= k1:
            weight = math.log(k / k0) / math.log(k1 / k0)
            return (r0 + (r1 - r0) * weight) * 1e9
    return points[-1][1] * 1e9


def _table_rate(k: int, precision: str, probe: str = "probe") -> float:
    """The table's GEMM rate at inner size ``k``: of the probe taken with its ``probe`` section (the attention rows
    are measured on their own, with their own probe; the rest of the table with ``probe``)."""
    return gemm_rate(tuple(map(tuple, cpu_table()[probe]["gemm_gflops"])), k, precision)


def _nearest(rows: list[dict], key: str, value: float) -> list[dict]:
    best = min({r[key] for r in rows}, key=lambda x: (abs(x - value), x))
    return [r for r in rows if r[key] == best]


def attention_seconds(cfg: ModelConfig, gpu: GpuKind, seq_len: int, tokens: int,
                      precision: str = "fp32") -> AttentionTime:
    """The reference attention of ``tokens`` tokens through every layer application, from the measured table's
    rows for ``precision``'s inputs (fp16 reads bf16's: both are cast to float32)."""
    inputs = "fp32" if precision == "fp32" else "bf16"
    rows = [r for r in cpu_table()["attention"] if r["precision"] == inputs]
    for key, value in (("head_dim", cfg.head_dim), ("span", cfg.att_span if cfg.relative_attention else 0),
                       ("dropout", cfg.attention_probs_dropout_prob)):
        rows = _nearest(rows, key, value)
    rows = sorted(rows, key=lambda r: r["n"])
    ratio = _table_rate(cfg.head_dim, "fp32", "attention_probe") / gemm_rate(gpu.gemm_curve, cfg.head_dim, "fp32")
    applications = layer_applications(cfg) if cfg.emd else cfg.num_hidden_layers
    scale = ratio * cfg.head_dim / rows[0]["head_dim"] * tokens * cfg.num_attention_heads * applications / 1e3
    forward = per_token_head_ms(rows, seq_len, ("fwd_ms",)) * scale
    how = (f"the reference kernels measured on CPU (cpu_table.json: d={rows[0]['head_dim']}, span {rows[0]['span']}, "
           f"dropout {rows[0]['dropout']:g}, {inputs} inputs), times the GEMM-rate ratio "
           f"{ratio:.2f}")
    return AttentionTime(per_token_head_ms(rows, seq_len) * scale, forward, how, None)


def _bandwidth_ratio(gpu: GpuKind) -> float:
    return cpu_table()["probe"]["copy_gb_s"] / (gpu.hbm_tb_s * 1e3)


def _core_ratio(gpu: GpuKind, probe: str = "probe") -> float:
    """How much faster the table's core (as its ``probe`` section measured it) ran scalar work than this machine's:
    the ratio of their fp32 GEMM rates at the smallest probed size (the per-call work is Python and dispatch:
    neither bandwidth- nor GEMM-bound, but it follows the core's speed, which the small GEMM's rate tracks closest
    of what the probe measures)."""
    smallest = cpu_table()[probe]["gemm_gflops"][0][0]
    return _table_rate(smallest, "fp32", probe) / gemm_rate(gpu.gemm_curve, smallest, "fp32")


def _ns(s: Setting) -> dict[str, float]:
    return cpu_table()["elementwise_ns"]["fp32" if s.precision == "fp32" else "bf16"]


def layer_rest_ns(cfg: ModelConfig, seq_len: int) -> float:
    """ns per token of one layer application's ops around its GEMMs and attention (the table's measured layers,
    linear in the hidden size and the sequence length between its rows, at the nearest dropout). Beyond the
    longest row the cost per token stays that row's: these ops are per token (LayerNorms, GELU, dropout,
    residuals, relayouts) and do not grow with the length (the rows fall from 64 to 128 tokens; hidden 128
    and 384 measured flat from 128 to 512 tokens, docs/plan.md); beyond the widest, it grows with the hidden
    size (every op is ``[tokens, hidden]``)."""
    rows = _nearest(cpu_table()["layer_rest"], "dropout", cfg.hidden_dropout_prob)

    def along(points: list[tuple[float, float]], x: float, beyond_grows: bool) -> float:
        points = sorted(points)
        if x <= points[0][0] or len(points) == 1:
            return points[0][1] * (x / points[0][0] if x < points[0][0] else 1.0)
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return points[-1][1] * (x / points[-1][0] if beyond_grows else 1.0)

    fixed = _fixed(cfg)
    per_token_fixed = fixed["layer_rest_ms"] * 1e6 / fixed["layer_rest_tokens"]      # counted by fixed_seconds
    by_hidden = {}
    for r in rows:
        by_hidden.setdefault(r["hidden"], []).append((r["n"], max(0.0, r["ns_per_token"] - per_token_fixed)))
    return along([(hidden, along(points, seq_len, False)) for hidden, points in by_hidden.items()],
                 cfg.hidden_size, True)


def _fixed(cfg: ModelConfig) -> dict:
    return _nearest(cpu_table()["fixed_ms"], "dropout", cfg.hidden_dropout_prob)[0]


def fixed_seconds(cfg: ModelConfig) -> tuple[float, float]:
    """One thread's forward and backward seconds of ``cfg``'s per-call work per micro-batch (the table's tiny
    model at a few tokens: its layer applications' and the rest of the model's), whatever its tokens."""
    fixed, applications = _fixed(cfg), layer_applications(cfg) if cfg.emd else cfg.num_hidden_layers
    return tuple((applications * fixed["layer_ms"][stage] + fixed["model_ms"][stage]) * 1e-3
                 for stage in ("forward", "backward"))


def model_ns_per_token(cfg: ModelConfig, labelled: float) -> float:
    """ns per token of the embeddings' and the MLM head's ops around their GEMMs (forward + backward, one
    thread): LayerNorm and dropout of the embeddings, the head's bias-GELU and LayerNorm and its loss per logit
    (an RTD generator's draw of replacements is :func:`sampling_seconds`)."""
    ns = cpu_table()["elementwise_ns"]["fp32"]
    d, e = cfg.hidden_size, cfg.embedding_size
    embeddings = d * ns["layer_norm_residual"] + (d * ns["dropout"] if cfg.hidden_dropout_prob > 0 else 0)
    head = labelled * (e * (ns["bias_gelu"] + ns["layer_norm_residual"])
                       + cfg.vocab_size * ns["mlm_loss_per_logit"])
    return embeddings + head


def compute_seconds(s: Setting, gpu: GpuKind, a: Assumptions) -> Compute:
    """GEMM, attention and elementwise seconds of one micro-batch on one CPU rank."""
    tokens, n = s.tokens, s.attention_len
    parts, forward, source = {"GEMMs": 0.0, "attention": 0.0, "fused ops": 0.0}, 0.0, ""
    threads = max(1, gpu.threads)
    for index, cfg in enumerate(s.models):
        labelled = s.labelled_share if index == 0 else 0.0
        gemm = train_flops_per_token(cfg, n, labelled) - attention_flops_per_token(cfg, n)
        gemm_s = gemm * tokens / gemm_rate(gpu.gemm_curve, cfg.hidden_size, s.precision)
        attn = attention_seconds(cfg, gpu, n, tokens, s.precision)
        table = cfg.vocab_size * cfg.embedding_size * _ns(s)["table_gradient"]     # its gradient, every micro-batch
        applications = layer_applications(cfg) if cfg.emd else cfg.num_hidden_layers
        per_token = (applications * layer_rest_ns(cfg, n)
                     + model_ns_per_token(cfg, labelled))
        elementwise = (per_token * tokens + table) * 1e-9 * _bandwidth_ratio(gpu) / threads
        # per-call work is one thread's whatever the threads (Python and dispatch do not split across cores)
        fixed_forward, fixed_backward = (seconds * _core_ratio(gpu) for seconds in fixed_seconds(cfg))
        recompute = 4 / 3 if cfg.activation_checkpointing else 1.0
        parts["GEMMs"] += gemm_s * recompute
        parts["attention"] += attn.seconds * recompute
        replays = 2 if cfg.activation_checkpointing else 1        # a checkpointed forward runs again
        parts["fused ops"] += elementwise * recompute + fixed_forward * replays + fixed_backward
        forward += gemm_s / 3 + attn.forward + elementwise / 3 + fixed_forward
        source = attn.source
    if len(s.models) == 2:      # RTD's own work around its two models: its per-call work, and its draw
        fixed = _fixed(s.models[-1])
        rtd, sampling = fixed["rtd_ms"], sampling_seconds(s, gpu)
        # the per-call figure's pair drew replacements for its labelled half of a few tokens (from the sampling
        # probe's vocabulary, cpu_table.py): counted once, here
        drawn = fixed["tokens"] / 2 * cpu_table()["rtd_sampling"]["vocab"]
        rtd_forward = max(0.0, rtd["forward"] * 1e-3 * _core_ratio(gpu) - sampling_seconds(s, gpu, drawn))
        parts["fused ops"] += rtd_forward + rtd["backward"] * 1e-3 * _core_ratio(gpu) + sampling
        forward += rtd_forward + sampling
    return Compute(parts, forward, source, None)


def sampling_seconds(s: Setting, gpu: GpuKind, logits: float | None = None) -> float:
    """RTD's draw of a replacement for each labelled token of the micro-batch (or of ``logits`` logits): the
    generator's logits again, Gumbel noise and an argmax per logit, forward only, as the table measured it per
    logit (``rtd_sampling``: its random numbers cost several times a loss's per logit), scaled by the cores'
    speeds (random numbers follow the core, as dropout's did under ``benchmarks/cpu_table.py --drift``)."""
    found = cpu_table()["rtd_sampling"]
    if logits is None:
        logits = s.tokens * s.labelled_share * s.models[0].vocab_size
    ns = found["fp32_ns_per_logit" if s.precision == "fp32" else "bf16_ns_per_logit"]
    return logits * ns * 1e-9 * _core_ratio(gpu, "rtd_sampling_probe")


def _deepspeed_costs(section: str, s: Setting) -> dict[str, float]:
    """The table's DeepSpeed ``section`` at ``s``'s ZeRO stage (ZeRO 3, which the table does not measure: ZeRO 2's)
    and precision: fp32's, or for half precision bf16's (its FP16_UnfusedOptimizer or ZeRO's fp32 master copies,
    and gradients of half the bytes; fp16 runs the same optimizers and reads them too)."""
    return cpu_table()[section if s.precision == "fp32" else f"{section}_bf16"][str(min(s.zero, 2))]


def _deepspeed(s: Setting, gpu: GpuKind, what: str) -> float:
    """Seconds of DeepSpeed's ``what`` (reduction, step) for ``s``: the table's CPU ns per parameter at the run's
    ZeRO stage and precision, scaled by the cores' speeds (:func:`_core_ratio`: what these costs were measured to
    follow, not the copy bandwidth) and, for a ring over ``W`` ranks, by the bytes each rank moves (``(W-1)/W``,
    the table's at 2 ranks)."""
    ns = _deepspeed_costs("deepspeed", s)[what]
    ring = 2 * (s.ranks - 1) / s.ranks if s.ranks > 1 else 0.0
    per_parameter = ns * s.params * 1e-9 * _core_ratio(gpu) * (ring if what == "reduction" else 1.0)
    return per_parameter + _per_tensor(s, gpu, what)


def _per_tensor(s: Setting, gpu: GpuKind, what: str) -> float:
    """Seconds of DeepSpeed's ``what`` that go with the count of parameter tensors, not their size (a loop in
    Python over them: the table's many small tensors less their per-parameter cost), scaled as per-call work."""
    ns = _deepspeed_costs("deepspeed_per_tensor", s)[what]
    return ns * s.param_tensors * 1e-9 * _core_ratio(gpu)


def optimizer_seconds(s: Setting, gpu: GpuKind, a: Assumptions) -> float:
    """DeepSpeed's optimizer step as the table measured it: AdamW over the rank's shard, ZeRO's copies around it
    and, at ZeRO 1-2, the new weights' all-gather (all in ``engine.step``)."""
    return _deepspeed(s, gpu, "step")


def communication_seconds(s: Setting, gpu: GpuKind, nodes: int, grad_accum: int, backward_s: float,
                          micro_s: float, a: Assumptions) -> dict[str, float]:
    """DeepSpeed's gradient reduction as the table measured it (gloo's all-reduce of every gradient and the copies
    into and out of its bucket), none hidden: after the last micro-batch at ZeRO 0-1, after each at ZeRO 2-3;
    ZeRO 3 also gathers the weights for the forward. The all-gather after the step is the optimizer's."""
    found = {"gradient communication": 0.0, "optimizer": 0.0, "forward": 0.0}
    if s.ranks == 1:
        return found
    reductions = grad_accum if s.zero >= 2 else 1
    found["gradient communication"] = _deepspeed(s, gpu, "reduction") * reductions
    if s.zero == 3:
        found["forward"] = _deepspeed(s, gpu, "reduction") / 2 * grad_accum
    return found
