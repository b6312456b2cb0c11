"""Static performance figures of a compiled kernel: what a GPU engineer reads off the machine code.

The compile check proves a kernel exists for a target; this module reads how fast it can be, from
the compiler's own output and nothing else (no GPU is needed):

* **SASS** of the cubin (``nvdisasm`` from the triton wheel, with line info): the control-flow graph,
  the *hot loop* (the innermost loop holding tensor-core instructions: the tile loop of an
  attention kernel) and every acyclic path through it (a tile path: saturated, general, ...), each
  with its warp-instruction mix (tensor-core, global, shared, barrier, MUFU, the rest).
* **TTGIR** of the kernel: each ``tt.dot`` / ``ttng.warp_group_dot`` with its tile and layout, and how
  many times the warps of the block repeat the same tensor-core work (``issued / unique``).
* **Occupancy**: blocks per SM from registers, warps and shared memory.

A thread of a warp issues each instruction of its path once, so a path of ``I`` SASS instructions is
``I`` warp-instructions per warp and ``warps x I`` for the block; divided by the scores of the tile
it is the *instructions per score* figure. ``benchmarks/attention_judge.py`` turns these into a
calibrated time estimate; everything here is a count, not a time.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

# Instruction classes, by SASS opcode (the part before the first dot).
TENSOR = ("HMMA", "HGMMA", "IMMA", "UTCHMMA", "UTCQMMA", "UTCOMMA")
GLOBAL = ("LDG", "STG", "LDGSTS", "ATOMG", "RED", "REDG", "UTMALDG", "UTMASTG", "LDGDEPBAR", "UBLKCP")
SHARED = ("LDS", "LDSM", "STS", "STSM", "ATOMS", "LDGSTS")
BARRIER = ("BAR", "SYNCS", "MEMBAR", "DEPBAR", "WARPGROUP")
MUFU = ("MUFU",)
CLASSES = ("tensor", "global", "shared", "barrier", "mufu", "other")
SKIPPED = ("NOP",)


@dataclass(frozen=True)
class Instruction:
    address: int
    opcode: str          # e.g. "HMMA.16816.F32.BF16"
    predicated: bool     # guarded by @P / @!P
    target: int | None   # branch target address
    line: str            # "file:line" of the source the compiler attributes it to
    operands: str = ""   # the text after the opcode, guard predicate first ("@!P0 R4, desc[UR4][R2.64]")

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def kind(self) -> str:
        base = self.base
        for name, opcodes in (("tensor", TENSOR), ("global", GLOBAL), ("shared", SHARED), ("barrier", BARRIER),
                              ("mufu", MUFU)):
            if base in opcodes:
                return name
        return "other"

    @property
    def is_branch(self) -> bool:
        return self.base in ("BRA", "BRX", "JMP", "JMX")

    @property
    def ends_block(self) -> bool:
        return self.is_branch or self.base in ("EXIT", "RET")


_LINE = re.compile(r'//## File "(?P<file>[^"]+)", line (?P<line>\d+)')
_INSTR = re.compile(r"^\s*/\*(?P<addr>[0-9a-f]{4,})\*/\s+(?P<pred>@!?U?P[T0-9]+\s+)?(?P<op>[A-Z][A-Za-z0-9_.]*)"
                    r"(?P<rest>[^;]*);")
_LABEL = re.compile(r"^(?P<label>\.L_x_\d+):")
_TARGET = re.compile(r"`\((?P<label>\.L_x_\d+)\)")


def nvidia_tool(name: str) -> Path:
    """A tool the triton wheel ships beside ``ptxas`` (``nvdisasm``, ``cuobjdump``)."""
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def disassemble(cubin: Path) -> list[Instruction]:
    """The SASS of ``cubin`` with each instruction's source line (``nvdisasm -g``)."""
    text = subprocess.run([str(nvidia_tool("nvdisasm")), "-g", "-c", str(cubin)], capture_output=True,
                          text=True, check=True).stdout
    return parse_listing(text)


def parse_listing(text: str) -> list[Instruction]:
    """Instructions of an ``nvdisasm -g -c`` listing, labels resolved to addresses."""
    rows, labels, pending, line = [], {}, [], ""
    for raw in text.splitlines():
        if m := _LINE.search(raw):
            line = f"{m['file']}:{m['line']}"
        elif m := _LABEL.match(raw.strip()):
            pending.append(m["label"])
        elif m := _INSTR.match(raw):
            address = int(m["addr"], 16)
            labels.update({label: address for label in pending})
            pending = []
            target = _TARGET.search(m["rest"])
            rows.append((address, m["op"], m["pred"] or "", target["label"] if target else None, line, m["rest"]))
    return [Instruction(a, op, bool(pred), labels.get(t) if t else None, ln, pred + rest)
            for a, op, pred, t, ln, rest in rows]


# --------------------------------------------------------------------------- control flow


