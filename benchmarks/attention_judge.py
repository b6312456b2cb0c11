"""Static performance judge of the fused attention: distaff against DisentangledFlash, FlashDeBERTa, a
content-only FlashAttention-2 and Hugging Face's eager DeBERTa-v2 attention, with no GPU. Every figure it prints is an ESTIMATE read from the compiled code, not a measurement.

    python benchmarks/attention_judge.py                      # the issue's matrix: N=512 B=32 and N=8192 B=2,
                                                              # d 64 and 128, dropout 0 and 0.1, sm_90 and sm_80
    python benchmarks/attention_judge.py --targets 90 --head-dims 64 --kernels   # and the per-kernel rows

How: each implementation's own host code runs on fake tensors (``attention_recording.py``: distaff and HF eager
on fake CPU tensors, distaff planned for the target, the peers on fake CUDA tensors), its Triton launches are
recorded instead of run and every other torch operation on its tensors (the peers' position-score GEMMs,
distaff's mask cast, zero-fills, partial sums and casts, all of HF eager's work) is recorded by a dispatch mode
as GPU work; host planning on real CPU tensors is not. Each launch is compiled for the target as the compile
check does (same cache), then:

* the SASS of its tile loops (``static_perf``): warp-instructions per path, per tile;
* per program: the tiles it walks on each path (distaff: from the bucket table, as its kernels decide, each of
  the forward's three runs on its own loop, a one-loop kernel's saturated and general tiles on the dearest path
  each can execute, every ``if saturated:`` of the tile taken its way; the peers: one path, the
  fewest-instruction one when their loop has several) plus its other code;
* blocks per SM from registers, warps and shared memory; programs are list-scheduled onto the SMs'
  block slots, a block issuing ``4 / blocks`` warp-instructions a cycle (four schedulers per SM), and never
  faster than its tensor-core FLOPs (issued, repetition included) at the GPU's dense peak;
* one warp's in-order walk of each tile path (``static_perf.chain_cycles``: a scoreboard over the SASS,
  each instruction, guarded or not, waiting for its operands' producers, cp.async groups, warpgroup MMA
  groups, barriers; a spill reload ``LDL`` is an L1 hit, 35 cycles), at a global round trip of 300 cycles (low end) and 600 cycles (high end), three
  iterations of a loop walked first so that a pipelined loop's prefetches count as hidden; a program takes
  the longest of its issue share (the co-resident blocks' issue overlaps its waits), its tensor work and its
  chain;
* the makespan at the boost clock times ONE calibration factor per end, never under the launch's L2 bytes
  (every lane of every global load and store in the SASS) at the L2 bandwidth, nor its HBM bytes (each
  tensor once; at the high end plus the re-reads that miss an L2 the tensors overflow) at HBM bandwidth;
* the factor is the geometric mean over published timings of two designs compiled here (the anchors:
  DisentangledFlash's H200 layer forward 8.48 ms, N=8192, B=2, H=12, d=64, bf16, its README; its H200
  tuning profile's measured kernels at N=2048-8192 with 8 and 32 heads, a latency-bound two-wave forward
  among them; the Triton tutorial FlashAttention-2 forward on an H100, B=128, H=8, d=128, N=1024 and 8192,
  pytorch/benchmark PR #2296, see ``attention_anchor.py``); each anchor's residual is printed, the README's
  backward too, which the profile contradicts and the factor is not fitted to (``README_UNFITTED``);
* each launch adds a GPU-side gap (1-2 us) and each host read of a device value (``.item()`` and friends,
  counted through the dispatch mode) a drain and relaunch (15-40 us);
* work outside the kernels (torch GEMMs, copies, fills, sums) is estimated at its roofline (dense tensor peak,
  HBM bandwidth), favourable to whoever does it; HF eager's GEMMs at the efficiency cuBLAS reaches
  (``CUBLAS_EFFICIENCY``), each of its torch ops one launch;
* distaff is judged as the presets run it, its forward's dense position scores kept for the backward (the
  model's ``keep_position_scores``, the op's ``keep_scores``, both on by default: 2 x H x tokens x 2k elements
  a layer); the column "distaff, scores recomputed" is the memory-saving setting, the backward recomputing them
  with two GEMMs;
* DisentangledFlash's backward is held to each of its two published figures (``DF_BACKWARD_FIGURES``: its
  profile's, about 83 ms, and its README's, 45.26 ms, at N = 8192 with 24 sequence-heads), and every bar of
  the issue (``BARS``, ``CONTENT_BARS``) is judged under both (``verdicts``).

The peers are a benchmark extra (``pip install disentangled-flash==1.1.1 flashdeberta==0.0.8``); without
them their rows say "not installed".
"""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import math
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, astuple, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention_anchor  # noqa: E402  (sibling scripts, not a package)
from attention_recording import (BUCKETS, CONTENT, HEADS, HF_EAGER, IMPLEMENTATIONS, MAX_REL,  # noqa: E402
                                 PASSES, RECOMPUTED, Recording, Unavailable, Workload, record_disentangled_flash)

from distaff.kernels import attention as distaff_attention
from distaff.kernels.aot import compile_check, static_perf

