"""``distaff probe``: what an encoder knows about word order, length and words, on text it was not pretrained on.

Builds SentEval-style probing tasks from any text (:mod:`distaff.train.tools.probe_tasks`: bshift, coordinv, sentlen,
wc), drops every sentence whose tokens occur in the pretraining text (:mod:`distaff.train.tools.probe_overlap`), then,
for each seed, splits each task into train and dev rows exactly as ``distaff finetune`` does with
``data.dev_fraction`` and ``data.split_seed`` and scores:

* a **linear probe** of each frozen encoder (``--model``; :func:`distaff.train.tools.baselines.frozen_encoder`: mean of
  the final hidden states, standardised, L2-penalised logistic regression) on all training rows;
* with ``--random``, the same for the first model's architecture and tokenizer with random weights drawn from
  the seed (the untrained control);
* with ``--bow``, the bag-of-words baseline (:mod:`distaff.train.tools.baselines`: unigram and bigram tf-idf);
* with ``--finetune N ...``, ``distaff finetune`` of every encoder (and the bag of words) on ``N`` training rows
  drawn with the seed, scored on the same dev rows, for the tasks in ``--finetune-tasks``.

::

    distaff probe --text data/movie-snippets.tsv.gz --text-column 1 --model mlm=runs/demo/run --random --bow \\
        --seeds 1 2 3 --finetune 200 1000 --out runs/probe

``--model`` is a distaff run, checkpoint or model folder, or an HF DeBERTa-v2/v3 folder (``NAME=PATH`` names its
rows). The pretraining text is the training split of ``--pretraining-data`` (distaff data dirs), else of each
run's own ``data.dir``; a model with neither (an HF folder) is probed unchecked, and the report says so.
Writes ``tasks/<task>.tsv`` (``label<TAB>text``, every example), ``tasks.json`` (sizes, label meanings, the
overlap check), the fine-tuning runs under ``finetune/``, and ``results.json`` + a printed table: dev accuracy
per seed, mean +- std, and per-seed differences of each model against random weights.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from distaff.train.core.errors import (MAX_COUNT, MAX_SEED, ConfigError, RunFailure, command_main, document_ranges,
                                       float_arg, int_arg)
from distaff.train.core.files import check_apart
from distaff.train.core.threads import configure_threads
from distaff.train.data.manifest import MAX_SEQ_LEN, MIN_SEQ_LEN
from distaff.train.data.sources import ReadOptions, iter_documents
from distaff.train.finetune.classifier_init import load_encoder
from distaff.train.finetune.labelled import CSV_SUFFIXES, TSV_SUFFIXES, Example, hold_out, read_examples, read_texts
from distaff.train.run.checkpoint_files import check_apart_from_checkpoints
from distaff.train.tools.baselines import BUNDLED_COLUMNS, PROBE_L2, bag_of_words, fit_and_score, frozen_encoder
from distaff.train.tools.probe_overlap import pretrained_on, run_data_dir
from distaff.train.tools.probe_tasks import MAX_WORDS, MIN_SENTENCES, MIN_WORDS, TASKS, build_tasks, probe_sentences

BOW = "bag of words"
RANDOM = "random"


@dataclass(frozen=True)
class Encoder:
    name: str
    path: Path
    tokenizer: Path | None = None   # None: the one saved with the weights


def read_documents(paths: Sequence[Path], column: str | None) -> list[str]:
    """The documents of ``paths``: one column of a TSV/CSV file per row (``column``: a header name or a 0-based
    index), or the documents of a text, JSONL or parquet file as ``distaff data prepare`` reads them
    (``.txt``: blank-line separated; ``column``: the JSONL/parquet field, default ``text``)."""
    documents: list[str] = []
    for path in paths:
        if path.name.endswith(TSV_SUFFIXES + CSV_SUFFIXES):
            if column is None:
                raise ConfigError(f"--text {path}: a TSV/CSV file needs --text-column (a header name or 0-based index)")
            # an index only when written in ASCII digits: "²".isdigit() is True, but int("²") fails
            documents.extend(read_texts(path, int(column) if re.fullmatch("[0-9]+", column) else column))
        else:
            documents.extend(doc.text for doc in iter_documents([path], ReadOptions(text_field=column or "text")))
    return documents


def overlap_sources(args: argparse.Namespace, encoders: Sequence[Encoder]) -> tuple[list[Path], list[str]]:
    """The data dirs holding the pretraining text, and the models none of them covers."""
    if args.pretraining_data:
        return [Path(d) for d in args.pretraining_data], []
    found = {encoder.name: run_data_dir(encoder.path) for encoder in encoders}
    for name, data_dir in found.items():
        if data_dir is not None and not data_dir.is_dir():
            raise FileNotFoundError(f"--model {name}: its run config names data.dir {data_dir}, which does not exist "
                                    "here; pass the pretraining data dir with --pretraining-data DIR")
    return sorted({d for d in found.values() if d is not None}), [n for n, d in found.items() if d is None]


def held_out_sentences(args: argparse.Namespace, encoders: Sequence[Encoder]) -> tuple[list[str], dict]:
    """The sentences of ``--text`` that no data dir of the pretraining text holds, and the check's report."""
    sentences = probe_sentences(read_documents(args.text, args.text_column))
    _check_enough(sentences, args, "before the overlap check")
    data_dirs, unchecked = overlap_sources(args, encoders)
    seen = np.zeros(len(sentences), dtype=bool)
    for data_dir in data_dirs:
        seen |= np.array(pretrained_on(sentences, data_dir), dtype=bool)
    kept = [s for s, dropped in zip(sentences, seen) if not dropped]
    if args.max_sentences:
        kept = kept[:args.max_sentences]
    _check_enough(kept, args, f"{len(sentences)} sentences, {int(seen.sum())} of them in the pretraining text")
    report = {"sentences": len(sentences), "in_pretraining_text": int(seen.sum()), "kept": len(kept),
              "pretraining_data": [str(d) for d in data_dirs], "unchecked_models": unchecked}
    return kept, report


