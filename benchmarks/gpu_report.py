"""Join a measured attention table (``benchmarks/attention.py --peers``) with the static judge's estimates
(``benchmarks/attention_judge.py --json``): one markdown table of measured ms, estimated ms and their ratio
per implementation, N, B, dropout and pass, at one head dim. Used by ``scripts/gpu-check.sh``.

    python benchmarks/gpu_report.py --peers peers.md --judge judge.json --cc 90 [--head-dim 64]

A ratio above 1 means the GPU was slower than the judge estimated. Rows the judge did not estimate (or a
missing judge file) say so; nothing is invented.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

# The measured table's row names -> the judge's implementation names.
JUDGE_NAMES = {"distaff (Triton)": "distaff", "FlashDeBERTa 0.0.8": "FlashDeBERTa",
               "DisentangledFlash 1.1.1 layer (incl. projections)": "DisentangledFlash"}
_SECTION = re.compile(r"^\|\s*\*\*d = (\d+)\*\*")


def parse_peers(text: str) -> list[dict]:
    """The measured rows of ``attention.py --peers`` output: name, head dim, N, B, dropout, fwd and bwd ms
    (rows whose timing is a message, e.g. "not installed", keep it as ``note``)."""
    rows, head_dim = [], None
    for line in text.splitlines():
        section = _SECTION.match(line)
        if section:
            head_dim = int(section.group(1))
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if head_dim is None or len(cells) < 6 or not cells[1].isdigit():
            continue
        row = dict(name=cells[0], head_dim=head_dim, n=int(cells[1]), batch=int(cells[2]), dropout=float(cells[3]))
        try:
            row.update(fwd=float(cells[4]), bwd=float(cells[5]))
        except ValueError:
            row.update(note=cells[4])
        rows.append(row)
    return rows


def load_judge(path: Path | None) -> dict | None:
    """``(impl, n, batch, head_dim, dropout, cc, pass) -> total_ms`` from the judge's JSON; None if absent."""
    if path is None or not path.is_file():
        return None
    estimates = {}
    data = json.loads(path.read_text())
    # `attention_judge.py --json` writes {"estimated", "calibration", "records": [...]}; a bare list is records too
    for record in data["records"] if isinstance(data, dict) else data:
        if "total_ms" not in record:
            continue
        w = record["workload"]
        key = (record["impl"], w["n"], w["batch"], w["head_dim"], float(w["dropout"]), w["cc"], record["pass_"])
        estimates[key] = record["total_ms"]
    return estimates


def joined_table(measured: list[dict], judge: dict | None, cc: int, head_dim: int = 64) -> str:
    """Markdown: each measured row at ``head_dim`` beside the judge's estimate for sm_``cc``, with the ratio."""
    lines = [f"| implementation | N | B | dropout | pass | measured ms | judge estimate ms (sm_{cc}) | "
             "measured / estimate |", "|---|---|---|---|---|---:|---:|---:|"]
    for row in (r for r in measured if r["head_dim"] == head_dim):
        for p in ("fwd", "bwd"):
            start = f"| {row['name']} | {row['n']} | {row['batch']} | {row['dropout']:g} | {p} |"
            if "note" in row:
                lines.append(f"{start} {row['note']} | | |")
                continue
            impl = JUDGE_NAMES.get(row["name"])
            estimate = None if judge is None or impl is None else judge.get(
                (impl, row["n"], row["batch"], head_dim, row["dropout"], cc, p))
            if estimate is None:
                why = "no judge file" if judge is None else "not estimated by the judge"
                lines.append(f"{start} {row[p]:.3f} | {why} | |")
            else:
                lines.append(f"{start} {row[p]:.3f} | {estimate:.3f} | {row[p] / estimate:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=Path, required=True, help="saved output of attention.py --peers")
    parser.add_argument("--judge", type=Path, help="attention_judge.py --json output (optional)")
    parser.add_argument("--cc", type=int, default=90, help="the judge's target for this GPU (90: H100/H200)")
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args(argv)
    judge = load_judge(args.judge)
    if judge is None:
        print(f"(no judge estimates: {args.judge or 'no --judge given'} is absent; run "
              "`python benchmarks/attention_judge.py --json FILE` on any machine first)\n")
    print(joined_table(parse_peers(args.peers.read_text()), judge, args.cc, args.head_dim))
    return 0


if __name__ == "__main__":
    sys.exit(main())
