"""Reading speed off compiled code (``kernels/aot/static_perf.py``): the SASS control flow, the tile loops'
cheapest and dearest paths, the products' warp repetition from TTGIR layouts, and occupancy. On small
hand-written listings whose answers are known, then on one real kernel compiled for sm_90."""

from __future__ import annotations

import pytest

from distaff.kernels.aot import static_perf as sp

# An outer loop (no tensor core) around an inner tile loop with a two-way branch, then a second loop with
# an HMMA: the shape of a backward kernel (tile loop, band loop) in nvdisasm -g -c's format.
LISTING = """
\t//## File "/k/attn.py", line 10
        /*0000*/                   MOV R1, R2 ;
.L_x_5:
\t//## File "/k/attn.py", line 20
        /*0010*/                   IADD3 R3, R3, 0x1, RZ ;
.L_x_0:
\t//## File "/k/attn.py", line 30
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0030*/                   LDG.E R5, desc[UR4][R6.64] ;
        /*0040*/               @P0 BRA `(.L_x_1) ;
\t//## File "/k/attn.py", line 31
        /*0050*/                   LDS R7, [R9] ;
        /*0060*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0070*/                   MUFU.EX2 R7, R7 ;
        /*0080*/                   NOP ;
.L_x_1:
\t//## File "/k/attn.py", line 29
        /*0090*/                   FADD R4, R4, R5 ;
        /*00a0*/              @!P1 BRA `(.L_x_0) ;
\t//## File "/k/attn.py", line 40
        /*00b0*/                   MOV R20, RZ ;
        /*00c0*/               @P2 BRA `(.L_x_2) ;
        /*00d0*/                   BRA `(.L_x_3) ;
.L_x_2:
\t//## File "/k/attn.py", line 41
        /*00e0*/                   HGMMA.64x128x16.F32.BF16 R20, gdesc[UR8], R20 ;
        /*00f0*/              @!P3 BRA `(.L_x_2) ;
.L_x_3:
\t//## File "/k/attn.py", line 19
        /*0100*/              @!P4 BRA `(.L_x_5) ;
        /*0110*/                   EXIT ;
"""


@pytest.mark.unit
def test_listing_is_parsed_with_branch_targets_and_source_lines() -> None:
    code = sp.parse_listing(LISTING)
    assert [i.address for i in code][:3] == [0x0, 0x10, 0x20]
    branch = next(i for i in code if i.address == 0x40)
    assert branch.is_branch and branch.predicated and branch.target == 0x90
    assert code[2].kind == "tensor" and code[3].kind == "global" and branch.line == "/k/attn.py:30"
    assert {i.kind for i in code if i.address in (0x50, 0x60, 0x70)} == {"shared", "barrier", "mufu"}


@pytest.mark.unit
def test_tensor_loops_are_the_innermost_loops_with_tensor_instructions() -> None:
    blocks = sp.basic_blocks(sp.parse_listing(LISTING))
    found = sp.tensor_loops(blocks)
    assert [lp.header for lp in found] == [0x20, 0xe0]  # the outer loop at 0x10 holds both: not innermost
    assert len(sp.loops(blocks)) == 3


@pytest.mark.unit
def test_cheapest_and_dearest_paths_of_a_loop() -> None:
    blocks = sp.basic_blocks(sp.parse_listing(LISTING))
    cheap, dear = sp.loop_extremes(blocks, sp.tensor_loops(blocks)[0])
    # header (HMMA, LDG, BRA) + latch (FADD, BRA), with or without LDS, BAR, MUFU (the NOP is not counted)
    assert sp.instructions(cheap) == 5 and sp.instructions(dear) == 8
    assert dear["shared"] == dear["barrier"] == dear["mufu"] == 1 and cheap["shared"] == 0
    assert cheap["flops"] == dear["flops"] == 2 * 16 * 8 * 16