def _check_enough(sentences: list[str], args: argparse.Namespace, detail: str) -> None:
    if len(sentences) < MIN_SENTENCES:
        raise ConfigError(f"--text: {len(sentences)} usable sentences in {', '.join(map(str, args.text))} ({detail}; "
                          f"usable: {MIN_WORDS}-{MAX_WORDS} words, starting with a capital letter after . ! or ?); "
                          f"the tasks need at least {MIN_SENTENCES}: give more (or other) text")


def write_tasks(out: Path, sentences: list[str], args: argparse.Namespace, report: dict) -> dict[str, Path]:
    """``tasks/<task>.tsv`` for every task, and ``tasks.json``."""
    built, meaning = build_tasks(sentences, args.task_seed, args.tasks)
    (out / "tasks").mkdir(parents=True, exist_ok=True)
    paths = {}
    for task, examples in built.items():
        if len({e.label for e in examples}) < 2:
            raise ConfigError(f"--text: task {task} has {len(examples)} example(s) from {len(sentences)} sentences, "
                             "too few for two classes; give more text or leave the task out (--tasks)")
        paths[task] = out / "tasks" / f"{task}.tsv"
        paths[task].write_text("".join(f"{e.label}\t{e.text}\n" for e in examples), encoding="utf-8")
    summary = {"task_seed": args.task_seed, "overlap": report,
               "tasks": {t: {"examples": len(built[t]), "labels": meaning[t]} for t in built}}
    (out / "tasks.json").write_text(json.dumps(summary, indent=1) + "\n")
    return paths


def random_encoder(like: Encoder, seed: int, out: Path) -> Encoder:
    """``like``'s architecture with weights drawn from ``seed`` (as a fresh model is initialised), its tokenizer."""
    from distaff.train.model.deberta import DebertaForMaskedLM
    from distaff.train.run.model_folder import save_model_folder

    source = load_encoder(like.path, {}, "--model")
    torch.manual_seed(seed)
    folder = save_model_folder(DebertaForMaskedLM(source.config), out / f"random-seed-{seed}", tokenizer=None)
    return Encoder(RANDOM, folder, like.tokenizer or source.tokenizer_dir)


def few_labels(train: list[Example], n: int, seed: int) -> list[Example]:
    """``n`` training rows drawn with ``seed`` (in file order)."""
    chosen = np.sort(np.random.default_rng(seed).permutation(len(train))[:n])
    return [train[i] for i in chosen]


def _tsv(path: Path, examples: Sequence[Example]) -> Path:
    path.write_text("".join(f"{e.label}\t{e.text}\n" for e in examples), encoding="utf-8")
    return path


