"""``distaff average CKPT... --out DIR``: the weighted average of checkpoints' weights, written as a checkpoint.

CKPT is a checkpoint folder, or a run directory / ``checkpoints`` folder, which stands for every complete
checkpoint in it; ``--last K`` keeps the newest K of all that were named (by step). The weights are averaged
uniformly, or with ``--ema DECAY`` exponentially: the newest checkpoint weighs 1, the one before it DECAY, the one
before that DECAY^2 ..., normalised to sum 1 (an exponential moving average taken at the checkpoints).

The output is a checkpoint like any other (train/run/checkpoint.py): the newest source's DeepSpeed files with every
copy of the weights averaged in place (the module's weights, and the fp32 master weights of ZeRO 1-3, bf16 and
fp16 optimizers, however they are partitioned), its optimizer moments, step, data position and random states
unchanged, its tokenizer, a ``files.json`` and a ``meta.json`` naming the sources and their weights
(``averaged_from``). It resumes (``checkpoint.resume=DIR``: training continues from the newest source's step and
optimizer state with the averaged weights, as a new W&B run), fine-tunes (``model.init_from=DIR``) and exports
(``distaff export-hf DIR OUT``) like any checkpoint. Sources must be of one architecture, tokenizer, objective,
ZeRO stage, precision and world size (their files are averaged tensor by tensor); any difference is a one-line
error. Every file is read with the restricted unpickler (train/core/safe_load.py). ``--eval`` prints the held-out
figures of the average and of the newest source alone (train/tools/checkpoint_eval.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distaff.train.core.errors import MAX_COUNT, ConfigError, command_main, document_ranges, float_arg, int_arg, shown
from distaff.train.core.files import atomic_write_text, check_apart, check_out_dir, file_sha256, replaced_folder
from distaff.train.core.safe_load import safe_load
from distaff.train.core.threads import configure_threads
from distaff.train.data.errors import DataError
from distaff.train.run.checkpoint_files import (FILES, FORMAT_WITH_META_LISTED, META, check_apart_from_checkpoints,
                                               checkpoint_problem, is_complete, read_meta, write_file_list)
from distaff.train.run.resume_check import RESUME_FREE_MODEL_FIELDS

# Where DeepSpeed keeps full-precision copies of the weights, in a model-states or optimizer-states file: ZeRO 1-2 and
# the bf16 optimizer, ZeRO-3, the fused and the unfused fp16 optimizers.
MASTER_WEIGHTS = ("single_partition_of_fp32_groups", "fp32_flat_groups", "fp32_groups_flat", "fp32_groups")
DERIVED = ("universal", ".partial-universal")        # a resized resume's conversions, not part of the checkpoint


@dataclass(frozen=True)
class Source:
    folder: Path
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def checkpoints_in(path: Path) -> list[Path]:
    """``path`` itself if it is a checkpoint, else every complete checkpoint of the run or checkpoints folder."""
    if is_complete(path):
        return [path]
    for root in (path / "checkpoints", path):
        found = sorted(p for p in root.glob("step-*") if is_complete(p))
        if found:
            return found
    raise FileNotFoundError(f"{path}: no complete checkpoint here (a folder with {META}, or a run or checkpoints "
                            "folder holding some)")


def gather(paths: list[str], last: int = 0) -> list[Source]:
    """The checkpoints the paths name, oldest first by step (the newest ``last`` when given), each verified."""
    folders = [folder.resolve() for path in paths for folder in checkpoints_in(Path(path))]
    twice = sorted({str(f) for f in folders if folders.count(f) > 1})
    if twice:
        raise ConfigError(f"{twice[0]}: named twice; name each checkpoint once")
    sources = sorted((Source(f, read_meta(f)) for f in folders), key=lambda s: s.step)
    sources = sources[-last:] if last else sources
    for source in sources:
        problem = checkpoint_problem(source.folder)
        if problem:
            raise DataError(f"{source.folder}: damaged checkpoint: {problem}; leave it out")
    return sources


def average_weights(count: int, ema: float = 0.0) -> list[float]:
    """Each source's weight, oldest first: uniform, or ``ema ** age`` normalised (age 0: the newest)."""
    raw = [ema ** (count - 1 - i) for i in range(count)] if ema else [1.0] * count
    return [w / sum(raw) for w in raw]


