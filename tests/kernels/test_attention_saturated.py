"""The saturated-tile path of the fused attention: tiles whose distances all fall in bucket 0 or in the
top bucket add per-row (c2p) and per-column (p2c) end terms instead of window products, and their
position gradients are rank-1 updates, once per block, instead of band reads.

Small ``position_buckets`` / ``max_relative_positions`` make most tiles saturate at small N, so the
interpreter exercises the saturated path next to the general one in every sequence; each test asserts
that saturated tiles occur, and one counts that the kernels take that path on exactly the tiles
``attention.tile_paths`` predicts.
"""

from __future__ import annotations

import pytest
import torch
from test_attention_triton import TOL, assert_close, dropout_against_oracle, make_inputs, run_with_grads

from distaff.kernels import attention, reference
from distaff.kernels.aot.compile_check import launch_name
from distaff.kernels.attention.planning import _Problem
from distaff.kernels.contract import AttentionCall
from distaff.kernels.relative_position import attention_span, relative_position_index

pytestmark = pytest.mark.unit

BUCKETS, MAX_REL = 8, 32  # saturated beyond |i - j| of 16 (positive side) and 32 (negative side)


def _saturated_tiles(n: int, buckets: int = BUCKETS, max_rel: int = MAX_REL) -> int:
    """Saturated tiles of a length-``n`` sequence at the interpreter's tiles; both paths must occur."""
    paths = attention.tile_paths(n, attention.INTERPRETER_TILES, buckets, max_rel)
    assert paths.saturated > 0 and paths.general > 0, paths  # both paths in one sequence
    return paths.saturated


# --------------------------------------------------------------------------- counting the paths


def _brute_force_paths(n: int, tiles: attention.Tiles, buckets: int, max_rel: int) -> attention.TilePaths:
    """Each tile's set of position rows, read off the full ``[i, j]`` index of the tile's rectangle
    (including rows and columns past ``n``, which the kernels' windows cover too)."""
    bm, bn = tiles.block_m, tiles.block_n
    rows, cols = -(-n // bm) * bm, -(-n // bn) * bn
    idx = relative_position_index(rows, cols, buckets, max_rel)
    ends = {0, 2 * attention_span(buckets, max_rel) - 1}
    saturated = general = 0
    for i0 in range(0, n, bm):
        for j0 in range(0, n, bn):
            distinct = set(idx[i0:i0 + bm, j0:j0 + bn].flatten().tolist())
            if len(distinct) == 1 and distinct <= ends:
                saturated += 1
            else:
                general += 1
    return attention.TilePaths(saturated, general)


@pytest.mark.parametrize("n,tiles,buckets,max_rel", [
    (512, attention.Tiles(64, 64, 4, 1), 256, 512),
    (1100, attention.Tiles(16, 16, 8, 1), 256, 512),   # both saturated sides (|i - j| >= 506 / 512)
    (1100, attention.Tiles(64, 32, 4, 1), 256, 512),
    (300, attention.Tiles(32, 16, 4, 1), 32, 128),     # the tiny preset's table, rectangular tiles
    (130, attention.Tiles(16, 32, 4, 1), BUCKETS, MAX_REL),
    (257, attention.Tiles(32, 32, 4, 1), 0, 24),       # clamped distances, no log buckets
    (77, attention.Tiles(16, 16, 4, 1), 4, 8),         # odd length: the last tiles overhang n
])
def test_tile_paths_match_a_brute_force_enumeration(n, tiles, buckets, max_rel) -> None:
    assert attention.tile_paths(n, tiles, buckets, max_rel) == _brute_force_paths(n, tiles, buckets, max_rel)


def test_v3_path_fractions_at_the_benchmark_lengths() -> None:
    """DeBERTa-v3 settings at 64 x 64 tiles: no saturated tile at N = 512 (the farthest distance, 511,
    saturates only on the positive side and no whole window reaches it), about half at 2048, most at 8192."""
    tiles = attention.Tiles(64, 64, 4, 1)
    fractions = [attention.tile_paths(n, tiles, 256, 512).saturated / (n // 64) ** 2 for n in (512, 2048, 8192)]
    assert fractions[0] == 0.0 and 0.4 < fractions[1] < 0.6 and 0.8 < fractions[2] < 0.9, fractions


@pytest.mark.parametrize("cc", [80, 90, 100])
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 64), (torch.float16, 32), (torch.float32, 128)])
@pytest.mark.parametrize("n,buckets,max_rel", [(512, 256, 512), (513, 256, 512), (576, 256, 512), (1024, 256, 512),
                                               (130, BUCKETS, MAX_REL), (33, BUCKETS, MAX_REL), (300, 32, 128),
                                               (77, 4, 8), (40, 0, 24)])