@pytest.mark.unit
def test_tensor_flops_per_warp_instruction() -> None:
    assert sp.tensor_flops("HMMA.16816.F32.BF16") == 4096
    assert sp.tensor_flops("HMMA.1688.F32.TF32") == 2048
    assert sp.tensor_flops("HGMMA.64x128x16.F32.BF16") == 2 * 64 * 128 * 16 // 4  # a warpgroup's, per warp
    assert sp.tensor_flops("FFMA") == 0


TTGIR = """
#mma = #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [1, 8], instrShape = [16, 8]}>
#mma1 = #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [4, 1], instrShape = [16, 8]}>
#mma2 = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 1], instrShape = [16, 64, 16]}>
    %a = tt.dot %q, %k, %c : tensor<16x64xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma}>> * tensor<64x16xbf16, #ttg.dot_op<{opIdx = 1, parent = #mma}>> -> tensor<16x16xf32, #mma>
    %b = tt.dot %q, %k, %c : tensor<64x64xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma1}>> * tensor<64x32xbf16, #ttg.dot_op<{opIdx = 1, parent = #mma1}>> -> tensor<64x32xf32, #mma1>
    %e = tt.dot %q, %k, %c : tensor<32x64xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma1}>> * tensor<64x32xbf16, #ttg.dot_op<{opIdx = 1, parent = #mma1}>> -> tensor<32x32xf32, #mma1>
    %d = ttng.warp_group_dot %q, %k, %c : !ttg.memdesc<64x64xbf16, #shared, #smem> * !ttg.memdesc<64x64xbf16, #shared1, #smem> -> tensor<64x64xf32, #mma2>
"""


@pytest.mark.unit
def test_repeated_warps_read_off_the_layouts() -> None:
    dots = sp.ttgir_dots(TTGIR)
    assert [(d.m, d.n, d.k, d.warp_group) for d in dots] == [(16, 16, 64, False), (64, 32, 64, False),
                                                             (32, 32, 64, False), (64, 64, 64, True)]
    # 16 x 16 on 8 warps along N: two 8-column instruction tiles, so 8 warps do the work of 2.
    # 64 x 32 on 4 warps along M: one 16-row slice each. 32 x 32 on [4, 1]: half the warps repeat.
    assert [d.repetition for d in dots] == [4.0, 1.0, 2.0, 1.0]


@pytest.mark.unit
def test_blocks_per_sm_from_registers_warps_and_shared_memory() -> None:
    h100 = sp.GPUS[90]
    assert sp.blocks_per_sm(255, 4, 32 * 1024, h100) == 2   # registers: 256 x 128 threads = half the file
    assert sp.blocks_per_sm(128, 4, 16 * 1024, h100) == 4
    assert sp.blocks_per_sm(64, 4, 100 * 1024, h100) == 2   # shared memory
    assert sp.blocks_per_sm(32, 2, 0, h100) == 32           # the block limit


