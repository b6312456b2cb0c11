"""The CPU costs the plan's time model reads for CPU ranks (``train/plan/cpu_table.json``), measured here.

    python benchmarks/cpu_table.py            # one thread; a minute or two; writes train/plan/cpu_table.json
    python benchmarks/cpu_table.py --print    # the table as markdown, from the committed file

What the GPU plan reads from the attention judge's table and the datasheets, the CPU plan reads from this: the
reference kernels' disentangled attention (forward and backward ms per token per head, by head size, position
span, sequence length and dropout), an encoder layer's ops around its GEMMs and attention (ns per token, by
hidden size, sequence length and dropout: the layer run with its GEMMs and attention taken out), the per-element cost (ns, forward + backward) of the ops of the embeddings and the MLM head (LayerNorm
with its residual add, bias + GELU, dropout, the loss per logit, the tied word table's gradient), and
DeepSpeed's gradient reduction (gloo's all-reduce and the copies around it) and optimizer step (AdamW, ZeRO's
copies, the weights' all-gather) on two CPU ranks at ZeRO 0-2 (CPU ns per parameter, on a stack of linear
layers: no DeBERTa model goes into the table). The probe's figures of this machine at the time (GEMM rates, copy
bandwidth) are stored with them: another machine's plan scales attention by the ratio of fp32 GEMM rates and
the per-element costs by the ratio of copy bandwidths. Times are CPU time of the measuring thread, as the
probe's, so a shared machine measures about what an idle one would; the load average is recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from distaff import kernels
from distaff.kernels import reference
from distaff.train.model.config import load_model_config
from distaff.train.model.deberta import Encoder
from distaff.train.plan.cpu import probe
from distaff.train.plan.cpu_time import CPU_TABLE

TOKENS, HEADS = 2048, 4
HEAD_DIMS, SPANS, LENGTHS, DROPOUTS = (32, 64), (16, 32, 256), (64, 128, 256), (0.0, 0.1)
ELEMENTS = 1 << 20


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


def attention_row(head_dim: int, span: int, n: int, dropout: float) -> dict:
    """The reference attention's forward and backward ms per token per head (a padded batch, every token real)."""
    batch = TOKENS // n
    q, k, v = (torch.randn(batch, HEADS, n, head_dim, requires_grad=True) for _ in range(3))
    kr, qr = (torch.randn(HEADS, 2 * span, head_dim) for _ in range(2))
    mask, grad = torch.ones(batch, n, dtype=torch.long), torch.randn(batch, HEADS, n, head_dim)

    def run():
        return reference.disentangled_attention(q, k, v, kr, qr, position_buckets=span, max_relative_positions=512,
                                                attention_mask=mask, dropout_p=dropout)

    forward = best_seconds(run)
    both = best_seconds(lambda: torch.autograd.grad(run(), (q, k, v), grad))
    return {"head_dim": head_dim, "span": span, "n": n, "dropout": dropout, "tokens": TOKENS, "heads": HEADS,
            "fwd_ms": forward * 1e3, "bwd_ms": max(0.0, both - forward) * 1e3}


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
    batch = 1024 // n
    x = torch.randn(batch, n, hidden, requires_grad=True)
    mask = torch.ones(batch, n, dtype=torch.long)

    def layer():
        out, _ = encoder.layer[0](x, mask, encoder.rel_table())
        out.sum().backward()

    with without_gemms_and_attention():
        rest = best_seconds(layer)
    return {"hidden": hidden, "n": n, "dropout": dropout, "ns_per_token": rest / (batch * n) * 1e9}


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


