"""An ablation's report, read back from its finished runs: ``ablation.csv``, ``ablation.md`` and ``ablation.png``."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from distaff.train.data.errors import DataError
from distaff.train.run.metrics import METRICS_FILE, numbers, read_metrics, save_figure
from distaff.train.tools.ablate.config import AblationConfig, Variant
from distaff.train.tools.ablate.plan import PlannedRun

# the report's figures per objective, and their column titles
REPORT_KEYS = {"mlm": ("eval_loss", "eval_accuracy", "tokens_per_s"),
               "rtd": ("eval_loss", "eval_rtd_accuracy", "eval_rtd_auc", "tokens_per_s")}
TITLES = {"eval_loss": "held-out loss", "eval_accuracy": "held-out MLM accuracy", "tokens_per_s": "tokens/s",
          "eval_rtd_accuracy": "held-out discriminator accuracy", "eval_rtd_auc": "held-out replaced-token AUC"}


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def report_keys(runs: list[PlannedRun]) -> tuple[str, ...]:
    """The figures the report compares: the objective's (every variant trains the same one, load_ablation)."""
    return REPORT_KEYS["rtd" if any(run.config.get("train.objective") == "rtd" for run in runs) else "mlm"]


def collect(runs: list[PlannedRun]) -> list[dict[str, Any]]:
    """Each finished run's summary figures (unfinished runs, and runs of another length, are left out)."""
    rows, keys = [], report_keys(runs)
    for run in runs:
        if not run.done:
            continue
        summary = run.summary()
        missing = [k for k in keys if summary.get(k) is None]
        if missing:
            raise DataError(f"{run.summary_path}: no {missing} (did the run evaluate?)")
        rows.append({"variant": run.variant, "seed": run.seed, "steps": summary["steps"],
                     "tokens": summary["tokens"], **{k: summary[k] for k in keys}})
    return rows