@pytest.mark.integration
def test_a_compiled_tile_loop_is_found_with_its_products(tmp_path) -> None:
    """A real flash-style loop compiled for sm_90 (no GPU): one tensor-core loop, wgmma, no repetition."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = tmp_path / "kernel.py"
    script.write_text(textwrap.dedent("""
        import pathlib, sys, triton, triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from distaff.kernels.aot import static_perf as sp

        @triton.jit
        def loop(Q, K, O, n, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
            m, c, d = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, D)
            q = tl.load(Q + m[:, None] * D + d[None, :])
            acc = tl.zeros([BM, D], tl.float32)
            for j in range(0, n, BN):
                k = tl.load(K + (j + c)[:, None] * D + d[None, :])
                p = tl.exp2(tl.dot(q, tl.trans(k)))
                acc += tl.dot(p.to(k.dtype), k)
            tl.store(O + m[:, None] * D + d[None, :], acc)

        src = ASTSource(loop, {"Q": "*bf16", "K": "*bf16", "O": "*fp32", "n": "i32", "BM": "constexpr",
                               "BN": "constexpr", "D": "constexpr"}, {"BM": 64, "BN": 64, "D": 64})
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        out = pathlib.Path(sys.argv[1])
        (out / "k.cubin").write_bytes(compiled.asm["cubin"])
        figures = sp.kernel_figures(out / "k.cubin", compiled.asm["ttgir"])
        print(len(figures.loops), figures.uses_wgmma, figures.repetition,
              sp.instructions(figures.loops[0]["paths"][0]), figures.loops[0]["paths"][0]["flops"])
    """))
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    loops, wgmma, repetition, instructions, flops = run.stdout.split()
    assert (loops, wgmma, float(repetition)) == ("1", "True", 1.0)
    assert int(instructions) > 0
    assert int(flops) == 2 * (2 * 64 * 64 * 64) // 4  # two 64 x 64 x 64 products per tile, a quarter per warp


# A load, an independent add, then the load's use; then a loop body that consumes last iteration's load
# before issuing the next one (a one-deep prefetch).
CHAIN = """
        /*0000*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0010*/                   IADD3 R9, R9, 0x1, RZ ;
        /*0020*/                   FADD R10, R7, R9 ;
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0040*/                   STG.E desc[UR4][R2.64], R10 ;
"""
PREFETCH = """
        /*0000*/                   FADD R10, R4, R10 ;
        /*0010*/                   LDG.E R4, desc[UR4][R2.64] ;
"""


@pytest.mark.unit
def test_the_scoreboard_charges_a_dependent_round_trip_and_hides_a_prefetched_one() -> None:
    code = sp.parse_listing(CHAIN)
    assert sp.registers(code[0]) == (["UR4", "R2", "R3"], ["R4", "R5", "R6", "R7"])  # a 128-bit load fills 4
    assert sp.registers(code[4]) == (["UR4", "R2", "R3", "R10"], [])  # a store produces nothing
    low, high = sp.LATENCIES
    # FADD waits for the load (issued at 0): 300 / 600, then the barrier, then the store; 4 warps: 1 cycle each
    assert sp.chain_cycles(code, 4, low) == 300 + 1 + low.barrier + 1 + 1
    assert sp.chain_cycles(code, 4, high) - sp.chain_cycles(code, 4, low) == 300
    assert sp.chain_cycles(code, 8, low) == 300 + 2 + low.barrier + 2 + 2  # 8 warps share 4 schedulers
    loop = sp.parse_listing(PREFETCH)
    # each iteration waits for the previous one's load: a full round trip per iteration...
    assert sp.chain_cycles(loop, 4, low, iterations=3) == 300 + 1
    # ...and the bytes of each global instruction are counted for every lane
    assert [sp.global_bytes(i) for i in code] == [512, 0, 0, 0, 128]


@pytest.mark.unit
def test_copy_groups_and_warpgroup_products_are_waited_for_where_the_code_waits() -> None:
    listing = """
        /*0000*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R2.64] ;
        /*0010*/                   LDGDEPBAR ;
        /*0020*/                   LDGSTS.E.BYPASS.128 [R3+0x800], desc[UR4][R2.64+0x80] ;
        /*0030*/                   LDGDEPBAR ;
        /*0040*/                   DEPBAR.LE SB0, 0x1 ;
        /*0050*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24, gsb0 ;
        /*0060*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
"""
    code = sp.parse_listing(listing)
    low = sp.LATENCIES[0]
    # the first group is waited for (300 after its issue at 0), the second is left in flight; then the
    # product runs 2*64*64*16 FLOPs at the SM's rate before the wait returns
    mma = 2 * 64 * 64 * 16 / sp.SM90_TENSOR_FLOPS_PER_CYCLE
    assert sp.chain_cycles(code, 4, low) == pytest.approx(300 + 1 + mma + 1)


@pytest.mark.unit
def test_a_copy_wait_with_instruction_scoreboards_waits_for_its_count() -> None:
    """ptxas appends the instruction scoreboards a copy wait also drains (``DEPBAR.LE SB0, 0x0, {2,1}``, read from
    sm_80's two-stage forward): the count is the operand after ``SB0``, not the last token."""
    groups = """
        /*0000*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R2.64] ;
        /*0010*/                   LDGDEPBAR ;
        /*0020*/                   LDGSTS.E.BYPASS.128 [R3+0x800], desc[UR4][R2.64+0x80] ;
        /*0030*/                   LDGDEPBAR ;
