"""Each evaluation across a run's checkpoints: a printed table and a plot (``<run>/evals.png``).

A row per checkpoint with results or due some: the run's by step, then each decay branch's, then the averages; a
column per evaluation of the run's ``evals`` section: the mean over seeds +- their standard deviation (and how many
seeds), ``diverged (K of N)`` where K of its N seeds scored NaN or inf (a diverged checkpoint), ``failed`` where an
evaluation failed and has no result, ``-`` where it is due and has none yet. The plot has a panel per evaluation: the
run's checkpoints as a line with the spread over seeds as error bars, the branch ends and the averages as markers
beside it; a diverged checkpoint is left out of its panel, whose title counts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distaff.train.run.config import EvalTaskSection
from distaff.train.run.metrics import save_figure
from distaff.train.tools.evals import records
from distaff.train.tools.evals.catalog import BRANCHES, Plan

PLOT_FILE = "evals.png"
ORDER = {"run": 0, "branch": 1, "average": 2}


@dataclass(frozen=True)
class Row:
    run_dir: Path
    checkpoint: str
    step: int
    source: str
    label: str


@dataclass
class Cell:
    values: list[float]
    failed: bool
    due: bool

    def text(self) -> str:
        lost = sum(map(records.diverged, self.values))
        if lost:
            return f"diverged ({lost} of {len(self.values)})"
        if self.values:
            mean, std = records.spread(self.values)
            return f"{mean:.4f}" + (f" +- {std:.4f}" if std is not None else "") + f" ({len(self.values)})"
        return "failed" if self.failed else "-" if self.due else ""


def _label(run_dir: Path, record: dict[str, Any], root: Path) -> str:
    if record["source"] == "average":
        return f"average {Path(record['checkpoint']).name}"
    if run_dir != root:
        return f"{run_dir.name} step {record['step']}"
    return f"step {record['step']}"


def gather(root: Path, plan: Plan, tasks: list[EvalTaskSection]) -> tuple[list[Row], dict[tuple, Cell]]:
    """The rows (checkpoints with results, or due some) and their cells, by (row, evaluation name)."""
    owners = [root, *sorted(p.parent for p in (root / BRANCHES).glob("*/config.yaml"))]
    rows: dict[tuple[Path, str], Row] = {}
    cells: dict[tuple, Cell] = {}
    hashes = {task.name: records.task_hash(task) for task in tasks}
    for target, due in plan:
        row = rows.setdefault((target.run_dir, target.name), Row(target.run_dir, target.name, target.step,
                                                                 target.source, target.label))
        for task in due:
            cells[(row, task.name)] = Cell([], False, True)
    for owner in owners:
        for record in records.read(owner / records.EVALS_FILE):
            if hashes.get(record["name"]) != record["task_hash"]:
                continue        # an evaluation no longer in the section, or with other settings now
            row = rows.setdefault((owner, record["checkpoint"]), Row(owner, record["checkpoint"], record["step"],
                                                                     record["source"], _label(owner, record, root)))
            cells.setdefault((row, record["name"]), Cell([], False, False)).values.append(record["value"])
        for failure in records.read_failures(owner / records.FAILURES_FILE):
            row = rows.get((owner, failure["checkpoint"]))
            if row is not None and (row, failure["name"]) in cells:
                cells[(row, failure["name"])].failed = True
    ordered = sorted(rows.values(), key=lambda r: (ORDER.get(r.source, 3), str(r.run_dir), r.step, r.checkpoint))
    return ordered, cells


def table(root: Path, plan: Plan, tasks: list[EvalTaskSection]) -> str:
    rows, cells = gather(root, plan, tasks)
    if not rows:
        return "(no checkpoint evaluated or due yet)"
    metrics = _metrics(root, tasks)
    heads = [f"{t.name} ({metrics.get(t.name, t.kind)})" for t in tasks]
    texts = [[cells[(row, t.name)].text() if (row, t.name) in cells else "" for t in tasks] for row in rows]
    width = max(len(r.label) for r in rows) + 2
    columns = [max([len(h)] + [len(line[i]) for line in texts]) + 2 for i, h in enumerate(heads)]
    lines = [" " * width + "".join(f"{h:<{w}}" for h, w in zip(heads, columns))]
    lines += [f"{row.label:<{width}}" + "".join(f"{c:<{w}}" for c, w in zip(line, columns))
              for row, line in zip(rows, texts)]
    return "\n".join(lines)


def _metrics(root: Path, tasks: list[EvalTaskSection]) -> dict[str, str]:
    """Each evaluation's metric, as its records name it."""
    found = {}
    for record in records.read(root / records.EVALS_FILE):
        found.setdefault(record["name"], record["metric"])
    return found


def plot(root: Path, plan: Plan, tasks: list[EvalTaskSection]) -> Path | None:
    """``root/evals.png``: one panel per evaluation (None when nothing has results yet)."""
    rows, cells = gather(root, plan, tasks)
    series = {t.name: [(row, cells[(row, t.name)].values) for row in rows
                       if (row, t.name) in cells and cells[(row, t.name)].values] for t in tasks}
    if not any(series.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.8), squeeze=False)
    metrics = _metrics(root, tasks)
    for ax, task in zip(axes.flat, tasks):
        finite = [(row, values) for row, values in series[task.name] if not any(map(records.diverged, values))]
        lost = len(series[task.name]) - len(finite)
        _panel(ax, task.name + (f" ({lost} diverged: not drawn)" if lost else ""), metrics.get(task.name, ""), finite)
    return save_figure(fig, root / PLOT_FILE)


def _panel(ax, name: str, metric: str, points: list[tuple[Row, list[float]]]) -> None:
    def mean_std(values: list[float]) -> tuple[float, float]:
        mean, std = records.spread(values)
        return mean, std or 0.0

    main = [(row.step, *mean_std(values)) for row, values in points if row.source == "run"]
    if main:
        steps, means, stds = zip(*main)
        ax.errorbar(steps, means, yerr=stds, marker="o", capsize=3, label="run")
    for row, values in points:
        if row.source != "run":
            mean, std = mean_std(values)
            ax.errorbar([row.step], [mean], yerr=[std], marker="s" if row.source == "branch" else "*",
                        markersize=8, capsize=3, linestyle="none", label=row.label)
    ax.set_title(name)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    if points:          # a panel whose every checkpoint diverged has nothing to label
        ax.legend(fontsize="small")
