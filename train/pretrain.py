"""MLM pretraining under DeepSpeed: ``python -m distaff.train.pretrain --config RUN.yaml [key=value ...]``.

Run under the ``deepspeed`` launcher, ``torchrun`` or ``srun``; rank and world size come from the
environment. Data flows one way: config -> data stream -> model -> engine -> checkpoints/metrics.
On SIGTERM or SIGUSR1 every rank finishes the current step, a checkpoint is saved and the process
exits with :data:`EXIT_PREEMPTED` (75); ``checkpoint.resume=auto`` continues from there.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import string
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import distributed as dist_utils
from .checkpoint import CheckpointManager, capture_rng_state, restore_rng_state
from .config import ConfigError, RunConfig, config_to_dict, load_config, save_config
from .engine import initialize, loss_scale, set_lr
from .flops import peak_flops, train_flops_per_token
from .metrics import PLOT_FILE, MetricsLogger, Throughput, WandbSink, peak_memory_gb, perplexity, plot_metrics, system_info
from .model_config import ModelConfig
from .schedule import lr_at

EXIT_PREEMPTED = 75     # EX_TEMPFAIL: checkpointed on a signal; run again to resume
EXIT_FAILURE = 1
EXIT_BAD_CONFIG = 2
SUMMARY_FILE = "summary.json"


class PreemptionFlag:
    """Remembers a SIGTERM/SIGUSR1; the loop acts on it at the next step boundary."""

    def __init__(self) -> None:
        self.signum = 0
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum


@dataclass
class Progress:
    """Counters that survive restarts (stored in the checkpoint metadata)."""
    tokens: int = 0
    samples: int = 0
    train_time_s: float = 0.0
    last_eval: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------- data and model

def build_model_config(cfg: RunConfig, tokenizer) -> ModelConfig:
    """The preset with overrides; vocabulary size and padding id come from the tokenizer."""
    fixed = {"pad_token_id": tokenizer.pad_id}
    chosen = cfg.model.overrides.get("vocab_size")
    if chosen is None:
        fixed["vocab_size"] = tokenizer.vocab_size
    elif chosen < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size: {chosen} is smaller than the tokenizer's vocabulary ({tokenizer.vocab_size})")
    return cfg.model_config(**fixed)


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


# ---------------------------------------------------------------- one step, evaluation

def train_step(engine, batches, grad_accum: int, device: torch.device) -> torch.Tensor:
    """One optimizer step over ``grad_accum`` micro-batches; this rank's sums
    ``[loss * labelled, labelled, correct, tokens, samples]`` as a float64 tensor on ``device``
    (kept there so micro-batches queue without a host sync)."""
    sums = torch.zeros(5, dtype=torch.float64, device=device)
    for _ in range(grad_accum):
        batch = _to_device(next(batches), device)
        ids = batch["input_ids"]
        out = engine(ids, attention_mask=batch["attention_mask"], labels=batch["labels"])
        engine.backward(out.loss)
        engine.step()
        labelled = out.num_labelled.double()
        sums[:3] += torch.stack([out.loss.detach().double() * labelled, labelled, out.num_correct.double()])
        sums[3:] += torch.tensor([ids.numel(), ids.shape[0]], dtype=torch.float64, device=device)
    return sums


@torch.no_grad()
def evaluate(engine, cfg: RunConfig, layout: dist_utils.DistEnv, device: torch.device) -> dict[str, float]:
    """Loss, accuracy and perplexity on the held-out split, token-weighted over all ranks.

    Every rank runs the same number of batches (ZeRO-3 forwards are collective), and the global
    RNG is forked so evaluating never changes the training run's random stream.
    """
    from .data.loader import build_eval_loader

    loader = build_eval_loader(cfg.data.dir, batch_size=cfg.data.eval_batch_size or cfg.data.batch_size,
                               rank=layout.rank, world_size=layout.world_size, seed=cfg.run.seed,
                               masking=cfg.data.masking)
    sums = [0.0, 0.0, 0.0]
    engine.eval()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        batches, done = iter(loader), 0
        while cfg.eval.batches == 0 or done < cfg.eval.batches:
            batch = next(batches, None)
            have = dist_utils.all_reduce_sum([0.0 if batch is None else 1.0], device)[0]
            if have < layout.world_size:
                break
            batch = _to_device(batch, device)
            out = engine(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
            labelled = float(out.num_labelled)
            sums[0] += float(out.loss) * labelled
            sums[1] += labelled
            sums[2] += float(out.num_correct)
            done += 1
    engine.train()
    loss_sum, labelled, correct = dist_utils.all_reduce_sum(sums, device)
    if labelled == 0:
        raise RuntimeError(f"evaluation saw no labelled tokens: is the held-out split of {cfg.data.dir} empty?")
    loss = loss_sum / labelled
    return {"eval_loss": loss, "eval_accuracy": correct / labelled, "eval_perplexity": perplexity(loss),
            "eval_tokens": int(labelled)}


def unigram_baseline_accuracy(data_dir: str) -> float | None:
    """MLM accuracy of always predicting the held-out split's most frequent non-special token."""
    from .data.manifest import read_manifest

    split = read_manifest(data_dir).splits.get("heldout")
    if split is None or not split.top_tokens or not split.non_special_tokens:
        return None
    return split.top_tokens[0][1] / split.non_special_tokens


