"""Fused DeBERTa disentangled attention in Triton: flash-style forward, deterministic backward.

Scores of a tile of ``BLOCK_M`` query rows (``i0 + a``) and ``BLOCK_N`` key columns (``j0 + b``) are
``(Q K^T + c2p + p2c) * scale`` with ``c2p[a, b] = Q_a . Kr[idx(i, j)]`` and ``p2c[a, b] = K_b . Qr[idx(i, j)]``.
The distances ``i - j`` of a tile form one *window* of ``BLOCK_M + BLOCK_N - 1`` values starting at
``r0 = i0 - j0 - (BLOCK_N - 1)``; window column ``c = a - b + BLOCK_N - 1``. A tile takes one of two paths:

* **saturated** (every distance of the window in bucket 0 or in the top bucket ``2k - 1``: far from the
  diagonal, most tiles at long N): c2p is one value per query row and p2c one per key column. Those
  values, ``Q_i . Kr[end]`` and ``K_j . Qr[end]`` for both ends, are computed once per token by
  ``_attn_end_terms`` (the ``END`` tensor), so the tile adds two vectors to ``Q K^T``. The host launches it
  only when some tile can saturate (``planning._Problem.saturates``; none does at 512 tokens with v3's settings).
* **general**: ``X = Q @ Kr[bucket(r0 + c)]^T`` (``[BLOCK_M, WINDOW]``, one table row per window
  distance, gathered by the bucket table) and ``Y = K @ Qr[bucket(r0 + c)]^T`` on tensor cores, written
  to the program's scratch buffer and read back *skewed*: score ``(a, b)`` reads ``X[a, a - b + BN - 1]``
  (address ``a * (WINDOW + 1) - b + BN - 1``) and ``Y[b, a - b + BN - 1]`` (``b * (WINDOW - 1) + a + BN - 1``).
  The skew is one store and one load per element, affine addresses, no per-element index arithmetic;
  Triton's register gather (``tl.gather``) costs about 30 instructions per element here (docs/kernels.md).
  In the forward's *dense* design (``planning.forward_design``, named in the plan as ``_Problem.forward``) two
  torch GEMMs compute ``C2P = Q Kr^T`` and ``P2C = K Qr^T`` (``[H, rows, 2k]``, ``dense.dense_scores``) before
  the kernel, and a general tile reads score ``(i, j)``'s terms at ``C2P[i, bucket(i - j)]`` and
  ``P2C[j, bucket(i - j)]``: no window rows, products or scratch. The backward's kernels read the scores they
  recompute the same way (``planning.backward_scores_design``, ``_Problem.backward_scores``): the forward's, kept
  for them where both passes read dense ones (``_Problem.keep_scores``: 403 MB a layer at v3's batch), else from
  two GEMMs run again at the backward's start.

Backward (no atomics, deterministic): ``_attn_bwd_delta`` (``rowsum(dO * O)``), then ``_attn_bwd`` launched
twice, recomputing the scores: over query blocks (``dQ`` and the c2p table gradient ``dKr``; its rows are called
``_attn_bwd_dq`` in the compile check and the judge) and over key blocks, the tile held transposed (``dK``, ``dV``
and the p2c gradient ``dQr``; ``_attn_bwd_dkdv``).
A position gradient needs ``dS`` in distance coordinates: each general tile stores its ``dS`` into a
per-program *band* (row, distance) with the same affine skew; after the tile loop of a block, the band
is read in chunks of distances whose buckets are contiguous: ``merged = band @ one_hot`` adds the distances
that share a bucket (the identity where they are one-to-one), then ``dQ += merged @ Kr[b .. b + CHUNK)`` and
``dKr[b ..] += merged^T @ Q``. Saturated tiles add their ``dS`` row sums (column sums for p2c) into two
accumulators per block, turned into rank-1 updates once per block. A program walks a run of (sequence,
block) items of one head and keeps one float32 ``[2k, d]`` partial of its head; ``torch.sum`` adds the
partials in a fixed order. Programs, partials and scratch are sized to a budget (``backward.PARTIAL_BUDGET``).
In the *dense* design (``dense``; ``planning.backward_design`` picks it per capability and length, named in the
plan as ``_Problem.backward``) each block writes its merged chunks (and its saturated tiles' end sums) in bucket
coordinates to a head-major ``[H, rows, 2k]`` HBM buffer instead (``dC2P`` from dq, ``dP2C`` from dk/dv), and four
batched torch GEMMs finish the job: ``dQ += dC2P Kr``, ``dKr = dC2P^T Q``, ``dK += dP2C Qr``, ``dQr = dP2C^T K``.

Optional features are ``tl.constexpr`` specialisations: ``SCALE_PER_SEQ`` (one softmax scale per
sequence), ``MASK_DIAGONAL`` (``i != j``, tested only on tiles that meet the diagonal), ``VARLEN``.
A row left without keys gets ``lse = +inf`` and output 0, hence ``P = 0`` and ``dS = 0`` in backward. The
padding mask is packed 32 tokens to a word by one launch (``mask.mask_bits``): a tile side's visibility is one
scalar load per 32 tokens.

Dropout keeps ``(i, j)`` iff a 32-bit integer hash of ``(seed + b*H + h, (i << 16) ^ j)`` is at least
``p * 2**32`` (``scores._dropout_keep``): about six integer instructions per score (Philox costs ~55),
regenerated in backward, never stored.
Tile sizes per kernel, head dim and target are chosen so every configuration compiles without
register spills (``compile_check``); the static speed figures are read by ``static_perf`` and
``benchmarks/attention_judge.py``; design notes: ``docs/kernels.md``.

The modules: ``planning`` (host: tiles, tables, the launch plan and its checks; its settings
``PLANNED_CAPABILITY`` and ``INTERPRETER_TILES`` are set there), ``scores`` (what one tile computes, shared by
all kernels), ``forward``, ``backward`` (its budget ``PARTIAL_BUDGET`` is set there), ``dense`` (the dense
designs' GEMMs, buffer reads and writes) and ``op`` (the autograd function and the public ops). This package
re-exports the public names callers used before the split
(private ones, such as ``planning._Problem``, are named on their module); the settings are read here through
``__getattr__`` and must be assigned on their own module.

Imports: ``distaff.kernels.contract`` and ``distaff.kernels.relative_position``, torch, triton. Imported by:
``distaff.kernels`` (the public dispatch and the custom ops), ``distaff.kernels.aot`` (its launches compiled),
the benchmarks and tests.
"""