def test_end_terms_are_planned_exactly_when_a_tile_of_some_kernel_saturates(n, buckets, max_rel, dtype, d, cc,
                                                                            monkeypatch) -> None:
    """The host skips the end-terms kernel when no tile can saturate (512 tokens at v3's settings); its
    O(1) test agrees with the tile-by-tile enumeration for every kernel's real tiles on each target (those of the
    designs the plan picked)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the GPU tiles, not the interpreter's
    monkeypatch.setattr(attention.planning, "PLANNED_CAPABILITY", cc)
    q = torch.empty(1, 2, n, d, dtype=dtype)
    call = AttentionCall(q, q, q, q.new_empty(2, 2 * attention_span(buckets, max_rel), d), None, buckets, max_rel,
                         0.0, 0.125)
    problem = attention.plan(call)[3]
    saturated = [attention.tile_paths(n, problem.tiles(kernel, q), buckets, max_rel).saturated  # the plan's designs'
                 for kernel in attention.KERNELS]
    assert problem.saturates(q) == any(saturated), saturated
    if not any(saturated):  # a one-element stand-in, no launch
        assert attention.end_terms(problem, q, q, call.pos_key, None).numel() == 1


def test_no_end_terms_at_512_tokens_with_v3_settings_and_the_output_still_matches(monkeypatch) -> None:
    """The case the skip is for, through the kernels (interpreter tiles): nothing saturates, the
    end-terms kernel is not launched, and forward and backward match the reference."""
    launched = []
    original = _Problem.launch_rows

    def recorded(self, kernel, *args, **kwargs):
        launched.append(kernel.__name__)
        return original(self, kernel, *args, **kwargs)

    monkeypatch.setattr(_Problem, "launch_rows", recorded)
    n, kw = 64, dict(position_buckets=256, max_relative_positions=512)
    assert attention.tile_paths(n, attention.INTERPRETER_TILES, 256, 512).saturated == 0
    inputs = make_inputs(torch.device("cpu"), 1, 2, n, 16, 256, seed=5)
    got = run_with_grads(attention.disentangled_attention, inputs, torch.float32, **kw)
    want = run_with_grads(reference.disentangled_attention, inputs, torch.float64, **kw)
    assert_close(got, want, TOL[torch.float32])
    assert "_attn_end_terms" not in launched and "_attn_bwd_delta" in launched


@pytest.mark.parametrize("n,buckets,max_rel,ahead", [(64, 256, 512, False), (130, BUCKETS, MAX_REL, True)],
                         ids=["nothing-saturates", "saturating"])
def test_the_backward_reads_end_terms_ahead_only_where_a_tile_can_saturate(n, buckets, max_rel, ahead,
                                                                           monkeypatch) -> None:
    """Both backward kernels read a saturated tile's end terms a tile ahead (``ENDS_AHEAD``) exactly when some tile
    can saturate (and their tiles hoist, as the interpreter's do): at v3's settings and 64 tokens the masked-off
    reads would only cost the general tiles. Gradients match the reference either way."""
    launched = {}
    original = _Problem.launch

    def recorded(self, kernel, *args, **kwargs):
        launched[launch_name(kernel, kwargs)] = kwargs.get("ENDS_AHEAD")
        return original(self, kernel, *args, **kwargs)

    monkeypatch.setattr(_Problem, "launch", recorded)
    inputs = make_inputs(torch.device("cpu"), 1, 2, n, 16, attention_span(buckets, max_rel), seed=9)
    kw = dict(position_buckets=buckets, max_relative_positions=max_rel)
    got = run_with_grads(attention.disentangled_attention, inputs, torch.float32, **kw)
    want = run_with_grads(reference.disentangled_attention, inputs, torch.float64, **kw)
    assert_close(got, want, TOL[torch.float32])
    assert launched == {"_attn_fwd": None, "_attn_bwd_dkdv": ahead, "_attn_bwd_dq": ahead}


@pytest.mark.parametrize("tiles,forward,scores", [(attention.INTERPRETER_TILES, "fused", "fused"),
                                                  (attention.INTERPRETER_TILES, "dense", "dense"),
                                                  (attention.Tiles(32, 32, 4, 1), "fused", "fused"),
                                                  (attention.Tiles(32, 32, 4, 1), "fused", "dense")],
                         ids=["paths-apart", "paths-apart-dense-scores", "one-loop", "one-loop-dense-backward"])
def test_kernels_take_the_saturated_path_on_exactly_the_saturated_tiles(tiles, forward, scores, monkeypatch) -> None:
    """Every tile's scores come from exactly one of the two paths, in each of the three kernels: the end
    terms on the saturated tiles, the skewed window products (or, in the dense designs of the forward's and the
    backward's scores, the dense products) on the others; whether the forward walks the paths in separate loops
    (key ranges from the host's limits) or reads each tile's path from the table."""
    assert tiles.paths_apart == (tiles is attention.INTERPRETER_TILES)
    monkeypatch.setattr(attention.planning, "INTERPRETER_TILES", tiles)
    monkeypatch.setattr(attention.planning, "forward_design", lambda *args: forward)
    monkeypatch.setattr(attention.planning, "backward_scores_design", lambda *args: scores)
    calls = {"saturated": 0, "general": 0}

    def counted(name, fn):
        def wrapper(*args):
            calls[name] += 1
            return fn(*args)
        return wrapper

    # each kernel calls them through the module it imported them into: the one-loop tiles' (_tile_scores, the
    # backward's end terms read a tile ahead or not) from scores, the forward's runs from forward
    end_row_column = counted("saturated", attention.scores._end_row_column)
    skewed_read = counted("general", attention.scores._skewed_read)
    for module in (attention.scores, attention.forward):
        monkeypatch.setattr(module, "_end_row_column", end_row_column)
        monkeypatch.setattr(module, "_skewed_read", skewed_read)
    dense_bias = counted("general", attention.dense._dense_bias)
    for module in (attention.scores, attention.forward):
        monkeypatch.setattr(module, "_dense_bias", dense_bias)
    batch, heads, n = 1, 2, 130
    paths = attention.tile_paths(n, attention.INTERPRETER_TILES, BUCKETS, MAX_REL)
    assert paths.saturated > 0 and paths.general > 0, paths
    inputs = make_inputs(torch.device("cpu"), batch, heads, n, 32, 8)
    leaves = [t.requires_grad_() for t in inputs]
    out = attention.disentangled_attention(*leaves, position_buckets=BUCKETS, max_relative_positions=MAX_REL)
    per_pass = {"saturated": paths.saturated * batch * heads, "general": paths.general * batch * heads}
    assert calls == per_pass
    out.backward(torch.randn_like(out))
    assert calls == {name: 3 * count for name, count in per_pass.items()}


# --------------------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("c2p,p2c,dtype", [
    pytest.param(True, True, torch.float32, id="both-fp32"),
    pytest.param(True, True, torch.float16, id="both-fp16"),
    pytest.param(True, False, torch.float32, id="c2p-only"),
    pytest.param(False, True, torch.float16, id="p2c-only-fp16"),
])
def test_saturated_tiles_match_the_reference(c2p, p2c, dtype) -> None:
    n = 130
    _saturated_tiles(n)
    inputs = make_inputs(torch.device("cpu"), 1, 2, n, 32, 8, c2p, p2c, seed=4)
    kw = dict(position_buckets=BUCKETS, max_relative_positions=MAX_REL)
    got = run_with_grads(attention.disentangled_attention, inputs, dtype, **kw)
    want = run_with_grads(reference.disentangled_attention, inputs, torch.float64, **kw)
    assert_close(got, want, TOL[dtype])


@pytest.mark.parametrize("tiles", [attention.Tiles(16, 16, 8, 1), attention.Tiles(32, 16, 4, 1),
                                   attention.Tiles(16, 32, 4, 1, hoist=False), attention.Tiles(32, 16, 2, 1),
                                   attention.Tiles(16, 32, 1, 1), attention.Tiles(32, 32, 2, 1, hoist=False),
                                   attention.Tiles(32, 16, 2, 1, keys_ahead=True),
                                   attention.Tiles(16, 32, 1, 1, keys_ahead=True)],
                         ids=["16x16", "32x16", "16x32-unhoisted", "32x16-apart", "16x32-apart",
                              "32x32-apart-unhoisted", "32x16-apart-keys-ahead", "16x32-apart-keys-ahead"])
def test_saturated_gpu_and_rectangular_tiles(tiles, monkeypatch) -> None:
    """Small and rectangular tiles (windows of other widths, partly saturated windows) on both paths, with
    the forward's paths in one loop or apart, window rows hoisted or not, a saturated run's keys loaded a tile
    ahead or in the tile."""
    monkeypatch.setattr(attention.planning, "INTERPRETER_TILES", tiles)
    n = 80
    _saturated_tiles(n)
    inputs = make_inputs(torch.device("cpu"), 1, 1, n, 32, 8, seed=8)
    kw = dict(position_buckets=BUCKETS, max_relative_positions=MAX_REL)
    got = run_with_grads(attention.disentangled_attention, inputs, torch.float32, **kw)
    want = run_with_grads(reference.disentangled_attention, inputs, torch.float64, **kw)
    assert_close(got, want, TOL[torch.float32])


def test_saturated_tiles_with_padding() -> None:
    """Padded rows and columns inside saturated tiles: holes, trailing padding, an empty sequence."""
    n = 110
    _saturated_tiles(n)
    inputs = make_inputs(torch.device("cpu"), 3, 1, n, 32, 8, seed=5)
    mask = torch.ones(3, n, dtype=torch.long)
    mask[0, 75:] = 0
    mask[1, 1::4] = 0
    mask[2] = 0
    kw = dict(position_buckets=BUCKETS, max_relative_positions=MAX_REL, attention_mask=mask)
    got = run_with_grads(attention.disentangled_attention, inputs, torch.float32, **kw)
    want = run_with_grads(reference.disentangled_attention, inputs, torch.float64, **kw)
    assert_close(got, want, TOL[torch.float32])


def test_saturated_tiles_in_packed_sequences() -> None:
    """Packed sequences: positions restart per sequence, so the long ones saturate and the short do not."""
    lengths = [100, 7, 75]
    _saturated_tiles(100)
    cu_seqlens = torch.tensor([0, 100, 107, 182], dtype=torch.int32)
    gen = torch.Generator().manual_seed(6)
    inputs = [torch.randn(sum(lengths), 2, 32, generator=gen) for _ in range(3)]
    inputs += [torch.randn(2, 2 * BUCKETS, 32, generator=gen) for _ in range(2)]
    kw = dict(cu_seqlens=cu_seqlens, max_seqlen=max(lengths), position_buckets=BUCKETS,
              max_relative_positions=MAX_REL)
    got = run_with_grads(attention.disentangled_attention_varlen, inputs, torch.float32, **kw)
    want = run_with_grads(reference.disentangled_attention_varlen, inputs, torch.float64, **kw)
    assert_close(got, want, TOL[torch.float32])


def test_saturated_tiles_with_a_shared_position_table() -> None:
    """``share_att_key``: Kr and Qr are the content key/query projections of one table R, so R's
    gradient sums the c2p and p2c rank-1 gradients of the same saturated buckets."""
    heads, d, n = 2, 32, 130
    _saturated_tiles(n)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, heads, n, d, generator=gen) for _ in range(3))
    table = torch.randn(2 * BUCKETS, heads * d, generator=gen)
    w_key, w_query = (torch.randn(heads * d, heads * d, generator=gen) / (heads * d) ** 0.5 for _ in range(2))

    def attend(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, table)]
        rel = leaves[3]
        pos_key, pos_query = ((rel @ w.to(dtype).T).view(2 * BUCKETS, heads, d).transpose(0, 1)
                              for w in (w_key, w_query))
        out = fn(*leaves[:3], pos_key, pos_query, position_buckets=BUCKETS, max_relative_positions=MAX_REL)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype))
        return [out] + [t.grad for t in leaves]

    got = attend(attention.disentangled_attention, torch.float32)
    want = attend(reference.disentangled_attention, torch.float64)
    assert_close(got, want, TOL[torch.float32])  # out, dq, dk, dv and dR (in the dpos_key slot)


def test_saturated_tiles_with_dropout() -> None:
    """Dropout inside saturated tiles against an oracle that applies the kernel's own keep mask."""
    n = 128
    _saturated_tiles(n)
    inputs = [t.double() for t in make_inputs(torch.device("cpu"), 1, 1, n, 32, attention_span(8, 32))]
    got, want = dropout_against_oracle(inputs, 9, position_buckets=BUCKETS, max_relative_positions=MAX_REL)
    assert_close(got, want, TOL[torch.float32])
