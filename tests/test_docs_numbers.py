"""The docs quote what the commands print: no leftover placeholder in README.md or docs/, and every measured
span (``<!-- measured: NAME -->...<!-- /measured -->``) is one ``scripts/refresh-doc-numbers.sh`` rewrites."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# All-caps words with underscores that are names, not placeholders, where prose uses them without backticks.
NAMES = {"NODE_FAIL", "EX_TEMPFAIL", "N_TRAIN", "DS_ENV_FILE"}
PLACEHOLDER = re.compile(r"\b(?:[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+|TODO|TBD|FIXME|XXX)\b")


def _refresher():
    spec = importlib.util.spec_from_file_location("refresh_doc_numbers", REPO / "scripts" / "refresh_doc_numbers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def placeholders(text: str) -> list[tuple[int, str]]:
    """(line, word) of each all-caps placeholder outside code (fenced blocks and backticks)."""
    prose = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return [(number, m.group(0)) for number, line in enumerate(prose.splitlines(), 1)
            for m in PLACEHOLDER.finditer(re.sub(r"`[^`]*`", "", line)) if m.group(0) not in NAMES]


def test_the_checker_finds_a_leftover_placeholder_and_ignores_code():
    text = "Intro.\n\nRECIPE_MEASURED `--input` takes files; `OMP_NUM_THREADS` is code.\n```\nA_B = 1\n```\nTODO\n"
    assert placeholders(text) == [(3, "RECIPE_MEASURED"), (7, "TODO")]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_doc_has_a_leftover_placeholder(doc):
    assert placeholders(doc.read_text()) == []


def test_every_measured_span_is_closed_and_rewritten_by_the_refresh_script():
    refresh = _refresher()
    text = (REPO / "README.md").read_text()
    assert text.count("<!-- measured: ") == text.count("<!-- /measured -->") == len(refresh.SPAN.findall(text)) > 0
    summary = {"tokens_per_s": 8518.4, "tokens": 2044916, "eval_loss": 4.75, "eval_perplexity": 115.5,
               "eval_accuracy": 0.241, "unigram_baseline_accuracy": 0.041}
    values = refresh.demo_values("== distaff demo summary (4m25s in all)\n  trained ...", summary, 265)
    rewritten = refresh.rewrite(text, values)
    assert "<!-- measured: demo.elapsed -->4m25s<!-- /measured -->" in rewritten
    assert "<!-- measured: demo.tokens_per_s -->8,518<!-- /measured -->" in rewritten
    assert "<!-- measured: demo.summary -->\n```\n== distaff demo summary (4m25s in all)" in rewritten
    assert refresh.rewrite(rewritten, values) == rewritten                 # a second refresh changes nothing
    with pytest.raises(ValueError, match=r"no value for the measured span\(s\) \['demo.new'\]"):
        refresh.rewrite(text + "<!-- measured: demo.new -->1<!-- /measured -->", values)


def _results():
    spec = importlib.util.spec_from_file_location("render_results", REPO / "scripts" / "render_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_results_page_is_what_its_committed_json_renders_to():
    results = _results()
    pages = results.pages()
    assert {"threads.md", "packing.md"} <= set(pages)
    assert results.stale() == [], "docs/results is stale: run python scripts/render_results.py"


def test_a_results_page_that_differs_from_its_json_is_caught(tmp_path, monkeypatch):
    results = _results()
    monkeypatch.setattr(results, "PAGES", tmp_path)
    assert results.main([]) == 0 and results.stale() == []
    page = tmp_path / "threads.md"
    page.write_text(page.read_text().replace("| 503 |", "| 530 |", 1))
    (tmp_path / "orphan.md").write_text("# a page with no JSON\n")
    assert results.stale() == ["orphan.md", "threads.md"]
    assert results.main(["--check"]) == 1


def test_a_result_renders_typed_cells_and_refuses_a_short_row():
    results = _results()
    table = {"columns": [{"name": "run"}, {"name": "tokens/s", "format": ",d", "align": "right"},
                         {"name": "share", "format": ".1%", "align": "right"}],
             "rows": [["a|b", 12345, 0.479], ["c", None, 0.0]]}
    assert results.table_lines(table) == ["| run | tokens/s | share |", "|---|---:|---:|",
                                          "| a\\|b | 12,345 | 47.9% |", "| c | - | 0.0% |"]
    table["rows"].append(["d", 1])
    with pytest.raises(ValueError, match=r"row 3 of table '' has 2 cells, the columns 3"):
        results.table_lines(table)


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def anchors(text: str) -> set[str]:
    """GitHub's anchors for the headings of a markdown text (fenced code excluded), duplicates numbered."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", prose, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(doc: Path) -> list[str]:
    """Relative links of ``doc`` (outside code) whose file, or heading anchor in a markdown file, does not exist."""
    text = doc.read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    broken = []
    for match in LINK.finditer(prose):
        target = match.group(1) or match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):          # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(target)
    return broken


