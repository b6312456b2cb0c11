"""Rank-0 metrics: a stdout line, ``metrics.jsonl``, W&B, a progress bar, and a PNG plot at the end; every
rank's clock of where a step's time goes (:class:`StageClock`).

W&B is best effort: any failure (no network, bad credentials, a crash inside wandb) is logged
once and the sink switches itself off; training never stops because of it. The JSONL file and
the plot carry the same numbers for people without W&B.
"""

from __future__ import annotations

import json
import math
import platform
import socket
import sys
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from distaff.train.core.files import WHOLE, append_record, atomic_write_text, read_records
from distaff.train.model.flops import mfu
from distaff.train.run.config import WandbSection

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"
TENSORBOARD_DIR = "tensorboard"


def warn(message: str) -> None:
    print(f"distaff: warning: {message}", file=sys.stderr, flush=True)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (none when there is none), each with a whole-number ``step``; a line that
    is not one (torn by a crash, edited by hand) is passed over and reported once with its line number."""
    return read_records(path, {"step": WHOLE}, "metrics records")


def numbers(record: dict[str, Any], *keys: str) -> bool:
    """Whether ``record`` holds a number (not a bool) under each of ``keys``."""
    return all(isinstance(record.get(key), (int, float)) and not isinstance(record.get(key), bool) for key in keys)


def system_info(world_size: int) -> dict[str, Any]:
    import deepspeed

    info = {"hostname": socket.gethostname(), "python": platform.python_version(), "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "world_size": world_size, "cuda": torch.cuda.is_available(),
            "threads_per_rank": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    else:
        info["device"] = platform.processor() or platform.machine()
    return info


# W&B sections: the run page groups charts by the prefix before "/". metrics.jsonl and stdout keep the flat
# names, which plots, the ablation report and users' scripts read. Keys not listed here: ``eval_*`` -> eval/,
# RTD's ``gen_*``/``rtd_*``/``weight_*``/``replaced_rate`` -> rtd/, the rest (loss, accuracy) -> train/.
WANDB_SECTIONS = {
    "progress": ("step", "tokens_seen", "epoch", "tokens_by_source", "global_batch", "phase", "phase_change"),
    "optim": ("lr", "grad_norm", "loss_scale", "nonfinite_steps"),
    "perf": ("tokens_per_s", "tokens_per_s_per_device", "samples_per_s", "samples_per_s_per_device",
             "padding_fraction", "step_time_s", "mfu", "eta_s", "peak_mem_gb", "step_cpu_s", "evals_inline_s",
             *(f"{stage}{clock}_s" for stage in ("data_wait", "forward", "backward", "grad_comm", "optimizer", "other",
                                                 "checkpoint") for clock in ("", "_cpu"))),
}
WANDB_STEP, WANDB_TOKENS = "progress/step", "progress/tokens_seen"
WANDB_CHARTED = ("train", "eval", "rtd", "optim", "perf")     # sections charted against the step


def wandb_key(key: str) -> str:
    """The sectioned W&B name of a flat metric key (``eval_loss`` -> ``eval/loss``, ``lr`` -> ``optim/lr``)."""
    if key.startswith("eval_"):
        return f"eval/{key[len('eval_'):]}"
    for section, keys in WANDB_SECTIONS.items():
        if key in keys:
            return f"{section}/{key}"
    if key.startswith("rtd_"):
        return f"rtd/{key[len('rtd_'):]}"
    if key.startswith(("gen_", "weight_")) or key == "replaced_rate":
        return f"rtd/{key}"
    return f"train/{key}"


def wandb_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """``summary.json`` for the W&B run summary: the final held-out numbers under eval/ (where the charts'
    last values are) with the baseline and the best dev checkpoint beside them, the run's totals under run/."""
    def key(name: str) -> str:
        if name.startswith("eval_"):
            return wandb_key(name)
        return f"eval/{name}" if name.startswith("best_") or name.endswith("baseline_accuracy") else f"run/{name}"

    return {key(name): value for name, value in summary.items() if value is not None}


