"""Benchmark distaff's fused training ops against eager PyTorch, torch.compile and Liger-Kernel.

On one GPU, for DeBERTa-v3-base shapes (32 x 512 tokens, hidden 768, FFN 3072, vocab 128100,
15% of positions labelled, bf16), times forward and forward+backward of:

- residual-add + LayerNorm,
- bias-add + erf GELU on the FFN intermediate,
- the masked-LM loss (vocabulary projection + cross-entropy + gradients of hidden/weight/bias),

and reports the peak memory each forward+backward allocates on top of its inputs. Prints one
markdown table with the device and library versions. Peers that are not installed are listed as
"not installed". ``--cpu-smoke`` runs tiny shapes on the CPU under ``TRITON_INTERPRET=1`` to check
the script itself; its timings mean nothing.

    python benchmarks/ops.py [--repeats 20] [--output table.md]
    python benchmarks/ops.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shapes:
    tokens: int
    hidden: int
    intermediate: int
    vocab: int
    labelled_fraction: float
    dtype: torch.dtype


DEBERTA_V3_BASE = Shapes(tokens=32 * 512, hidden=768, intermediate=3072, vocab=128100,
                         labelled_fraction=0.15, dtype=torch.bfloat16)
CPU_SMOKE = Shapes(tokens=64, hidden=64, intermediate=256, vocab=500, labelled_fraction=0.15, dtype=torch.float32)
EPS = 1e-7


@dataclass
class Row:
    op: str
    impl: str
    forward_ms: str
    train_ms: str
    peak_mib: str
    note: str = ""


# --------------------------------------------------------------------------- measurement


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    for _ in range(3):  # warm-up: compilation, autotuning, allocator
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _peak_mib(fn: Callable[[], object], device: torch.device) -> str:
    if device.type != "cuda":
        return "n/a (CPU)"
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    fn()
    _sync(device)
    return f"{(torch.cuda.max_memory_allocated(device) - baseline) / 2**20:.0f}"


def _measure(op: str, impl: str, forward: Callable[[], torch.Tensor], leaves: list[torch.Tensor],
             device: torch.device, repeats: int, note: str = "") -> Row:
    """Time ``forward`` alone and followed by ``.backward()`` with a fixed random output gradient;
    the leaves' grads are reset each step so accumulation is not counted."""
    def train_step():
        for t in leaves:
            t.grad = None
        forward().backward(grad_out)

    try:
        with torch.no_grad():
            probe = forward()
        grad_out = torch.randn_like(probe) if probe.dim() else torch.ones_like(probe)
        del probe
        with torch.no_grad():
            forward_ms = _median_ms(forward, device, repeats)
        train_ms = _median_ms(train_step, device, repeats)
        peak = _peak_mib(train_step, device)
    except Exception as error:  # one failing peer (OOM, compiler) must not cost the whole table
        return Row(op, impl, "-", "-", "-", f"failed: {type(error).__name__}: {str(error).splitlines()[0][:80]}")
    return Row(op, impl, f"{forward_ms:.3f}", f"{train_ms:.3f}", peak, note)


def _unavailable(op: str, impl: str, why: str) -> Row:
    return Row(op, impl, "-", "-", "-", why)


# --------------------------------------------------------------------------- peers


def _liger():
    """Liger-Kernel's ops modules, or None when the package is missing."""
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
        from liger_kernel.ops.geglu import LigerGELUMulFunction
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    except ImportError:
        return None
    return LigerLayerNormFunction, LigerGELUMulFunction, LigerFusedLinearCrossEntropyFunction


def _compiled_row(op: str, fn: Callable, leaves, device, repeats, smoke: bool, note: str = "") -> Row:
    if smoke:
        return _unavailable(op, "torch.compile", "skipped in --cpu-smoke")
    return _measure(op, "torch.compile", torch.compile(fn), leaves, device, repeats, note)


def _liger_row(op: str, liger, fn: Callable, leaves, device, repeats, smoke: bool, note: str) -> Row:
    """``fn`` reads ``liger`` only when called, so it may be built when the package is missing."""
    if liger is None:
        return _unavailable(op, "Liger-Kernel", "not installed")
    if smoke:
        return _unavailable(op, "Liger-Kernel", "needs CUDA")
    return _measure(op, "Liger-Kernel", fn, leaves, device, repeats, note)


# --------------------------------------------------------------------------- ops


def _bench_layer_norm(shapes: Shapes, device, repeats, smoke, liger) -> list[Row]:
    from distaff.kernels.fused_layer_norm import layer_norm as fused_layer_norm

    def leaf(*shape):
        return torch.randn(*shape, device=device, dtype=shapes.dtype, requires_grad=True)

    x, residual = leaf(shapes.tokens, shapes.hidden), leaf(shapes.tokens, shapes.hidden)
    weight, bias = leaf(shapes.hidden), leaf(shapes.hidden)
    leaves = [x, residual, weight, bias]

    def eager():
        return F.layer_norm(x + residual, (shapes.hidden,), weight, bias, EPS)

    op = f"residual + LayerNorm [{shapes.tokens}, {shapes.hidden}]"
    return [
        _measure(op, "eager PyTorch", eager, leaves, device, repeats),
        _compiled_row(op, eager, leaves, device, repeats, smoke),
        _liger_row(op, liger, lambda: liger[0].apply(x + residual, weight, bias, EPS), leaves, device, repeats,
                   smoke, "LigerLayerNorm; residual add unfused"),
        _measure(op, "distaff", lambda: fused_layer_norm(x, weight, bias, EPS, residual), leaves, device, repeats,
                 "residual add fused"),
    ]