@dataclass
class Block:
    start: int
    instructions: list[Instruction]
    successors: list[int] = field(default_factory=list)  # start addresses

    @property
    def end(self) -> int:
        return self.instructions[-1].address


def basic_blocks(code: list[Instruction]) -> dict[int, Block]:
    """Basic blocks keyed by start address, with their successors."""
    leaders = {code[0].address} | {i.target for i in code if i.target is not None}
    leaders |= {code[n + 1].address for n, i in enumerate(code[:-1]) if i.ends_block}
    blocks: dict[int, Block] = {}
    for instr in code:
        if instr.address in leaders:
            current = blocks[instr.address] = Block(instr.address, [])
        current.instructions.append(instr)
    starts = sorted(blocks)
    for n, start in enumerate(starts):
        last = blocks[start].instructions[-1]
        follows = starts[n + 1] if n + 1 < len(starts) else None
        succ = []
        if last.is_branch and last.target is not None:
            succ.append(last.target)
        if follows is not None and (not last.ends_block or last.predicated):
            succ.append(follows)
        blocks[start].successors = succ
    return blocks


@dataclass(frozen=True)
class Loop:
    header: int
    latch: int          # block whose branch goes back to the header
    body: frozenset     # block start addresses


def loops(blocks: dict[int, Block]) -> list[Loop]:
    """Natural loops of back edges (an edge to a block at or before the branch)."""
    preds: dict[int, list[int]] = {b: [] for b in blocks}
    for b in blocks.values():
        for s in b.successors:
            preds[s].append(b.start)
    found = []
    for b in blocks.values():
        for s in b.successors:
            if s <= b.start:
                body, stack = {s, b.start}, [b.start] if b.start != s else []
                while stack:
                    for p in preds[stack.pop()]:
                        if p not in body:
                            body.add(p)
                            stack.append(p)
                found.append(Loop(s, b.start, frozenset(body)))
    return found


def tensor_loops(blocks: dict[int, Block]) -> list[Loop]:
    """The innermost loops that hold tensor-core instructions (a kernel's tile loops), in address order."""
    def has_tensor(loop: Loop) -> bool:
        return any(i.kind == "tensor" for b in loop.body for i in blocks[b].instructions)

    candidates = [lp for lp in loops(blocks) if has_tensor(lp)]
    innermost = [lp for lp in candidates if not any(o.body < lp.body for o in candidates)]
    return sorted(innermost, key=lambda lp: lp.header)


MAX_PATHS = 256
_MMA_SHAPE = re.compile(r"^HMMA\.(16816|1688|884)|^HGMMA\.64x(\d+)x(\d+)")


def tensor_flops(opcode: str) -> int:
    """FLOPs one warp's issue of a tensor-core instruction accounts for (``HGMMA`` is a warpgroup's: a
    quarter each), 0 for other instructions."""
    m = _MMA_SHAPE.match(opcode)
    if not m:
        return 0
    if m[1]:
        mnk = {"16816": 16 * 8 * 16, "1688": 16 * 8 * 8, "884": 8 * 8 * 4}[m[1]]
        return 2 * mnk
    return 2 * 64 * int(m[2]) * int(m[3]) // 4


def instructions(mix: dict) -> int:
    """Warp-instructions of a mix (its ``flops`` entry is not an instruction count)."""
    return sum(v for k, v in mix.items() if k in CLASSES)


_WIDTHS = ((".128", 16), (".64", 8), (".U16", 2), (".S16", 2), (".U8", 1), (".S8", 1))


def global_bytes(instr: Instruction) -> int:
    """Bytes one warp's global load, store, copy or atomic moves (all 32 lanes, predicated or not), else 0."""
    if instr.kind != "global" or instr.base in ("LDGDEPBAR",):
        return 0
    width = next((w for suffix, w in _WIDTHS if suffix in instr.opcode), 4)
    return 32 * width


def _mix(block: Block) -> dict:
    mix = {k: 0 for k in (*CLASSES, "flops", "bytes")}
    for instr in block.instructions:
        if instr.base not in SKIPPED:
            mix[instr.kind] += 1
            mix["flops"] += tensor_flops(instr.opcode)
            mix["bytes"] += global_bytes(instr)
    return mix


def loop_extremes(blocks: dict[int, Block], loop: Loop) -> tuple[dict, dict]:
    """The instruction mixes of the cheapest and the dearest path from the loop's header back to it (fewest
    and most warp-instructions)."""
    (cheap, _), (dear, _) = loop_paths(blocks, loop)
    return cheap, dear


