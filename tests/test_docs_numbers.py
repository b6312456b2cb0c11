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