def row_keys(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """The report's figures, as ``collect`` put them in the rows."""
    return REPORT_KEYS["rtd" if rows and "eval_rtd_auc" in rows[0] else "mlm"]


def aggregate(cfg: AblationConfig, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per variant (in config order): seeds finished and each figure's mean and std over them."""
    table = []
    for variant in cfg.variants:
        mine = [r for r in rows if r["variant"] == variant.name]
        if not mine:
            continue
        entry: dict[str, Any] = {"variant": variant.name, "seeds": len(mine),
                                 "tokens": round(sum(r["tokens"] for r in mine) / len(mine))}
        for key in row_keys(rows):
            entry[f"{key}_mean"], entry[f"{key}_std"] = _mean_std([float(r[key]) for r in mine])
        table.append(entry)
    return table


def _write_csv(path: Path, rows: list[dict[str, Any]], table: list[dict[str, Any]]) -> None:
    """Per-variant rows (seed ``all``) then per-run rows, one header for both."""
    header = ["variant", "seed", "seeds", "steps", "tokens"] + [f"{k}{s}" for k in row_keys(rows)
                                                                 for s in ("_mean", "_std", "")]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=header, restval="")
        writer.writeheader()
        writer.writerows({"seed": "all", **entry} for entry in table)
        writer.writerows(rows)


def _per_seed(cfg: AblationConfig, rows: list[dict[str, Any]]) -> list[str]:
    """Held-out loss per variant and seed: a seed shares data order across variants, so columns pair up."""
    loss = {(r["variant"], r["seed"]): r["eval_loss"] for r in rows}
    lines = ["", "Held-out loss per seed (same seed = same data order and masking across variants):", "",
             "| variant | " + " | ".join(f"seed {s}" for s in cfg.seeds) + " |",
             "| --- |" + " ---: |" * len(cfg.seeds)]
    for variant in cfg.variants:
        cells = [f"{loss[variant.name, s]:.4f}" if (variant.name, s) in loss else "-" for s in cfg.seeds]
        lines.append(f"| {variant.name} | " + " | ".join(cells) + " |")
    return lines


def paired_differences(cfg: AblationConfig, rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per variant after the first: its held-out loss minus the first variant's, for each seed both finished."""
    loss = {(r["variant"], r["seed"]): r["eval_loss"] for r in rows}
    first = cfg.variants[0].name
    return {v.name: [loss[v.name, s] - loss[first, s] for s in cfg.seeds if (v.name, s) in loss and (first, s) in loss]
            for v in cfg.variants[1:]}


def _paired_with_parent(cfg: AblationConfig, rows: list[dict[str, Any]]) -> list[str]:
    """Each branch's and average's held-out loss minus the run it was made from, paired by seed."""
    loss = {(r["variant"], r["seed"]): r["eval_loss"] for r in rows}
    derived = [(v.name, (v.branch or v.average).of) for v in cfg.variants if v.branch or v.average]
    if not derived:
        return []
    lines = ["", "Held-out loss minus that of the run each was made from, paired by seed:", "",
             "| variant | made from | pairs | difference |", "| --- | --- | ---: | ---: |"]
    for name, parent in derived:
        diffs = [loss[name, s] - loss[parent, s] for s in cfg.seeds if (name, s) in loss and (parent, s) in loss]
        mean, std = _mean_std(diffs) if diffs else (math.nan, math.nan)
        lines.append(f"| {name} | {parent} | {len(diffs)} | {mean:+.4f} +- {std:.4f} |")
    return lines


def _paired(cfg: AblationConfig, rows: list[dict[str, Any]]) -> list[str]:
    lines = ["", f"Held-out loss minus `{cfg.variants[0].name}`'s, paired by seed (mean +- sample std over the "
             "seeds both finished; negative: lower loss):", "", "| variant | pairs | difference |", "| --- | ---: | ---: |"]
    for name, diffs in paired_differences(cfg, rows).items():
        mean, std = _mean_std(diffs) if diffs else (math.nan, math.nan)
        lines.append(f"| {name} | {len(diffs)} | {mean:+.4f} +- {std:.4f} |")
    return lines


def _cell(entry: dict[str, Any], key: str) -> str:
    mean, std = entry[f"{key}_mean"], entry[f"{key}_std"]
    return f"{mean:,.0f} +- {std:,.0f}" if key == "tokens_per_s" else f"{mean:.4f} +- {std:.4f}"


def _markdown(cfg: AblationConfig, table: list[dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    keys = row_keys(rows)
    budget = "real tokens" if cfg.budget == "real" else "tokens"
    lines = [f"# Ablation {cfg.name}", "",
             f"Base `{cfg.base}`, {cfg.tokens:,} {budget} per run, seeds {cfg.seeds}, {cfg.ranks} rank(s) per run. "
             "Mean +- sample std over seeds; held-out figures are from each run's final evaluation.", "",
             "| variant | seeds | tokens | " + " | ".join(TITLES[k] for k in keys) + " |",
             "| --- | ---: | ---: |" + " ---: |" * len(keys)]
    for e in table:
        lines.append(f"| {e['variant']} | {e['seeds']} | {e['tokens']:,} | "
                     + " | ".join(_cell(e, k) for k in keys) + " |")
    derived = [v for v in cfg.variants if v.branch is not None or v.average is not None]
    if derived:
        lines += ["", "Made from another variant's run: " + "; ".join(_derived_line(v) for v in derived) + "."]
    return "\n".join(lines + _per_seed(cfg, rows) + _paired(cfg, rows) + _paired_with_parent(cfg, rows)) + "\n"


def _derived_line(variant: Variant) -> str:
    if variant.branch is not None:
        return (f"`{variant.name}` is a decay branch of `{variant.branch.of}` over its last "
                f"{variant.branch.decay:.0%} of steps ({variant.branch.shape or 'the parent decay shape'})")
    how = f"exponential weights, decay {variant.average.ema}" if variant.average.ema else "uniform"
    return (f"`{variant.name}` is the average of the last {variant.average.last} checkpoint(s) of "
            f"`{variant.average.of}` ({how}; its tokens/s are that run's)")


def eval_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(tokens seen, held-out loss) at each evaluation; tokens from the train record of the same step."""
    records = read_metrics(run_dir / METRICS_FILE)
    tokens = {r["step"]: r["tokens_seen"] for r in records if numbers(r, "tokens_seen")}
    return [(tokens[r["step"]], r["eval_loss"]) for r in records if numbers(r, "eval_loss") and r["step"] in tokens]


def plot_curves(cfg: AblationConfig, runs: list[PlannedRun], path: Path) -> Path | None:
    """Held-out loss against tokens: each variant's mean over seeds, +- std shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant in cfg.variants:
        curves = [eval_curve(r.out_dir) for r in runs if r.variant == variant.name and r.done]
        length = min((len(c) for c in curves), default=0)
        if not length:
            continue
        tokens = [sum(c[i][0] for c in curves) / len(curves) for i in range(length)]
        stats = [_mean_std([c[i][1] for c in curves]) for i in range(length)]
        ax.plot(tokens, [m for m, _ in stats], "o-", label=f"{variant.name} ({len(curves)} seeds)")
        ax.fill_between(tokens, [m - s for m, s in stats], [m + s for m, s in stats], alpha=0.2)
    loss = "held-out loss (generator + rtd.weight x discriminator)" if "eval_rtd_auc" in report_keys(runs) \
        else "held-out MLM loss"
    ax.set(xlabel="tokens seen", ylabel=loss, title=f"ablation {cfg.name}")
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


def write_report(cfg: AblationConfig, runs: list[PlannedRun]) -> list[dict[str, Any]]:
    """``ablation.csv``, ``ablation.md`` and ``ablation.png`` under ``out_dir``; the per-variant table."""
    rows = collect(runs)
    table = aggregate(cfg, rows)
    cfg.root.mkdir(parents=True, exist_ok=True)
    _write_csv(cfg.root / "ablation.csv", rows, table)
    markdown = _markdown(cfg, table, rows)
    (cfg.root / "ablation.md").write_text(markdown)
    plot_curves(cfg, runs, cfg.root / "ablation.png")
    print(markdown, flush=True)
    return table