"""
    low = sp.LATENCIES[0]
    for count, cycles in ((0, 300 + 2 + 1), (1, 300 + 1)):
        plain = sp.parse_listing(groups + f"        /*0040*/                   DEPBAR.LE SB0, 0x{count} ;\n")
        listed = sp.parse_listing(groups + f"        /*0040*/                   DEPBAR.LE SB0, 0x{count}, {{2,1}} ;\n")
        assert sp.chain_cycles(listed, 4, low) == sp.chain_cycles(plain, 4, low) == cycles, count


@pytest.mark.unit
def test_chain_waits_name_the_line_that_waits() -> None:
    code = sp.parse_listing('\t//## File "/k/a.py", line 7\n' + CHAIN)
    low = sp.LATENCIES[0]
    # the add (its turn at cycle 2) waits for the load (ready at 300), the barrier 20: both on line 7 here
    assert sp.chain_waits(code, 4, low) == {"/k/a.py:7": 298 + low.barrier}


# Real SASS lines of each instruction form, as ``nvdisasm -g -c`` prints them for kernels this repository's
# tooling compiled here (``compile_check.compile_artifacts`` for distaff's kernels and the judge's peers, read by
# ``static_perf.disassemble``), with (sources, destinations). The target, kernel and address are in the comment.
REAL_FORMS = [
    # sm_80 _attn_fwd: a masked key-mask byte load (guard first, then the destination), a predicated 128-bit
    # store (no destination, four data registers), mma.sync (A 4, B 2 registers; a float32 accumulator of 4)
    ("/*2970*/  @!P5 LDG.E.U8 R84, [R224.64] ;", ["P5", "R224", "R225"], ["R84"]),
    ("/*4170*/  @!P4 STG.E.128 [R52.64], R44 ;", ["P4", "R52", "R53", "R44", "R45", "R46", "R47"], []),
    ("/*2e90*/  @P3 STS [R159.X4+0x2000], R44 ;", ["P3", "R159", "R44"], []),
    ("/*16d0*/  HMMA.16816.F32 R80, R84.reuse, R44, RZ ;", ["R84", "R44", "R85", "R86", "R87", "R45"],
     ["R80", "R81", "R82", "R83"]),
    # sm_80 _attn_fwd / _attn_bwd_delta: uniform registers and predicates, carry-out predicates, a shuffle
    # (its first operand PT is a predicate destination), a 64-bit constant load
    ("/*0ff0*/  @!UP0 UIADD3 UR4, UR4, -UR24, URZ ;", ["UP0", "UR4", "UR24"], ["UR4"]),
    ("/*01c0*/  IADD3 R4, P0, R4, c[0x0][0x170], RZ ;", ["R4"], ["R4", "P0"]),
    ("/*0930*/  SHFL.BFLY PT, R5, R6, 0x4, 0x1f ;", ["R6"], ["R5"]),
    ("/*0030*/  ULDC.64 UR4, c[0x0][0x118] ;", [], ["UR4", "UR5"]),
    # sm_80 DisentangledFlash forward: cp.async (writes shared memory, no register), its commit and wait, and
    # the never-executed load ptxas puts before them
    ("/*0b90*/  LDGSTS.E.BYPASS.128 [R2+0x6000], [R4.64], !P0 ;", ["R2", "R4", "P0", "R5"], []),
    ("/*0bd0*/  LDGDEPBAR ;", [], []),
    ("/*1f70*/  DEPBAR.LE SB0, 0x0 ;", [], []),
    ("/*0b60*/  @!PT LDS RZ, [RZ] ;", [], []),
    # sm_90 _attn_fwd: the form the old parser split at the last space (issue 38), warpgroup MMAs (the
    # accumulator is written asynchronously: no destination; A from registers; the group's gsb0), their fence
    # and wait, a predicated 128-bit store
    ("/*1b70*/  @!P4 LDG.E.128 R24, desc[UR12][R36.64] ;", ["P4", "UR12", "R36", "R37"],
     ["R24", "R25", "R26", "R27"]),
    ("/*2060*/  HGMMA.64x64x16.F32 R24, gdesc[UR16], R24, gsb0 ;", ["UR16", "R24"] + [f"R{r}" for r in range(25, 56)],
     []),
    ("/*4e30*/  HGMMA.64x64x16.F32 R56, R24, gdesc[UR32].tnspB, R56 ;",
     ["R24", "UR32", "R56", "R25", "R26", "R27"] + [f"R{r}" for r in range(57, 88)], []),
    ("/*1f20*/  WARPGROUP.ARRIVE ;", [], []),
    ("/*21b0*/  WARPGROUP.DEPBAR.LE gsb0, 0x0 ;", [], []),
    ("/*ed30*/  @!P6 STG.E.128 desc[UR8][R40.64], R36 ;", ["P6", "UR8", "R40", "R41", "R36", "R37", "R38", "R39"],
     []),
    ("/*0bc0*/  LDGSTS.E.BYPASS.128 [R47], desc[UR56][R6.64], !P0 ;", ["R47", "UR56", "R6", "P0", "R7"], []),
    # sm_100 _attn_bwd_dq: guarded loads and stores with descriptors, two carry-outs that are PT (no register),
    # a uniform-predicate guard, mma.sync with a bf16 suffix, a predicate-and-register result
    ("/*5210*/  @!P1 LDG.E.U8 R24, desc[UR28][R218.64+0x18] ;", ["P1", "UR28", "R218", "R219"], ["R24"]),
    ("/*b5e0*/  @!P2 STG.E desc[UR28][R16.64], R13 ;", ["P2", "UR28", "R16", "R17", "R13"], []),
    ("/*0450*/  @P0 STS.U8 [UR4+0x1c], R2 ;", ["P0", "UR4", "R2"], []),
    ("/*0680*/  IADD3 R4, PT, PT, RZ, -R4, RZ ;", ["R4"], ["R4"]),
    ("/*15d0*/  @!UP2 UIADD3 UR8, UPT, UPT, UR8, -UR23, URZ ;", ["UP2", "UR8", "UR23"], ["UR8"]),
    ("/*2a60*/  HMMA.16816.F32.BF16 R100, R96, R12.reuse, RZ ;", ["R96", "R12", "R97", "R98", "R99", "R13"],
     ["R100", "R101", "R102", "R103"]),
    ("/*0140*/  UTCATOMSWS.FIND_AND_SET.ALIGN UP1, UR6, UR6 ;", ["UR6"], ["UP1", "UR6"]),
    # sm_90 DisentangledFlash 1.1.1 forward (64 x 64, 4 warps, 2 stages; 112 B spilled): a spill store, a spill
    # reload and a last-use reload (``.LU``) of the thread's local slots
    ("/*03a0*/  STL [R1+0x10], R52 ;", ["R1", "R52"], []),
    ("/*5850*/  LDL R114, [R1] ;", ["R1"], ["R114"]),
    ("/*8d20*/  LDL.LU R20, [R1+0x24] ;", ["R1"], ["R20"]),
    # sm_80 DisentangledFlash 1.1.1 forward (176-192 B spilled): the same forms
    ("/*3cb0*/  LDL R143, [R1+0x68] ;", ["R1"], ["R143"]),
    ("/*f560*/  LDL.LU R144, [R1+0x10] ;", ["R1"], ["R144"]),
]


@pytest.mark.parametrize("line, sources, destinations", REAL_FORMS, ids=[f[0].split("*/")[1].split(" ;")[0].strip()
                                                                         for f in REAL_FORMS])
@pytest.mark.unit
def test_every_compiled_instruction_form_is_read_with_its_sources_and_destinations(line, sources,
                                                                                     destinations) -> None:
    (instr,) = sp.parse_listing("        " + line)
    read, written = sp.registers(instr)
    assert (sorted(read), written) == (sorted(sources), destinations)


# sm_90 _attn_fwd (distaff, issue 38's baseline): a masked K-row load, an independent multiply-add and the
# shared-memory store that consumes the load (addresses 1b70, 1b80, 1f60 of the compiled kernel).
GUARDED_LOAD_THEN_USE = """
        /*1b70*/              @!P4 LDG.E.128 R24, desc[UR12][R36.64] ;
        /*1b80*/                   IMAD R49, R123, R120.reuse, R117.reuse ;
        /*1f60*/                   STS.128 [R21+UR4+0x2000], R24 ;