# ---------------------------------------------------------------- the run

def _new_wandb_id() -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _seed(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train(cfg: RunConfig, layout: dist_utils.DistEnv) -> int:
    device = dist_utils.device_for(layout)
    out_dir = cfg.out_dir
    if layout.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    dist_utils.barrier()
    preemption = PreemptionFlag()

    from .data.loader import build_train_loader
    from .model import DebertaForMaskedLM

    loader = build_train_loader(cfg.data.dir, batch_size=cfg.data.batch_size, rank=layout.rank,
                                world_size=layout.world_size, num_workers=cfg.data.num_workers, seed=cfg.run.seed,
                                masking=cfg.data.masking)
    model_cfg = build_model_config(cfg, loader.tokenizer)
    _seed(cfg.run.seed)                      # identical initial weights on every rank
    engine = initialize(DebertaForMaskedLM(model_cfg), cfg, layout.world_size)
    _seed(cfg.run.seed + 7919 * (layout.rank + 1))   # different dropout and masking per rank

    checkpoints = CheckpointManager(out_dir / "checkpoints", keep=cfg.checkpoint.keep, rank=layout.rank,
                                    world_size=layout.world_size, barrier=dist_utils.barrier)
    resume_from = checkpoints.resolve(cfg.checkpoint.resume)
    checkpoints.remove_partial()
    step, progress, wandb_id = 0, Progress(), None
    if resume_from is not None:
        loaded = checkpoints.load(engine, resume_from)
        loader.load_state_dict(loaded.rank_state["data"])
        restore_rng_state(loaded.rank_state["rng"])
        step, wandb_id = loaded.meta["step"], loaded.meta["wandb_run_id"]
        progress = Progress(**loaded.meta["progress"])
    steps = dist_utils.all_reduce_sum([float(step)], device)[0]
    if steps != step * layout.world_size:
        raise RuntimeError(f"ranks resumed from different steps (this rank: {step}); is {checkpoints.root} shared?")
    wandb_id = wandb_id or os.environ.get("WANDB_RUN_ID") or _new_wandb_id()

    sink = None
    if layout.is_main:
        save_config(cfg, out_dir / "config.yaml", model_cfg)
        print(f"distaff: {'resuming from ' + str(resume_from) if resume_from else 'starting a new run'}; "
              f"{layout.world_size} rank(s), ZeRO-{cfg.zero.stage}, {cfg.train.precision}, "
              f"{sum(getattr(p, 'ds_numel', p.numel()) for p in engine.module.parameters()) / 1e6:.2f}M parameters", flush=True)
        sink = WandbSink(cfg.wandb, run_name=cfg.run.name, out_dir=out_dir, run_id=wandb_id,
                         config={**config_to_dict(cfg), "model_resolved": model_cfg.to_dict(),
                                 "system": system_info(layout.world_size)})
    metrics = MetricsLogger(out_dir, enabled=layout.is_main, max_steps=cfg.train.max_steps, start_step=step,
                            progress_bar=cfg.logging.progress_bar, wandb=sink)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    throughput = Throughput(layout.world_size, train_flops_per_token(model_cfg, loader.seq_len,
                                                                     cfg.data.masking.mlm_probability),
                            peak_flops(device_name, cfg.train.precision) if device.type == "cuda" else None)

    def save(at_step: int) -> None:
        meta = {"config": config_to_dict(cfg), "model_config": model_cfg.to_dict(), "wandb_run_id": wandb_id,
                "progress": progress.__dict__}
        checkpoints.save(engine, at_step, {"data": loader.state_dict(), "rng": capture_rng_state()}, meta,
                         tokenizer_dir=loader.tokenizer.path)

    exit_code, saved_at, batches = 0, step, iter(loader)
    while step < cfg.train.max_steps:
        t0 = time.perf_counter()
        set_lr(engine, lr_at(step, lr=cfg.optim.lr, warmup_steps=cfg.optim.warmup_steps,
                             max_steps=cfg.train.max_steps, schedule=cfg.optim.schedule,
                             min_lr_ratio=cfg.optim.min_lr_ratio))
        local = train_step(engine, batches, cfg.train.grad_accum, device)
        step += 1
        # one small collective per step: global sums plus "did any rank get a signal?"
        flag = torch.tensor([float(preemption.signum != 0)], dtype=torch.float64, device=device)
        loss_sum, labelled, correct, tokens, samples, signalled = dist_utils.all_reduce_sum(
            torch.cat([local, flag]), device)
        progress.tokens += int(tokens)
        progress.samples += int(samples)
        progress.train_time_s += time.perf_counter() - t0
        throughput.add(int(tokens), int(samples))
        if step % cfg.logging.every == 0 or step == cfg.train.max_steps:
            grad_norm = engine.get_global_grad_norm()
            metrics.log({"step": step, "loss": loss_sum / max(labelled, 1.0), "accuracy": correct / max(labelled, 1.0),
                         "lr": engine.optimizer.param_groups[0]["lr"],
                         "grad_norm": None if grad_norm is None else float(grad_norm),
                         "loss_scale": loss_scale(engine), "tokens_seen": progress.tokens,
                         "peak_mem_gb": peak_memory_gb(), **throughput.report(cfg.train.max_steps - step)})
        metrics.advance(step)
        if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.max_steps:
            progress.last_eval = evaluate(engine, cfg, layout, device)
            metrics.log({"step": step, **progress.last_eval})
        if signalled or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
            save(step)
            saved_at = step
        if signalled:
            exit_code = EXIT_PREEMPTED
            if layout.is_main:
                print(f"distaff: signal received; checkpoint saved at step {step}; exiting with {EXIT_PREEMPTED} "
                      "(run again to resume)", flush=True)
            break
    metrics.close()

    if exit_code == 0:
        progress.last_eval = evaluate(engine, cfg, layout, device)
        metrics.log({"step": step, **progress.last_eval})
        if saved_at != step:
            save(step)
    if layout.is_main:
        summary = write_summary(cfg, step, progress, checkpoints.latest(), layout.world_size)
        if sink is not None:
            sink.summary(summary)
            sink.finish(exit_code)
    return exit_code


def write_summary(cfg: RunConfig, step: int, progress: Progress, checkpoint: Path | None,
                  world_size: int) -> dict[str, Any]:
    """``summary.json`` and a short printed report; the plot is drawn here too."""
    out_dir = cfg.out_dir
    plot = plot_metrics(out_dir / "metrics.jsonl", out_dir / PLOT_FILE) if cfg.logging.plot else None
    summary = {"steps": step, "tokens": progress.tokens, "samples": progress.samples, "world_size": world_size,
               "train_time_s": round(progress.train_time_s, 2),
               "tokens_per_s": progress.tokens / progress.train_time_s if progress.train_time_s else None,
               **progress.last_eval,
               "unigram_baseline_accuracy": unigram_baseline_accuracy(cfg.data.dir),
               "run_dir": str(out_dir), "checkpoint": str(checkpoint) if checkpoint else None,
               "metrics": str(out_dir / "metrics.jsonl"), "plot": str(plot) if plot else None}
    (out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    lines = [f"steps {step}, {progress.tokens:,} tokens on {world_size} rank(s) in {progress.train_time_s:.0f} s"
             + (f" ({summary['tokens_per_s']:,.0f} tokens/s)" if summary["tokens_per_s"] else "")]
    if "eval_loss" in summary:
        baseline = summary["unigram_baseline_accuracy"]
        lines.append(f"held-out loss {summary['eval_loss']:.4f}, perplexity {summary['eval_perplexity']:.1f}, "
                     f"MLM accuracy {summary['eval_accuracy']:.4f}"
                     + (f" (unigram-frequency baseline {baseline:.4f})" if baseline is not None else ""))
    lines.append(f"run directory {out_dir}; latest checkpoint {checkpoint}")
    print("distaff: summary\n  " + "\n  ".join(lines), flush=True)
    return summary


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
    layout = dist_utils.env_from_environ()
    try:
        layout = dist_utils.init_distributed(cfg.distributed.timeout_s)
        code = train(cfg, layout)
        dist_utils.shutdown()
        return code
    except ConfigError as err:
        print(f"distaff pretrain: rank {layout.rank}: config error: {err}", file=sys.stderr, flush=True)
        return EXIT_BAD_CONFIG
    except Exception as err:  # noqa: BLE001 - report which rank failed and why, then exit non-zero
        traceback.print_exc()
        hint = ""
        if isinstance(err, (torch.distributed.DistError, RuntimeError)) and layout.world_size > 1:
            hint = (f" (if a collective failed: another rank probably died, or a collective waited longer than "
                    f"distributed.timeout_s={cfg.distributed.timeout_s})")
        print(f"distaff pretrain: rank {layout.rank}: failed: {type(err).__name__}: {err}{hint}",
              file=sys.stderr, flush=True)
        return EXIT_FAILURE
    finally:
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