def loop_paths(blocks: dict[int, Block], loop: Loop) -> tuple[tuple[dict, list], tuple[dict, list]]:
    """``(mix, block starts)`` of the cheapest and the dearest path from the loop's header back to it, by
    dynamic programming over the body in address order (its forward edges form a DAG; inner back edges
    are not followed)."""
    best: dict[int, tuple] = {}
    order = sorted(loop.body)
    ends: list[tuple] = []
    for start in order:
        own = _mix(blocks[start])
        if start == loop.header:
            cheap = dear = (own, [start])
        else:
            preds = [best[p] for p in order if p in best and start in blocks[p].successors and p < start]
            if not preds:
                continue
            low = min((c for c, _ in preds), key=lambda path: instructions(path[0]))
            high = max((d for _, d in preds), key=lambda path: instructions(path[0]))
            cheap, dear = (_add(low[0], own), low[1] + [start]), (_add(high[0], own), high[1] + [start])
        best[start] = (cheap, dear)
        if loop.header in blocks[start].successors:
            ends.append((cheap, dear))
    return (min((c for c, _ in ends), key=lambda path: instructions(path[0])),
            max((d for _, d in ends), key=lambda path: instructions(path[0])))


def _add(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


# --------------------------------------------------------------------------- feasible tile paths


def acyclic_paths(blocks: dict[int, Block], loop: Loop) -> list[list[int]]:
    """Every path from the loop's header back to it (block starts, forward edges only), at most ``MAX_PATHS``."""
    paths, stack = [], [[loop.header]]
    while stack:
        path = stack.pop()
        for succ in blocks[path[-1]].successors:
            if succ == loop.header:
                paths.append(path)
            elif succ in loop.body and succ > path[-1]:
                stack.append(path + [succ])
        if len(paths) > MAX_PATHS:
            raise ValueError(f"loop at {loop.header:#x}: more than {MAX_PATHS} paths")
    return paths


@dataclass(frozen=True)
class Decision:
    """A conditional branch on ``if <condition>:`` and the tile kind each of its successors executes."""

    block: int
    sides: dict          # successor block start -> "then" / "else"


def _body_lines(file: str, statements: list, functions: dict, trees: dict) -> set:
    """``(file, line)`` of the statements and, transitively, of the functions (of the parsed files) they call."""
    lines, todo, seen = set(), [(file, statements)], set()
    while todo:
        where, stmts = todo.pop()
        for stmt in stmts:
            lines |= {(where, n) for n in range(stmt.lineno, stmt.end_lineno + 1)}
            for call in (c for c in ast.walk(stmt) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)):
                for other, names in functions.items():
                    if call.func.id in names and (other, call.func.id) not in seen:
                        seen.add((other, call.func.id))
                        fn = next(f for f in trees[other].body if getattr(f, "name", None) == call.func.id)
                        todo.append((other, fn.body))
    return lines


def decisions(blocks: dict[int, Block], loop: Loop, condition: str) -> list[Decision]:
    """The loop's branches on ``if <condition>:`` (or ``if not <condition>:``), each successor labelled with the
    side of the ``if`` it executes, from the source lines its instructions are attributed to: lines of the
    ``then`` body and of the functions only it calls, against those of the ``else`` body. A successor with
    neither is the other one's opposite (an ``if`` without ``else`` falls through to the join)."""
    files = {i.line.rpartition(":")[0] for b in loop.body for i in blocks[b].instructions if i.line}
    trees = {f: ast.parse(Path(f).read_text()) for f in files if Path(f).exists()}
    functions = {f: {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} for f, tree in trees.items()}
    found = []
    for start in sorted(loop.body):
        last = blocks[start].instructions[-1]
        file, _, number = last.line.rpartition(":")
        if not (last.is_branch and last.predicated and file in trees):
            continue
        node = next((n for n in ast.walk(trees[file]) if isinstance(n, ast.If) and n.lineno == int(number)), None)
        test = getattr(node, "test", None)
        negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
        name = test.operand if negated else test
        if not (isinstance(name, ast.Name) and name.id == condition):
            continue
        then = _body_lines(file, node.body, functions, trees)
        other = _body_lines(file, node.orelse, functions, trees)
        sides = {}
        for succ in blocks[start].successors:
            here = {(i.line.rpartition(":")[0], int(i.line.rpartition(":")[2]))
                    for i in blocks[succ].instructions if i.line}
            hits = (len(here & (then - other)), len(here & (other - then)))
            if hits[0] != hits[1]:
                sides[succ] = ("then" if hits[0] > hits[1] else "else") if not negated else \
                    ("else" if hits[0] > hits[1] else "then")
        if len(sides) == 1 and len(blocks[start].successors) == 2:
            (known, side), = sides.items()
            unknown = next(s for s in blocks[start].successors if s != known)
            sides[unknown] = "else" if side == "then" else "then"
        if len(set(sides.values())) != 2:
            raise ValueError(f"branch at {last.address:#x} ({source_line(last.line)}): cannot tell its sides apart")
        found.append(Decision(start, sides))
    return found


