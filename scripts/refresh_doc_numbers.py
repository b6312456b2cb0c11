"""Rewrite the measured spans of README.md and scripts/demo.sh's header (and of docs/pretraining.md) from the runs
that produce them.

A span is ``<!-- measured: NAME -->value<!-- /measured -->`` (inline) or the same two comments around lines
(a block). ``scripts/refresh-doc-numbers.sh`` runs the commands, then this with the values:

    python scripts/refresh_doc_numbers.py README.md runs/demo/summary.txt runs/demo/run/summary.json ELAPSED_S
    python scripts/refresh_doc_numbers.py scripts/demo.sh runs/demo/summary.txt runs/demo/run/summary.json ELAPSED_S

Values it fills: ``demo.summary`` (the demo's printed summary, as a code block), ``demo.elapsed``,
``demo.tokens_per_s``, ``demo.loss``, ``demo.perplexity``, ``demo.accuracy``, ``demo.baseline``,
``demo.tokens``, ``demo.when`` (date, machine and load average of the run). ``demo.elapsed`` is the time the
demo's own summary prints (``(10m18s in all)``), so the README, the script's header and the quoted summary give
one duration; ELAPSED_S (the shell's count) stands in only for a summary without it. A span it has no value for
is an error, so a new span cannot be left behind stale.

docs/pretraining.md's evaluation figures come from ``benchmarks/evals_side.py --json FILE`` (about 15 minutes on 2
cores, so the refresh script reads its last results rather than rerunning it):

    python scripts/refresh_doc_numbers.py --evals-side docs/pretraining.md benchmarks/results/evals_side.json

fills ``evals_side.command``, ``evals_side.when``, ``evals_side.table``, ``evals_side.ratio`` and
``evals_side.evals``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import time
from pathlib import Path

SPAN = re.compile(r"<!-- measured: (?P<name>[\w.-]+) -->(?P<value>.*?)<!-- /measured -->", re.S)


def demo_values(summary_text: str, summary: dict, elapsed_s: int) -> dict[str, str]:
    """The README's demo figures from the demo's printed summary, its run's summary.json and its wall time."""
    load = os.getloadavg()[0]
    printed = re.search(r"\((\d+m\d{2}s) in all\)", summary_text)
    return {
        "demo.summary": f"\n```\n{summary_text.strip()}\n```\n",
        "demo.elapsed": printed.group(1) if printed else f"{elapsed_s // 60}m{elapsed_s % 60:02d}s",
        "demo.tokens_per_s": f"{summary['tokens_per_s']:,.0f}",
        "demo.tokens": f"{summary['tokens']:,}",
        "demo.loss": f"{summary['eval_loss']:.3f}",
        "demo.perplexity": f"{summary['eval_perplexity']:.1f}",
        "demo.accuracy": f"{summary['eval_accuracy']:.3f}",
        "demo.baseline": f"{summary['unigram_baseline_accuracy']:.3f}",
        "demo.when": f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()}-core {platform.machine()} machine, "
                     f"load average {load:.1f} at the end",
    }


def evals_side_values(results: dict) -> dict[str, str]:
    """docs/pretraining.md's figures from ``benchmarks/evals_side.py --json``'s file."""
    return {
        "evals_side.command": f"\n```bash\n{results['command']}\n```\n",
        "evals_side.when": f"{results['date']}, {results['machine']}",
        "evals_side.table": f"\n{results['table'].strip()}\n",
        "evals_side.ratio": f"{results['ratio']:.3f}",
        "evals_side.evals": f"\n```\n{_lines(results['evals_table'])}\n```\n",
    }


def _lines(table: str) -> str:
    """A printed table without its trailing blanks (its first line's indent is its alignment)."""
    return "\n".join(line.rstrip() for line in table.strip("\n").splitlines())


def rewrite(text: str, values: dict[str, str]) -> str:
    """``text`` with every measured span's value replaced; a span without a value is a ValueError."""
    missing = sorted({m["name"] for m in SPAN.finditer(text)} - set(values))
    if missing:
        raise ValueError(f"no value for the measured span(s) {missing}")
    return SPAN.sub(lambda m: f"<!-- measured: {m['name']} -->{values[m['name']]}<!-- /measured -->", text)


def main(argv: list[str]) -> int:
    if argv[0] == "--evals-side":
        _, doc, results = argv
        values = evals_side_values(json.loads(Path(results).read_text()))
    else:
        doc, summary_text, summary_json, elapsed = argv
        values = demo_values(Path(summary_text).read_text(), json.loads(Path(summary_json).read_text()), int(elapsed))
    path = Path(doc)
    path.write_text(rewrite(path.read_text(), values))
    print(f"{doc}: rewrote {len(SPAN.findall(path.read_text()))} measured span(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
