"""The CPU costs the plan's time model reads for CPU ranks (``train/plan/cpu_table.json``), measured here.

    python benchmarks/cpu_table.py            # one thread; a few minutes; writes train/plan/cpu_table.json
    python benchmarks/cpu_table.py --print    # the table as markdown, from the committed file
    python benchmarks/cpu_table.py --attention-only            # the attention rows and their probe (a minute or two)
    python benchmarks/cpu_table.py --half-precision-deepspeed  # DeepSpeed's bf16 costs (bf16 / fp32 ratios, 20 s)
    python benchmarks/cpu_table.py --fixed-only                # the per-call and per-tensor costs
    python benchmarks/cpu_table.py --drift                     # which probe figure the costs follow
    python benchmarks/cpu_table.py --sampling-only             # RTD's replacement draw per logit (seconds)

What the GPU plan reads from the attention judge's table and the datasheets, the CPU plan reads from this: the
reference kernels' disentangled attention (forward and backward ms per token per head, by head size, position
span, sequence length, dropout and the inputs' dtype, with the probe taken beside them), an encoder layer's ops around its GEMMs and attention (ns per token, by
hidden size, sequence length and dropout: the layer run with its GEMMs and attention taken out), the per-element cost (ns, forward + backward) of the ops of the embeddings and the MLM head (LayerNorm
with its residual add, bias + GELU, dropout, the loss per logit, the tied word table's gradient), and
DeepSpeed's gradient reduction (gloo's all-reduce and the copies around it) and optimizer step (AdamW, ZeRO's
copies, the weights' all-gather) on two CPU ranks at ZeRO 0-2 (CPU ns per parameter, on a stack of linear
layers: no DeBERTa model goes into the table), in fp32 and, as fp32's times their ratio measured side by side,
bf16. The probe's figures of this machine at the time (GEMM rates, copy
bandwidth) are stored with them: another machine's plan scales attention by the ratio of fp32 GEMM rates and
the per-element costs by the ratio of copy bandwidths and DeepSpeed's by that of the cores' small-GEMM
rates (what each was measured to follow, ``--drift``). Times are CPU time of the measuring thread, as the
probe's, which a shared machine inflates far less than wall time, though not nothing (its caches and memory
bandwidth are shared: the same rows measured at load 5 and at load 1.7 differ by up to 1.6x relative to their
probes, docs/plan.md); the load average is recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from distaff import kernels
from distaff.kernels import reference
from distaff.train.model.config import load_model_config
from distaff.train.model.deberta import DebertaForMaskedLM, Encoder
from distaff.train.model.rtd import ReplacedTokenDetection, ReplacementSampler
from distaff.train.model.flops import layer_applications
from distaff.train.plan.cpu import probe
from distaff.train.plan.cpu_time import CPU_TABLE

# 3,072 tokens per attention row: 48 x 64 to 6 x 512, none of them a shape benchmarks/plan_time.py trains
TOKENS, HEADS = 3072, 4
HEAD_DIMS, SPANS, LENGTHS, DROPOUTS = (32, 64), (16, 32, 256), (64, 128, 256, 512), (0.0, 0.1)
# the inputs' dtypes: half-precision attention runs in float32 in the reference, but its casts and its
# float32 copies of Q/K/V and their gradients are work an fp32 row does not have
ATTENTION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ELEMENTS = 1 << 20
LAYER_REST_TOKENS = 1024   # tokens of each layer_rest row
FIXED_TOKENS = 8           # tokens of the per-call (fixed) calibration: its cost is nearly all per-call work
# RTD's sampling probe (512 rows x 4,000 logits), and the vocabulary of the per-call probe's RTD pair: the plan takes
# that pair's draws out of its per-call figure with the sampling probe's vocabulary
SAMPLE_ROWS, SAMPLE_WIDTH, SAMPLE_VOCAB = 512, 128, 4000


def best_seconds(fn, repeat: int = 5) -> float:
    """The least CPU time of this thread (``time.thread_time``) over ``repeat`` runs after a warm-up: the cost
    to a core, as the probe measures it, whatever else the machine runs."""
    fn()
    times = []
    for _ in range(repeat):
        started = time.thread_time()
        fn()
        times.append(time.thread_time() - started)
    return min(times)


def attention_row(head_dim: int, span: int, n: int, dropout: float, precision: str = "fp32") -> dict:
    """The reference attention's forward and backward ms of :data:`TOKENS` tokens x :data:`HEADS` heads (a padded
    batch, every token real) on ``precision``'s inputs."""
    batch, dtype = TOKENS // n, ATTENTION_DTYPES[precision]
    q, k, v = (torch.randn(batch, HEADS, n, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
    kr, qr = (torch.randn(HEADS, 2 * span, head_dim, dtype=dtype) for _ in range(2))
    mask, grad = torch.ones(batch, n, dtype=torch.long), torch.randn(batch, HEADS, n, head_dim, dtype=dtype)

    def run():
        return reference.disentangled_attention(q, k, v, kr, qr, position_buckets=span, max_relative_positions=512,
                                                attention_mask=mask, dropout_p=dropout)

    forward = best_seconds(run)
    both = best_seconds(lambda: torch.autograd.grad(run(), (q, k, v), grad))
    return {"head_dim": head_dim, "span": span, "n": n, "dropout": dropout, "precision": precision,
            "tokens": TOKENS, "heads": HEADS, "fwd_ms": forward * 1e3, "bwd_ms": max(0.0, both - forward) * 1e3}


LAYERS = ((128, 4, 32), (384, 6, 256), (768, 12, 256))      # (hidden, heads, position span): tiny, xsmall, base


@contextlib.contextmanager
def without_gemms_and_attention():
    """Inside: every ``F.linear`` returns a broadcast view of its input (no multiply; its backward a sum) and the
    attention op returns its values as they are, so a layer runs only the ops around them."""
    linear, attention = F.linear, kernels.disentangled_attention

    def no_gemm(x, weight, bias=None):
        return x.narrow(-1, 0, 1).expand(*x.shape[:-1], weight.shape[0])

    F.linear = no_gemm
    kernels.disentangled_attention = lambda q, k, v, *args, **kwargs: v.view_as(v)
    try:
        yield
    finally:
        F.linear, kernels.disentangled_attention = linear, attention


def layer_rest_row(hidden: int, heads: int, span: int, n: int, dropout: float) -> dict:
    """An encoder layer's forward and backward on the reference path with its GEMMs and attention taken out
    (:func:`without_gemms_and_attention`): the ops around them (LayerNorms, GELU, dropout, relayouts, residuals,
    the framework's work per op), ns per token."""
    cfg = load_model_config("tiny", hidden_size=hidden, intermediate_size=4 * hidden, num_attention_heads=heads,
                            position_buckets=span, max_position_embeddings=512, hidden_dropout_prob=dropout,
                            attention_probs_dropout_prob=dropout, kernel_impl="reference", attention_impl="reference")
    encoder = Encoder(cfg)
    batch = LAYER_REST_TOKENS // n
    x = torch.randn(batch, n, hidden, requires_grad=True)
    mask = torch.ones(batch, n, dtype=torch.long)

    def layer():
        out, _ = encoder.layer[0](x, mask, encoder.rel_table())
        out.sum().backward()

    with without_gemms_and_attention():
        rest = best_seconds(layer)
    return {"hidden": hidden, "n": n, "dropout": dropout, "ns_per_token": rest / (batch * n) * 1e9}


def _few_tokens_ms(model: torch.nn.Module, vocab_size: int) -> tuple[float, float]:
    """CPU ms of ``model``'s forward and of its forward + backward at :data:`FIXED_TOKENS` tokens: at so few
    tokens nearly all of it is the per-call work (Python, modules, autograd, dispatch)."""
    model.train()
    ids = torch.randint(5, vocab_size, (1, FIXED_TOKENS))
    labels = ids.masked_fill(torch.arange(FIXED_TOKENS) % 2 == 0, -100)
    mask = torch.ones(1, FIXED_TOKENS, dtype=torch.long)

    def forward():
        return model(ids, mask, labels=labels).loss

    return best_seconds(forward, 15) * 1e3, best_seconds(lambda: forward().backward(), 15) * 1e3


def _model_ms(layers: int, dropout: float) -> tuple[float, float]:
    """:func:`_few_tokens_ms` of a tiny MLM model of ``layers`` layers on the reference path."""
    cfg = load_model_config("tiny", vocab_size=4000, num_hidden_layers=layers, hidden_dropout_prob=dropout,
                            attention_probs_dropout_prob=dropout, kernel_impl="reference", attention_impl="reference")
    return _few_tokens_ms(DebertaForMaskedLM(cfg), cfg.vocab_size)


def _rtd_ms(row: dict) -> dict[str, float]:
    """The RTD wrapper's own per-call work (the replacement's sampling, the discriminator's input and head, the
    two losses' weighting): the tiny-rtd-cpu pair at a few tokens less its two models' layers and rest (``row``)."""
    from distaff.train.plan.planner import models_of
    from distaff.train.run.config import load_config

    generator, discriminator = (replace(m, vocab_size=SAMPLE_VOCAB, kernel_impl="reference", attention_impl="reference")
                                for m in models_of(load_config("tiny-rtd-cpu", ["data.dir=unused"])))
    forward, both = _few_tokens_ms(ReplacedTokenDetection(generator, discriminator), SAMPLE_VOCAB)
    models = {stage: sum(layer_applications(m) * row["layer_ms"][stage] + row["model_ms"][stage]
                         for m in (generator, discriminator)) for stage in ("forward", "backward")}
    return {"forward": max(0.0, forward - models["forward"]), "backward": max(0.0, both - forward - models["backward"])}


def rest_fixed_ms(dropout: float) -> float:
    """CPU ms of one layer's ops around its GEMMs and attention (forward + backward) at :data:`FIXED_TOKENS`
    tokens: the part of a ``layer_rest`` row that does not grow with its tokens (:func:`layer_rest_row`)."""
    cfg = load_model_config("tiny", hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                            kernel_impl="reference", attention_impl="reference")
    encoder = Encoder(cfg)
    x = torch.randn(1, FIXED_TOKENS, cfg.hidden_size, requires_grad=True)
    mask = torch.ones(1, FIXED_TOKENS, dtype=torch.long)

    def layer():
        out, _ = encoder.layer[0](x, mask, encoder.rel_table())
        out.sum().backward()

    with without_gemms_and_attention():
        return best_seconds(layer, 9) * 1e3


def fixed_ms() -> list[dict]:
    """The per-step work that does not grow with the tokens (issue 50: a small model's step is mostly this), per
    dropout: one layer application's forward and backward (the slope of two tiny models, 4 and 8 layers, at
    :data:`FIXED_TOKENS` tokens), the rest of the model (embeddings, EMD's setup, the head and its loss: the
    4-layer model less its layer applications), and the layer-rest rows' own share of it (to take out of them)."""
    rows = []
    for dropout in DROPOUTS:
        (fwd4, all4), (fwd8, all8) = _model_ms(4, dropout), _model_ms(8, dropout)
        applications = layer_applications(load_model_config("tiny", num_hidden_layers=4))
        layer_fwd, layer_all = (fwd8 - fwd4) / 4, (all8 - all4) / 4
        rows.append({"dropout": dropout, "tokens": FIXED_TOKENS,
                     "layer_ms": {"forward": layer_fwd, "backward": layer_all - layer_fwd},
                     "model_ms": {"forward": max(0.0, fwd4 - applications * layer_fwd),
                                  "backward": max(0.0, all4 - fwd4 - applications * (layer_all - layer_fwd))},
                     "layer_rest_ms": rest_fixed_ms(dropout), "layer_rest_tokens": LAYER_REST_TOKENS})
        rows[-1]["rtd_ms"] = _rtd_ms(rows[-1])
    return rows


def rtd_sampling() -> dict:
    """RTD's draw of a replacement per labelled row (the generator's ``ReplacementSampler``: the rows' logits
    again, in float32, Gumbel noise from ``exponential_``, their log and an argmax), ns per logit in fp32 and bf16
    rows: forward-only work the loss-per-logit row does not stand for (its random numbers cost several times a
    loss's per logit), with the probe of the cores it was measured on (the plan scales it by that one)."""
    torch.set_num_threads(1)
    sampler, found = ReplacementSampler(0), {"rows": SAMPLE_ROWS, "vocab": SAMPLE_VOCAB}
    cores = probe()
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        rows = torch.randn(SAMPLE_ROWS, SAMPLE_WIDTH, dtype=dtype)
        weight = torch.randn(SAMPLE_VOCAB, SAMPLE_WIDTH, dtype=dtype)
        seconds = best_seconds(lambda: sampler.sample(rows, weight, None, True), 9)
        found[f"{name}_ns_per_logit"] = seconds / (SAMPLE_ROWS * SAMPLE_VOCAB) * 1e9
    return {"rtd_sampling": found, "rtd_sampling_probe": cores}


def _fwd_bwd_ns(make, fn, elements: int) -> float:
    """ns per element of ``fn``'s forward and backward on fresh inputs from ``make``."""
    inputs = make()
    out = fn(*inputs)
    grad = torch.randn_like(out)
    needs = [x for x in inputs if x.requires_grad]
    return best_seconds(lambda: torch.autograd.grad(fn(*inputs), needs, grad)) / elements * 1e9


def elementwise_ns(dtype: torch.dtype) -> dict[str, float]:
    rows, width = ELEMENTS // 512, 512

    def act(*shape, grad=True):
        return torch.randn(*shape, dtype=dtype, requires_grad=grad)

    weight, bias = torch.ones(width, dtype=dtype, requires_grad=True), torch.zeros(width, dtype=dtype, requires_grad=True)
    found = {
        "layer_norm_residual": _fwd_bwd_ns(lambda: (act(rows, width), act(rows, width)),
                                           lambda x, r: reference.layer_norm(x, weight, bias, 1e-7, r), ELEMENTS),
        "bias_gelu": _fwd_bwd_ns(lambda: (act(rows, width), bias), reference.bias_gelu, ELEMENTS),
        "dropout": _fwd_bwd_ns(lambda: (act(rows, width),), lambda x: F.dropout(x, 0.1, True), ELEMENTS),
    }
    vocab = 8192
    logits_rows = ELEMENTS // vocab
    targets = torch.randint(0, vocab, (logits_rows,))
    found["mlm_loss_per_logit"] = _fwd_bwd_ns(
        lambda: (act(logits_rows, vocab).float().detach().requires_grad_(),),
        lambda x: F.cross_entropy(x, targets, reduction="sum") + 0 * x.argmax(-1).sum(), ELEMENTS)
    table = torch.zeros(ELEMENTS, dtype=dtype)
    found["table_gradient"] = best_seconds(lambda: torch.zeros(ELEMENTS, dtype=dtype).add_(table)) / ELEMENTS * 1e9
    return found


DS_LAYERS, DS_WIDTH = 16, 1024      # the DeepSpeed probe's model: 16 linear layers of 1024 x 1024 (16.8M parameters)
DS_SMALL_LAYERS, DS_SMALL_WIDTH = 128, 16     # and its per-tensor probe: 256 tensors of 16 x 16 or 16 (35K parameters)


def _deepspeed_ns(model, zero: int, precision: str = "fp32") -> dict[str, float]:
    """This process's CPU ns of ``model``'s gradient reduction (``engine.allreduce_gradients``) and optimizer step
    at ZeRO ``zero`` in ``precision`` (distaff's engine settings), the mean of three steps after a first."""
    from distaff.train.run.config import config_from_dict
    from distaff.train.run.engine import initialize

    cfg = config_from_dict({"model": {"preset": "tiny"}, "data": {"dir": "unused", "batch_size": 8},
                            "train": {"precision": precision}, "zero": {"stage": zero}})
    engine = initialize(model, cfg, 2)
    spent = {"reduction": 0.0, "step": 0.0}
    reduce = engine.allreduce_gradients

    def timed(*args, **kwargs):
        started = time.process_time()
        reduce(*args, **kwargs)
        spent["reduction"] += time.process_time() - started

    engine.allreduce_gradients = timed
    x = torch.randn(8, model[0].in_features, dtype=next(engine.module.parameters()).dtype)
    for step in range(4):
        if step == 1:
            spent.update(reduction=0.0, step=0.0)
        engine.backward(engine(x).square().mean())
        started = time.process_time()
        engine.step()
        spent["step"] += time.process_time() - started
    engine.destroy()
    return {key: value / 3 * 1e9 for key, value in spent.items()}


def _deepspeed_costs(zero: int, precision: str, floor: float) -> tuple[dict[str, float], dict[str, float]]:
    """DeepSpeed's reduction and step at ZeRO ``zero`` in ``precision``: CPU ns per parameter (a stack of large
    linear layers), and ns per parameter tensor beyond that (a stack of :data:`DS_SMALL_LAYERS` small ones: a small
    model's step is mostly per-tensor work, issue 50), at least ``floor``."""
    from torch import nn

    large = nn.Sequential(*(nn.Linear(DS_WIDTH, DS_WIDTH) for _ in range(DS_LAYERS)))
    small = nn.Sequential(*(nn.Linear(DS_SMALL_WIDTH, DS_SMALL_WIDTH) for _ in range(DS_SMALL_LAYERS)))
    per_param = {key: ns / sum(p.numel() for p in large.parameters())
                 for key, ns in _deepspeed_ns(large, zero, precision).items()}
    params, tensors = sum(p.numel() for p in small.parameters()), len(list(small.parameters()))
    per_tensor = {key: max(floor, ns - per_param[key] * params) / tensors
                  for key, ns in _deepspeed_ns(small, zero, precision).items()}
    return per_param, per_tensor


def _start_rank(rank: int, port: int) -> None:
    """Join the two ranks' gloo group on one thread."""
    from distaff.train.core.distributed import init_distributed

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed(600)


def deepspeed_rank(rank: int, port: int) -> None:
    """One of two ranks timing DeepSpeed's gradient reduction and optimizer step on CPU ranks at ZeRO 0, 1 and 2
    in fp32 (:func:`_deepspeed_costs`)."""
    _start_rank(rank, port)
    per_param, per_tensor = {}, {}
    for zero in (0, 1, 2):
        per_param[str(zero)], per_tensor[str(zero)] = _deepspeed_costs(zero, "fp32", 0.0)
    if rank == 0:
        print(json.dumps({"deepspeed": per_param, "deepspeed_per_tensor": per_tensor}))
    torch.distributed.barrier()


def half_precision_rank(rank: int, port: int) -> None:
    """One of two ranks timing DeepSpeed's reduction and step in bf16 and fp32, side by side in the same processes
    (bf16 runs DeepSpeed's FP16_UnfusedOptimizer at ZeRO 0 and fp32 master copies at ZeRO 1-2: other work per
    parameter and per tensor): the ratio of bf16's to fp32's per parameter and per tensor, by stage."""
    _start_rank(rank, port)
    ratios = {"deepspeed": {}, "deepspeed_per_tensor": {}}
    for zero in (0, 1, 2):
        # a floor of 1 ns a tensor keeps the ratio finite where noise leaves no per-tensor work
        fp32, bf16 = (_deepspeed_costs(zero, precision, 1.0) for precision in ("fp32", "bf16"))
        for index, section in enumerate(ratios.values()):
            section[str(zero)] = {key: bf16[index][key] / fp32[index][key] for key in fp32[index]}
    if rank == 0:
        print(json.dumps(ratios))
    torch.distributed.barrier()


def half_precision_deepspeed(table: dict) -> dict:
    """The table's DeepSpeed costs in bf16: its fp32 figures times the bf16 / fp32 ratios measured side by side
    (:func:`half_precision_rank`), so both precisions stand on the machine state the fp32 figures were taken in."""
    ratios = _two_ranks("--half-precision-rank")
    return {f"{section}_bf16": {zero: {key: table[section][zero][key] * ratio for key, ratio in by_key.items()}
                                for zero, by_key in ratios[section].items()} for section in ratios}


def _two_ranks(flag: str) -> dict:
    """Run this script's ``flag`` rank program on two processes; rank 0's JSON."""
    from distaff.train.core.distributed import free_port

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    procs = [subprocess.Popen([sys.executable, __file__, flag, str(rank), "--port", str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for rank in (0, 1)]
    outputs = [proc.communicate(timeout=900)[0] for proc in procs]
    return json.loads(outputs[0].strip().splitlines()[-1])


def attention_rows() -> dict:
    """Every attention row, with the probe of the cores they were measured on (the plan scales them by it)."""
    return {"attention_probe": probe(),
            "attention": [attention_row(d, span, n, p, precision) for precision in ATTENTION_DTYPES
                          for d in HEAD_DIMS for span in SPANS for n in LENGTHS for p in DROPOUTS],
            "attention_load_average": os.getloadavg()[0]}


def measure() -> dict:
    torch.set_num_threads(1)
    started = time.perf_counter()
    rests = [layer_rest_row(hidden, heads, span, n, p) for hidden, heads, span in LAYERS for n in (64, 128)
             for p in DROPOUTS]
    table = {"layer_rest": rests, "source": "benchmarks/cpu_table.py on one thread: the reference kernels' costs (no GPU)",
            "regenerate": "python benchmarks/cpu_table.py", "probe": probe(),
            **attention_rows(), "elementwise_ns": {"fp32": elementwise_ns(torch.float32),
                                                  "bf16": elementwise_ns(torch.bfloat16)},
            **_two_ranks("--deepspeed-rank"), "fixed_ms": fixed_ms(), **rtd_sampling(),
            "load_average": os.getloadavg()[0],
            "seconds": round(time.perf_counter() - started, 1)}
    return {**table, **half_precision_deepspeed(table)}


def drift(table: dict) -> dict:
    """How the committed table's DeepSpeed per-parameter costs and elementwise rows moved since they were measured,
    beside how the probe's figures moved: which probe figure each follows (the plan scales each by that one). The
    ratios are the table's cost over today's, so a faster machine reads above 1."""
    torch.set_num_threads(1)
    before = probe()
    elementwise = elementwise_ns(torch.float32)
    deepspeed = _two_ranks("--deepspeed-rank")["deepspeed"]
    after = probe()
    def small(figures: dict) -> float:        # the small-GEMM rate the plan's _core_ratio reads
        return figures["gemm_gflops"][0][1]

    then = table["probe"]
    return {"date": after["date"], "load_average": after["load_average"],
            "core": (small(before) + small(after)) / 2 / small(then),
            "copy": (before["copy_gb_s"] + after["copy_gb_s"]) / 2 / then["copy_gb_s"],
            "elementwise": {k: table["elementwise_ns"]["fp32"][k] / v for k, v in elementwise.items()},
            "deepspeed": {zero: {k: table["deepspeed"][zero][k] / v for k, v in costs.items()}
                          for zero, costs in deepspeed.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--print", action="store_true", help="print the committed table, measure nothing")
    parser.add_argument("--out", type=Path, default=CPU_TABLE)
    parser.add_argument("--fixed-only", action="store_true",
                        help="measure only the per-call (fixed) costs into the committed table, keep the rest")
    parser.add_argument("--attention-only", action="store_true",
                        help="measure only the attention rows (and their probe) into the committed table, keep the rest")
    parser.add_argument("--half-precision-deepspeed", action="store_true",
                        help="add DeepSpeed's bf16 costs (measured beside fp32) to the committed table, keep the rest")
    parser.add_argument("--sampling-only", action="store_true",
                        help="measure only RTD's sampling (and its probe) into the committed table, keep the rest")
    parser.add_argument("--drift", action="store_true",
                        help="remeasure the DeepSpeed and elementwise costs and print how far they and the probe moved")
    parser.add_argument("--deepspeed-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--half-precision-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.deepspeed_rank is not None:
        deepspeed_rank(args.deepspeed_rank, args.port)
        return 0
    if args.half_precision_rank is not None:
        half_precision_rank(args.half_precision_rank, args.port)
        return 0
    if args.drift:
        print(json.dumps(drift(json.loads(args.out.read_text())), indent=1))
        return 0
    if args.fixed_only:
        torch.set_num_threads(1)
        deepspeed = _two_ranks("--deepspeed-rank")["deepspeed_per_tensor"]
        table = {**json.loads(args.out.read_text()), "fixed_ms": fixed_ms(), "deepspeed_per_tensor": deepspeed,
                 "fixed_load_average": os.getloadavg()[0]}
    elif args.half_precision_deepspeed:
        table = json.loads(args.out.read_text())
        table.update(half_precision_deepspeed(table), half_precision_load_average=os.getloadavg()[0])
    elif args.sampling_only:
        table = {**json.loads(args.out.read_text()), **rtd_sampling()}
    elif args.attention_only:
        torch.set_num_threads(1)
        table = {**json.loads(args.out.read_text()), **attention_rows()}
    else:
        table = json.loads(args.out.read_text()) if args.print else measure()
    if not args.print:
        args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"probe: {table['probe']['gemm_gflops']} GFLOP/s per thread, copy {table['probe']['copy_gb_s']:.1f} GB/s, "
          f"load {table['load_average']:.1f}")
    print(f"| d | span | N | dropout | inputs | fwd ms | bwd ms |  ({TOKENS} tokens x {HEADS} heads)\n"
          "|---|---|---|---|---|---|---|")
    for r in table["attention"]:
        print(f"| {r['head_dim']} | {r['span']} | {r['n']} | {r['dropout']:g} | {r['precision']} | "
              f"{r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} |")
    for dtype, costs in table["elementwise_ns"].items():
        print(dtype, {k: round(v, 2) for k, v in costs.items()})
    print("layer rest ns/token:", [(r["hidden"], r["n"], r["dropout"], round(r["ns_per_token"])) for r in table["layer_rest"]])
    print("fixed (per-call) ms per step:", table.get("fixed_ms"))
    print(f"DeepSpeed on 2 CPU ranks, CPU ns per parameter: {table['deepspeed']}, "
          f"per tensor beyond it: {table.get('deepspeed_per_tensor')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