def tile_kinds(blocks: dict[int, Block], loop: Loop, condition: str) -> dict[str, tuple[dict, list]] | None:
    """``{"then": (mix, starts), "else": (mix, starts)}``: per side of the loop's ``if <condition>:`` branches,
    the dearest path a tile of that kind can execute (every branch on the condition taken to that side: two
    ``if saturated:`` in one tile agree); None when the loop does not branch on it. Other branches are left
    free, and the dearest of their paths priced."""
    found = decisions(blocks, loop, condition)
    if not found:
        return None
    kinds: dict = {}
    for path in acyclic_paths(blocks, loop):
        taken = {d.sides.get(path[n + 1] if n + 1 < len(path) else loop.header)
                 for d in found for n, start in enumerate(path) if start == d.block}
        if len(taken) != 1 or None in taken:
            continue  # infeasible: the same condition both ways in one tile
        (side,) = taken
        mix = functools.reduce(_add, (_mix(blocks[b]) for b in path))
        if side not in kinds or instructions(mix) > instructions(kinds[side][0]):
            kinds[side] = (mix, path)
    return kinds


# --------------------------------------------------------------------------- latency: an in-order scoreboard


@dataclass(frozen=True)
class Latency:
    """Cycles from an instruction's issue to its result, by what it waits on (stated model inputs, not
    measurements): ``global`` is a load's round trip through L2 (a mix with HBM misses at the high end);
    ``local`` a spill reload (``LDL``): the thread's own slot of local memory, just written by its ``STL``
    and so an L1 hit (about 30-40 cycles on Ampere and Hopper in public microbenchmarks), never an L2 round
    trip."""

    name: str
    global_: int
    local: int = 35       # LDL: an L1 hit
    shared: int = 30      # LDS / LDSM / SHFL
    tensor: int = 24      # HMMA result
    mufu: int = 20
    special: int = 20     # S2R, S2UR, LDC
    alu: int = 5
    barrier: int = 20     # BAR.SYNC once every warp has arrived
    fence: int = 10       # MEMBAR / FENCE at block scope


LATENCIES = (Latency("low", 300), Latency("high", 600))
PIPELINE_WALKS = 4  # a loop path's steady state: up to 3 iterations of prefetch in flight
SM90_TENSOR_FLOPS_PER_CYCLE = 989e12 / (132 * 1.98e9)  # one SM's dense bf16 rate: how long an HGMMA runs
_REGISTER = re.compile(r"\b(U?R\d+|U?P\d)\b")
_PAIR = re.compile(r"\b(U?R)(\d+)\.64\b")        # a 64-bit address operand: the register and the next one
_PREDICATE = re.compile(r"!?U?P(?:T|\d)")         # a predicate operand (PT / UPT: the constant true)
_REGISTER_OPERAND = re.compile(r"-?\|?U?R(?:Z|\d+)\b")
# Opcodes that write no register: stores, branches, barriers and fences, cp.async (it writes shared memory),
# warpgroup MMAs (their accumulators are written asynchronously: ``WARPGROUP.DEPBAR`` is the wait).
_NO_DEST = ("ST", "STG", "STS", "STL", "STSM", "RED", "REDG", "BAR", "BRA", "BRX", "JMP", "EXIT", "RET", "MEMBAR",
            "FENCE", "DEPBAR", "WARPGROUP", "LDGDEPBAR", "LDGSTS", "BSSY", "BSYNC", "NOP", "WARPSYNC", "CALL",
            "HGMMA", "ERRBAR", "CCTL", "BREAK", "UTMALDG", "UTMASTG", "UBLKCP", "ACQBULK", "ARRIVES")
_STORES = ("ST", "STG", "STS", "STL", "STSM", "RED", "REDG", "ATOM", "ATOMG", "ATOMS")
# Opcodes whose destinations are predicates only (``ISETP P0, PT, R2, R3, PT``: P0 and PT are written).
_PREDICATE_DESTS = {"ISETP": 2, "FSETP": 2, "DSETP": 2, "HSETP2": 2, "UISETP": 2, "PSETP": 2, "PLOP3": 2,
                    "UPLOP3": 2, "FCHK": 1}
# Opcodes that write carry predicates after their register (``IADD3 R4, P0, PT, ...``, ``LEA R4, P0, ...``).
_CARRIES = ("IADD3", "UIADD3", "LEA", "ULEA", "IMAD", "UIMAD", "IADD", "VOTE", "VOTEU")


def _numbered(token: str, count: int) -> list[str]:
    """``count`` consecutive registers from the one ``token`` names (RZ, URZ, PT: none)."""
    m = re.search(r"\b(U?[RP])(\d+)\b", token)
    return [f"{m[1]}{int(m[2]) + i}" for i in range(count)] if m else []


def _is_register(token: str) -> bool:
    return bool(_REGISTER_OPERAND.fullmatch(token.split(".")[0]))


def _token_registers(token: str) -> list[str]:
    """Registers one operand token names (``desc[UR4][R2.64+0x10]``: UR4, R2 and R3)."""
    return _REGISTER.findall(token) + [f"{m[1]}{int(m[2]) + 1}" for m in _PAIR.finditer(token)]