class WandbSink:
    """A W&B run on rank 0 that resumes by id and never raises; metrics go in sections (:func:`wandb_key`),
    charted against the optimizer step (``progress/step``; ``progress/tokens_seen`` is the other x-axis).

    ``writer`` names a second writer of the run (an evaluation of its checkpoints, train/tools/evals/): online, it
    joins the run in W&B's shared mode (several processes write one run; it leaves the run's state alone)."""

    def __init__(self, cfg: WandbSection, *, run_name: str, out_dir: Path, run_id: str, config: dict[str, Any],
                 writer: str = ""):
        self.run = None
        if cfg.mode == "disabled":
            return
        try:
            import wandb

            mode, shared = cfg.mode, {}
            if writer and cfg.mode == "online":
                mode, shared = "shared", {"x_primary": False, "x_label": writer, "x_update_finish_state": False}
            self.run = wandb.init(project=cfg.project, name=cfg.name or run_name, group=cfg.group or None,
                                  tags=cfg.tags or None, mode=mode, dir=str(out_dir), id=run_id,
                                  resume=None if shared else "allow", config=config,
                                  settings=wandb.Settings(init_timeout=90, console="off", silent=True, **shared))
            self.run.define_metric(WANDB_STEP)
            self.run.define_metric(WANDB_TOKENS, step_metric=WANDB_STEP)
            for section in WANDB_CHARTED:
                self.run.define_metric(f"{section}/*", step_metric=WANDB_STEP)
        except Exception as err:  # noqa: BLE001 - W&B must never stop training
            warn(f"W&B disabled: wandb.init failed: {type(err).__name__}: {err}")
            self.run = None

    def log(self, record: dict[str, Any], step: int | None) -> None:
        """``record`` at W&B step ``step`` (None: the run's next step, for a row charted by its own
        ``progress/step``, as an evaluation of an earlier checkpoint is)."""
        if self.run is None:
            return
        try:
            self.run.log({wandb_key(k): v for k, v in record.items() if v is not None}, step=step)
        except Exception as err:  # noqa: BLE001
            warn(f"W&B disabled: wandb.log failed: {type(err).__name__}: {err}")
            self.run = None

    def summary(self, values: dict[str, Any]) -> None:
        if self.run is None:
            return
        try:
            self.run.summary.update(wandb_summary(values))
        except Exception as err:  # noqa: BLE001
            warn(f"W&B summary failed: {type(err).__name__}: {err}")

    def finish(self, exit_code: int) -> None:
        if self.run is None:
            return
        try:
            self.run.finish(exit_code=exit_code)
        except Exception as err:  # noqa: BLE001
            warn(f"W&B finish failed: {type(err).__name__}: {err}")
        self.run = None


def _flat(record: dict[str, Any]) -> dict[str, Any]:
    """A mapping's values under ``key/name``, as W&B nests them (``tokens_by_source``: one chart per source)."""
    flat: dict[str, Any] = {}
    for key, value in record.items():
        flat.update({f"{key}/{name}": v for name, v in value.items()} if isinstance(value, dict) else {key: value})
    return flat


class TensorBoardSink:
    """TensorBoard event files in ``<out_dir>/tensorboard`` on rank 0, in W&B's sections (:func:`wandb_key`)
    against the optimizer step; like W&B, a failure disables it and never stops training."""

    def __init__(self, out_dir: Path):
        from torch.utils.tensorboard import SummaryWriter     # needs the tensorboard package (checked by config)

        self.writer = SummaryWriter(log_dir=str(out_dir / TENSORBOARD_DIR))
        self.step = 0

    def _write(self, scalars: dict[str, Any], step: int) -> None:
        if self.writer is None:
            return
        try:
            for tag, value in _flat(scalars).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(tag, value, step)
            self.writer.flush()
        except Exception as err:  # noqa: BLE001 - logging must never stop training
            warn(f"TensorBoard disabled: {type(err).__name__}: {err}")
            self.writer = None

    def log(self, record: dict[str, Any], step: int) -> None:
        self.step = step
        self._write({wandb_key(k): v for k, v in record.items() if k != "step"}, step)

    def summary(self, values: dict[str, Any]) -> None:
        """At the last step: the run's totals (run/), the baseline and the best dev checkpoint (eval/); the final
        held-out numbers are already there as the last evaluation."""
        final = wandb_summary(values)
        self._write({k: v for k, v in final.items() if not k.startswith("eval/") or "baseline" in k or "best" in k},
                    self.step)

    def finish(self, exit_code: int) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


# (key, label) of the objective's metrics a line shows when the record has them (MLM or RTD).
QUALITY_KEYS = (("loss", "loss"), ("accuracy", "acc"), ("gen_loss", "gen"), ("gen_accuracy", "gen acc"),
                ("rtd_loss", "rtd"), ("rtd_accuracy", "rtd acc"), ("rtd_auc", "auc"), ("replaced_rate", "replaced"),
                ("f1", "f1"), ("mcc", "mcc"), ("pearson", "pearson"), ("spearman", "spearman"))


