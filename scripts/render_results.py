"""Write each docs/results/NAME.md from benchmarks/results/NAME.json: the measured tables the docs link to.

One mechanism for every result page. A result file holds what a reader needs beside the numbers and the numbers
themselves, typed (no formatting baked in):

    {"title": "...", "summary": "what the figures say, in a sentence or two",
     "tables": [{"caption": "...", "text": "markdown before the table", "command": "python benchmarks/x.py ...",
                "conditions": "date, machine, load",
                 "columns": [{"name": "tokens/s", "format": ",.0f", "align": "right"}, ...],
                 "rows": [["finetune", 190.0, ...], ...],
                 "notes": "how to read it"}],
     "notes": "..."}

A column's ``format`` is a Python format spec applied to each number (strings are written as they are; null is
"-"). A JSON file without "tables" (written by a tool with its own schema, attention_judge.json) has no page.
``tests/test_docs_numbers.py`` renders every page again and fails when one differs from what is committed, so a
page cannot drift from its JSON; after rerunning a benchmark and updating its JSON:

    python scripts/render_results.py          # rewrites docs/results/*.md
    python scripts/render_results.py --check  # exit 1 and the names of the stale pages
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PAGES = REPO / "docs" / "results"
ALIGN = {"left": "---", "right": "---:", "center": ":---:"}


def cell(value: object, column: dict) -> str:
    """One table cell: a number in the column's format, a string as it is, null as '-'."""
    if value is None:
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and "format" in column:
        return format(value, column["format"])
    return str(value).replace("|", "\\|")


def table_lines(table: dict) -> list[str]:
    """A markdown table; a row whose length differs from the columns' is a ValueError naming it."""
    columns = table["columns"]
    lines = ["| " + " | ".join(c["name"] for c in columns) + " |",
             "|" + "|".join(ALIGN[c.get("align", "left")] for c in columns) + "|"]
    for number, row in enumerate(table["rows"], 1):
        if len(row) != len(columns):
            raise ValueError(f"row {number} of table {table.get('caption', '')!r} has {len(row)} cells, "
                             f"the columns {len(columns)}")
        lines.append("| " + " | ".join(cell(v, c) for v, c in zip(row, columns)) + " |")
    return lines


def render(name: str, result: dict) -> str:
    """The page for benchmarks/results/NAME.json."""
    out = [f"<!-- Written by scripts/render_results.py from benchmarks/results/{name}.json: edit that file, "
           f"then run the script. -->", f"# {result['title']}", "", result["summary"], ""]
    for table in result["tables"]:
        if table.get("caption"):
            out += [f"## {table['caption']}", ""]
        if table.get("text"):
            out += [table["text"], ""]
        if table.get("command"):
            out += ["```bash", table["command"], "```", ""]
        if table.get("conditions"):
            out += [f"Measured: {table['conditions']}.", ""]
        out += [*table_lines(table), ""]
        if table.get("notes"):
            out += [table["notes"], ""]
    if result.get("notes"):
        out += [result["notes"], ""]
    return "\n".join(out)


def pages() -> dict[str, str]:
    """Every result page, keyed by its path under docs/results/."""
    rendered = {}
    for path in sorted(RESULTS.glob("*.json")):
        result = json.loads(path.read_text())
        if "tables" in result:
            rendered[f"{path.stem}.md"] = render(path.stem, result)
    return rendered


def stale() -> list[str]:
    """The pages under docs/results/ that differ from their JSON, are missing, or have no JSON."""
    want = pages()
    have = {p.name for p in PAGES.glob("*.md")}
    return sorted({n for n, text in want.items() if not (PAGES / n).is_file() or (PAGES / n).read_text() != text}
                  | (have - set(want)))


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        names = stale()
        for name in names:
            print(f"docs/results/{name} is stale: run python scripts/render_results.py")
        return 1 if names else 0
    PAGES.mkdir(exist_ok=True)
    for name, text in pages().items():
        (PAGES / name).write_text(text)
    print(f"docs/results: wrote {len(pages())} page(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