WORKLOADS = ((512, 32), (8192, 2))  # (N, B): 16,384 tokens per batch
HEAD_DIMS = (64, 128)
DROPOUTS = (0.0, 0.1)
TARGETS = (90, 80)
# DisentangledFlash's published H200 figures (its README, v1.1.1): N=8192, 16,384 tokens, H=12, d=64, bf16,
# no dropout, padded layout with every token active; an attention layer (Q/K/V projections included).
CALIBRATION = {"fwd": 8.48, "bwd": 45.26}
CALIBRATION_SHAPE = (8192, 2, 64)
# DisentangledFlash 1.1.1's H200 tuning profile (shipped in its wheel: disentangled_flash/profiles/
# h200-sm90-deberta-v2-v3-torch-2.14-cu130-triton-3.8.json): per workload, the launch configuration its tuner
# chose and the measured medians (25 repetitions, CUDA events) of the training attention with it
# ("combined_forward_ms", "combined_backward_ms"), over one padded sequence of H heads ([1, H, N, 64]), half
# precision, a 2-D padding mask, c2p + p2c, no dropout. N = 4096 with 8 heads runs 512 forward programs on 132
# SMs (two waves of one long tile loop each): a latency-bound chain, which the README's N = 8192 timing and the
# FlashAttention-2 anchors (compute-bound, 350-410 TFLOP/s) do not test. Configs: forward, dq, dk/dv as
# (block_m, block_n, warps, stages).
_PROFILE_TILES = ((64, 64, 4, 2), (16, 16, 4, 1), (16, 16, 4, 1))  # N >= 4096: what the judge's own DF row runs
PROFILE_ANCHORS = ((4096, 8, _PROFILE_TILES, {"fwd": 0.913887978, "bwd": 9.60511971}),
                   (2048, 32, ((64, 64, 4, 1), (16, 16, 4, 1), (16, 16, 4, 1)), {"fwd": 0.947647989,
                                                                                "bwd": 9.09139156}),
                   (8192, 8, _PROFILE_TILES, {"fwd": 3.26099205, "bwd": 30.3701115}),
                   (8192, 32, _PROFILE_TILES, {"fwd": 12.5237122, "bwd": 109.282494}))
# The README's backward is not fitted: the same kernels with the same tiles (the heuristic's at N = 8192, what
# the judge records) measured 30.37 ms with 8 heads and 109.28 ms with 32 in the project's own profile, which
# puts 24 heads near 82 ms by linear interpolation (the programs of a head are independent and the GPU is
# full at 8 heads: 4,096 programs), 1.8x the README's 45.26 ms for an attention layer that does more. No one
# factor can fit both; the judge is fitted to the profile's two measurements that bracket the README's shape.
README_UNFITTED = {"bwd": "contradicted by the same project's profile: 30.37 ms at 8 heads, 109.28 ms at 32"}
# DisentangledFlash's backward has two published figures at N = 8192 with 24 sequence-heads; the judge holds its
# DF backward to each in turn (the model's estimate scaled by figure / estimate at that shape) and every verdict
# must hold under both. The profile's, interpolated linearly in heads between its 8- and 32-head medians, is of
# the kernels alone; the README's is of a layer (its projections are taken off at their roofline).
_PROFILE_8, _PROFILE_32 = PROFILE_ANCHORS[2][3]["bwd"], PROFILE_ANCHORS[3][3]["bwd"]
DF_BACKWARD_FIGURES = {"profile": _PROFILE_8 + (_PROFILE_32 - _PROFILE_8) * (24 - 8) / (32 - 8),
                       "README": CALIBRATION["bwd"]}


# --------------------------------------------------------------------------- compiled kernels


@dataclass
class KernelEstimate:
    """One launch's static figures and its issue floor on one GPU."""

    impl: str
    kernel: str
    tile: str
    warps: int
    stages: int
    registers: int
    spills: int
    shared: int
    blocks_per_sm: int
    programs: int
    waves: float
    paths: list          # [(name, warp-instructions per score, mix), ...] of its tile loop
    repetition: float
    wgmma: bool
    cycles: float        # list-scheduled makespan at the issue floor alone (the former judge), not calibrated
    span: dict           # end -> makespan with each program's dependent chain at that latency, not calibrated
    l2_bytes: float      # global bytes the SASS moves through L2 (every lane of every load and store)
    hbm_bytes: tuple     # (low, high): each tensor once; plus the re-reads that miss an L2 the tensors overflow


def _figures(kernel, args, kwargs, cc: int) -> tuple:
    """The compile check's row for a launch (compiled once, cached) and its static figures."""
    case = compile_check.Case("attention", "bfloat16")
    row, stem = compile_check.compile_artifacts(kernel, args, kwargs, case, cc)
    if stem is None:
        raise Unavailable(f"{row.kernel} does not compile for sm_{cc}: {row.error}")
    return row, _kernel_figures(str(stem))


@functools.lru_cache(maxsize=None)
def _kernel_figures(stem: str):
    """``static_perf.kernel_figures`` of one cached compile, read once per process (workloads and anchors share
    most of their compiled kernels)."""
    path = Path(stem)
    return static_perf.kernel_figures(path.with_suffix(".cubin"), path.with_suffix(".ttgir").read_text(),
                                      condition="saturated")


