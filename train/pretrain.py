"""Pretraining (MLM or RTD, ``train.objective``) under DeepSpeed: ``python -m distaff.train.pretrain --config RUN.yaml [key=value ...]``.

Run under the ``deepspeed`` launcher, ``torchrun`` or ``srun``; rank and world size come from the
environment. Data flows one way: config -> data stream -> model -> engine -> checkpoints/metrics.
:class:`Trainer` builds the stateful components (data loader, RNGs, counters, engine), runs the
loop and closes the run. On SIGTERM or SIGUSR1 every rank finishes the current step, a checkpoint
is saved and the process exits with :data:`EXIT_PREEMPTED` (75); ``checkpoint.resume=auto``
continues from there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import secrets
import signal
import string
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from . import distributed as dist_utils
from .checkpoint import Checkpointer, RNGState, latest_checkpoint
from .config import ConfigError, RunConfig, config_to_dict, load_config, save_config
from .data.loader import EvalLoader, PretrainLoader, open_data_dir
from .data.manifest import Manifest
from .engine import initialize, loss_scale, set_lr
from .exit_codes import EXIT_BAD_CONFIG, EXIT_FAILURE, EXIT_PREEMPTED
from .flops import peak_flops
from .metrics import (PLOT_FILE, MetricsLogger, Throughput, WandbSink, padding_fraction, peak_memory_gb, plot_metrics,
                      system_info)
from .model_config import ModelConfig
from .model_folder import load_initial_weights
from .objectives import objective_for
from .schedule import lr_at
from .tokenizer import TokenizerInfo
from .runlock import DirLock
from .steps import Evaluator, optimizer_step, train_step
from .watchdog import Watchdog

SUMMARY_FILE = "summary.json"

__all__ = ["EXIT_BAD_CONFIG", "EXIT_FAILURE", "EXIT_PREEMPTED", "TrainState", "Trainer", "main", "train"]


class PreemptionFlag:
    """Remembers a SIGTERM/SIGUSR1; the loop acts on it at the next step boundary."""

    def __init__(self) -> None:
        self.signum = 0
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum


@dataclass
class TrainState:
    """The W&B run id, where the loop is and its counters: what a resumed run continues from."""
    wandb_run_id: str | None = None
    step: int = 0
    tokens: int = 0                     # real (non-padding) tokens
    samples: int = 0
    positions: int = 0                  # token positions computed, padding included
    train_time_s: float = 0.0
    nonfinite_steps: int = 0            # steps skipped for a non-finite loss
    last_eval: dict[str, float] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in dataclasses.fields(self):
            if f.name in state:         # checkpoints from before a counter existed lack it
                setattr(self, f.name, state[f.name])


def build_model_config(cfg: RunConfig, tokenizer) -> ModelConfig:
    """The preset with overrides; vocabulary size and padding id come from the tokenizer."""
    fixed = {"pad_token_id": tokenizer.pad_id}
    chosen = cfg.model.overrides.get("vocab_size")
    if chosen is None:
        fixed["vocab_size"] = tokenizer.vocab_size
    elif chosen < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size: {chosen} is smaller than the tokenizer's vocabulary ({tokenizer.vocab_size})")
    return cfg.model_config(**fixed)


def check_data_fits_model(model_cfg: ModelConfig, seq_len: int, section: str = "model") -> None:
    """Absolute position embeddings (``position_biased_input``, the Enhanced Mask Decoder, T-TA's queries) have
    ``max_position_embeddings`` rows: longer sequences would fail at the first step with a shape error."""
    users = [f"{section}.{name}" for name, on in (("position_biased_input", model_cfg.position_biased_input),
                                                  ("emd", model_cfg.emd), ("tta", model_cfg.tta)) if on]
    if users and seq_len > model_cfg.max_position_embeddings:
        raise ConfigError(f"{section}.max_position_embeddings: {model_cfg.max_position_embeddings} is shorter than "
                          f"the data's sequences (data.dir: seq_len {seq_len}), and {' and '.join(users)} "
                          f"use absolute positions; raise it or prepare the data with a smaller --seq-len")


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _new_wandb_id() -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class Trainer:
    """One rank of a run: ``Trainer(cfg, layout).run()`` builds, loops, closes; returns the exit code."""

    def __init__(self, cfg: RunConfig, layout: dist_utils.DistEnv):
        self.cfg, self.layout = cfg, layout
        self.device = dist_utils.device_for(layout)
        self.out_dir_lock = self._lock_out_dir()
        self.preemption = PreemptionFlag()
        self.manifest, tokenizer = open_data_dir(cfg.data.dir)
        self.model_cfg = build_model_config(cfg, tokenizer)
        self.objective = objective_for(cfg, self.model_cfg)
        self.loader, self.evaluator = self._build_data(tokenizer)
        for section, model_cfg in self.objective.model_configs().items():
            check_data_fits_model(model_cfg, self.loader.seq_len, section)
        self.engine = self._build_engine()
        self.state = TrainState()
        self.checkpointer = self._build_checkpointer(tokenizer.path)
        resumed_from = self.checkpointer.restore(cfg.checkpoint.resume)
        self._check_same_step()
        self.state.wandb_run_id = self.state.wandb_run_id or os.environ.get("WANDB_RUN_ID") or _new_wandb_id()
        self.metrics = self._build_metrics(resumed_from)
        self.throughput = self._build_throughput()
        self.nonfinite_in_a_row = 0
        self.watchdog: Watchdog | None = None

    # ---------------------------------------------------------------- building

    def _lock_out_dir(self) -> DirLock | None:
        """Rank 0 holds ``run.out_dir``'s lock for the run's life; every rank learns of a refusal."""
        lock, refusal = None, ""
        if self.layout.is_main:
            try:
                lock = DirLock(self.cfg.out_dir, "run.out_dir")
            except ConfigError as err:
                refusal = str(err)
        if dist_utils.all_reduce_sum([float(bool(refusal))], self.device)[0]:
            raise ConfigError(refusal or f"run.out_dir: {self.cfg.out_dir} is in use by another run (see rank 0)")
        return lock

    def _build_data(self, tokenizer: TokenizerInfo) -> tuple[PretrainLoader, Evaluator]:
        cfg, layout = self.cfg, self.layout
        shared = dict(rank=layout.rank, world_size=layout.world_size, seed=cfg.run.seed,
                      masking=self.objective.masking)
        seq_len = self.manifest.seq_len
        loader = PretrainLoader(cfg.data.dir, self.manifest, tokenizer, batch_size=cfg.data.batch_size,
                                num_workers=cfg.data.num_workers, token_budget=cfg.data.token_budget(seq_len),
                                **shared)
        eval_loader = EvalLoader(cfg.data.dir, self.manifest, tokenizer,
                                 batch_size=cfg.data.eval_batch_size or cfg.data.batch_size,
                                 token_budget=cfg.data.token_budget(seq_len, eval=True), **shared)
        return loader, Evaluator(eval_loader, cfg.eval.batches, layout.world_size, self.device, self.objective)

    def _build_engine(self):
        _seed(self.cfg.run.seed)                      # identical initial weights on every rank
        model = self.objective.build(self.layout.rank)
        if self.cfg.model.init_from:
            load_initial_weights(model, self.cfg.model.init_from)
        engine = initialize(model, self.cfg, self.layout.world_size)
        _seed(self.cfg.run.seed + 7919 * (self.layout.rank + 1))   # different dropout and masking per rank
        return engine

    def _build_checkpointer(self, tokenizer_dir: Path) -> Checkpointer:
        """Saves the engine plus each rank's data stream and RNGs, and the loop's state once (rank 0)."""
        cfg, layout = self.cfg, self.layout
        per_rank = {"data": self.loader, "rng": RNGState(layout.rank),
                    **self.objective.per_rank_state(self.engine.module)}
        meta = {"config": config_to_dict(cfg), "model_config": self.objective.model_cfg.to_dict(),
                **self.objective.meta()}
        return Checkpointer(cfg.out_dir / "checkpoints", self.engine, per_rank=per_rank,
                            shared={"train_state": self.state}, meta=meta,
                            every=cfg.checkpoint.every, keep=cfg.checkpoint.keep, rank=layout.rank,
                            world_size=layout.world_size, barrier=dist_utils.barrier, any_rank=self._any_rank,
                            from_rank0=lambda text: dist_utils.broadcast_text(text, self.device),
                            tokenizer_dir=tokenizer_dir)

    def _any_rank(self, flag: bool) -> bool:
        return dist_utils.all_reduce_sum([float(flag)], self.device)[0] > 0

    def _check_same_step(self) -> None:
        step = self.state.step
        steps = dist_utils.all_reduce_sum([float(step)], self.device)[0]
        if steps != step * self.layout.world_size:
            raise RuntimeError(f"ranks resumed from different steps (this rank: {step}); "
                               f"is {self.checkpointer.root} shared?")

    def _build_metrics(self, resumed_from: Path | None) -> MetricsLogger:
        cfg, sink = self.cfg, None
        if self.layout.is_main:
            save_config(cfg, cfg.out_dir / "config.yaml", self.model_cfg)
            parameters = sum(getattr(p, "ds_numel", p.numel()) for p in self.engine.module.parameters())
            print(f"distaff: {'resuming from ' + str(resumed_from) if resumed_from else 'starting a new run'}; "
                  f"{self.layout.world_size} rank(s), ZeRO-{cfg.zero.stage}, {cfg.train.precision}, "
                  f"{parameters / 1e6:.2f}M parameters", flush=True)
            sink = WandbSink(cfg.wandb, run_name=cfg.run.name, out_dir=cfg.out_dir, run_id=self.state.wandb_run_id,
                             config={**config_to_dict(cfg), "model_resolved": self.objective.model_cfg.to_dict(),
                                     **self.objective.meta(), "system": system_info(self.layout.world_size)})
        return MetricsLogger(cfg.out_dir, enabled=self.layout.is_main, max_steps=cfg.train.max_steps,
                             start_step=self.state.step, progress_bar=cfg.logging.progress_bar, wandb=sink)

    def _build_throughput(self) -> Throughput:
        on_gpu = self.device.type == "cuda"
        peak = peak_flops(torch.cuda.get_device_name(), self.cfg.train.precision) if on_gpu else None
        flops = self.objective.flops_per_token(self.loader.seq_len)
        return Throughput(self.layout.world_size, flops, peak)

    # ---------------------------------------------------------------- the loop

    def run(self) -> int:
        cfg = self.cfg
        self.watchdog = Watchdog(cfg.distributed.watchdog_s or cfg.distributed.timeout_s, cfg.out_dir,
                                 self.layout.rank)
        exit_code = self._loop()
        self.watchdog.stop()
        self.metrics.close()
        if exit_code == 0:
            # the final checkpoint before anything else that can fail (evaluation, summary, W&B)
            self.checkpointer.maybe_save(self.state.step, last=True)
            self._evaluate()
        self._close(exit_code)
        return exit_code

    def _loop(self) -> int:
        cfg, batches = self.cfg, iter(self.loader)
        while self.state.step < cfg.train.max_steps:
            signalled = self._step(batches)
            step = self.state.step
            with self.watchdog.paused():  # bounded by the collective timeout, may take longer than a step
                if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.max_steps:
                    self._evaluate()
                self.checkpointer.maybe_save(step, signalled=signalled)
            if signalled:
                if self.layout.is_main:
                    print(f"distaff: signal received; checkpoint saved at step {step}; exiting with "
                          f"{EXIT_PREEMPTED} (run again to resume)", flush=True)
                return EXIT_PREEMPTED
        return 0

    def _step(self, batches: Iterator[dict]) -> bool:
        """One optimizer step and its bookkeeping; returns whether any rank got a signal."""
        state, started = self.state, time.perf_counter()
        set_lr(self.engine, self._lr(state.step))
        local = train_step(self.engine, batches, self.cfg.train.grad_accum, self.device, self.objective,
                           self.layout.world_size)
        # one small collective per step: global sums plus "did any rank get a signal?"; a non-finite
        # global sum makes every rank skip the same optimizer step
        flag = torch.tensor([float(self.preemption.signum != 0)], dtype=torch.float64, device=self.device)
        *sums, tokens, samples, positions, signalled = dist_utils.all_reduce_sum(torch.cat([local, flag]), self.device)
        skipped = not all(map(math.isfinite, sums))
        optimizer_step(self.engine, skip=skipped)
        if not skipped:
            self.objective.after_step(self.engine.module, sums)
        state.step += 1
        self._count_nonfinite(skipped)
        state.tokens += int(tokens)
        state.samples += int(samples)
        state.positions += int(positions)
        state.train_time_s += time.perf_counter() - started
        self.throughput.add(int(tokens), int(samples), int(positions))
        if state.step % self.cfg.logging.every == 0 or state.step == self.cfg.train.max_steps:
            self._log_train(self.objective.report(sums))
        self.metrics.advance(state.step)
        self.watchdog.feed()
        self._stop_if_nonfinite()
        return bool(signalled)

    def _count_nonfinite(self, skipped: bool) -> None:
        if not skipped:
            self.nonfinite_in_a_row = 0
            return
        self.state.nonfinite_steps += 1
        self.nonfinite_in_a_row += 1
        if self.layout.is_main:
            print(f"distaff: step {self.state.step}: non-finite loss; optimizer step skipped "
                  f"({self.nonfinite_in_a_row} in a row, limit train.max_nonfinite_steps="
                  f"{self.cfg.train.max_nonfinite_steps})", flush=True)

    def _stop_if_nonfinite(self) -> None:
        """``train.max_nonfinite_steps`` skipped steps in a row stop the run before this step is saved."""
        in_a_row = self.nonfinite_in_a_row
        if in_a_row >= self.cfg.train.max_nonfinite_steps:
            raise FloatingPointError(
                f"the loss was not finite for {in_a_row} steps in a row (up to step {self.state.step}); stopping "
                f"without saving (those steps left the weights unchanged; latest checkpoint: "
                f"{latest_checkpoint(self.checkpointer.root)}); lower optim.lr or check the data")

    def _lr(self, step: int) -> float:
        optim = self.cfg.optim
        return lr_at(step, lr=optim.lr, warmup_steps=optim.warmup_steps, max_steps=self.cfg.train.max_steps,
                     schedule=optim.schedule, min_lr_ratio=optim.min_lr_ratio)

    def _log_train(self, objective_metrics: dict[str, float | None]) -> None:
        grad_norm = self.engine.get_global_grad_norm()
        self.metrics.log({"step": self.state.step, **objective_metrics,
                          "lr": self.engine.optimizer.param_groups[0]["lr"],
                          "grad_norm": None if grad_norm is None else float(grad_norm),
                          "loss_scale": loss_scale(self.engine), "tokens_seen": self.state.tokens,
                          "nonfinite_steps": self.state.nonfinite_steps,
                          "peak_mem_gb": peak_memory_gb(),
                          **self.throughput.report(self.cfg.train.max_steps - self.state.step)})

    def _evaluate(self) -> None:
        self.state.last_eval = self.evaluator(self.engine)
        self.metrics.log({"step": self.state.step, **self.state.last_eval})

    # ---------------------------------------------------------------- closing

    def _close(self, exit_code: int) -> None:
        if not self.layout.is_main:
            return
        summary = write_summary(self.cfg, self.state, self.manifest, latest_checkpoint(self.checkpointer.root),
                                self.layout.world_size)
        if self.metrics.wandb is not None:
            self.metrics.wandb.summary(summary)
            self.metrics.wandb.finish(exit_code)


def unigram_baseline_accuracy(manifest: Manifest) -> float | None:
    """MLM accuracy of always predicting the held-out split's most frequent non-special token."""
    split = manifest.splits.get("heldout")
    if split is None or not split.top_tokens or not split.non_special_tokens:
        return None
    return split.top_tokens[0][1] / split.non_special_tokens


def write_summary(cfg: RunConfig, state: TrainState, manifest: Manifest, checkpoint: Path | None,
                  world_size: int) -> dict[str, Any]:
    """``summary.json`` and a short printed report; the plot is drawn here too."""
    out_dir = cfg.out_dir
    plot = plot_metrics(out_dir / "metrics.jsonl", out_dir / PLOT_FILE) if cfg.logging.plot else None
    summary = {"steps": state.step, "tokens": state.tokens, "samples": state.samples, "positions": state.positions,
               "padding_fraction": padding_fraction(state.tokens, state.positions), "packing": cfg.data.packing,
               "world_size": world_size, "train_time_s": round(state.train_time_s, 2),
               "tokens_per_s": state.tokens / state.train_time_s if state.train_time_s else None,
               **state.last_eval,
               "unigram_baseline_accuracy": unigram_baseline_accuracy(manifest),
               "run_dir": str(out_dir), "checkpoint": str(checkpoint) if checkpoint else None,
               "metrics": str(out_dir / "metrics.jsonl"), "plot": str(plot) if plot else None}
    (out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    lines = [f"steps {state.step}, {state.tokens:,} tokens on {world_size} rank(s) in {state.train_time_s:.0f} s"
             + (f" ({summary['tokens_per_s']:,.0f} tokens/s)" if summary["tokens_per_s"] else "")
             + (f", {100 * summary['padding_fraction']:.1f}% padding ({cfg.data.packing})"
                if summary["padding_fraction"] is not None else "")]
    if "eval_rtd_auc" in summary:
        lines.append(eval_rtd_line(summary))
    elif "eval_loss" in summary:
        baseline = summary["unigram_baseline_accuracy"]
        lines.append(f"held-out loss {summary['eval_loss']:.4f}, perplexity {summary['eval_perplexity']:.1f}, "
                     f"MLM accuracy {summary['eval_accuracy']:.4f}"
                     + (f" (unigram-frequency baseline {baseline:.4f})" if baseline is not None else ""))
    lines.append(f"run directory {out_dir}; latest checkpoint {checkpoint}")
    print("distaff: summary\n  " + "\n  ".join(lines), flush=True)
    return summary


def eval_rtd_line(summary: dict[str, Any]) -> str:
    def fmt(key: str) -> str:
        return "n/a" if summary.get(key) is None else f"{summary[key]:.4f}"

    return (f"held-out generator loss {fmt('eval_gen_loss')}, accuracy {fmt('eval_gen_accuracy')}; "
            f"discriminator accuracy {fmt('eval_rtd_accuracy')} (all-original baseline "
            f"{fmt('eval_rtd_baseline_accuracy')}), replaced-token AUC {fmt('eval_rtd_auc')} (chance 0.5), "
            f"precision {fmt('eval_rtd_precision')}, recall {fmt('eval_rtd_recall')}")


def train(cfg: RunConfig, layout: dist_utils.DistEnv) -> int:
    """Run (or resume) training on this rank; the exit code."""
    return Trainer(cfg, layout).run()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="distaff pretrain", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="run config YAML (configs/run/*.yaml)")
    # the deepspeed launcher appends --local_rank unless run with --no_local_rank; LOCAL_RANK is read from the env
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. optim.lr=3e-4")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"distaff pretrain: config error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    dist_utils.die_with_launcher()
    layout = dist_utils.env_from_environ()
    try:
        layout = dist_utils.init_distributed(cfg.distributed.timeout_s)
        code = train(cfg, layout)
        dist_utils.shutdown()
        return code
    except ConfigError as err:
        print(f"distaff pretrain: rank {layout.rank}: config error: {err}", file=sys.stderr, flush=True)
        # every rank refuses together, so no collective is pending: a live process group left to the
        # interpreter's exit aborts the process ("terminate called without an active exception")
        dist_utils.shutdown()
        return EXIT_BAD_CONFIG
    except Exception as err:  # noqa: BLE001 - report which rank failed and why, then exit non-zero
        traceback.print_exc()
        hint = ""
        if isinstance(err, (torch.distributed.DistError, RuntimeError)) and layout.world_size > 1:
            hint = (f" (if a collective failed: another rank probably died, or a collective waited longer than "
                    f"distributed.timeout_s={cfg.distributed.timeout_s})")
        print(f"distaff pretrain: rank {layout.rank}: failed: {type(err).__name__}: {err}{hint}",
              file=sys.stderr, flush=True)
        # its peers may be gone or mid-collective, so the process group can be neither destroyed (that
        # may wait) nor left to the interpreter's teardown (gloo's threads abort it with -6): leave now
        if dist_utils.torch_distributed_initialized():
            sys.stdout.flush()
            os._exit(EXIT_FAILURE)
        return EXIT_FAILURE
    finally:
        sys.stdout.flush()


if __name__ == "__main__":
    dist_utils.exit_process(main())