# ---------------------------------------------------------------- what must agree

def identity(meta: dict[str, Any]) -> dict[str, Any]:
    """What two checkpoints must share for their files to average tensor by tensor, as flat ``key: value``."""
    config = meta.get("config", {})
    model = {f"model.{k}": v for k, v in meta.get("model_config", {}).items() if k not in RESUME_FREE_MODEL_FIELDS}
    generator = {f"rtd.generator.{k}": v for k, v in (meta.get("generator_config") or {}).items()
                 if k not in RESUME_FREE_MODEL_FIELDS}
    return {"task": meta.get("task", "pretraining"), "train.objective": config.get("train", {}).get("objective"),
            "num_labels": meta.get("num_labels"), "rtd.embedding_sharing": config.get("rtd", {}).get("embedding_sharing"),
            "zero.stage": config.get("zero", {}).get("stage"), "train.precision": config.get("train", {}).get("precision"),
            "world_size": meta.get("world_size"), **model, **generator}


def tokenizer_files(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): file_sha256(p) for p in sorted((folder / "tokenizer").rglob("*"))
            if p.is_file()}


def check_compatible(sources: list[Source]) -> None:
    """Every source against the newest: architecture, objective, partitioning, tokenizer and DeepSpeed files."""
    newest = sources[-1]
    want, tokenizer, files = identity(newest.meta), tokenizer_files(newest.folder), deepspeed_files(newest.folder)
    for source in sources[:-1]:
        have = identity(source.meta)
        changed = [key for key in want if have.get(key) != want[key]]
        if changed:
            key = changed[0]
            raise ConfigError(f"{source.folder}: {key} {shown(have.get(key))}, but {shown(want[key])} in "
                              f"{newest.folder}: checkpoints of different architectures, objectives or partitionings "
                              "cannot be averaged")
        if tokenizer_files(source.folder) != tokenizer:
            raise ConfigError(f"{source.folder}: its tokenizer differs from {newest.folder}'s: checkpoints of different "
                              "tokenizers cannot be averaged")
        if deepspeed_files(source.folder) != files:
            raise ConfigError(f"{source.folder}: its DeepSpeed files ({', '.join(deepspeed_files(source.folder))}) differ "
                              f"from {newest.folder}'s; average checkpoints of one run layout")


def deepspeed_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.pt"))


# ---------------------------------------------------------------- averaging the files

def weighted(tensors: list[Any], weights: list[float], where: str) -> Any:
    """The weighted sum of matching tensors (or nested lists of them), in float64, cast back to their dtype."""
    first = tensors[0]
    if isinstance(first, (list, tuple)):
        if any(len(t) != len(first) for t in tensors):
            raise DataError(f"{where}: the checkpoints hold different numbers of weight groups; they cannot be averaged")
        return type(first)(weighted([t[i] for t in tensors], weights, f"{where}[{i}]") for i in range(len(first)))
    if not torch.is_tensor(first) or not first.is_floating_point():
        return tensors[-1]
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) > 1:
        raise ConfigError(f"{where}: shapes {sorted(shapes)} differ between the checkpoints: checkpoints of different "
                          "shapes cannot be averaged")
    total = sum(w * t.double() for w, t in zip(weights, tensors))
    return total.to(first.dtype)


def weight_containers(state: dict[str, Any]) -> list[tuple[str, dict[str, Any], list[str]]]:
    """(name, dict, keys) of every place a DeepSpeed file keeps weights: the module, and master copies in an
    optimizer's state (in the model-states file at ZeRO-0, in the optimizer-states files otherwise)."""
    found = []
    if isinstance(state.get("module"), dict):
        found.append(("module", state["module"], list(state["module"])))
    for name in ("optimizer", "optimizer_state_dict"):
        inner = state.get(name)
        if isinstance(inner, dict):
            found.append((name, inner, [key for key in MASTER_WEIGHTS if key in inner]))
    return found


def average_file(files: list[Path], weights: list[float]) -> dict[str, Any]:
    """One DeepSpeed file of the newest source (the last of ``files``) with its weights replaced by the average."""
    states = [safe_load(path) for path in files]
    out = states[-1]
    for name, container, keys in weight_containers(out):
        for key in keys:
            where = f"{files[-1].name}: {name}.{key}"
            container[key] = weighted([state[name][key] for state in states], weights, where)
    return out