def deepspeed_rank(rank: int, port: int) -> None:
    """One of two ranks timing DeepSpeed's gradient reduction (``engine.allreduce_gradients``) and optimizer step
    on CPU ranks at ZeRO 0, 1 and 2 (fp32, distaff's engine settings): the process's CPU ns per parameter."""
    from torch import nn

    from distaff.train.core.distributed import init_distributed
    from distaff.train.run.config import config_from_dict
    from distaff.train.run.engine import initialize

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed(600)
    found = {}
    for zero in (0, 1, 2):
        model = nn.Sequential(*(nn.Linear(DS_WIDTH, DS_WIDTH) for _ in range(DS_LAYERS)))
        cfg = config_from_dict({"model": {"preset": "tiny"}, "data": {"dir": "unused", "batch_size": 8},
                                "train": {"precision": "fp32"}, "zero": {"stage": zero}})
        engine = initialize(model, cfg, 2)
        params = sum(p.numel() for p in model.parameters())
        spent = {"reduction": 0.0, "step": 0.0}
        reduce = engine.allreduce_gradients

        def timed(*args, **kwargs):
            started = time.process_time()
            reduce(*args, **kwargs)
            spent["reduction"] += time.process_time() - started

        engine.allreduce_gradients = timed
        x = torch.randn(8, DS_WIDTH)
        for step in range(4):
            if step == 1:
                spent.update(reduction=0.0, step=0.0)
            engine.backward(engine(x).square().mean())
            started = time.process_time()
            engine.step()
            spent["step"] += time.process_time() - started
        found[str(zero)] = {key: value / 3 / params * 1e9 for key, value in spent.items()}
        engine.destroy()
    if rank == 0:
        print(json.dumps(found))
    torch.distributed.barrier()


def _two_ranks(flag: str) -> dict:
    """Run this script's ``flag`` rank program on two processes; rank 0's JSON."""
    from distaff.train.core.distributed import free_port

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    procs = [subprocess.Popen([sys.executable, __file__, flag, str(rank), "--port", str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for rank in (0, 1)]
    outputs = [proc.communicate(timeout=900)[0] for proc in procs]
    return json.loads(outputs[0].strip().splitlines()[-1])


def measure() -> dict:
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows = [attention_row(d, span, n, p) for d in HEAD_DIMS for span in SPANS for n in LENGTHS for p in DROPOUTS]
    rests = [layer_rest_row(hidden, heads, span, n, p) for hidden, heads, span in LAYERS for n in (64, 128)
             for p in DROPOUTS]
    return {"layer_rest": rests,"source": "benchmarks/cpu_table.py on one thread: the reference kernels' costs (no GPU)",
            "regenerate": "python benchmarks/cpu_table.py", "probe": probe(),
            "attention": rows, "elementwise_ns": {"fp32": elementwise_ns(torch.float32),
                                                  "bf16": elementwise_ns(torch.bfloat16)},
            "deepspeed": _two_ranks("--deepspeed-rank"), "load_average": os.getloadavg()[0],
            "seconds": round(time.perf_counter() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--print", action="store_true", help="print the committed table, measure nothing")
    parser.add_argument("--out", type=Path, default=CPU_TABLE)
    parser.add_argument("--deepspeed-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.deepspeed_rank is not None:
        deepspeed_rank(args.deepspeed_rank, args.port)
        return 0
    table = json.loads(args.out.read_text()) if args.print else measure()
    if not args.print:
        args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"probe: {table['probe']['gemm_gflops']} GFLOP/s per thread, copy {table['probe']['copy_gb_s']:.1f} GB/s, "
          f"load {table['load_average']:.1f}")
    print(f"| d | span | N | dropout | fwd ms | bwd ms |  ({TOKENS} tokens x {HEADS} heads)\n|---|---|---|---|---|---|")
    for r in table["attention"]:
        print(f"| {r['head_dim']} | {r['span']} | {r['n']} | {r['dropout']:g} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} |")
    for dtype, costs in table["elementwise_ns"].items():
        print(dtype, {k: round(v, 2) for k, v in costs.items()})
    print("layer rest ns/token:", [(r["hidden"], r["n"], r["dropout"], round(r["ns_per_token"])) for r in table["layer_rest"]])
    print(f"DeepSpeed on 2 CPU ranks, CPU ns per parameter: {table['deepspeed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