def test_the_link_checker_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "b.md").write_text("# Packed training (`data.packing: varlen`)\n\n## Notes\n\n## Notes\n")
    doc = tmp_path / "a.md"
    doc.write_text("[ok](b.md#packed-training-datapacking-varlen) [dup](b.md#notes-1) [web](https://x.org/y) "
                   "`[code](nosuch.md)` [gone](nosuch.md) [bad](b.md#nosuch) [self](#top)\n# Top\n")
    assert broken_links(doc) == ["nosuch.md", "b.md#nosuch"]


@pytest.mark.parametrize("doc", [*DOCS, *sorted((REPO / "docs" / "results").glob("*.md"))], ids=lambda p: p.name)
def test_every_relative_link_of_the_docs_resolves(doc):
    assert broken_links(doc) == []


def test_the_evaluation_figures_of_docs_pretraining_are_the_benchmarks_last_results():
    """docs/pretraining.md's side-mode figures are what ``benchmarks/evals_side.py --json`` wrote (refreshing them
    from that file changes nothing) and every span there has a value."""
    refresh = _refresher()
    text = (REPO / "docs" / "pretraining.md").read_text()
    results = json.loads((REPO / "benchmarks" / "results" / "evals_side.json").read_text())
    values = refresh.evals_side_values(results)
    assert text.count("<!-- measured: ") == text.count("<!-- /measured -->") == len(refresh.SPAN.findall(text)) == 5
    assert refresh.rewrite(text, values) == text
    assert f"**<!-- measured: evals_side.ratio -->{results['ratio']:.3f}<!-- /measured -->x**" in text


def test_the_demo_has_one_duration_the_one_its_summary_prints_in_the_readme_and_its_header():
    refresh = _refresher()
    readme, header = (REPO / "README.md").read_text(), (REPO / "scripts" / "demo.sh").read_text()
    spans = [dict((m["name"], m["value"]) for m in refresh.SPAN.finditer(text)) for text in (readme, header)]
    assert spans[1] == {"demo.elapsed": spans[0]["demo.elapsed"]}
    assert f"== distaff demo summary ({spans[0]['demo.elapsed']} in all)" in spans[0]["demo.summary"]
    summary = {"tokens_per_s": 1.0, "tokens": 1, "eval_loss": 1.0, "eval_perplexity": 1.0, "eval_accuracy": 0.1,
               "unigram_baseline_accuracy": 0.1}
    values = refresh.demo_values("== distaff demo summary (9m05s in all)\n", summary, 560)   # the shell counted 9m20s
    assert "<!-- measured: demo.elapsed -->9m05s<!-- /measured -->" in refresh.rewrite(header, values)
    assert "for doc in README.md scripts/demo.sh; do" in (REPO / "scripts" / "refresh-doc-numbers.sh").read_text()
