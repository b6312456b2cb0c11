"""docs/plan.md quotes the tool: every table and figure is a span scripts/refresh_plan_doc.py writes, and rendering
them again (the plan's output now, the committed measurements) gives the file as it is."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REFRESH, PLAN_DOC = _script("refresh_doc_numbers"), _script("refresh_plan_doc")


def stale_spans(text: str, values: dict[str, str]) -> list[str]:
    """The spans of ``text`` whose value differs from what the refresh would write."""
    return sorted(m["name"] for m in REFRESH.SPAN.finditer(text) if m["value"] != values.get(m["name"]))


@pytest.fixture(scope="module")
def values() -> dict[str, str]:
    return PLAN_DOC.values()


def test_every_figure_of_the_plan_doc_is_what_the_tool_prints_now(values):
    text = (REPO / "docs" / "plan.md").read_text()
    spans = {m["name"] for m in REFRESH.SPAN.finditer(text)}
    assert {"plan.memory", "plan.estimators", "plan.anchors", "plan.cpu_time", "plan.cpu_time_summary",
            "plan.clusters"} <= spans
    assert stale_spans(text, values) == [], "docs/plan.md is stale: run bash scripts/refresh-doc-numbers.sh plan-tables"


def test_a_figure_that_differs_from_the_tool_is_caught(values):
    text = REFRESH.rewrite((REPO / "docs" / "plan.md").read_text(), values)
    tampered = text.replace(values["plan.anchors"], values["plan.anchors"].replace("| 1.", "| 9.", 1))
    assert tampered != text and stale_spans(tampered, values) == ["plan.anchors"]