def _quality(record: dict[str, Any], prefix: str) -> list[str]:
    return [f"{label} {record[prefix + key]:.4f}" for key, label in QUALITY_KEYS
            if record.get(prefix + key) is not None]


def format_line(record: dict[str, Any], max_steps: int) -> str:
    """One human-readable line for a train, eval or phase-switch record."""
    if "phase_change" in record:
        return f"step {record['step']}: phase {record['phase']} begins: {record['phase_change']}"
    if "eval_loss" in record:
        parts = [f"eval step {record['step']}", *_quality(record, "eval_")]
        if "eval_perplexity" in record:  # pretraining
            parts += [f"ppl {record['eval_perplexity']:.2f}", f"{record['eval_tokens']} tokens"]
        return " | ".join(parts)
    parts = [f"step {record['step']}/{max_steps}", *_quality(record, ""), f"lr {record['lr']:.2e}"]
    if record.get("grad_norm") is not None:
        parts.append(f"gnorm {record['grad_norm']:.3f}")
    if record.get("loss_scale") is not None:
        parts.append(f"scale {record['loss_scale']:g}")
    parts.append(f"tok/s {record['tokens_per_s']:.0f} ({record['tokens_per_s_per_device']:.0f}/dev)")
    parts.append(f"samples/s {record['samples_per_s']:.1f}")
    if record.get("padding_fraction") is not None:
        parts.append(f"pad {100 * record['padding_fraction']:.1f}%")
    if record.get("mfu") is not None:
        parts.append(f"mfu {100 * record['mfu']:.1f}%")
    parts.append(f"mem {record['peak_mem_gb']:.2f} GB")
    if record.get("evals_inline_s"):
        parts.append(f"evals {record['evals_inline_s']:.1f}s")
    parts.append(f"eta {_format_duration(record['eta_s'])}")
    return " | ".join(parts)


class MetricsLogger:
    """Rank 0 writes; other ranks hold an inert logger so call sites need no rank checks."""

    def __init__(self, out_dir: Path, *, enabled: bool, max_steps: int, start_step: int, progress_bar: bool,
                 sinks: list[WandbSink | TensorBoardSink] = ()):
        self.enabled = enabled
        self.max_steps = max_steps
        self.path = out_dir / METRICS_FILE
        self.sinks = list(sinks)
        self.bar = None
        if not enabled:
            return
        self._truncate_after(start_step)
        if progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=max_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def _truncate_after(self, step: int) -> None:
        """Drop records past the resumed step (written after the checkpoint by the interrupted run), and a line it
        tore when it stopped (counted, reported)."""
        if not self.path.exists():
            return
        kept = [record for record in read_metrics(self.path) if record["step"] <= step]
        atomic_write_text(self.path, "".join(json.dumps(record) + "\n" for record in kept))

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        line = format_line(record, self.max_steps)
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)
        append_record(self.path, record, durable=False)    # a whole line or, on a full disk, none
        for sink in self.sinks:
            sink.log(record, step=record["step"])

    def advance(self, step: int) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class Throughput:
    """Real tokens/s, samples/s, the padding fraction and ETA over the steps since the last report."""

    def __init__(self, world_size: int, flops_per_token: float, peak_flops: float | None):
        self.world_size = world_size
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.reset()

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.samples = 0
        self.positions = 0
        self.steps = 0
        self.paused_s = 0.0

    def add(self, tokens: int, samples: int, positions: int) -> None:
        """Global real tokens, samples and computed positions (padding included) of one optimizer step."""
        self.tokens += tokens
        self.samples += samples
        self.positions += positions
        self.steps += 1

    def exclude(self, seconds: float) -> None:
        """``seconds`` since the last report were no training (an evaluation between two steps): they are left out
        of the rates, the step time and the ETA, which would otherwise spread the pause over the window's steps."""
        self.paused_s += seconds

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The block's time is no training (see :meth:`exclude`)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.exclude(time.perf_counter() - started)

    def report(self, steps_left: int) -> dict[str, Any]:
        elapsed = max(time.perf_counter() - self.t0 - self.paused_s, 1e-9)
        tokens_per_s = self.tokens / elapsed
        per_device = tokens_per_s / self.world_size
        report = {"tokens_per_s": tokens_per_s, "tokens_per_s_per_device": per_device,
                  "samples_per_s": self.samples / elapsed, "samples_per_s_per_device": self.samples / elapsed / self.world_size,
                  "padding_fraction": padding_fraction(self.tokens, self.positions),
                  "step_time_s": elapsed / max(self.steps, 1), "mfu": mfu(per_device, self.flops_per_token, self.peak_flops),
                  "eta_s": steps_left * elapsed / max(self.steps, 1)}
        self.reset()
        return report