from __future__ import annotations

from ..contract import AttentionCall
from . import backward, forward, mask, planning, scores
from .backward import BackwardBuffers, attention_backward, backward_buffers, row_delta
from .forward import attention_forward, end_terms
from .mask import mask_bits, mask_bits_reference
from .op import disentangled_attention, disentangled_attention_varlen
from .planning import (INT32_MAX, KERNELS, DistanceTable, TilePaths, Tiles, band_folds, band_range, capability,
                       check_offsets_fit_int32, multiprocessors, plan, programs_per_head, tile_paths,
                       tile_saturation, tiles_for)

_SETTINGS = {"PLANNED_CAPABILITY": planning, "INTERPRETER_TILES": planning, "PARTIAL_BUDGET": backward}


def __getattr__(name: str):
    """The settings, read from the module that uses them (assign them there: ``planning.PLANNED_CAPABILITY``)."""
    if name in _SETTINGS:
        return getattr(_SETTINGS[name], name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AttentionCall", "BackwardBuffers", "DistanceTable", "INT32_MAX", "KERNELS", "TilePaths", "Tiles",
           "attention_backward", "attention_forward", "backward", "backward_buffers", "band_folds", "band_range",
           "capability", "check_offsets_fit_int32", "disentangled_attention", "disentangled_attention_varlen",
           "end_terms", "forward", "mask", "mask_bits", "mask_bits_reference", "multiprocessors", "plan", "planning",
           "programs_per_head", "row_delta", "scores", "tile_paths", "tile_saturation", "tiles_for"]