def _vector_width(instr: Instruction) -> int:
    """Registers of a load's destination or a store's data: ``.64`` 2, ``.128`` 4; ``LDSM``/``STSM`` by their
    matrix count (``.2``, ``.4``); 64-bit ``.WIDE`` products and ``CS2R`` 2."""
    parts = instr.opcode.split(".")
    if "128" in parts or (instr.base in ("LDSM", "STSM") and parts[-1] == "4"):
        return 4
    if "64" in parts or "WIDE" in parts or (instr.base in ("LDSM", "STSM") and parts[-1] == "2"):
        return 2
    return 2 if instr.base == "CS2R" and "32" not in parts else 1


def _mma_widths(instr: Instruction) -> tuple[int, int, int]:
    """Registers per thread of an ``HMMA``'s A, B and C/D fragments (``m16n8k16``: 4, 2 and 4 with a float32
    accumulator, 2 with a half one; ``m16n8k8``: 2, 1 with half inputs, 4, 2 with tf32)."""
    parts = instr.opcode.split(".")
    acc = 4 if len(parts) > 2 and parts[2] == "F32" else 2
    if len(parts) > 1 and parts[1] == "16816":
        return 4, 2, acc
    return (4, 2, acc) if "TF32" in parts else (2, 1, acc)


def _split_guard(operands: str) -> tuple[str, list[str]]:
    """``(guard, operand tokens)``: the guard predicate (``@!P4``; empty when unguarded) is everything up to
    the FIRST space, the operands are the comma-separated rest."""
    guard, body = "", operands
    if operands.startswith("@"):
        guard, _, body = operands.partition(" ")
    return guard, [t for t in (t.strip() for t in body.split(",")) if t]


def _destination_count(base: str, tokens: list[str]) -> int:
    """How many leading operand tokens an instruction writes (the rest it reads): predicates first where it
    sets some (``SHFL.BFLY PT, R55``, ``LOP3.LUT P0, RZ``), its register, then carry-out predicates
    (``IADD3 R20, P1, ...``, ``LEA R12, P0, ...``)."""
    if base in _NO_DEST:
        return 0
    if base in _PREDICATE_DESTS:
        return _PREDICATE_DESTS[base]
    n = 0
    while n < len(tokens) and _PREDICATE.fullmatch(tokens[n]):
        n += 1
    if n == len(tokens) or not _is_register(tokens[n]):
        return n
    n += 1
    carries = {"VOTE": 1, "VOTEU": 1}.get(base, 2 if base in _CARRIES else 0)
    while carries and n < len(tokens) and _PREDICATE.fullmatch(tokens[n]) and not tokens[n].startswith("!"):
        n, carries = n + 1, carries - 1
    return n


def _source_registers(instr: Instruction, tokens: list[str]) -> list[str]:
    """Registers the operand tokens after the destinations read: 64-bit addresses as pairs, and at their full
    width a store's data, an ``HMMA``'s three fragments and a ``.WIDE`` product's 64-bit addend."""
    if instr.base == "HGMMA":
        return _warpgroup_sources(instr, tokens)
    regs = [r for token in tokens for r in _token_registers(token)]
    if instr.base == "HMMA":
        for token, width in zip(tokens, _mma_widths(instr)):
            regs += _numbered(token, width)[1:]
    elif instr.base in _STORES and tokens and _is_register(tokens[-1]):
        regs += _numbered(tokens[-1], _vector_width(instr))[1:]
    elif instr.base == "IMAD" and "WIDE" in instr.opcode.split(".") and tokens:
        regs += _numbered(tokens[-1], 2)[1:]
    return regs


def _warpgroup_sources(instr: Instruction, tokens: list[str]) -> list[str]:
    """What an ``HGMMA`` reads: its descriptors' uniform registers, its A fragment when A comes from registers
    (``HGMMA R56, R24, gdesc[UR32].tnspB, R56``: R24..R27) and the accumulator it adds to (R56..R87: ``N / 2``
    float32 or ``N / 4`` half registers of a ``64 x N`` tile; ``RZ``: none). Its first token, the accumulator
    it writes, is written asynchronously (``WARPGROUP.DEPBAR`` waits for it). ``WARPGROUP.ARRIVE``
    (``wgmma.fence``) orders the registers the next ``HGMMA`` reads: modelled as those reads."""
    m = re.match(r"HGMMA\.64x(\d+)x\d+\.(\w+)", instr.opcode)
    width = int(m[1]) // (2 if m[2] == "F32" else 4) if m else 1
    a = tokens[1] if len(tokens) > 1 and _is_register(tokens[1]) else ""
    c = next((t for t in tokens[2:] if _is_register(t)), "")
    regs = [r for token in tokens[1:] for r in _token_registers(token)]
    return regs + _numbered(a, 4)[1:] + _numbered(c, width)[1:]