def finetune(encoder: Encoder, train_file: Path, dev_file: Path | None, labels: list[str] | None, run_dir: Path,
             seed: int, args: argparse.Namespace) -> dict:
    """``distaff finetune`` of ``encoder`` (one process, a fresh ``run_dir``) on the two files (no ``dev_file``: the
    dev rows as ``args.finetune_overrides`` say; no ``labels``: the training file's); its ``summary.json``."""
    dev = [f"data.dev={dev_file}", "data.dev_fraction=0"] if dev_file is not None else []
    command = [sys.executable, "-m", "distaff.train.finetune", "--config", str(args.finetune_config),
               f"model.init_from={encoder.path}", f"data.train={train_file}", *dev,
               *([f"data.labels={json.dumps(labels)}"] if labels is not None else []), f"run.seed={seed}",
               f"run.out_dir={run_dir}", "logging.progress_bar=false",
               *([f"data.tokenizer={encoder.tokenizer}"] if encoder.tokenizer else []), *args.finetune_overrides]
    shutil.rmtree(run_dir, ignore_errors=True)   # a run left from an earlier command would resume, not restart
    run_dir.mkdir(parents=True)
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as handle:
        code = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, check=False).returncode
    summary = run_dir / "summary.json"
    if code != 0 or not summary.is_file():
        tail = "\n    ".join(log.read_text(errors="replace").splitlines()[-15:])
        raise RunFailure(f"distaff finetune of {encoder.name} failed (exit {code}); {log} ends:\n    {tail}")
    return json.loads(summary.read_text())


def _row(method: str, arm: str, labels: int | str, task: str, seed: int, accuracy: float, **extra) -> dict:
    return {"method": method, "arm": arm, "labels": labels, "task": task, "seed": seed, "dev_accuracy": accuracy,
            **extra}


def finetune_rows(task: str, train: list[Example], dev: list[Example], labels: list[str], arms: Sequence[Encoder],
                  seed: int, args: argparse.Namespace, out: Path) -> list[dict]:
    """The bag of words and ``distaff finetune`` of every arm on each ``--finetune N`` rows of ``train``."""
    rows = []
    folder = out / "finetune" / task / f"seed-{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    dev_file = _tsv(folder / "dev.tsv", dev)
    for n in args.finetune:
        if n > len(train):
            print(f"  {task} has {len(train)} training rows: no fine-tuning on {n}", flush=True)
            continue
        subset = few_labels(train, n, seed)
        if args.bow:
            bow = fit_and_score(subset, dev, bag_of_words, 1e-4, seed, labels)
            rows.append(_row("bow", BOW, n, task, seed, bow.dev_accuracy))
        train_file = _tsv(folder / f"train-{n}.tsv", subset)
        for arm in arms:
            summary = finetune(arm, train_file, dev_file, labels, folder / f"{n}-{arm.name}", seed, args)
            rows.append(_row("finetune", arm.name, n, task, seed, summary["eval_accuracy"],
                             train_time_s=summary["train_time_s"], steps=summary["steps"]))
            print(f"  fine-tuned {arm.name} on {n} {task} labels, seed {seed}: {summary['eval_accuracy']:.3f}",
                  flush=True)
    return rows


def score_seed(seed: int, tasks: dict[str, Path], encoders: Sequence[Encoder], probes: dict, args: argparse.Namespace,
               out: Path) -> list[dict]:
    """Every row of one seed: probes of each encoder (and random weights), the bag of words, fine-tuning."""
    arms = list(encoders)
    if args.random:
        arms.append(random_encoder(encoders[0], seed, out / "random"))
        probes[RANDOM] = frozen_encoder(arms[-1].path, args.max_length, arms[-1].tokenizer, "--model")
    rows = []
    for task, path in tasks.items():
        examples = read_examples(path, BUNDLED_COLUMNS, regression=False)
        labels = sorted({e.label for e in examples}, key=int)
        train, dev = hold_out(examples, args.dev_fraction, seed)
        top = Counter(e.label for e in train).most_common(1)[0][0]
        rows.append(_row("majority", "majority class", "all", task, seed, sum(e.label == top for e in dev) / len(dev),
                         train=len(train), dev=len(dev)))
        if args.bow:
            bow = fit_and_score(train, dev, bag_of_words, 1e-4, seed, labels)
            rows.append(_row("bow", BOW, "all", task, seed, bow.dev_accuracy))
        for arm in arms:
            rows.append(_row("probe", arm.name, "all", task, seed,
                             fit_and_score(train, dev, probes[arm.name], PROBE_L2, seed, labels).dev_accuracy))
        print(f"  probes of {task}, seed {seed}: " + ", ".join(f"{r['arm']} {r['dev_accuracy']:.3f}" for r in rows
                                                              if r["task"] == task), flush=True)
        if task in args.finetune_tasks and args.finetune:
            rows += finetune_rows(task, train, dev, labels, arms, seed, args, out)
    return rows