@dataclass
class Work:
    """What a program (or a tile path) costs: warp-instructions and tensor FLOPs per warp, one warp's
    dependent chain in cycles at the low and the high latency, global bytes per warp."""

    instr: float = 0.0
    flops: float = 0.0
    chain_low: float = 0.0
    chain_high: float = 0.0
    bytes: float = 0.0

    @classmethod
    def of(cls, mix: dict) -> "Work":
        return cls(static_perf.instructions(mix), mix["flops"], mix["chain_low"], mix["chain_high"], mix["bytes"])

    def __add__(self, other: "Work") -> "Work":
        return Work(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def __mul__(self, k: float) -> "Work":
        return Work(*(a * k for a in astuple(self)))


def _tile_paths(kernel_name: str, figures) -> list[dict]:
    """The paths of a distaff attention kernel's tile loops that do not branch on the tile's kind (no position
    terms), fewest warp-instructions first."""
    lines = {"_attn_fwd": ("for j0 in tl.range(j_start, j_end, BLOCK_N", "for j0 in range(0, seq_len, BLOCK_N)")}.get(
        kernel_name, ("for other in range(0, seq_len, BLOCK_OTHER)",))  # the backward's
    for line in lines:
        try:
            entries = figures.loops_at(line)
        except KeyError:
            continue
        return sorted((path for entry in entries for path in entry["paths"]), key=static_perf.instructions)
    raise Unavailable(f"{kernel_name}: no tile loop at {lines}")


def _run_mixes(kernel_name: str, kwargs: dict, figures) -> dict:
    """``{"top", "general", "bottom"}`` -> the path mix of one tile of each run a distaff kernel walks. The
    forward with its paths apart has one loop per run (the three inlined copies of ``_fwd_tiles``' loop, in
    address order: top-saturated, general, bottom-saturated), each priced on its own path; the one-loop kernels
    (backward, one-loop forward) branch per tile on ``if saturated:``: a tile of each kind is priced on the
    dearest path it can execute, every branch on ``saturated`` taken its way (``static_perf.tile_kinds``), not
    on the loop's cheapest and dearest instruction mixes, which take the two tests of a tile different ways."""
    if kernel_name == "_attn_fwd" and kwargs.get("PATHS_APART"):
        loops = figures.loops_at("for j0 in tl.range(j_start, j_end, BLOCK_N")
        if len(loops) == 3:
            top, general, bottom = loops
            if static_perf.instructions(general["paths"][-1]) < max(
                    static_perf.instructions(x["paths"][0]) for x in (top, bottom)):
                raise Unavailable("the forward's general loop is not the middle of its three")
            return {"top": top["paths"][0], "general": general["paths"][-1], "bottom": bottom["paths"][0]}
    sides = [entry["sides"] for entry in figures.loops if "sides" in entry]
    if len(sides) > 1:
        raise Unavailable(f"{kernel_name}: {len(sides)} tile loops branch on `if saturated:` (one expected)")
    if sides:
        return {"top": sides[0]["then"], "general": sides[0]["else"], "bottom": sides[0]["then"]}
    paths = _tile_paths(kernel_name, figures)  # no position terms: no branch on the tile's kind
    return {"top": paths[0], "general": paths[-1], "bottom": paths[0]}


def _distaff_program_work(kernel_name: str, kwargs: dict, grid: tuple, figures) -> list[Work]:
    """Per program of a distaff attention launch, from the tiles it walks on each run (the kernels' own
    saturation test on the bucket table; a saturated tile is in the top run when its key block precedes its
    query block), the band chunks of its backward blocks (the chunk loop's dearest path) and its code outside
    the loops once per block."""
    bm, bn, n = kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["n_ctx"]
    tiles = distaff_attention.Tiles(bm, bn, kwargs["num_warps"], kwargs["num_stages"])
    saturated = distaff_attention.tile_saturation(n, tiles, BUCKETS, MAX_REL)
    key_first = torch.arange(saturated.shape[1])[None, :] * bn < torch.arange(saturated.shape[0])[:, None] * bm
    top_run = saturated & key_first
    by_key = kernel_name == "_attn_bwd_dkdv"
    runs = {run: Work.of(mix) for run, mix in _run_mixes(kernel_name, kwargs, figures).items()}
    chunk = Work.of(figures.loop("for c0 in range(")["paths"][-1]) if kernel_name != "_attn_fwd" and (
        kwargs["HAS_C2P"] if kernel_name == "_attn_bwd_dq" else kwargs["HAS_P2C"]) else None
    per_block = []
    for block in range(saturated.shape[1] if by_key else saturated.shape[0]):
        row, top = (saturated[:, block], top_run[:, block]) if by_key else (saturated[block], top_run[block])
        tops, bottoms, gen = int(top.sum()), int((row & ~top).sum()), int((~row).sum())
        work = runs["top"] * tops + runs["bottom"] * bottoms + runs["general"] * gen + Work.of(figures.straight)
        if chunk is not None and gen:
            work = work + chunk * _band_chunks(block, (~row).nonzero().flatten(), bm, bn, by_key, kwargs["lo"],
                                               kwargs["CHUNK"])
        per_block.append(work)
    blocks = len(per_block)
    items, ipp, programs = kwargs["num_seqs"] * blocks, kwargs["items_per_program"], grid[0]
    return [sum((per_block[item % blocks] for item in range(p * ipp, min((p + 1) * ipp, items))), Work())
            for _head in range(grid[1]) for p in range(programs)]


def _band_chunks(block: int, general, bm: int, bn: int, by_key: bool, lo: int, chunk: int) -> int:
    """How many band chunks a distaff backward block reads: the chunks (aligned to ``lo``) covering the
    distances of its general tiles, as ``_band_gradients`` walks them."""
    if by_key:  # key block j0, query blocks first..last
        j0, first, last = block * bn, int(general[0]) * bm, int(general[-1]) * bm
        d_lo, d_hi = first - j0 - (bn - 1), last + bm - 1 - j0
    else:
        i0, first, last = block * bm, int(general[0]) * bn, int(general[-1]) * bn
        d_lo, d_hi = i0 - last - (bn - 1), i0 - first + bm - 1
    return (d_hi - lo) // chunk - (d_lo - lo) // chunk + 1


def _peer_program_work(kwargs: dict, grid: tuple, n: int, figures) -> list[Work]:
    """Per program of a peer's launch: its tile loops' cheapest path once per block of the loop's side
    (the peers get the benefit of the doubt) plus its code outside the loops."""
    programs = grid[0] * grid[1] * grid[2]
    work = Work.of(figures.straight)
    if figures.loops:
        blocks_m, block_n = -(-n // kwargs.get("BLOCK_M", n)), kwargs.get("BLOCK_N", n)
        step = block_n if grid[0] == blocks_m else kwargs["BLOCK_M"]  # the loop walks the other side
        for entry in figures.loops:
            work = work + Work.of(entry["paths"][0]) * -(-n // step)
    return [work] * programs


def _makespan(works: list[Work], warps: int, blocks: int, gpu: static_perf.Gpu, end: str | None) -> float:
    """Cycles to run the programs (launch order) on ``gpu.sms`` SMs x ``blocks`` slots: a block issues
    ``min(warps, 4 / blocks)`` warp-instructions a cycle, does tensor work no faster than its share of the
    SM's dense peak and, at latency ``end`` ("low"/"high"; None: the issue floor alone), no faster than one
    warp's dependent chain; the co-resident blocks' issue overlaps it. Each program takes the earliest
    free slot."""
    issue = min(warps, gpu.schedulers / blocks)
    tensor = gpu.tensor_tflops * 1e12 / (gpu.sms * gpu.clock_ghz * 1e9) / blocks
    free = [0.0] * (gpu.sms * blocks)
    for w in works:
        start = heapq.heappop(free)
        chain = getattr(w, f"chain_{end}") if end else 0.0
        heapq.heappush(free, start + max(w.instr * warps / issue, w.flops * warps / tensor, chain))
    return max(free)


def _tensor_bytes(args: tuple, kwargs: dict) -> float:
    """The bytes of a launch's distinct tensor arguments: what it must move through HBM at least once."""
    seen = {id(a): a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
    return float(sum(t.numel() * t.element_size() for t in seen.values()))


# distaff as the presets run it (its forward's dense position scores kept for the backward) and with them recomputed
# (model.keep_position_scores=false): the same kernels, read with distaff's own program model
DISTAFF = ("distaff", RECOMPUTED)


def estimate_launch(impl: str, launch: tuple, w: Workload, gpu: static_perf.Gpu) -> KernelEstimate:
    """Compile one recorded launch for ``w.cc`` and estimate its issue floor, its latency-aware makespan at
    both ends and its bytes on ``gpu``."""
    kernel, args, kwargs, grid = launch
    row, figures = _figures(kernel, args, kwargs, w.cc)
    warps = kwargs.get("num_warps", 4)
    name = compile_check.launch_name(kernel, kwargs)
    tiled = impl in DISTAFF and name in ("_attn_fwd", "_attn_bwd_dq", "_attn_bwd_dkdv")
    if tiled:
        works = _distaff_program_work(name, kwargs, grid, figures)
    else:
        works = _peer_program_work(kwargs, grid, w.n, figures)
    blocks = max(1, static_perf.blocks_per_sm(row.registers, warps, row.shared, gpu))
    bm, bn = kwargs.get("BLOCK_M", 0), kwargs.get("BLOCK_N", 0)
    paths = []
    if figures.loops and bm and bn:
        if tiled:
            runs = _run_mixes(name, kwargs, figures)
            picks = runs if runs["top"] is not runs["bottom"] else {"saturated": runs["top"],
                                                                    "general": runs["general"]}
        else:
            picks = {"tile": max(figures.loops, key=lambda e: e["paths"][-1]["flops"])["paths"][0]}
        paths = [(name, static_perf.instructions(mix) * warps / (bm * bn), mix) for name, mix in picks.items()]
    l2 = sum(x.bytes for x in works) * warps
    unique = _tensor_bytes(args, kwargs)
    miss = max(0.0, 1.0 - gpu.l2_mb * 1e6 / unique) if unique else 0.0
    hbm = (min(unique, l2 or unique), min(unique, l2 or unique) + max(0.0, l2 - unique) * miss)
    return KernelEstimate(impl, name, f"{bm}x{bn}" if bm and bn else "-", warps, row.stages,
                          row.registers, row.spill_stores, row.shared, blocks, len(works),
                          len(works) / (blocks * gpu.sms), paths, figures.repetition, figures.uses_wgmma,
                          _makespan(works, warps, blocks, gpu, None),
                          {end: _makespan(works, warps, blocks, gpu, end) for end in ENDS}, l2, hbm)


# --------------------------------------------------------------------------- estimates

ENDS = ("low", "high")
# Outside the kernels' own time (stated model inputs): the gap between two back-to-back launches on the
# GPU, and what one host read of a device value costs (the queue drains, the host reads, relaunches).
LAUNCH_GAP_US = {"low": 1.0, "high": 2.0}
HOST_SYNC_US = {"low": 15.0, "high": 40.0}


def kernel_ms(r: KernelEstimate, gpu: static_perf.Gpu, factor: float, end: str, waits: bool = True) -> float:
    """One launch at latency ``end``: its calibrated makespan, never under its L2 or HBM bandwidth floor.
    Without ``waits``: its calibrated issue floor instead of the makespan, the launch as if no warp ever
    waited on a dependent result (its floor: what no latency hiding can beat, the bytes still charged)."""
    l2_floor = r.l2_bytes / (gpu.l2_tb_s[ENDS.index(end)] * 1e12)
    hbm_floor = r.hbm_bytes[ENDS.index(end)] / (gpu.hbm_tb_s * 1e12)
    cycles = r.span[end] if waits else r.cycles
    return max(factor * cycles / (gpu.clock_ghz * 1e9), l2_floor, hbm_floor) * 1e3


def projections_ms(w: Workload, gpu: static_perf.Gpu, pass_: str) -> float:
    """The roofline of an attention layer's Q/K/V projections (backward: twice the forward's FLOPs), which
    DisentangledFlash's published layer timings include and the attention cores do not."""
    tokens, hidden = w.n * w.batch, HEADS * w.head_dim
    flops = 3 * 2 * tokens * hidden * hidden * (1 if pass_ == "fwd" else 2)
    return flops / (gpu.tensor_tflops * 1e12) * 1e3


@dataclass
class PassEstimate:
    """One pass of one implementation: per end (low/high latency), its kernels (calibrated, bandwidth
    floors applied), the work outside them (roofline), and the launch gaps and host syncs."""

    impl: str
    pass_: str
    kernel_ms: dict
    floor_ms: dict          # end -> the kernels with no dependent wait (``kernel_ms(waits=False)``)
    outside_ms: float
    launches: int
    syncs: int
    rows: list

    def overhead_ms(self, end: str) -> float:
        return (self.launches * LAUNCH_GAP_US[end] + self.syncs * HOST_SYNC_US[end]) * 1e-3

    def total(self, end: str) -> float:
        return self.kernel_ms[end] + self.outside_ms + self.overhead_ms(end)

    @property
    def total_ms(self) -> float:
        """The high end: what the bar is judged on."""
        return self.total("high")

    @property
    def floor_total_ms(self) -> float:
        """The high end with every kernel at its floor: the most any latency hiding in these kernels can give."""
        return self.floor_ms["high"] + self.outside_ms + self.overhead_ms("high")


# --------------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class Anchor:
    """A published time of a kernel design compiled here, which the model is fitted to."""

    name: str
    source: str
    published_ms: float
    gpu: static_perf.Gpu
    projections_ms: float     # work in the published time the recorded passes do not include (roofline)
    unfitted: str = ""        # why the factor is not fitted to it (printed with its residual all the same)


def _anchor_passes() -> list[tuple[Anchor, str, Recording, Workload]]:
    """Every anchor with the recorded pass it times and the workload it was compiled for."""
    n, batch, d = CALIBRATION_SHAPE
    w = Workload(n, batch, d, 0.0, 90)
    df = record_disentangled_flash(w)
    rows = [(Anchor(f"DisentangledFlash {p}, N={n} B={batch} H=12 d={d}", "disentangled-flash 1.1.1 README "
                    "(H200, attention layer)", CALIBRATION[p], static_perf.H200,
                    projections_ms(w, static_perf.H200, p), README_UNFITTED.get(p, "")), p, df[p], w)
            for p in PASSES]
    for length, heads, configs, published in PROFILE_ANCHORS:
        pw = Workload(length, 1, 64, 0.0, 90)
        recorded = record_disentangled_flash(pw, heads, configs)
        for p in PASSES:
            tiles = "; ".join(f"{kernel} {c[0]}x{c[1]} {c[2]}w {c[3]}s" for kernel, c in zip(("fwd", "dq", "dk/dv"),
                                                                                          configs))
            rows.append((Anchor(f"DisentangledFlash {p}, N={length} B=1 H={heads} d=64 ({tiles})",
                                "disentangled-flash 1.1.1 H200 tuning profile (kernels, measured medians)",
                                published[p], static_perf.H200, 0.0), p, recorded[p], pw))
    for length, published in attention_anchor.PUBLISHED_H100:
        rec = Recording("fwd")
        rec.launches.append(attention_anchor.launch(length))
        aw = Workload(length, attention_anchor.BATCH, attention_anchor.HEAD_DIM, 0.0, 90)
        rows.append((Anchor(f"Triton tutorial FlashAttention-2 fwd, N={length} B={attention_anchor.BATCH} "
                            f"H={attention_anchor.HEADS} d={attention_anchor.HEAD_DIM}",
                            "pytorch/benchmark PR #2296 (H100)", published, static_perf.GPUS[90], 0.0),
                     "fwd", rec, aw))
    return rows


@dataclass
class Calibration:
    factor: dict            # end -> the one factor applied to every kernel's makespan
    anchors: list           # (Anchor, {end: estimated ms})

    def residuals(self) -> list[tuple[Anchor, dict]]:
        return [(a, {end: est[end] / a.published_ms for end in ENDS}) for a, est in self.anchors]


@functools.lru_cache(maxsize=1)
def calibration() -> Calibration:
    """One factor per end, the geometric mean over the fitted anchors of (published - outside) / makespan, so
    no design is favoured; every anchor's residual (estimate / published) is then reported, the unfitted
    ones' too."""
    fitted, logs = [], {end: [] for end in ENDS}
    for anchor, p, rec, w in _anchor_passes():
        rows = [estimate_launch("anchor", launch, w, anchor.gpu) for launch in rec.launches]
        est = pass_estimate_rows("anchor", rec, rows, anchor.gpu, {end: 1.0 for end in ENDS})
        fitted.append((anchor, rec, rows))
        if anchor.unfitted:
            continue
        for end in ENDS:
            span_ms = sum(r.span[end] for r in rows) / (anchor.gpu.clock_ghz * 1e6)
            rest = est.outside_ms + est.overhead_ms(end) + anchor.projections_ms
            logs[end].append(math.log(max(anchor.published_ms - rest, 1e-6) / span_ms))
    factor = {end: math.exp(sum(v) / len(v)) for end, v in logs.items()}
    anchors = []
    for anchor, rec, rows in fitted:
        est = pass_estimate_rows("anchor", rec, rows, anchor.gpu, factor)
        anchors.append((anchor, {end: est.total(end) + anchor.projections_ms for end in ENDS}))
    return Calibration(factor, anchors)


def pass_estimate_rows(impl: str, rec: Recording, rows: list, gpu: static_perf.Gpu, factor: dict) -> PassEstimate:
    kernels = {end: sum(kernel_ms(r, gpu, factor[end], end) for r in rows) for end in ENDS}
    floors = {end: sum(kernel_ms(r, gpu, factor[end], end, waits=False) for r in rows) for end in ENDS}
    return PassEstimate(impl, rec.pass_, kernels, floors, rec.outside_seconds(gpu) * 1e3,
                        len(rec.launches) + len(rec.outside), rec.syncs, rows)


def estimate(impl: str, w: Workload) -> dict:
    """``{pass: PassEstimate}`` of one implementation on one workload (raises Unavailable)."""
    gpu = static_perf.GPUS[w.cc]
    passes = IMPLEMENTATIONS[impl](w)
    factor = calibration().factor
    return {p: pass_estimate_rows(impl, passes[p], [estimate_launch(impl, launch, w, gpu)
                                                    for launch in passes[p].launches], gpu, factor)
            for p in PASSES}


# --------------------------------------------------------------------------- tables


def _cell(result: dict, impl: str, p: str, figure: str = "profile") -> str:
    if not isinstance(result.get(impl), dict):
        return str(result.get(impl))
    return "-".join(f"{peer_ms(result, impl, p, figure, end):.2f}" for end in ENDS)


def estimate_all(w: Workload) -> dict:
    """``{impl: {pass: PassEstimate} or "n/a (why)"}`` for one workload."""
    result = {}
    for impl in IMPLEMENTATIONS:
        try:
            result[impl] = estimate(impl, w)
        except Unavailable as why:
            result[impl] = f"n/a ({why})"
    return result


def df_backward_scales() -> dict:
    """``{figure: {end: scale}}``: what DisentangledFlash's estimated backward is multiplied by to be held to
    each of its published backward figures (``DF_BACKWARD_FIGURES``), from the judge's estimate of the README's
    layer (N = 8192, B = 2, H = 12) less its projections."""
    anchor, est = next((a, e) for a, e in calibration().anchors if a.unfitted and "bwd" in a.name)
    projections = {"profile": 0.0, "README": anchor.projections_ms}
    return {name: {end: (ms - projections[name]) / (est[end] - anchor.projections_ms) for end in ENDS}
            for name, ms in DF_BACKWARD_FIGURES.items()}


PEERS = ("DisentangledFlash", "FlashDeBERTa", CONTENT, HF_EAGER)


def peer_ms(result: dict, peer: str, p: str, figure: str = "profile", end: str = "high") -> float | None:
    """A peer's ms on one pass at ``end``; DisentangledFlash's backward held to ``figure``; None when absent."""
    est = result.get(peer)
    if not isinstance(est, dict):
        return None
    scale = df_backward_scales()[figure][end] if (peer, p) == ("DisentangledFlash", "bwd") else 1.0
    return est[p].total(end) * scale


def summary_rows(workloads: list[Workload], jobs: int = 1) -> tuple[list[str], dict]:
    """The side-by-side table (markdown: low-high ms, ratios at the high end) and the estimates behind it,
    ``{workload: {impl: {pass: ...}}}``; workloads are estimated in ``jobs`` processes (compiles are cached
    on disk, shared between them). DisentangledFlash's backward is shown held to its profile and to its
    README figure."""
    lines = ["| workload | target | pass | distaff ms | distaff, scores recomputed ms | DisentangledFlash ms (bwd: "
             "profile / README) | FlashDeBERTa ms | FlashAttention-2 content only ms | HF eager ms | distaff / DF "
             "profile | distaff / DF README | distaff / FD | distaff / FA-2 content | distaff / HF eager | distaff "
             "launches / host syncs |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    calibration()  # compiled once here, read from the cache by the workers
    # Spawned, not forked: a fork of a process that has run torch and triton can deadlock in the child.
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = dict(zip(workloads, pool.map(estimate_all, workloads)))
    for w, result in results.items():
        for p in PASSES:
            ours = result["distaff"][p]
            ratios = [_ratio(ours.total_ms, peer_ms(result, peer, p, figure))
                      for peer, figure in (("DisentangledFlash", "profile"), ("DisentangledFlash", "README"),
                                           ("FlashDeBERTa", "profile"), (CONTENT, "profile"), (HF_EAGER, "profile"))]
            df = _cell(result, "DisentangledFlash", p)
            if p == "bwd" and isinstance(result["DisentangledFlash"], dict):
                df = " / ".join(_cell(result, "DisentangledFlash", p, figure) for figure in DF_BACKWARD_FIGURES)
            lines.append(f"| {w.name} | sm_{w.cc} | {p} | {_cell(result, 'distaff', p)} | "
                         f"{_cell(result, RECOMPUTED, p)} | {df} | "
                         f"{_cell(result, 'FlashDeBERTa', p)} | {_cell(result, CONTENT, p)} | "
                         f"{_cell(result, HF_EAGER, p)} | {' | '.join(ratios)} | {ours.launches} / {ours.syncs} |")
    return lines, results


def _ratio(ours: float, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}" if theirs else "-"


# The issue's bars at the high end: distaff / peer at most this, per pass (fwd+bwd for HF eager, at N = 512
# only; FlashAttention-2 content only per target, at N = 512 only).
BARS = {"DisentangledFlash": 0.8, "FlashDeBERTa": 0.9, HF_EAGER: 0.5}
CONTENT_BARS = {90: {"fwd": 4.0, "bwd": 8.0}, 80: {"fwd": 8.0, "bwd": 10.0}}


def verdicts(results: dict) -> list[dict]:
    """Every bar of the issue on every cell, at the high end: DisentangledFlash under both backward figures,
    FlashDeBERTa where it has the option, HF eager on fwd+bwd at N = 512, the content-only FlashAttention-2 at
    N = 512 (its bar per target). Each also at distaff's floor (``floor_ratio``: its kernels with no dependent
    wait, ``PassEstimate.floor_total_ms``): a bar unmet there is out of reach of these kernels' design, whatever
    latency they come to hide."""
    rows = []
    for w, result in results.items():
        ours = {p: result["distaff"][p] for p in PASSES}
        for p in PASSES:
            for figure in DF_BACKWARD_FIGURES:
                if (theirs := peer_ms(result, "DisentangledFlash", p, figure)) and (p == "bwd" or figure == "profile"):
                    rows.append(_verdict(w, p, f"DisentangledFlash ({figure})" if p == "bwd" else "DisentangledFlash",
                                         [ours[p]], theirs, BARS["DisentangledFlash"]))
            if theirs := peer_ms(result, "FlashDeBERTa", p):
                rows.append(_verdict(w, p, "FlashDeBERTa", [ours[p]], theirs, BARS["FlashDeBERTa"]))
            if w.n == 512 and w.cc in CONTENT_BARS and (theirs := peer_ms(result, CONTENT, p)):
                rows.append(_verdict(w, p, CONTENT, [ours[p]], theirs, CONTENT_BARS[w.cc][p]))
        if w.n == 512 and isinstance(result.get(HF_EAGER), dict):
            hf = sum(peer_ms(result, HF_EAGER, p) for p in PASSES)
            rows.append(_verdict(w, "fwd+bwd", HF_EAGER, list(ours.values()), hf, BARS[HF_EAGER]))
    return rows


def _verdict(w: Workload, p: str, against: str, ours: list[PassEstimate], theirs: float, bar: float) -> dict:
    ratio = sum(e.total_ms for e in ours) / theirs
    floor_ratio = sum(e.floor_total_ms for e in ours) / theirs
    return dict(workload=w.name, target=f"sm_{w.cc}", pass_=p, against=against, ratio=round(ratio, 3), bar=bar,
                met=ratio <= bar, floor_ratio=round(floor_ratio, 3), met_at_floor=floor_ratio <= bar)


def verdict_lines(rows: list[dict]) -> list[str]:
    lines = ["| workload | target | pass | against | distaff / it (high) | bar | met | distaff with no dependent "
             "wait / it | met there |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['workload']} | {r['target']} | {r['pass_']} | {r['against']} | {r['ratio']:.2f} | "
              f"<= {r['bar']:g} | {'yes' if r['met'] else '**no**'} | {r['floor_ratio']:.2f} | "
              f"{'yes' if r['met_at_floor'] else '**no**'} |" for r in rows]
    met, at_floor = sum(r["met"] for r in rows), sum(r["met_at_floor"] for r in rows)
    return lines + ["", f"{met} of {len(rows)} bars met (ESTIMATES at the 600-cycle end); {at_floor} of {len(rows)} "
                        "with distaff's kernels at their floor (no dependent wait: each at its calibrated issue floor "
                        "or its L2 / HBM floor): a bar unmet there is out of their design's reach."]


def kernel_rows(results: dict) -> list[str]:
    """Per launch: tile, occupancy, waves, instructions per score and one warp's chain on each tile path,
    bytes, and its time at the issue floor, at both latency ends and at its bandwidth floors."""
    lines = ["| workload | target | impl | kernel | tile | warps/stages | regs | spill B | blocks/SM | programs "
             "| waves | instr/score by path (tensor/global/shared/barrier/MUFU/other per warp) | chain cycles by "
             "path (low-high) | issued/unique | wgmma | L2 GB | HBM GB (low-high) | issue floor ms | "
             "latency-aware ms (low-high, uncalibrated) |", "|" + "---|" * 19]
    for w, result in results.items():
        for impl, passes in result.items():
            if not isinstance(passes, dict) or impl == RECOMPUTED:  # distaff's kernels, as read in its own rows
                continue
            gpu = static_perf.GPUS[w.cc]
            ms = gpu.clock_ghz * 1e6
            for est in passes.values():
                for r in est.rows:
                    paths = "; ".join(f"{name} {score:.2f} ({'/'.join(str(mix[k]) for k in static_perf.CLASSES)})"
                                      for name, score, mix in r.paths) or "-"
                    chains = "; ".join(f"{name} {mix['chain_low']:.0f}-{mix['chain_high']:.0f}"
                                       for name, _, mix in r.paths) or "-"
                    lines.append(f"| {w.name} | sm_{w.cc} | {impl} | `{r.kernel}` | {r.tile} | {r.warps}/{r.stages} | "
                                 f"{r.registers} | {r.spills} | {r.blocks_per_sm} | {r.programs} | {r.waves:.2f} | "
                                 f"{paths} | {chains} | {r.repetition:.2f} | {'yes' if r.wgmma else 'no'} | "
                                 f"{r.l2_bytes / 1e9:.2f} | {r.hbm_bytes[0] / 1e9:.2f}-{r.hbm_bytes[1] / 1e9:.2f} | "
                                 f"{r.cycles / ms:.3f} | {r.span['low'] / ms:.3f}-{r.span['high'] / ms:.3f} |")
    return lines


def calibration_lines() -> list[str]:
    cal = calibration()
    rounds = ", ".join(f"{lat.name} {lat.global_}" for lat in static_perf.LATENCIES)
    lines = [f"latency model: global round trip {rounds} cycles; launch gap {LAUNCH_GAP_US['low']}-"
             f"{LAUNCH_GAP_US['high']} us; host sync {HOST_SYNC_US['low']}-{HOST_SYNC_US['high']} us; calibration "
             f"factor (one for every kernel, geometric mean over the fitted anchors) low {cal.factor['low']:.2f}, "
             f"high {cal.factor['high']:.2f}", "",
             "| anchor | source | published ms | estimate ms (low-high) | residual (estimate / published, low-high) "
             "| fitted |", "|---|---|---|---|---|---|"]
    for (anchor, est), (_, res) in zip(cal.anchors, cal.residuals()):
        fitted = f"no: {anchor.unfitted}" if anchor.unfitted else "yes"
        lines.append(f"| {anchor.name} | {anchor.source} | {anchor.published_ms:.4g} | {est['low']:.2f}-"
                     f"{est['high']:.2f} | {res['low']:.2f}-{res['high']:.2f} | {fitted} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", type=int, nargs="+", default=list(TARGETS))
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
    parser.add_argument("--dropouts", type=float, nargs="+", default=list(DROPOUTS))
    parser.add_argument("--lengths", type=int, nargs="+", default=[n for n, _ in WORKLOADS],
                        help="sequence lengths (B = 16,384 tokens / N)")
    parser.add_argument("--kernels", action="store_true", help="also print the per-kernel rows")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel processes")
    parser.add_argument("--json", type=Path, help="also write the estimates as JSON here")
    args = parser.parse_args(argv)
    workloads = [Workload(n, 16384 // n, d, p, cc) for cc in args.targets for n in args.lengths
                 for d in args.head_dims for p in args.dropouts]
    print("# ESTIMATES from compiled code (no GPU): H=12, bf16, 256 buckets, max relative 512; sm_90 = H100 SXM, "
          "sm_80 = A100 SXM; milliseconds per pass, kernels plus their outside work\n")
    print("\n".join(calibration_lines()) + "\n")
    table, results = summary_rows(workloads, args.jobs)
    print("\n".join(table))
    print("\n" + "\n".join(verdict_lines(verdicts(results))))
    if args.kernels:
        print("\n" + "\n".join(kernel_rows(results)))
    if args.json:
        args.json.write_text(json.dumps(as_json(results), indent=1))
    return 0


def as_json(results: dict) -> dict:
    """The estimates for other tools (a planner reads attention times from it): the calibration with each
    anchor's residual, and one record per (workload, implementation, pass) with the GPU modelled, the
    pass's milliseconds at the low and the high end (kernels, outside work, launch gaps and host syncs),
    and each launch's static figures. ``ms_low`` / ``ms_high`` are the estimates at the 300- and the
    600-cycle round trip (``total_ms`` = ``ms_high``, what the bar is judged on); each end has its own
    calibration factor, so for a kernel that hides its latency ``ms_low`` can exceed ``ms_high``. All
    figures are ESTIMATES."""
    cal = calibration()
    records = []
    for w, result in results.items():
        gpu = static_perf.GPUS[w.cc].name
        for impl, passes in result.items():
            if not isinstance(passes, dict):
                records.append(dict(workload=asdict(w), gpu=gpu, impl=impl, unavailable=passes))
                continue
            for p, est in passes.items():
                records.append(dict(workload=asdict(w), gpu=gpu, impl=impl, pass_=p, estimated=True,
                                    ms_low=est.total("low"), ms_high=est.total("high"), total_ms=est.total_ms,
                                    kernel_ms=est.kernel_ms, outside_ms=est.outside_ms, launches=est.launches,
                                    host_syncs=est.syncs, kernels=[asdict(r) for r in est.rows]))
    anchors = [dict(name=a.name, source=a.source, gpu=a.gpu.name, published_ms=a.published_ms, estimate_ms=est,
                    residual=res, fitted=not a.unfitted, unfitted=a.unfitted)
               for (a, est), (_, res) in zip(cal.anchors, cal.residuals())]
    figures = {name: dict(published_ms=DF_BACKWARD_FIGURES[name], scale=scale)
               for name, scale in df_backward_scales().items()}
    return dict(estimated=True, calibration=dict(factor=cal.factor, anchors=anchors),
                disentangled_flash_backward_figures=figures, verdicts=verdicts(results), records=records)


if __name__ == "__main__":
    sys.exit(main())
