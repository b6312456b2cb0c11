"""The GPU compile check: every kernel, launched as distaff's host code launches it, compiles for
sm_80 / sm_90 / sm_100 through Triton's real pipeline and ptxas, within the register, shared-memory
and tensor-core bar. Runs in subprocesses without TRITON_INTERPRET (the suite's conftest sets it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from distaff.kernels.attention import planning

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict:
    # The compile caches are the session's (tests/conftest.py): what the judge compiled is not compiled again.
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@pytest.mark.integration
def test_every_kernel_compiles_for_real_gpus_within_the_bar(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, "-m", "distaff.kernels.compile_check", "--json", str(out)],
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=850)
    print(run.stdout[-20000:])  # ends with how many kernels were compiled and how many read from the cache
    rows = json.loads(out.read_text())
    kernels = {row["kernel"] for row in rows}
    # Every Triton kernel distaff launches, for every target.
    assert kernels >= {"_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq", "_layer_norm_forward", "_layer_norm_backward",
                       "_bias_gelu_forward", "_bias_gelu_backward", "_cross_entropy_rows"}, kernels
    assert {row["target"] for row in rows} == {80, 90, 100}
    assert all(not row["error"] for row in rows), [row for row in rows if row["error"]][:3]
    assert all(row["registers"] > 0 for row in rows), "a row without ptxas figures: the log was not read"
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-3000:]


def _compile_snippet(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    """Compile a small kernel defined in a file (the JIT needs real source) through the check."""
    module = tmp_path / "snippet_kernel.py"
    module.write_text(textwrap.dedent(body))
    script = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, sys.argv[1])
        from snippet_kernel import launch
        from distaff.kernels.aot import compile_check as cc
        case = cc.Case("snippet", "float16")
        launches = []
        from triton.runtime.jit import JITFunction
        JITFunction.run = lambda self, *a, grid, warmup, **kw: launches.append((self, a, kw))
        launch(torch)
        for kernel, args, kwargs in launches:
            row = cc.compile_launch(kernel, args, kwargs, case, 90)
            print("PROBLEMS:", row.problems())
    """)
    return subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.integration
def test_check_reports_what_the_interpreter_accepts(tmp_path: Path) -> None:
    """A loop-carried tensor whose shape changes in the loop runs under the interpreter; the check
    must report it as a compile failure (the bug the fused attention once had)."""
    run = _compile_snippet(tmp_path, """
        import triton
        import triton.language as tl

        @triton.jit
        def _grows(x_ptr, out_ptr, BLOCK: tl.constexpr):
            acc = tl.load(x_ptr + tl.arange(0, BLOCK))
            for _ in range(2):
                acc = tl.load(x_ptr + tl.arange(0, 2 * BLOCK))
            tl.store(out_ptr + tl.arange(0, 2 * BLOCK), acc)

        def launch(torch):
            x = torch.zeros(128, dtype=torch.float16)
            _grows[(1,)](x, x, BLOCK=64)
    """)
    assert "PROBLEMS: ['does not compile:" in run.stdout, run.stdout + run.stderr


@pytest.mark.unit
@pytest.mark.parametrize("figures,expected", [
    (dict(spill_stores=8, half=True), "spills"),
    (dict(spill_stores=4096, half=False), "spills"),
    (dict(shared=120 * 1024, target=80, half=True, mma=4), "shared memory"),
    (dict(shared=200 * 1024, target=80, mma=4), "shared memory"),
    (dict(has_dot=True), "tensor-core"),
    (dict(has_dot=True, mma=4, repetition=2.0), "repeat tensor-core work"),
    (dict(error="boom"), "does not compile"),
])
def test_bar(figures: dict, expected: str) -> None:
    from distaff.kernels.aot.compile_check import Row

    row = Row(**{"kernel": "k", "case": "c", "target": 90, "registers": 100, "mma": 0, **figures})
    assert any(expected in problem for problem in row.problems())
    assert not Row("k", "c", 90, registers=100, mma=4, has_dot=True, half=True).problems()
    assert not Row("k", "c", 100, registers=100, tcgen05=2, has_dot=True, half=True).problems()  # Blackwell's MMA


@pytest.mark.unit
def test_the_repeated_warp_exception_is_exactly_where_documented() -> None:
    """Warps repeating products fail the bar everywhere but the d = 128 dk/dv kernel on sm_80 and sm_90, where
    no tile without repetition compiles without spills (attention.planning._TILES documents it)."""
    from distaff.kernels.aot.compile_check import Row

    figures = dict(registers=200, mma=4, has_dot=True, half=True, repetition=2.0)
    for target in (80, 90):
        assert not Row("_attn_bwd_dkdv", "d128 bfloat16 c2p+p2c padded dropout", target, **figures).problems()
    assert Row("_attn_bwd_dkdv", "d128 bfloat16 c2p+p2c padded dropout", 100, **figures).problems()
    assert Row("_attn_bwd_dq", "d128 bfloat16 c2p+p2c padded dropout", 80, **figures).problems()
    assert Row("_attn_bwd_dkdv", "d64 bfloat16 c2p+p2c padded dropout", 80, **figures).problems()


