"""What the GPU build of the fused attention does differently from the interpreter's default run:
its tile shapes (including rectangular tiles), TF32 products for float32 inputs, the 32-bit offset
bound, and the compile check's coverage of the model presets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from attention_oracle import naive_attention
from test_attention_triton import TOL, assert_close, dropout_against_oracle
from distaff.kernels import attention
from distaff.kernels.aot import compile_check
from distaff.kernels.attention import planning
from distaff.kernels.attention.planning import _TILES, _VARIANT_TILES, _distance_table
from distaff.kernels.contract import AttentionCall
from distaff.kernels.relative_position import attention_span

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _inputs(n: int, d: int, span: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, n, d, generator=gen) for _ in range(3)] + [
        torch.randn(2, 2 * span, d, generator=gen) for _ in range(2)]


def _out_and_grads(fn, inputs, dtype, **kwargs) -> list[torch.Tensor]:
    leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
    out = fn(*leaves, **kwargs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype))
    return [out] + [t.grad for t in leaves]


def _rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


GPU_SHAPES = sorted({(t.block_m, t.block_n) for row in _TILES.values() for t in row.values()}
                    | {(t.block_m, t.block_n) for t in _VARIANT_TILES.values()})


@pytest.mark.parametrize("shape", GPU_SHAPES, ids=[f"{m}x{n}" for m, n in GPU_SHAPES])
def test_gpu_and_rectangular_tiles_match_the_oracle(shape, monkeypatch) -> None:
    """Every tile shape a GPU launches (rectangular ones too, whose window is padded to a power of two)
    through the interpreter: identity, log and saturated buckets in one sequence of more than one block, with
    a padding mask (holes and trailing padding) read as packed words by tiles of 16, 32 and 64 tokens."""
    monkeypatch.setattr(attention.planning, "INTERPRETER_TILES", attention.Tiles(*shape, 4, 1))
    inputs = _inputs(150, 32, 16)
    mask = torch.ones(1, 150, dtype=torch.long)
    mask[0, 5::7] = 0
    mask[0, 131:] = 0
    kw = dict(position_buckets=16, max_relative_positions=40, attention_mask=mask)
    got = _out_and_grads(attention.disentangled_attention, inputs, torch.float32, **kw)
    want = _out_and_grads(naive_attention, inputs, torch.float64, **kw)
    for name, a, e in zip(("out", "dq", "dk", "dv", "dkr", "dqr"), got, want):
        assert _rel_l2(a, e) < 1e-5, name


# every forward tile a GPU launches, with the design it is planned for (a row's "fwd_dense" reads dense scores)
FORWARD_TILES = sorted({(t, "dense" if kernel == "fwd_dense" else "fused") for row in _TILES.values()
                        for kernel, t in row.items() if kernel in ("fwd", "fwd_dense")},
                       key=lambda pair: (pair[0].block_m, pair[0].block_n, pair[0].num_warps, pair[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("tiles,design", FORWARD_TILES,
                         ids=[f"{t.block_m}x{t.block_n}w{t.num_warps}-{d}" for t, d in FORWARD_TILES])
def test_every_planned_forward_tile_with_its_warps_matches_the_oracle(tiles, design, dtype, monkeypatch) -> None:
    """Each forward tile a GPU launches, with its warps (which decide whether it walks its paths apart, as sm_80's
    32 x 32 on 2 warps now does, or in one loop) and its design, through the interpreter on fresh random inputs:
    output and all five gradients against the float64 oracle, across identity, log and saturated buckets and a
    padding mask."""
    monkeypatch.setattr(attention.planning, "INTERPRETER_TILES", tiles)
    monkeypatch.setattr(attention.planning, "forward_design", lambda *args: design)
    inputs = _inputs(150, 32, 16, seed=11 + tiles.block_m + tiles.block_n + tiles.num_warps)
    mask = torch.ones(1, 150, dtype=torch.long)
    mask[0, 4::9] = 0
    mask[0, 137:] = 0
    kw = dict(position_buckets=16, max_relative_positions=40, attention_mask=mask)
    got = _out_and_grads(attention.disentangled_attention, inputs, dtype, **kw)
    want = _out_and_grads(naive_attention, inputs, torch.float64, **kw)
    for name, a, e in zip(("out", "dq", "dk", "dv", "dkr", "dqr"), got, want):
        assert _rel_l2(a, e) < (1e-5 if dtype == torch.float32 else 5e-3), name


# every backward tile a GPU launches with its buckets read a tile ahead (rows' and variants' dq/dkdv tiles)
BACKWARD_AHEAD_TILES = sorted({t for row in _TILES.values() for kernel, t in row.items()
                               if kernel.startswith(("dq", "dkdv")) and t.buckets_ahead}
                              | {t for key, t in _VARIANT_TILES.items() if key[3] != "fwd" and t.buckets_ahead},
                              key=lambda t: (t.block_m, t.block_n, t.num_stages, t.hoist))


@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("tiles", BACKWARD_AHEAD_TILES,
                         ids=[f"{t.block_m}x{t.block_n}s{t.num_stages}" for t in BACKWARD_AHEAD_TILES])
def test_every_backward_tile_reading_buckets_ahead_matches_the_oracle(tiles, dropout, monkeypatch) -> None:
    """The backward tiles that load their next tile's buckets a tile ahead (dq from the mirrored table, dk/dv
    from the direct one, both masked past the sequence's last block), with dense backward scores, through the
    interpreter: the five gradients against the float64 oracle across identity, log and saturated buckets, a
    padding mask and the diagonal mask; with dropout (128 tokens), against the oracle given the kernel's own keep
    mask."""
    monkeypatch.setattr(attention.planning, "INTERPRETER_TILES", tiles)
    monkeypatch.setattr(attention.planning, "backward_scores_design", lambda *args: "dense")
    n = 128 if dropout else 150  # the keep mask is recovered through an N x N identity V: N a head dim
    inputs = _inputs(n, 32, 16, seed=5 + tiles.block_m + tiles.num_stages)
    mask = torch.ones(1, n, dtype=torch.long)
    mask[0, 6::11] = 0
    mask[0, n - 9:] = 0
    kw = dict(position_buckets=16, max_relative_positions=40, attention_mask=mask, mask_diagonal=True)
    if dropout:
        got, want = dropout_against_oracle([t.double() for t in inputs], 7, **kw)
        assert_close(got, want, TOL[torch.float32])
        return
    got = _out_and_grads(attention.disentangled_attention, inputs, torch.float32, **kw)
    want = _out_and_grads(naive_attention, inputs, torch.float64, **kw)
    for name, a, e in zip(("out", "dq", "dk", "dv", "dkr", "dqr"), got, want):
        assert _rel_l2(a, e) < 1e-5, name


# every backward tile that gathers its next tile's c2p and p2c at the end of the one before (``Tiles.values_ahead``)
VALUES_AHEAD_TILES = [t for t in BACKWARD_AHEAD_TILES if t.values_ahead]
# No tile saturates at these lengths (the top bucket starts past 200 tokens), distances past 32 are log-bucketed:
# a launch where the tiles take their terms ahead.
GENERAL_ONLY = dict(position_buckets=64, max_relative_positions=256)


def _terms_ahead_launches(monkeypatch) -> list[bool]:
    """Whether each backward launch from now on gathers its terms a tile ahead (``VALUES_AHEAD``)."""
    launched, original = [], planning._Problem.launch

    def recorded(self, kernel, tiles, grid, q, has_c2p, has_p2c, **kwargs):
        if "DENSE" in kwargs:
            launched.append(kwargs["VALUES_AHEAD"])
        return original(self, kernel, tiles, grid, q, has_c2p, has_p2c, **kwargs)

    monkeypatch.setattr(planning._Problem, "launch", recorded)
    return launched


@pytest.mark.parametrize("case", ["padded-fp32", "padded-fp16", "c2p-only", "p2c-only", "varlen", "dropout"])
@pytest.mark.parametrize("tiles", VALUES_AHEAD_TILES,
                         ids=[f"{t.block_m}x{t.block_n}s{t.num_stages}" for t in VALUES_AHEAD_TILES])
def test_every_backward_tile_gathering_its_terms_ahead_matches_the_oracle(tiles, case, monkeypatch) -> None:
    """The backward tiles that gather each next tile's position terms at the end of the one before, through the
    interpreter with dense backward scores where no tile saturates: sequences ending mid-tile (the gathers a tile
    and the buckets two tiles past the end masked off), a padding mask and the diagonal mask; one term alone;
    packed sequences of 1 to 97 tokens; dropout against the oracle given the kernel's own keep mask. The launches
    are checked to have taken the terms ahead, so the test cannot pass on the tile-by-tile path."""
    from distaff.kernels import reference
    from test_attention_triton import make_inputs, run_with_grads

    monkeypatch.setattr(attention.planning, "INTERPRETER_TILES", tiles)
    monkeypatch.setattr(attention.planning, "backward_scores_design", lambda *args: "dense")
    launched = _terms_ahead_launches(monkeypatch)
    n = 128 if case == "dropout" else 150  # the keep mask is recovered through an N x N identity V
    mask = torch.ones(1, n, dtype=torch.long)
    mask[0, 6::11] = 0
    mask[0, n - 9:] = 0
    kw = dict(GENERAL_ONLY, mask_diagonal=tiles.gathers_ahead(True))  # the diagonal mask where it gathers ahead
    seed = 7 + tiles.block_m + tiles.num_stages
    if case == "varlen":
        lengths = [5, 1, 97, 40]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        gen = torch.Generator().manual_seed(seed)
        inputs = [torch.randn(sum(lengths), 2, 32, generator=gen) for _ in range(3)]
        inputs += [torch.randn(2, 128, 32, generator=gen) for _ in range(2)]
        kw.update(cu_seqlens=cu, max_seqlen=max(lengths))
        got = run_with_grads(attention.disentangled_attention_varlen, inputs, torch.float32, **kw)
        want = run_with_grads(reference.disentangled_attention_varlen, inputs, torch.float64, **kw)
        tol = TOL[torch.float32]
    elif case == "dropout":
        inputs = [t.double() for t in make_inputs(torch.device("cpu"), 1, 2, n, 32, 64, seed=seed)]
        got, want = dropout_against_oracle(inputs, 7, attention_mask=mask, **kw)
        tol = TOL[torch.float32]
    else:
        c2p, p2c = case != "p2c-only", case != "c2p-only"
        dtype = torch.float16 if case == "padded-fp16" else torch.float32
        inputs = make_inputs(torch.device("cpu"), 1, 2, n, 32, 64, c2p, p2c, seed=seed)
        got = run_with_grads(attention.disentangled_attention, inputs, dtype, attention_mask=mask, **kw)
        want = run_with_grads(reference.disentangled_attention, inputs, torch.float64, attention_mask=mask, **kw)
        tol = TOL[dtype]
    assert launched and all(launched), launched
    assert_close(got, want, tol)


def test_values_ahead_diagonal_overrides_values_ahead_under_the_diagonal_mask_only() -> None:
    """``values_ahead_diagonal`` decides under the diagonal mask only; unset, ``values_ahead`` does; either
    needs the buckets a tile ahead."""
    ahead = dict(buckets_ahead=True)
    assert [attention.Tiles(64, 32, 4, 2, values_ahead=True, values_ahead_diagonal=False, **ahead).gathers_ahead(d)
            for d in (False, True)] == [True, False]
    assert [attention.Tiles(64, 32, 4, 2, values_ahead=True, **ahead).gathers_ahead(d) for d in (False, True)] == [
        True, True]
    assert [attention.Tiles(64, 32, 4, 2, **ahead).gathers_ahead(d) for d in (False, True)] == [False, False]
    with pytest.raises(ValueError, match="buckets_ahead"):
        attention.Tiles(64, 32, 4, 2, values_ahead=True)


def test_the_terms_are_taken_ahead_only_where_no_tile_saturates(monkeypatch) -> None:
    """Past the lengths where no tile saturates, the same tiles take their terms tile by tile (the saturated
    tiles' end terms have no gathers to take ahead), and the result still matches the oracle."""
    from distaff.kernels import reference
    from test_attention_triton import make_inputs, run_with_grads

    tiles = VALUES_AHEAD_TILES[0]
    monkeypatch.setattr(attention.planning, "INTERPRETER_TILES", tiles)
    monkeypatch.setattr(attention.planning, "backward_scores_design", lambda *args: "dense")
    launched = _terms_ahead_launches(monkeypatch)
    kw = dict(position_buckets=16, max_relative_positions=40)
    assert attention.tile_paths(150, tiles, 16, 40).saturated > 0
    inputs = make_inputs(torch.device("cpu"), 1, 2, 150, 32, 16, seed=3)
    got = run_with_grads(attention.disentangled_attention, inputs, torch.float32, **kw)
    want = run_with_grads(reference.disentangled_attention, inputs, torch.float64, **kw)
    assert launched and not any(launched), launched
    assert_close(got, want, TOL[torch.float32])


def test_the_a100_forward_walks_its_paths_apart(monkeypatch) -> None:
    """sm_80's half-precision forward at d = 64 takes the tile-ahead forward: a warp per 16 query rows."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the GPU's tiles, not the interpreter's
    assert attention.tiles_for("fwd", 64, torch.bfloat16, 80).paths_apart


def test_forward_without_position_terms_on_its_own_tile_matches_the_oracle(monkeypatch) -> None:
    """The content-only forward on the tile sm_100 gives it at d = 128 (64 x 64 on 4 warps), through the
    interpreter with a padding mask: output and gradients against the oracle."""
    monkeypatch.setattr(attention.planning, "INTERPRETER_TILES", attention.Tiles(64, 64, 4, 1))
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(1, 2, 150, 32, generator=gen) for _ in range(3)]
    mask = torch.ones(1, 150, dtype=torch.long)
    mask[0, 3::5] = 0
    mask[0, 140:] = 0
    kw = dict(position_buckets=16, max_relative_positions=40, attention_mask=mask)
    got = _out_and_grads(lambda q, k, v: attention.disentangled_attention(q, k, v, None, None, **kw), inputs,
                         torch.float32)
    want = _out_and_grads(lambda q, k, v: naive_attention(q, k, v, None, None, **kw), inputs, torch.float64)
    for name, a, e in zip(("out", "dq", "dk", "dv"), got, want):
        assert _rel_l2(a, e) < 1e-5, name


@pytest.mark.parametrize("budget", [0.0, 1e9], ids=["one-program-per-head", "one-program-per-block"])
def test_backward_programs_however_the_partials_are_shared(budget, monkeypatch) -> None:
    """A backward program walks (sequence, block) items of one head into one partial: all of them
    (no budget), or one each (unlimited budget); both give the oracle's gradients."""
    monkeypatch.setattr(attention.backward, "PARTIAL_BUDGET", budget)
    gen = torch.Generator().manual_seed(2)
    inputs = [torch.randn(3, 2, 48, 32, generator=gen) for _ in range(3)] + [
        torch.randn(2, 32, 32, generator=gen) for _ in range(2)]
    kw = dict(position_buckets=16, max_relative_positions=40)
    got = _out_and_grads(attention.disentangled_attention, inputs, torch.float32, **kw)
    want = _out_and_grads(naive_attention, inputs, torch.float64, **kw)
    for name, a, e in zip(("out", "dq", "dk", "dv", "dkr", "dqr"), got, want):
        assert _rel_l2(a, e) < 1e-5, name


def _round_to_tf32(data: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even at TF32's 10 mantissa bits, as tensor cores read float32 operands."""
    bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32)
    rounded = (bits + ((bits >> 13) & 1) + 0xFFF) & np.uint32(0xFFFFE000)
    return rounded.view(np.float32)


def test_float32_inputs_within_the_documented_tf32_tolerance(monkeypatch) -> None:
    """On a GPU, float32 inputs run their products on TF32 tensor cores. The interpreter computes
    exact float32, so its dot is made to round TF32 operands as the hardware does; the result must
    stay within the tolerance docs/kernels.md states for float32 inputs (2e-3 relative L2)."""
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    exact_dot = interpreter.InterpreterBuilder.create_dot
    rounded_dots = []

    def tf32_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if input_precision == ir.INPUT_PRECISION.TF32 and a.data.dtype == np.float32:
            rounded_dots.append(1)
            a = interpreter.TensorHandle(_round_to_tf32(a.data), a.dtype)
            b = interpreter.TensorHandle(_round_to_tf32(b.data), b.dtype)
        return exact_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", tf32_dot)
    inputs = _inputs(48, 64, 32, seed=3)
    kw = dict(position_buckets=32, max_relative_positions=64)
    got = _out_and_grads(attention.disentangled_attention, inputs, torch.float32, **kw)
    want = _out_and_grads(naive_attention, inputs, torch.float64, **kw)
    assert rounded_dots, "no TF32 product was emulated: the kernel no longer asks for TF32"
    errors = {name: _rel_l2(a, e) for name, a, e in zip(("out", "dq", "dk", "dv", "dkr", "dqr"), got, want)}
    assert max(errors.values()) < 2e-3, errors
    assert max(errors.values()) > 1e-6, "TF32 rounding left no trace: the emulation did not run"


def test_forward_without_position_terms_takes_its_own_tile_or_the_capped_forward_tile(monkeypatch) -> None:
    """The content-only forward's tile ("content"): the row's own where it names one (sm_100, d = 128: the
    32-row forward tile on 2 warps spilled), else the forward's with at most ``BLOCK_M / 16`` warps; never more
    warps than its chained products have 16-row blocks (more would repeat them)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the GPU's tiles, not the interpreter's
    for (inputs, size, cc), row in _TILES.items():
        dtype = torch.float32 if inputs == "fp32" else torch.bfloat16
        content = attention.tiles_for("content", size, dtype, cc)
        assert content.num_warps * 16 <= content.block_m, (inputs, size, cc, content)
        assert content == row.get("content", row["fwd"].content_only()), (inputs, size, cc)
    assert attention.tiles_for("content", 128, torch.float16, 100) != attention.tiles_for("fwd", 128, torch.float16,
                                                                                          100).content_only()


def test_rows_hoisted_with_and_without_the_diagonal_mask_as_the_table_says() -> None:
    """``hoist_diagonal`` overrides ``hoist`` under the diagonal mask only, either way; unset, it follows ``hoist``."""
    assert [attention.Tiles(32, 64, 4, 1, hoist=False, hoist_diagonal=True).hoists(d) for d in (False, True)] == [
        False, True]
    assert [attention.Tiles(64, 32, 4, 1, hoist_diagonal=False).hoists(d) for d in (False, True)] == [True, False]
    assert [attention.Tiles(64, 32, 4, 1, hoist=False).hoists(d) for d in (False, True)] == [False, False]


def test_backward_buffers_fit_the_budget_at_deberta_v3_base_shapes() -> None:
    """At B=32, N=512, H=12, d=64 (bf16) one backward kernel's partials and scratch (window products and
    the band) stay within the bytes of dq + dk + dv, with enough programs to give every SM of an H100 two."""
    grads = 3 * 32 * 12 * 512 * 64 * 2
    tiles = attention.tiles_for("dq", 64, torch.bfloat16, 90)
    reach = 512 + tiles.window + tiles.block_m + tiles.block_n
    table = _distance_table(reach, 256, 512)
    lo, _, band = attention.band_range(table, 512, tiles, "dq")
    assert lo <= -511 and band == 512 + tiles.block_m - 1  # every distance a query block meets
    q = torch.empty(1, 1, 1, 64, dtype=torch.bfloat16)
    per_program = attention.backward_buffers(tiles, 512, band, q, "dq", True, True).program_bytes
    assert per_program == (512 + tiles.chunk) * 64 * 4 + (2 * (tiles.block_m + tiles.block_n) * tiles.window
                                                         + tiles.block_m * band) * 2
    programs = attention.programs_per_head(32 * 512 // tiles.block_m, per_program, grads, 12, 2 * 132)
    assert programs * 12 * per_program <= grads
    assert programs * 12 >= 2 * 132 - 12  # two programs per SM, rounded down to whole heads
    assert attention.programs_per_head(7, 0, 0, 12, 2 * 132) == 7  # no buffers: one program per item
    # A budget between one and two programs per SM: as many as fit (15 per head), whatever the SMs.
    assert attention.programs_per_head(4096, 1, 15 * 12, 12, 2 * 132) == 15


def test_the_mirrored_table_reads_each_distance_where_the_table_does() -> None:
    """The forward's dense tiles read ``bucket(d)`` at ``MIRROR[-d]`` (``dense._mirrored_buckets``): the same entry
    as ``TABLE[d]``, for every distance either can be asked for, on both sides of the log buckets."""
    q = torch.empty(2, 3, 40, 16)
    call = AttentionCall(q, q, q, torch.empty(3, 16, 16), None, 8, 32, 0.0, 0.25)
    _, _, _, problem = planning.plan(call)
    reach = problem.table.max_distance
    distances = torch.arange(-reach, reach + 1)
    table, mirror = problem.device_table, problem.device_mirror
    direct = table.as_strided((distances.numel(),), (1,), table.storage_offset() - reach)
    mirrored = mirror.as_strided((distances.numel(),), (1,), mirror.storage_offset() - reach)
    assert torch.equal(mirrored.flip(0), direct)
    assert direct.dtype == torch.int16 and torch.equal(direct.int(), problem.table.host)  # half-width buckets
    assert set(direct.tolist()) == set(range(2 * attention_span(8, 32)))  # every bucket, log ones and both ends


@pytest.mark.parametrize("backward_scores", ["fused", "dense"])
def test_a_table_whose_top_bucket_passes_16_bits_is_read_as_int32(backward_scores, monkeypatch) -> None:
    """The kernels read 16-bit buckets where the top one fits; with 32,800 position buckets a short sequence's
    distances sit at buckets 32,760-32,840 (the table is centred on the span), past 16 bits, so that table is
    int32, and the kernels read it right: the five gradients against the float64 oracle."""
    monkeypatch.setattr(attention.planning, "backward_scores_design", lambda *args: backward_scores)
    buckets, max_rel = 32_800, 65_536
    assert _distance_table(40, 256, 512).narrow.dtype == torch.int16
    wide = _distance_table(40, buckets, max_rel)
    assert wide.top >= 2 ** 15 and wide.narrow.dtype == torch.int32 and torch.equal(wide.narrow, wide.host)
    inputs = _inputs(24, 16, attention_span(buckets, max_rel), seed=11)
    kw = dict(position_buckets=buckets, max_relative_positions=max_rel)
    got = _out_and_grads(attention.disentangled_attention, inputs, torch.float32, **kw)
    want = _out_and_grads(naive_attention, inputs, torch.float64, **kw)
    for name, a, e in zip(("out", "dq", "dk", "dv", "dkr", "dqr"), got, want):
        assert _rel_l2(a, e) < 1e-5, name


def test_offsets_that_overflow_32_bits_are_refused_before_launch() -> None:
    # The largest shapes users run fit: 16k-token packed batches at 12 or 16 heads, N = 8192 with dropout.
    attention.check_offsets_fit_int32(num_seqs=32, n_heads=16, n_ctx=16_384, token_stride=16 * 128,
                                      table_elements=512 * 128, dropout=True)
    attention.check_offsets_fit_int32(num_seqs=64, n_heads=12, n_ctx=8192, token_stride=64, table_elements=512 * 64,
                                      dropout=True)
    # A million-token sequence at hidden 4096 does not: its token offsets pass 2**31.
    with pytest.raises(ValueError, match="token stride"):
        attention.check_offsets_fit_int32(num_seqs=1, n_heads=32, n_ctx=1 << 20, token_stride=4096,
                                          table_elements=512 * 128, dropout=False)
    with pytest.raises(ValueError, match="dropout counters"):
        attention.check_offsets_fit_int32(num_seqs=1, n_heads=1, n_ctx=50_000, token_stride=64,
                                          table_elements=512 * 64, dropout=True)
    # Four million tokens in one sequence at d = 64 fit the token offsets, not a dense buffer's 2k = 512 columns.
    attention.check_offsets_fit_int32(num_seqs=1, n_heads=12, n_ctx=1 << 22, token_stride=64,
                                      table_elements=512 * 64, dropout=False)
    with pytest.raises(ValueError, match="dense position buffers"):
        attention.check_offsets_fit_int32(num_seqs=1, n_heads=12, n_ctx=1 << 22, token_stride=64,
                                          table_elements=512 * 64, dropout=False, two_span=512)


def test_compile_check_covers_every_model_preset() -> None:
    """Each preset's (head dim, position table) is compiled by the suite's compile check."""
    covered = {(c.head_dim, attention_span(c.position_buckets, c.max_relative_positions))
               for c in compile_check.suite_cases() if c.op == "attention" and c.dtype in compile_check.HALF}
    for preset in sorted((REPO / "configs" / "model").glob("*.yaml")):
        cfg = yaml.safe_load(preset.read_text())
        max_rel = cfg["max_relative_positions"]
        max_rel = cfg["max_position_embeddings"] if max_rel < 1 else max_rel
        key = (cfg["hidden_size"] // cfg["num_attention_heads"], attention_span(cfg["position_buckets"], max_rel))
        assert key in covered, f"{preset.name}: head dim and span {key} are not in the compile check"