@functools.lru_cache(maxsize=None)
def registers(instr: Instruction) -> tuple[list[str], list[str]]:
    """``(sources, destinations)`` of an instruction: the registers it reads (its guard predicate included)
    and those whose value it produces. A vector destination (``LDG.E.128 R4``, ``LDSM.16.M88.4``, a float32
    ``HMMA`` accumulator) covers its consecutive registers; ``RZ``/``PT`` are no registers."""
    guard, tokens = _split_guard(instr.operands)
    count = _destination_count(instr.base, tokens)
    dests = []
    for token in tokens[:count]:
        width = 1 if _PREDICATE.fullmatch(token) else _mma_widths(instr)[2] if instr.base == "HMMA" else \
            _vector_width(instr)
        dests += _numbered(token, width)
    return _REGISTER.findall(guard) + _source_registers(instr, tokens[count:]), dests


def _result_latency(instr: Instruction, lat: Latency) -> int:
    base = instr.base
    if base in ("LDG", "ATOMG", "LD", "ATOM"):
        return lat.global_
    if base == "LDL":
        return lat.local
    if base in ("LDS", "LDSM", "SHFL", "ATOMS"):
        return lat.shared
    if base == "CS2R" and "SRZ" in instr.operands:  # zeroing a register pair
        return lat.alu
    return {"HMMA": lat.tensor, "MUFU": lat.mufu, "S2R": lat.special, "S2UR": lat.special, "LDC": lat.special,
            "ULDC": lat.special, "CS2R": lat.special}.get(base, lat.alu)


def _wait_count(instr: Instruction) -> int:
    """``N`` of ``DEPBAR.LE SB0, N`` / ``WARPGROUP.DEPBAR.LE gsb0, N``: the groups that may stay in flight.
    ptxas may append the instruction scoreboards the wait also drains (``DEPBAR.LE SB0, 0x0, {2,1}``, sm_80
    with two pipeline stages): results the walk already waits for where a consumer reads them."""
    _, tokens = _split_guard(instr.operands)
    return int(tokens[1], 0) if len(tokens) > 1 else 0


@dataclass
class _Scoreboard:
    """One warp's in-order walk: when each register's value is ready, and the asynchronous work in flight
    (cp.async groups, warpgroup MMA groups, global stores)."""

    lat: Latency
    interval: float            # cycles between two issues of this warp (its block's warps share 4 schedulers)
    time: float = 0.0
    ready: dict = field(default_factory=dict)
    copies: list = field(default_factory=list)   # completion of each committed cp.async group
    open_copy: float = 0.0
    mmas: list = field(default_factory=list)     # completion of each committed warpgroup MMA group
    tensor_free: float = 0.0                     # when the tensor cores finish the MMAs issued so far
    open_mma: float = 0.0
    stores_done: float = 0.0

    def issue(self, instr: Instruction) -> float:
        """Issue ``instr``; return the cycles it waited beyond its turn."""
        sources, dests = registers(instr)
        start = max([self.time] + [self.ready.get(r, 0.0) for r in sources])
        start = self._wait(instr, start)
        waited = start - self.time
        self.time = start + self.interval
        self._track(instr, start)
        for r in dests:
            self.ready[r] = start + _result_latency(instr, self.lat)
        return waited

    def _track(self, instr: Instruction, start: float) -> None:
        """Record the asynchronous work ``instr`` starts or commits."""
        base = instr.base
        if base == "LDGSTS":
            self.open_copy = max(self.open_copy, start + self.lat.global_)
        elif base == "LDGDEPBAR":
            self.copies.append(self.open_copy)
            self.open_copy = 0.0
        elif base == "HGMMA":  # the tensor cores run one MMA after another; ``gsb0`` commits the group
            flops = tensor_flops(instr.opcode) * 4
            self.tensor_free = self.open_mma = max(self.tensor_free, start) + flops / SM90_TENSOR_FLOPS_PER_CYCLE
            if "gsb0" in instr.operands:
                self.mmas.append(self.open_mma)
                self.open_mma = 0.0
        elif base in ("STG", "RED", "REDG", "ATOMG"):
            self.stores_done = max(self.stores_done, start + self.lat.global_)

    def _wait(self, instr: Instruction, start: float) -> float:
        """The issue time after what the instruction waits for besides its registers."""
        base, op = instr.base, instr.opcode
        if base == "DEPBAR" and "SB0" in instr.operands:      # cp.async.wait_group N
            self.copies, done = _retire(self.copies, _wait_count(instr))
            return max([start] + done)
        if base == "WARPGROUP" and "DEPBAR" in op:            # wgmma.wait_group N
            open_group = [self.open_mma] if self.open_mma else []  # MMAs issued with no commit: waited for too
            self.mmas, done = _retire(self.mmas + open_group, _wait_count(instr))
            self.open_mma = 0.0
            return max([start] + done)
        if base == "MEMBAR":
            return max(start, self.stores_done) if ("GPU" in op or "SYS" in op) else start + self.lat.fence
        if base == "BAR":
            return start + self.lat.barrier
        return start