def peak_memory_gb() -> float:
    """Peak CUDA memory allocated on this device, or the process's peak resident set on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# (title, keys): what each panel shows, for whichever keys the run logged (MLM, RTD or fine-tuning).
PLOT_PANELS = (("loss", ("loss", "gen_loss", "rtd_loss")),
               ("accuracy", ("accuracy", "gen_accuracy", "rtd_accuracy", "rtd_auc", "f1", "mcc", "pearson", "spearman")),
               ("learning rate", ("lr",)),
               ("gradient norm", ("grad_norm",)),
               ("tokens/s (all ranks)", ("tokens_per_s",)))
PLOT_COLUMNS = 3


def _plot_series(ax, key: str, train: list[dict], evals: list[dict]) -> bool:
    """``key`` from the train records and ``eval_<key>`` from the evaluations, where logged; whether any was."""
    color = None
    points = [(r["step"], r[key]) for r in train if numbers(r, key)]
    if points:
        color = ax.plot(*zip(*points), label=key, linewidth=1)[0].get_color()
    held = [(r["step"], r[f"eval_{key}"]) for r in evals if numbers(r, f"eval_{key}")]
    if held:
        ax.plot(*zip(*held), "o--", color=color, label=f"held-out {key}")
    return bool(points or held)


def _draw_panel(ax, title: str, keys: tuple[str, ...], train: list[dict], evals: list[dict],
                baseline: float | None) -> None:
    drawn = [_plot_series(ax, key, train, evals) for key in keys]
    if title == "accuracy" and baseline is not None:
        ax.axhline(baseline, color="grey", linestyle=":", label=f"unigram baseline {baseline:.3f}")
    if not any(drawn):
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if title == "learning rate":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def plot_metrics(jsonl_path: Path, png_path: Path, baseline: float | None = None) -> Path | None:
    """Loss, accuracy (MLM, or generator and discriminator with RTD; with ``baseline``, the unigram-frequency
    accuracy, as a line), learning rate, gradient norm and tokens/s against steps (train and held-out) as a
    PNG; None if nothing was logged."""
    records = read_metrics(jsonl_path)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    if not train and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = -(-len(PLOT_PANELS) // PLOT_COLUMNS)
    fig, axes = plt.subplots(rows, PLOT_COLUMNS, figsize=(5 * PLOT_COLUMNS, 3.6 * rows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, PLOT_PANELS):
        _draw_panel(ax, title, keys, train, evals, baseline)
    for ax in list(axes.flat)[len(PLOT_PANELS):]:
        ax.axis("off")
    return save_figure(fig, png_path)


def save_figure(fig, path: Path) -> Path:
    """Write a matplotlib figure as a PNG and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def padding_fraction(tokens: int, positions: int) -> float | None:
    """The share of computed token positions that were padding (None before any step)."""
    return 1.0 - tokens / positions if positions else None


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 50 else float("inf")


# ---------------------------------------------------------------- the step's stages

# Where a training step's time goes, without a host sync: data wait, forward, backward, gradient
# communication, optimizer step, the rest of the step, and checkpoint saves.
#
# The step marks each boundary with :meth:`StageClock.lap` (the time since the previous mark belongs to the
# stage named). On CPU ranks every op runs synchronously, so the wall clock is the stage's time. On GPUs a mark
# records a CUDA event on the current stream and the host moves on; a step's events are read when the next
# step ends (by then they have completed: ``query()`` says so without waiting), so no mark ever blocks the host.
# The data wait is the host's wait for the loader in both cases. On CPU ranks the process's CPU time is kept
# beside the wall clock (``step_cpu_s``): on a machine other processes share, the wall clock says how long the
# step took and the CPU time what it cost. The gradient reduction runs inside DeepSpeed's
# ``engine.backward`` (its epilogue calls ``engine.allreduce_gradients`` at every ZeRO stage, engine.py:3165):
# :meth:`watch_reduction` wraps that method so it is a stage of its own. Checkpoint saves are timed on the host
# (they are synchronous) and spread over the steps of the reporting interval.

CLOCK_STAGES = ("data_wait", "forward", "backward", "grad_comm", "optimizer", "other", "checkpoint")
HOST_STAGES = ("data_wait", "checkpoint")