"""


@pytest.mark.unit
def test_a_guarded_loads_consumer_waits_for_the_round_trip() -> None:
    code = sp.parse_listing(GUARDED_LOAD_THEN_USE)
    low, high = sp.LATENCIES
    assert sp.chain_cycles(code, 4, low) == low.global_ + 1  # the store issues when the load's registers arrive
    assert sp.chain_cycles(code, 4, high) == high.global_ + 1
    assert sp.chain_waits(code, 4, low) == {"": low.global_ - 2}


@pytest.mark.unit
def test_warpgroup_mma_groups_are_waited_for_up_to_the_count_left_in_flight() -> None:
    listing = """
        /*0000*/                   WARPGROUP.ARRIVE ;
        /*0010*/                   HGMMA.64x64x16.F32 R24, gdesc[UR16], R24, gsb0 ;
        /*0020*/                   WARPGROUP.ARRIVE ;
        /*0030*/                   HGMMA.64x64x16.F32 R56, gdesc[UR20], R56, gsb0 ;
        /*0040*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0050*/                   FADD R10, R24, R11 ;
        /*0060*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
"""
    code = sp.parse_listing(listing)
    low = sp.LATENCIES[0]
    mma = 2 * 64 * 64 * 16 / sp.SM90_TENSOR_FLOPS_PER_CYCLE
    # the first wait lets the second group run on: it returns when the first is done (issued at 1); the second
    # ran behind it on the tensor cores and the last wait returns when it is done
    assert sp.chain_cycles(code[:5], 4, low) == pytest.approx(1 + mma + 1)
    assert sp.chain_cycles(code, 4, low) == pytest.approx(1 + 2 * mma + 1)


# sm_90 DisentangledFlash 1.1.1 forward: a value spilled before the tile loop (0d60), reloaded in it (5850) and
# its first consumer (65a0), as compiled here (``static_perf.disassemble`` of the judge's cached compile).
SPILL_RELOAD_THEN_USE = """
        /*0d60*/                   STL [R1], R27 ;
        /*5850*/                   LDL R114, [R1] ;
        /*65a0*/                   LOP3.LUT P5, RZ, R114, 0xff, RZ, 0xc0, !PT ;
