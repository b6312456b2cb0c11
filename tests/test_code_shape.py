"""The code stays readable: no function in kernels/, train/ or launch/ is longer than 60 lines
(Triton kernels, ``@triton.jit`` functions, excepted: splitting them costs registers and launches)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "train", "launch")
MAX_FUNCTION_LINES = 60


def _is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any("triton.jit" in ast.unparse(decorator) for decorator in node.decorator_list)


def _long_functions(path: Path) -> list[str]:
    long = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_kernel(node):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    return long


def test_no_function_is_longer_than_60_lines():
    sources = sorted(path for package in PACKAGES for path in (REPO / package).rglob("*.py"))
    assert sources, "no sources found"
    assert [found for path in sources for found in _long_functions(path)] == []