def _stats(values: list[float]) -> dict:
    """Mean and standard deviation over seeds; one seed measures no deviation (``std`` None)."""
    return {"per_seed": values, "mean": statistics.mean(values),
            "std": statistics.stdev(values) if len(values) > 1 else None}


def summarise(rows: list[dict], encoders: Sequence[Encoder], random_arm: bool) -> dict:
    """Mean +- std over seeds per (method, arm, labels, task), and each encoder's paired per-seed difference
    against random weights with its mean / std ratio (the "standard deviations of the difference")."""
    groups: dict[tuple, dict[int, float]] = {}
    for row in rows:
        key = (row["method"], row["arm"], row["labels"], row["task"])
        groups.setdefault(key, {})[row["seed"]] = row["dev_accuracy"]
    table = [{"method": m, "arm": a, "labels": n, "task": t, "seeds": sorted(v), **_stats([v[s] for s in sorted(v)])}
             for (m, a, n, t), v in groups.items()]
    differences = []
    for (method, arm, n, task), values in groups.items():
        control = groups.get((method, RANDOM, n, task))
        if not random_arm or arm not in {e.name for e in encoders} or control is None:
            continue
        seeds = sorted(set(values) & set(control))
        diff = _stats([values[s] - control[s] for s in seeds])
        diff["std_ratio"] = diff["mean"] / diff["std"] if diff["std"] else None
        differences.append({"method": method, "arm": arm, "labels": n, "task": task, "seeds": seeds, **diff})
    return {"rows": table, "differences": differences}


def format_table(summary: dict, tasks: Sequence[str]) -> str:
    """The printed report: one line per (method, labels, arm), one column per task."""
    cells: dict[tuple, dict[str, dict]] = {}
    for row in summary["rows"]:
        cells.setdefault((row["method"], row["labels"], row["arm"]), {})[row["task"]] = row
    width = max([len(f"{m} {n} {a}") for m, n, a in cells] + [10]) + 2
    lines = [" " * width + "".join(f"{task:<28}" for task in tasks)]
    for (method, n, arm), by_task in cells.items():
        label = f"{method}{'' if n == 'all' else f' {n}'} {arm}" if method != "majority" else arm
        line = "".join(f"{_cell(by_task[t]):<28}" if t in by_task else " " * 28 for t in tasks)
        lines.append(f"{label:<{width}}{line}")
    for d in summary["differences"]:
        ratio = "" if d["std_ratio"] is None else f" = {d['std_ratio']:.1f} std"
        spread = (f"{d['mean']:+.3f} +- {d['std']:.3f}{ratio} (" + ", ".join(f"{v:+.3f}" for v in d["per_seed"])
                  + ")" if d["std"] is not None else f"{d['mean']:+.3f} (one seed)")
        lines.append(f"{d['method']}{'' if d['labels'] == 'all' else ' ' + str(d['labels'])} {d['arm']} - {RANDOM}, "
                     f"{d['task']}: {spread}")
    return "\n".join(lines)


def _cell(row: dict) -> str:
    return f"{row['mean']:.3f} +- {row['std']:.3f}" if row["std"] is not None else f"{row['mean']:.3f}"


def table_title(seeds: Sequence[int]) -> str:
    """What the cells hold: a deviation only where two or more seeds measured one."""
    return (f"mean +- std over seeds {list(seeds)}" if len(seeds) > 1 else
            f"seed {seeds[0]} alone (no deviation measured: --seeds 1 2 3 gives mean +- std)")


def parse_encoder(spec: str) -> Encoder:
    """``NAME=PATH``, or a ``PATH`` (its own name), which may itself hold an ``=``."""
    name, _, path = spec.partition("=")
    if Path(spec).exists() or not path:
        return Encoder(spec, Path(spec))
    return Encoder(name, Path(path))