"""


@pytest.mark.unit
def test_a_spill_reload_is_an_l1_hit_not_a_global_round_trip() -> None:
    code = sp.parse_listing(SPILL_RELOAD_THEN_USE)
    for lat in sp.LATENCIES:
        # the store issues at 0 and waits for nothing, the reload at 1, its consumer when the L1 answers (the
        # walk ends one issue after it)
        assert sp.chain_cycles(code, 4, lat) == 1 + lat.local + 1
        assert lat.local < lat.shared * 2 < lat.global_
    assert [i.kind for i in code[:2]] == ["other", "other"]  # no L2 bytes, no global class
    assert sum(sp.global_bytes(i) for i in code) == 0


# A one-loop tile kernel (its source below, written to a temporary file the listing's lines name) that tests
# ``saturated`` twice per tile, as distaff's backward does (``_tile_scores``' ``if saturated:``, then the
# gradient's): the first test branches to its ``else`` (``@!P0``), the second to its ``then`` (``@P2``), and the
# cheap side of the first is followed by the dear side of the second. The loop's cheapest and dearest mixes
# (8 and 14 instructions) each take the two tests different ways, which no tile does.
KIND_SOURCE = """def tile(x, n, saturated):
    for j in range(n):
        if saturated:
            a = cheap(x)
        else:
            a = dear(x)
        if saturated:
            b = sums(x)
        else:
            b = 0