def write_average(sources: list[Source], weights: list[float], out: Path, method: str) -> Path:
    """The averaged checkpoint in ``out`` (written whole beside it, then moved in place), verified."""
    newest = sources[-1]
    with replaced_folder(out) as fresh:
        shutil.copytree(newest.folder, fresh, dirs_exist_ok=True,
                        ignore=lambda folder, names: [n for n in names if n in DERIVED or n.endswith(".pt")])
        for stale in (fresh / FILES, fresh / META):
            stale.unlink(missing_ok=True)
        for name in deepspeed_files(newest.folder):
            torch.save(average_file([s.folder / name for s in sources], weights), fresh / name)
        meta = {**newest.meta, "format": FORMAT_WITH_META_LISTED, "averaging": method,
                "averaged_from": [{"checkpoint": str(s.folder), "step": s.step, "weight": w}
                                  for s, w in zip(sources, weights)],
                "train_state": {**newest.meta.get("train_state", {}), "wandb_run_id": None}}
        atomic_write_text(fresh / META, json.dumps(meta, indent=1))
        write_file_list(fresh)      # last: it lists meta.json too
    problem = checkpoint_problem(out)
    if problem:
        raise DataError(f"{out}: the average did not verify ({problem})")
    return out


def average(paths: list[str], out: str | Path, last: int = 0, ema: float = 0.0, overwrite: bool = False) -> Path:
    """Average the checkpoints ``paths`` name into the checkpoint folder ``out``; returns ``out``."""
    if last < 0:
        raise ConfigError(f"--last {last}: must be a positive number of checkpoints")
    if ema and not 0.0 < ema < 1.0:
        raise ConfigError(f"--ema {ema}: the decay must be between 0 and 1 (0.5: each older checkpoint weighs half)")
    check_apart_from_checkpoints(("--out", out), [("checkpoint", path) for path in paths])
    check_out_dir(Path(out), overwrite, "--out")
    sources = gather(paths, last)
    # each source resolved, a checkpoint linked in from elsewhere included
    check_apart(("--out", out), [("checkpoint", source.folder) for source in sources])
    check_compatible(sources)
    method = f"ema {ema}" if ema else "uniform"
    return write_average(sources, average_weights(len(sources), ema), Path(out), method)


# ---------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> int:
    return command_main("distaff average", _main, argv)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="distaff average", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+", help="checkpoint folders, or run / checkpoints folders (all of theirs)")
    parser.add_argument("--out", required=True, help="the averaged checkpoint's folder")
    parser.add_argument("--last", type=int_arg("--last", high=MAX_COUNT),
                        default=0, help="only the newest K of the checkpoints named (by step)")
    parser.add_argument("--ema", type=float_arg("--ema", low=0, high=1, high_open=True), default=0.0, metavar="DECAY",
                        help="exponential weights: the newest 1, the one before DECAY, then DECAY^2 ... (default: uniform)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it already holds files")
    parser.add_argument("--eval", action="store_true",
                        help="print the held-out figures of the average and of the newest checkpoint alone")
    parser.add_argument("--eval-batches", type=int_arg("--eval-batches", high=MAX_COUNT),
                        default=0, help="held-out batches to score (0: the whole split)")
    args = document_ranges(parser).parse_args(argv)
    configure_threads(announce=False)
    out = average(args.checkpoints, args.out, args.last, args.ema, args.overwrite)
    meta = read_meta(out)
    steps = ", ".join(str(s["step"]) for s in meta["averaged_from"])
    print(f"distaff average: wrote {out}: {meta['averaging']} average of {len(meta['averaged_from'])} checkpoint(s) "
          f"(steps {steps}); resume it (checkpoint.resume={out}), fine-tune it (model.init_from={out}) or export it "
          f"(distaff export-hf {out} OUT)")
    if args.eval:
        from distaff.train.tools.checkpoint_eval import heldout_metrics, metrics_line

        newest = Path(meta["averaged_from"][-1]["checkpoint"])
        print(f"  average: {metrics_line(heldout_metrics(out, args.eval_batches))}\n"
              f"  {newest.name} alone: {metrics_line(heldout_metrics(newest, args.eval_batches))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