class _Sums:
    """Seconds by stage and the steps they cover, per clock (host, GPU events)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(CLOCK_STAGES, 0.0)
        self.cpu_seconds = dict.fromkeys(CLOCK_STAGES, 0.0)     # CPU ranks: the process's CPU time
        self.steps = {"host": 0, "events": 0}

    def means(self, events: bool) -> dict[str, float]:
        def steps(stage: str) -> int:
            return max(1, self.steps["events" if events and stage not in HOST_STAGES else "host"])

        return {stage: value / steps(stage) for stage, value in self.seconds.items()}


class StageClock:
    """Seconds per step by stage, averaged over the steps since the last :meth:`report`, and over the steps
    since the run's second (the first pays for warm-up)."""

    def __init__(self, device: torch.device):
        self.events = device.type == "cuda"
        self.pending: deque[tuple[int, list[tuple[str, Any]]]] = deque()   # GPU steps not read yet
        self.marks: list[tuple[str, Any]] = []
        self.last_host = self.last_cpu = 0.0
        self.steps = 0
        self.interval, self.steady = _Sums(), _Sums()

    def start(self) -> None:
        self.last_host, self.last_cpu = time.perf_counter(), time.process_time()
        self.marks = [("start", self._event())]

    def _event(self):
        if not self.events:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def lap(self, stage: str) -> None:
        """The time since the previous mark belongs to ``stage``."""
        now, cpu = time.perf_counter(), time.process_time()
        if stage in HOST_STAGES or not self.events:
            self._add(stage, now - self.last_host, self.steps, cpu - self.last_cpu)
        else:
            self.marks.append((stage, self._event()))
        self.last_host, self.last_cpu = now, cpu

    def add_host(self, stage: str, seconds: float) -> None:
        """Host seconds spent outside a step (a checkpoint save after it)."""
        self._add(stage, seconds, self.steps)

    def finish(self) -> None:
        """The step is over: count it, and read every earlier step whose events have completed."""
        self._count("host", self.steps)
        if self.events:
            self.pending.append((self.steps, self.marks))
            while self.pending and self.pending[0][1][-1][1].query():
                step, marks = self.pending.popleft()
                for (_, before), (stage, after) in zip(marks, marks[1:]):
                    self._add(stage, before.elapsed_time(after) / 1e3, step)
                self._count("events", step)
        self.steps += 1

    def _add(self, stage: str, seconds: float, step: int, cpu: float = 0.0) -> None:
        for sums in (self.interval, self.steady) if step >= 1 else (self.interval,):
            sums.seconds[stage] += seconds
            sums.cpu_seconds[stage] += cpu

    def _count(self, clock: str, step: int) -> None:
        self.interval.steps[clock] += 1
        if step >= 1:
            self.steady.steps[clock] += 1

    def report(self) -> dict[str, float]:
        """``<stage>_s``: seconds per step of each stage since the last report; on CPU ranks also
        ``<stage>_cpu_s`` and ``step_cpu_s``, the CPU seconds per step of this rank's process (well below the wall
        clock's when other processes share its cores)."""
        found = {f"{stage}_s": value for stage, value in self.interval.means(self.events).items()}
        if not self.events:
            steps = max(1, self.interval.steps["host"])
            found.update({f"{stage}_cpu_s": value / steps for stage, value in self.interval.cpu_seconds.items()})
            found["step_cpu_s"] = sum(self.interval.cpu_seconds.values()) / steps
        self.interval = _Sums()
        return found

    def steady_cpu_means(self) -> dict[str, float]:
        """CPU ranks: the process's CPU seconds per step of each stage since the second step."""
        return {stage: value / max(1, self.steady.steps["host"]) for stage, value in self.steady.cpu_seconds.items()}

    def steady_means(self) -> dict[str, float]:
        """Seconds per step of each stage since the second step (the first one pays for warm-up)."""
        return self.steady.means(self.events)

    def watch_reduction(self, engine) -> None:
        """Time DeepSpeed's gradient reduction (``engine.allreduce_gradients``, called by ``engine.backward``'s
        epilogue at every ZeRO stage) as the stage ``grad_comm``, apart from the backward around it."""
        reduce = engine.allreduce_gradients

        def timed(*args, **kwargs):
            self.lap("backward")
            try:
                return reduce(*args, **kwargs)
            finally:
                self.lap("grad_comm")

        engine.allreduce_gradients = timed

    def watch_saves(self, checkpointer) -> None:
        """Time the checkpointer's saves (host seconds: a save waits for its copies) as the stage ``checkpoint``."""
        save = checkpointer.save

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return save(*args, **kwargs)
            finally:
                self.add_host("checkpoint", time.perf_counter() - started)

        checkpointer.save = timed


class NoClock(StageClock):
    """A clock that records nothing (callers that time no stages)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))

    def lap(self, stage: str) -> None:
        pass


NO_CLOCK = NoClock()