def run(args: argparse.Namespace) -> dict:
    """Build the tasks, score every arm on every seed, write ``results.json``; the results."""
    start = time.time()
    encoders = [parse_encoder(spec) for spec in args.model]
    names = [e.name for e in encoders]
    if len(set(names)) != len(names) or {RANDOM, BOW} & set(names):
        raise ConfigError(f"--model names {names} must be distinct and not {RANDOM!r} or {BOW!r} (use NAME=PATH)")
    for encoder in encoders:
        if not encoder.path.exists():
            raise FileNotFoundError(f"--model {encoder.name}: {encoder.path} does not exist")
    check_apart_from_checkpoints(("--out", args.out), [(f"--model {e.name}", e.path) for e in encoders])
    check_apart(("--out", args.out), [*(("--text", path) for path in args.text),
                                      *(("--pretraining-data", path) for path in args.pretraining_data or ()),
                                      ("--finetune-config", args.finetune_config)])
    args.out.mkdir(parents=True, exist_ok=True)
    sentences, report = held_out_sentences(args, encoders)
    print(f"distaff probe: {report['kept']} sentences ({report['in_pretraining_text']} of {report['sentences']} "
          f"dropped: in the pretraining text of {report['pretraining_data'] or 'no known data dir'})"
          + (f"; overlap NOT checked for {report['unchecked_models']}" if report["unchecked_models"] else ""),
          flush=True)
    tasks = write_tasks(args.out, sentences, args, report)
    probes = {e.name: frozen_encoder(e.path, args.max_length, e.tokenizer, "--model") for e in encoders}
    rows = [row for seed in args.seeds for row in score_seed(seed, tasks, encoders, probes, args, args.out)]
    results = {"command": ["distaff", "probe", *args.argv], "seconds": round(time.time() - start, 1),
               "seeds": args.seeds, "dev_fraction": args.dev_fraction,
               **json.loads((args.out / "tasks.json").read_text()), **summarise(rows, encoders, args.random),
               "runs": rows}
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="distaff probe", description=__doc__.splitlines()[0])
    parser.add_argument("--text", type=Path, nargs="+", required=True,
                        help="where the sentences come from: .txt(.gz), .jsonl(.gz), .parquet, or a TSV/CSV column")
    parser.add_argument("--text-column", help="TSV/CSV: the text's header name or 0-based index; JSONL/parquet: field")
    parser.add_argument("--model", action="append", required=True, metavar="[NAME=]PATH",
                        help="an encoder to probe (repeatable): distaff run, checkpoint or model folder, or HF folder")
    parser.add_argument("--random", action="store_true", help="also the first model's architecture, random weights")
    parser.add_argument("--bow", action="store_true", help="also the bag-of-words baseline")
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--seeds", type=int_arg("--seeds", high=MAX_SEED), nargs="+", default=[1],
                        help="each: a dev split, random weights, a fine-tuning seed")
    parser.add_argument("--task-seed", type=int_arg("--task-seed", high=MAX_SEED),
                        default=0, help="seeds the tasks' construction")
    parser.add_argument("--dev-fraction",
                        type=float_arg("--dev-fraction", low=0, low_open=True, high=1, high_open=True),
                        default=0.2)
    parser.add_argument("--pretraining-data", nargs="+", metavar="DIR",
                        help="distaff data dirs whose train split is the pretraining text (default: each run's own)")
    parser.add_argument("--max-sentences", type=int_arg("--max-sentences", high=MAX_COUNT),
                        default=0, help="use only the first N held-out sentences")
    parser.add_argument("--max-length", type=int_arg("--max-length", low=MIN_SEQ_LEN, high=MAX_SEQ_LEN),
                        default=128, help="tokens per probed sentence")
    parser.add_argument("--finetune", type=int_arg("--finetune", low=2, high=MAX_COUNT),
                        nargs="+", default=[], metavar="N",
                        help="also fine-tune each encoder on N training rows (several N; skipped above a task's rows)")
    parser.add_argument("--finetune-tasks", nargs="+", choices=TASKS, default=["bshift"])
    parser.add_argument("--finetune-config", type=Path,
                        default=resources.files("distaff.configs") / "finetune" / "probe-cpu.yaml")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("finetune_overrides", nargs="*", metavar="key=value",
                        help="fine-tuning config overrides (after --)")
    args = document_ranges(parser).parse_intermixed_args(argv)      # options may follow the overrides
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    return command_main("distaff probe", _main, argv)


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    configure_threads()
    results = run(args)
    print(f"\n== dev accuracy, {table_title(results['seeds'])} ({results['seconds']:.0f} s; "
          f"{args.out / 'results.json'})\n" + format_table(results, args.tasks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