def _retire(groups: list, keep: int) -> tuple[list, list]:
    """``(groups still in flight, completion times waited for)`` when at most ``keep`` may stay in flight."""
    cut = max(0, len(groups) - keep)
    return groups[cut:], groups[:cut]


def chain_waits(code: list[Instruction], warps: int, lat: Latency, iterations: int = 1) -> dict[str, float]:
    """Where the last walk of :func:`chain_cycles` waits: cycles waited per source line, largest first (what
    to prefetch, hoist or remove)."""
    board, waits = _Scoreboard(lat, max(1.0, warps / 4)), {}
    for walk in range(iterations):
        for instr in code:
            if instr.base not in SKIPPED:
                waited = board.issue(instr)
                if walk == iterations - 1 and waited > 0:
                    waits[instr.line] = waits.get(instr.line, 0.0) + waited
    return dict(sorted(waits.items(), key=lambda kv: -kv[1]))


def chain_cycles(code: list[Instruction], warps: int, lat: Latency, iterations: int = 1) -> float:
    """Cycles one warp takes to walk ``code`` in order, waiting on each operand's producer (the dependent
    chain of round trips and barriers), issuing one instruction per ``warps / 4`` cycles at best. A loop
    path is walked ``iterations`` times and the last walk's cycles returned: the steady state, where loads
    a pipelined loop issued one or more iterations ahead have arrived."""
    board = _Scoreboard(lat, max(1.0, warps / 4))
    marks = [0.0]
    for _ in range(iterations):
        for instr in code:
            if instr.base not in SKIPPED:
                board.issue(instr)
        marks.append(board.time)
    return marks[-1] - marks[-2]


def with_chains(mix: dict, code: list[Instruction], warps: int, iterations: int) -> dict:
    """``mix`` with its chain in cycles at each latency (``chain_low``, ``chain_high``)."""
    return {**mix, **{f"chain_{lat.name}": chain_cycles(code, warps, lat, iterations) for lat in LATENCIES}}


# --------------------------------------------------------------------------- TTGIR: repeated warps


_LAYOUT = re.compile(r"^#(?P<name>[\w]+) = #ttg\.nvidia_mma<\{versionMajor = (?P<major>\d+).*?"
                     r"warpsPerCTA = \[(?P<warps>[\d, ]+)\].*?instrShape = \[(?P<shape>[\d, ]+)\]", re.M)
_DOT = re.compile(r"= (?P<op>tt\.dot|ttng\.warp_group_dot) .*?-> tensor<(?P<m>\d+)x(?P<n>\d+)x\w+, #(?P<layout>\w+)>")
_DOT_K = re.compile(r": (?:tensor|!ttg\.memdesc)<(?P<m>\d+)x(?P<k>\d+)x")


