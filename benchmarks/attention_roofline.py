"""Roofline ESTIMATE of the fused attention kernels on an H100 (no GPU needed; nothing is timed).

    python benchmarks/attention_roofline.py [--lengths 512 8192] [--tokens 16384]

For each kernel at DeBERTa-v3-base shapes (H=12, d=64, bf16, 256 buckets, c2p+p2c) it counts, from
the tile shapes the host code launches on a GPU (``attention.tiles_for``) and the path each tile
takes (``attention.tile_paths``): the tensor-core FLOPs the kernel really issues (slab products and
bucket merges included, so more than the model's FLOPs), the CUDA-core FLOPs of the saturated tiles'
rank-1 terms, the HBM bytes it must move at least (every input read once, every output written once,
the position-gradient partials zero-filled, written and summed), the bytes of its partial
read-modify-writes (each tile's distinct buckets, read and written; served by L2 when the partials
fit there), and the time each would take at the H100 SXM's peak (989 TFLOP/s dense bf16, 67 TFLOP/s
float32 on the CUDA cores, 3.35 TB/s HBM, ~12 TB/s L2). The bound is whichever time is largest.
"before" counts every tile on the general path, as the kernels ran before the saturated-tile fast
path. These are estimates, not measurements: ``benchmarks/attention.py`` measures on a GPU.
"""

from __future__ import annotations

import argparse
import sys

import torch

from distaff.kernels import attention

PEAK_FLOPS, CUDA_CORE_FLOPS, HBM_BYTES_S, L2_BYTES_S = 989e12, 67e12, 3.35e12, 12e12
HEADS, HEAD_DIM, ELEMENT = 12, 64, 2
BUCKETS, MAX_REL = 256, 512
TWO_SPAN = 2 * BUCKETS
PATHS = ("saturated", "identity", "merged")


def tile_flops(kernel: str, tiles: attention.Tiles, path: str) -> tuple[int, int]:
    """(tensor-core, CUDA-core) FLOPs one tile of ``kernel`` issues on ``path`` (c2p + p2c)."""
    bm, bn, slab, d = tiles.block_m, tiles.block_n, tiles.slab, HEAD_DIM
    content = 2 * bm * bn * d  # one [bm, bn] x d product: QK^T, PV, dP, dV, dK or dQ
    if path == "saturated":  # rank-1 terms: q_a . Kr[t] per row, k_b . Qr[t] per column
        scores, rank1 = content, 2 * bm * d + 2 * bn * d
    else:  # both slab products
        scores, rank1 = content + 2 * bm * slab * d + 2 * bn * slab * d, 0
    if kernel == "fwd":
        return scores + content, rank1
    rows = bn if kernel == "dkdv" else bm  # the program's own side
    if path == "saturated":  # row sums of dS, acc += sums x rel[t], part[t] += sums @ own
        return scores + 3 * content, rank1 + bm * bn + 2 * 2 * rows * d
    merge = 0 if path == "identity" else 2 * rows * slab * slab  # one-hot bucket merge
    return scores + 3 * content + merge + 2 * 2 * rows * slab * d, rank1


def kernel_costs(kernel: str, tiles: attention.Tiles, n: int, batch: int, fast: bool = True) -> dict:
    """Tensor-core and CUDA-core FLOPs, minimal HBM bytes and partial read-modify-write bytes of one
    launch; ``fast=False``: every tile on the general path (the kernels before the fast path)."""
    paths = attention.tile_paths(n, tiles, BUCKETS, MAX_REL)
    counts = {p: getattr(paths, p) for p in PATHS}
    if not fast:
        counts = {"saturated": 0, "identity": counts["identity"], "merged": counts["merged"] + counts["saturated"]}
    flops = [sum(batch * HEADS * counts[p] * tile_flops(kernel, tiles, p)[i] for p in PATHS) for i in (0, 1)]
    tensor = batch * HEADS * n * HEAD_DIM * ELEMENT  # one of q, k, v, o, dO, dq, dk, dv
    if kernel == "fwd":
        return dict(tensor=flops[0], cuda=flops[1], hbm=4 * tensor, rmw=0.0)
    rows = tiles.block_n if kernel == "dkdv" else tiles.block_m
    partial = TWO_SPAN * HEAD_DIM * 4
    programs = attention.programs_per_head(batch * -(-n // rows), True, 3 * tensor, partial, HEADS)
    # Partials: zero-filled, read-modify-written at least once, summed: three passes over HBM.
    hbm = (6 if kernel == "dkdv" else 5) * tensor + 3 * HEADS * programs * partial
    buckets = attention.tile_bucket_widths(n, tiles, BUCKETS, MAX_REL) + 1  # one row for a saturated tile
    rmw = batch * HEADS * float(buckets.sum()) * HEAD_DIM * 4 * 2
    return dict(tensor=flops[0], cuda=flops[1], hbm=hbm, rmw=rmw)


def rows(lengths: list[int], tokens: int) -> list[str]:
    out = []
    for n in lengths:
        batch = max(1, tokens // n)
        for kernel in attention.KERNELS:
            tiles = attention.tiles_for(kernel, HEAD_DIM, torch.bfloat16)
            before, cost = kernel_costs(kernel, tiles, n, batch, fast=False), kernel_costs(kernel, tiles, n, batch)
            times = {"tensor cores": cost["tensor"] / PEAK_FLOPS, "CUDA cores": cost["cuda"] / CUDA_CORE_FLOPS,
                     "HBM": cost["hbm"] / HBM_BYTES_S, "L2 (partials)": cost["rmw"] / L2_BYTES_S}
            bound = max(times, key=times.get)
            out.append(f"| {kernel} | {n} | {batch} | {tiles.block_m}x{tiles.block_n} | {before['tensor'] / 1e9:.0f} | "
                       f"{cost['tensor'] / 1e9:.0f} | {cost['cuda'] / 1e9:.1f} | {cost['hbm'] / 1e6:.0f} | "
                       f"{cost['rmw'] / 1e6:.0f} | {times[bound] * 1e3:.3f} | {bound} |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per batch (B = tokens / N)")
    args = parser.parse_args(argv)
    print(f"# ESTIMATE (not measured): fused attention on H100 SXM, H={HEADS}, d={HEAD_DIM}, bf16, 2k={TWO_SPAN}\n")
    print("| kernel | N | B | tile | tensor GFLOP before | tensor GFLOP now | CUDA-core GFLOP | HBM MB (min) | "
          "partial RMW MB | est. ms at peak | bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows(args.lengths, args.tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
