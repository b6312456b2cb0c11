"""Add up scripts/test.sh's two pytest phases from their JUnit reports into one closing line.

Usage: ``python scripts/test_totals.py PARALLEL.xml SERIAL.xml ELAPSED_S``. A phase that wrote no report (it could
not start) counts as one failure, so the total never reads clean when a phase did not run.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def phase_counts(report: Path) -> dict[str, int]:
    """passed / failed / skipped of one JUnit report (errors count as failed)."""
    if not report.is_file():
        return {"passed": 0, "failed": 1, "skipped": 0}
    root = ElementTree.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests = sum(int(suite.get("tests", 0)) for suite in suites)
    failed = sum(int(suite.get("failures", 0)) + int(suite.get("errors", 0)) for suite in suites)
    skipped = sum(int(suite.get("skipped", 0)) for suite in suites)
    return {"passed": tests - failed - skipped, "failed": failed, "skipped": skipped}


def main(argv: list[str]) -> None:
    parallel, serial = (phase_counts(Path(path)) for path in argv[:2])
    elapsed_s = int(argv[2])
    total = {key: parallel[key] + serial[key] for key in parallel}
    print(f"scripts/test.sh: parallel phase {parallel['passed']} passed, {parallel['failed']} failed, "
          f"{parallel['skipped']} skipped; serial phase {serial['passed']} passed, {serial['failed']} failed, "
          f"{serial['skipped']} skipped; {elapsed_s // 60}m{elapsed_s % 60:02d}s in pytest")
    print(f"total: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")


if __name__ == "__main__":
    main(sys.argv[1:])
