"""``distaff probe``'s printed table: a deviation (``+- std``) only where two or more seeds measured one."""

from __future__ import annotations

import pytest

from distaff.train.tools.probe import Encoder, format_table, summarise, table_title

pytestmark = pytest.mark.unit


def _rows(seeds: list[int]) -> list[dict]:
    score = {("probe", "demo"): 0.60, ("probe", "random"): 0.50}
    return [{"method": method, "arm": arm, "labels": "all", "task": "bshift", "seed": seed,
             "dev_accuracy": value + 0.01 * seed} for (method, arm), value in score.items() for seed in seeds]


def _report(seeds: list[int]) -> str:
    return format_table(summarise(_rows(seeds), [Encoder("demo", None)], random_arm=True), ["bshift"])


def test_one_seed_prints_no_deviation():
    summary = summarise(_rows([1]), [Encoder("demo", None)], random_arm=True)
    assert all(row["std"] is None for row in summary["rows"]) and summary["differences"][0]["std"] is None
    report = _report([1])
    assert "+-" not in report and "std" not in report
    assert "probe demo - random, bshift: +0.100 (one seed)" in report
    assert "0.610" in report and "0.510" in report
    assert table_title([1]) == "seed 1 alone (no deviation measured: --seeds 1 2 3 gives mean +- std)"


def test_several_seeds_print_mean_and_deviation():
    report = _report([1, 2, 3])
    assert "0.620 +- 0.010" in report and "0.520 +- 0.010" in report
    assert "probe demo - random, bshift: +0.100 +- 0.000 (+0.100, +0.100, +0.100)" in report   # the same gap per seed
    assert table_title([1, 2, 3]) == "mean +- std over seeds [1, 2, 3]"