def _bench_bias_gelu(shapes: Shapes, device, repeats, smoke, liger) -> list[Row]:
    from distaff.kernels.gelu import bias_gelu as fused_bias_gelu

    x = torch.randn(shapes.tokens, shapes.intermediate, device=device, dtype=shapes.dtype, requires_grad=True)
    bias = torch.randn(shapes.intermediate, device=device, dtype=shapes.dtype, requires_grad=True)

    def eager():
        return F.gelu(x + bias)

    op = f"bias + GELU [{shapes.tokens}, {shapes.intermediate}]"
    # Liger has no erf GELU kernel; its GEGLU (tanh GELU(a) * b) reads two full tensors.
    gate = torch.randn_like(x, requires_grad=True)
    return [
        _measure(op, "eager PyTorch", eager, [x, bias], device, repeats),
        _compiled_row(op, eager, [x, bias], device, repeats, smoke),
        _liger_row(op, liger, lambda: liger[1].apply(x, gate), [x, gate], device, repeats, smoke,
                   "GEGLU gelu_tanh(a)*b: not the same op"),
        _measure(op, "distaff", lambda: fused_bias_gelu(x, bias), [x, bias], device, repeats),
    ]


def _bench_mlm_loss(shapes: Shapes, device, repeats, smoke, liger) -> list[Row]:
    from distaff.kernels import reference
    from distaff.kernels.mlm_loss import masked_lm_loss as fused_masked_lm_loss

    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(shapes.tokens, shapes.hidden, generator=gen).to(device, shapes.dtype).requires_grad_()
    weight = (torch.randn(shapes.vocab, shapes.hidden, generator=gen) * 0.02).to(device, shapes.dtype).requires_grad_()
    bias = torch.zeros(shapes.vocab, device=device, dtype=shapes.dtype, requires_grad=True)
    labels = torch.randint(0, shapes.vocab, (shapes.tokens,), generator=gen)
    labels[torch.rand(shapes.tokens, generator=gen) >= shapes.labelled_fraction] = -100
    labels = labels.to(device)
    leaves = [hidden, weight, bias]
    labelled = int((labels != -100).sum())

    def labelled_rows():
        keep = (labels != -100).nonzero().squeeze(1)
        return hidden.index_select(0, keep), labels.index_select(0, keep)

    def projection_ce(rows, targets):
        return F.cross_entropy(F.linear(rows, weight, bias).float(), targets)

    op = f"MLM loss [{shapes.tokens} tokens, {labelled} labelled] x [{shapes.vocab}, {shapes.hidden}]"
    rows = [
        _measure(op, "eager PyTorch, all tokens", lambda: F.cross_entropy(F.linear(hidden, weight, bias).float(), labels),
                 leaves, device, repeats, "HF-style: logits for every token"),
        _measure(op, "eager PyTorch", lambda: reference.masked_lm_loss(hidden, weight, bias, labels).loss,
                 leaves, device, repeats, "labelled rows first (distaff reference)"),
    ]
    rows.append(_compiled_row(op, lambda: projection_ce(*labelled_rows()), leaves, device, repeats, smoke,
                              "labelled rows first"))

    def liger_loss():
        rows_, targets = labelled_rows()
        out = liger[2].apply(rows_, weight, targets, bias)
        return out[0] if isinstance(out, tuple) else out
    rows.append(_liger_row(op, liger, liger_loss, leaves, device, repeats, smoke, "fused linear CE on labelled rows"))
    rows.append(_measure(op, "distaff", lambda: fused_masked_lm_loss(hidden, weight, bias, labels).loss,
                         leaves, device, repeats))
    return rows


# --------------------------------------------------------------------------- report


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _table(rows: list[Row], device: torch.device, shapes: Shapes, repeats: int) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (TRITON_INTERPRET=1, smoke run)"
    lines = [
        f"Device: {name}; torch {torch.__version__}, triton {_version('triton')}, "
        f"liger-kernel {_version('liger-kernel')}; dtype {str(shapes.dtype).removeprefix('torch.')}; "
        f"median of {repeats} runs; peak = extra memory of one forward+backward over its inputs.",
        "",
        "| op | implementation | forward ms | forward+backward ms | peak MiB | note |",
        "|---|---|---:|---:|---:|---|",
    ]
    lines += [f"| {r.op} | {r.impl} | {r.forward_ms} | {r.train_ms} | {r.peak_mib} | {r.note} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per measurement (median reported)")
    parser.add_argument("--output", help="also write the markdown table to this file")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    args = parser.parse_args(argv)

    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported (lazily, below)
        device, shapes, repeats = torch.device("cpu"), CPU_SMOKE, min(args.repeats, 2)
    elif not torch.cuda.is_available():
        print("benchmarks/ops.py needs a GPU (no CUDA device is visible). "
              "Use --cpu-smoke for a tiny CPU run that only checks the script.", file=sys.stderr)
        return 2
    else:
        device, shapes, repeats = torch.device("cuda"), DEBERTA_V3_BASE, args.repeats

    liger = _liger()
    rows = []
    for bench in (_bench_layer_norm, _bench_bias_gelu, _bench_mlm_loss):
        rows += bench(shapes, device, repeats, args.cpu_smoke, liger)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    table = _table(rows, device, shapes, repeats)
    print(table)
    if args.output:
        with open(args.output, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