@dataclass(frozen=True)
class Dot:
    m: int
    n: int
    k: int
    warp_group: bool     # Hopper's wgmma (``ttng.warp_group_dot``)
    warps: tuple         # warpsPerCTA of its layout
    instr: tuple         # instrShape (rows, cols) of one warp's instruction

    @property
    def repetition(self) -> float:
        """Issued / unique tensor-core work: warps beyond the tile's rows or columns redo a neighbour's."""
        rows_per_warp = 16 if self.warp_group else self.instr[0]  # a warpgroup's warps take 16 rows each
        distinct_m = min(self.warps[0], max(1, self.m // rows_per_warp))
        distinct_n = min(self.warps[1], max(1, self.n // self.instr[1]))
        return self.warps[0] * self.warps[1] / (distinct_m * distinct_n)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


def ttgir_dots(ttgir: str) -> list[Dot]:
    """Every matrix product of a kernel's TTGIR, with its layout."""
    layouts = {m["name"]: (int(m["major"]), tuple(int(x) for x in m["warps"].split(",")),
                           tuple(int(x) for x in m["shape"].split(",")))
               for m in _LAYOUT.finditer(ttgir)}
    dots = []
    for line in ttgir.splitlines():
        m = _DOT.search(line)
        if not m or m["layout"] not in layouts:
            continue
        _, warps, shape = layouts[m["layout"]]
        operand = _DOT_K.search(line)
        k = int(operand["k"]) if operand else 0
        dots.append(Dot(int(m["m"]), int(m["n"]), k, m["op"] == "ttng.warp_group_dot", warps[:2],
                        (shape[0], shape[1])))
    return dots


# --------------------------------------------------------------------------- occupancy


@dataclass(frozen=True)
class Gpu:
    """What the estimate needs of a GPU (vendor figures)."""

    name: str
    cc: int
    sms: int
    clock_ghz: float            # boost clock
    tensor_tflops: float        # dense bf16/fp16
    hbm_tb_s: float
    shared_per_sm: int          # bytes
    registers_per_sm: int = 65536
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    schedulers: int = 4
    l2_mb: float = 50.0
    l2_tb_s: tuple = (7.0, 5.5)   # L2 bandwidth assumed at the low and the high end of an estimate


GPUS = {
    80: Gpu("A100 SXM 80GB", 80, 108, 1.41, 312.0, 2.04, 164 * 1024, l2_mb=40.0, l2_tb_s=(5.5, 4.5)),
    90: Gpu("H100 SXM", 90, 132, 1.98, 989.0, 3.35, 228 * 1024),
    100: Gpu("B200", 100, 148, 1.965, 2250.0, 8.0, 228 * 1024, l2_mb=126.0, l2_tb_s=(12.0, 10.0)),
}
H200 = Gpu("H200", 90, 132, 1.98, 989.0, 4.8, 228 * 1024)


def blocks_per_sm(registers: int, warps: int, shared: int, gpu: Gpu) -> int:
    """Resident blocks per SM: registers are allocated per warp in units of 256 (8 per thread), shared
    memory with 1 KiB reserved per block."""
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = gpu.registers_per_sm // (regs_per_warp * warps)
    by_warps = gpu.max_warps_per_sm // warps
    by_shared = gpu.shared_per_sm // (shared + 1024) if shared else gpu.max_blocks_per_sm
    return max(0, min(by_regs, by_warps, by_shared, gpu.max_blocks_per_sm))


# --------------------------------------------------------------------------- one kernel


@dataclass
class KernelFigures:
    """The static figures of one compiled kernel (JSON-serialisable)."""

    loops: list      # [{"line": "file:line" of the loop's back edge, "paths": [cheapest mix, dearest mix],
                     #   "sides": {"then": mix, "else": mix} when it branches on the condition asked for}, ...],
                     # in address order
    straight: dict   # instruction mix outside those loops
    dots: list       # [(m, n, k, warp_group, repetition), ...] of every matrix product

    @property
    def repetition(self) -> float:
        """The largest issued / unique tensor-core work among the kernel's products."""
        return max((rep for *_, rep in self.dots), default=1.0)

    @property
    def uses_wgmma(self) -> bool:
        return any(wg for _, _, _, wg, _ in self.dots)

    def loop(self, line_text: str) -> dict:
        """The loop whose back edge is on the source line containing ``line_text``."""
        return self.loops_at(line_text)[0]

    def loops_at(self, line_text: str) -> list[dict]:
        """Every loop whose back edge is on a source line containing ``line_text`` (a helper the compiler
        inlined at several call sites gives one loop per site)."""
        found = [entry for entry in self.loops if line_text in source_line(entry["line"])]
        if not found:
            raise KeyError(f"no tensor-core loop at a line containing {line_text!r}: "
                           f"{[source_line(e['line']) for e in self.loops]}")
        return found


def kernel_figures(cubin: Path, ttgir: str, condition: str = "") -> KernelFigures:
    """Read the tile loops' paths, the rest of the code and the products of one compiled kernel; with a
    ``condition``, each loop that branches on ``if <condition>:`` also gets the dearest feasible path of each
    side (``sides``: ``{"then": mix, "else": mix}``, :func:`tile_kinds`)."""
    code = disassemble(cubin)
    blocks = basic_blocks(code)
    found = tensor_loops(blocks)
    warps = int(m[1]) if (m := re.search(r'"ttg\.num-warps" = (\d+)', ttgir)) else 4
    in_loops = {i.address for lp in found for b in lp.body for i in blocks[b].instructions}
    rest = [i for i in code if i.address not in in_loops]
    straight = with_chains(_mix(Block(0, rest)), rest, warps, 1)
    entries = []
    for lp in found:
        paths = [with_chains(mix, [i for b in starts for i in blocks[b].instructions], warps, PIPELINE_WALKS)
                 for mix, starts in loop_paths(blocks, lp)]
        entry = {"line": blocks[lp.latch].instructions[-1].line, "paths": paths}
        if condition and (kinds := tile_kinds(blocks, lp, condition)):
            entry["sides"] = {side: with_chains(mix, [i for b in starts for i in blocks[b].instructions], warps,
                                                PIPELINE_WALKS) for side, (mix, starts) in kinds.items()}
        entries.append(entry)
    dots = [(d.m, d.n, d.k, d.warp_group, d.repetition) for d in ttgir_dots(ttgir)]
    return KernelFigures(entries, straight, dots)


@functools.lru_cache(maxsize=None)
def source_line(location: str) -> str:
    """The text of a ``path:line`` location (the source file the compiler named), or ''."""
    name, _, number = location.rpartition(":")
    path = Path(name)
    if not path.exists() or not number.isdigit():
        return ""
    lines = path.read_text().splitlines()
    return lines[int(number) - 1].strip() if int(number) <= len(lines) else ""