@pytest.mark.integration
def test_forward_without_position_terms_keeps_a_warp_per_16_rows(tmp_path: Path) -> None:
    """Without position terms the forward's chained products give each warp 16 rows: more warps than
    ``BLOCK_M / 16`` would repeat them, so the host code launches no more (``Tiles.content_only``). The
    launches are recorded as the compile check records them (a subprocess: real JIT kernels), not compiled."""
    script = textwrap.dedent("""
        import json, torch
        from distaff.kernels import attention
        from distaff.kernels.aot.compile_check import Case, record_launches
        found = []
        for dtype, d, cc in (("bfloat16", 128, 90), ("float32", 64, 90), ("float32", 128, 80)):
            tiles = attention.tiles_for("fwd", d, getattr(torch, dtype), cc)
            for terms in ("none", "c2p+p2c"):
                launches = record_launches(Case("attention", dtype, d, terms, "varlen", dropout=False), cc)
                warps = [kw["num_warps"] for k, _, kw, _ in launches if k.__name__ == "_attn_fwd"]
                found.append((terms, tiles.block_m, tiles.num_warps, warps))
        print(json.dumps(found))
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for terms, block_m, table_warps, warps in json.loads(run.stdout.splitlines()[-1]):
        assert table_warps > block_m // 16                # the table's tile has more warps: the cap must act
        assert warps == [block_m // 16 if terms == "none" else table_warps], (terms, block_m, table_warps, warps)


@pytest.mark.integration
def test_a_variant_that_spilled_on_its_rows_tile_launches_its_own() -> None:
    """Each variant in ``planning._VARIANT_TILES`` (terms, layout, dropout and perhaps the diagonal mask where the
    row's tile spilled) launches its own tile, ``maxnreg``, hoisting, buckets and terms ahead included (512 tokens:
    no tile saturates), through the real host planning; the same kernel in the judged variant (both terms, padded,
    no diagonal mask) launches the row's, or that variant's own entry where it has one (sm_90's dk/dv with
    dropout). Recorded as the compile check records launches; that they compile without spills is the suite's
    check (``suite_cases`` holds them)."""
    script = textwrap.dedent("""
        import json, torch
        from distaff.kernels.aot.compile_check import Case, launch_name, record_launches
        from distaff.kernels.attention import planning
        names = {"fwd": "_attn_fwd", "dq": "_attn_bwd_dq", "dkdv": "_attn_bwd_dkdv"}
        found = []
        for (inputs, d, cc, kernel, dense, variant), own in planning._VARIANT_TILES.items():
            terms, layout, dropout = variant[:3]
            diagonal = "diagonal" if variant[3:] == (True,) else ""
            for case_terms, case_layout, features in ((terms, layout, diagonal), ("c2p+p2c", "padded", "")):
                case = Case("attention", "bfloat16", d, case_terms, case_layout, dropout, features=features)
                launch = [kw for k, _, kw, _ in record_launches(case, cc) if launch_name(k, kw) == names[kernel]][0]
                row = planning.tiles_for(kernel, d, torch.bfloat16, cc, dense)
                # the judged variant takes the row's tile, or its own entry where it has one
                judged = planning.tiles_for(kernel, d, torch.bfloat16, cc, dense, ("c2p+p2c", "padded", dropout, False))
                got = [launch[key] for key in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")] + [
                    launch.get("maxnreg"), launch["HOIST"], launch.get("BUCKETS_AHEAD", False),
                    launch.get("VALUES_AHEAD", False)]
                # 512 tokens: no tile saturates, so a backward on dense scores takes its tile's general_stages
                stages = lambda t: t.general_stages if kernel != "fwd" and dense and t.general_stages else t.num_stages
                want = [[t.block_m, t.block_n, t.num_warps, stages(t), t.maxnreg, t.hoists(bool(features)),
                         t.buckets_ahead, t.gathers_ahead(bool(features)) and dense] for t in (own, judged, row)]
                found.append([(case_terms, case_layout, features) == (terms, layout, diagonal), got, *want,
                              own != row])  # the entries themselves, at a length where tiles saturate too
        print(json.dumps(found))
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.splitlines()[-1])
    assert len(found) == 2 * len(planning._VARIANT_TILES)
    for is_variant, got, own, judged, row, differs in found:
        assert differs  # each entry changes something: else it would not be needed
        assert got == (own if is_variant else judged), (is_variant, got, own, judged)