def cheap(x): return x
def dear(x): return x
def sums(x): return x
"""
KIND_LISTING = """
\t//## File "{f}", line 2
        /*0000*/                   MOV R1, R2 ;
.L_x_0:
\t//## File "{f}", line 2
        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
\t//## File "{f}", line 3
        /*0020*/              @!P0 BRA `(.L_x_1) ;
\t//## File "{f}", line 11
        /*0030*/                   FADD R5, R5, R6 ;
\t//## File "{f}", line 4
        /*0040*/                   BRA `(.L_x_2) ;
.L_x_1:
\t//## File "{f}", line 12
        /*0050*/                   HMMA.16816.F32.BF16 R20, R8, R12, R20 ;
        /*0060*/                   LDG.E R7, desc[UR4][R6.64] ;
        /*0070*/                   STS [R9], R7 ;
        /*0080*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0090*/                   LDS R7, [R9] ;
.L_x_2:
\t//## File "{f}", line 7
        /*00a0*/                   ISETP.NE.AND P2, PT, R3, RZ, PT ;
        /*00b0*/               @P2 BRA `(.L_x_3) ;
\t//## File "{f}", line 9
        /*00c0*/                   BRA `(.L_x_4) ;
.L_x_3:
\t//## File "{f}", line 13
        /*00d0*/                   SHFL.BFLY PT, R5, R6, 0x4, 0x1f ;
        /*00e0*/                   FADD R6, R5, R6 ;
        /*00f0*/                   SHFL.BFLY PT, R5, R6, 0x2, 0x1f ;
        /*0100*/                   FADD R6, R5, R6 ;
.L_x_4:
\t//## File "{f}", line 2
        /*0110*/              @!P1 BRA `(.L_x_0) ;
        /*0120*/                   EXIT ;
"""


@pytest.mark.unit
def test_a_tile_kind_is_priced_on_the_paths_it_can_execute(tmp_path) -> None:
    source = tmp_path / "kernel.py"
    source.write_text(KIND_SOURCE)
    blocks = sp.basic_blocks(sp.parse_listing(KIND_LISTING.format(f=source)))
    (loop,) = sp.tensor_loops(blocks)
    assert len(sp.acyclic_paths(blocks, loop)) == 4
    found = sp.decisions(blocks, loop, "saturated")
    assert [(d.block, d.sides) for d in found] == [(0x10, {0x50: "else", 0x30: "then"}),
                                                    (0xa0, {0xd0: "then", 0xc0: "else"})]
    (cheap, _), (dear, _) = sp.loop_paths(blocks, loop)
    assert (sp.instructions(cheap), sp.instructions(dear)) == (8, 14)  # then + else, else + then: infeasible
    kinds = sp.tile_kinds(blocks, loop, "saturated")
    # saturated: HMMA, BRA, FADD, BRA, ISETP, BRA, 2 x (SHFL, FADD), BRA; general: HMMA, BRA, the five of dear(),
    # ISETP, BRA, BRA (line 9), BRA (the latch)
    assert {side: sp.instructions(mix) for side, (mix, _) in kinds.items()} == {"then": 11, "else": 11}
    assert kinds["then"][1] == [0x10, 0x30, 0xa0, 0xd0, 0x110]
    assert kinds["else"][1] == [0x10, 0x50, 0xa0, 0xc0, 0x110]
    assert (kinds["then"][0]["tensor"], kinds["else"][0]["tensor"]) == (1, 2)
    assert (kinds["then"][0]["shared"], kinds["else"][0]["shared"]) == (0, 2)
    assert sp.tile_kinds(blocks, loop, "general") is None  # no branch on it
