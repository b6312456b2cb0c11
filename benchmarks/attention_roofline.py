"""Roofline ESTIMATE of the fused attention kernels on an H100 (no GPU needed; nothing is timed).

    python benchmarks/attention_roofline.py [--lengths 512 8192] [--tokens 16384]

For each kernel at DeBERTa-v3-base shapes (H=12, d=64, bf16, 256 buckets, c2p+p2c) it counts, from
the tile shapes the host code launches on a GPU (``attention.tiles_for``): the tensor-core FLOPs
the kernel really issues (slab products and bucket merges included, so more than the model's
FLOPs), the HBM bytes it must move at least (every input read once, every output written once,
the position-gradient partials zero-filled, written and summed), the bytes of its partial
read-modify-writes (each tile's distinct buckets, read and written; served by L2 when the
partials fit there), and the time each would take at the H100 SXM's peak
(989 TFLOP/s dense bf16, 3.35 TB/s HBM, ~12 TB/s L2). The bound is whichever time is largest. These
are estimates, not measurements: ``benchmarks/attention.py`` measures on a GPU.
"""

from __future__ import annotations

import argparse
import sys

import torch

from distaff.kernels import attention
from distaff.kernels.relative_position import bucket_table

PEAK_FLOPS, HBM_BYTES_S, L2_BYTES_S = 989e12, 3.35e12, 12e12
HEADS, HEAD_DIM, ELEMENT = 12, 64, 2
BUCKETS, MAX_REL = 256, 512
TWO_SPAN = 2 * BUCKETS


def window_buckets(tiles: attention.Tiles, n: int) -> torch.Tensor:
    """Distinct buckets of every tile's distance window at length ``n`` (one row when saturated)."""
    table = bucket_table(n + 2 * tiles.slab, BUCKETS, MAX_REL).long()
    i0 = torch.arange(0, n, tiles.block_m)[:, None]
    j0 = torch.arange(0, n, tiles.block_n)[None, :]
    first = (i0 - j0 - (tiles.block_n - 1) + n + 2 * tiles.slab).flatten()
    return table[first + tiles.block_m + tiles.block_n - 2] - table[first] + 1


def kernel_costs(kernel: str, tiles: attention.Tiles, n: int, batch: int) -> tuple[float, float, float]:
    """(tensor-core FLOPs, minimal HBM bytes, partial read-modify-write bytes) of one launch."""
    bm, bn, slab, d = tiles.block_m, tiles.block_n, tiles.slab, HEAD_DIM
    count = batch * HEADS * -(-n // bm) * -(-n // bn)
    scores = 2 * bm * bn * d + 2 * bm * slab * d + 2 * bn * slab * d  # QK^T + both slab products
    tensor = batch * HEADS * n * d * ELEMENT  # one of q, k, v, o, dO, dq, dk, dv
    if kernel == "fwd":
        return count * (scores + 2 * bm * bn * d), 4 * tensor, 0.0
    rows = bn if kernel == "dkdv" else bm  # the side a program's blocks have
    # dP, two content gradients, the one-hot merge, the slab gradient and the partial's product.
    flops = count * (scores + 3 * 2 * bm * bn * d + 2 * rows * slab * slab + 2 * 2 * rows * slab * d)
    partial = TWO_SPAN * d * 4
    programs = attention.programs_per_head(batch * -(-n // rows), True, 3 * tensor, partial, HEADS)
    # Partials: zero-filled, read-modify-written at least once, summed: three passes over HBM.
    partials = HEADS * programs * partial
    reads_writes = (6 if kernel == "dkdv" else 5) * tensor
    rmw = batch * HEADS * float(window_buckets(tiles, n).sum()) * d * 4 * 2
    return flops, reads_writes + 3 * partials, rmw


def rows(lengths: list[int], tokens: int) -> list[str]:
    out = []
    for n in lengths:
        batch = max(1, tokens // n)
        for kernel in attention.KERNELS:
            tiles = attention.tiles_for(kernel, HEAD_DIM, torch.bfloat16)
            flops, hbm, rmw = kernel_costs(kernel, tiles, n, batch)
            times = {"tensor cores": flops / PEAK_FLOPS, "HBM": hbm / HBM_BYTES_S, "L2 (partials)": rmw / L2_BYTES_S}
            bound = max(times, key=times.get)
            out.append(f"| {kernel} | {n} | {batch} | {tiles.block_m}x{tiles.block_n} | {flops / 1e9:.0f} | "
                       f"{hbm / 1e6:.0f} | {rmw / 1e6:.0f} | {times[bound] * 1e3:.3f} | {bound} |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per batch (B = tokens / N)")
    args = parser.parse_args(argv)
    print(f"# ESTIMATE (not measured): fused attention on H100 SXM, H={HEADS}, d={HEAD_DIM}, bf16, 2k={TWO_SPAN}\n")
    print("| kernel | N | B | tile | GFLOP (issued) | HBM MB (min) | partial RMW MB | est. ms at peak | bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows(args.lengths, args.tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
