"""``torch.compile(fullgraph=True)`` through the ``distaff::`` custom ops (issue 30; the cases are in
``compile_layer_cases.py``), run by pytest in a fresh process.

Why a fresh process: a dynamo trace of these ops in the suite's processes once failed with a C++ ``vector::reserve``
error or crashed outright. The cause, found later: pytest started at the checkout's root has it on sys.path, and
``transformers``' probe for a ``kernels`` package imported ``kernels/`` a second time as a top-level package, which
registered the ``distaff::`` ops again (kernels/__init__.py now registers them only as ``distaff.kernels``). The
fresh process stays: a crash there fails this test with the cases' output instead of ending the suite.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("compile_layer_cases.py")


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_the_compile_cases_pass_in_a_fresh_process():
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
                         cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=560)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-3000:]
