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
from pathlib import Path
from typing import Any

import torch

from distaff.train.core import distributed as dist_utils
from distaff.train.core.exit_codes import EXIT_BAD_CONFIG, EXIT_FAILURE, EXIT_PREEMPTED
from distaff.train.data.loader import EvalLoader, PretrainLoader, open_data_dir
from distaff.train.data.manifest import MANIFEST_FILE, Manifest, is_remote
from distaff.train.data.tokenizer import TokenizerInfo
from distaff.train.model.config import ModelConfig
from distaff.train.model.flops import peak_flops
from distaff.train.plan.compare import first_check
from distaff.train.pretrain.objectives import objective_for
from distaff.train.run.checkpoint import Checkpointer, RNGState, latest_checkpoint
from distaff.train.run.config import ConfigError, RunConfig, config_to_dict, load_config, save_config
from distaff.train.run.engine import loss_scale
from distaff.train.run.metrics import PLOT_FILE, Throughput, padding_fraction, peak_memory_gb, plot_metrics, warn
from distaff.train.run.model_folder import load_initial_weights
from distaff.train.run.resume_check import RunIdentity, check_resumable
from distaff.train.run.runtime import Inspection, RunBase, TrainState, check_data_fits_model, parse_args as runtime_parse_args, run_main
from distaff.train.run.schedule import lr_at
from distaff.train.run.steps import Evaluator

MIN_EVAL_TOKENS = 1_000     # masked tokens an evaluation scores: fewer, and accuracy moves in coarse steps

__all__ = ["EXIT_BAD_CONFIG", "EXIT_FAILURE", "EXIT_PREEMPTED", "TrainState", "Trainer", "main", "train"]


def build_model_config(cfg: RunConfig, tokenizer) -> ModelConfig:
    """The preset with overrides; vocabulary size and padding id come from the tokenizer."""
    fixed = {"pad_token_id": tokenizer.pad_id}
    chosen = cfg.model.overrides.get("vocab_size")
    if chosen is None:
        fixed["vocab_size"] = tokenizer.vocab_size
    elif chosen < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size: {chosen} is smaller than the tokenizer's vocabulary ({tokenizer.vocab_size})")
    return cfg.model_config(**fixed)


class Trainer(RunBase):
    """One rank of a run: ``Trainer(cfg, layout).run()`` builds, loops, closes; returns the exit code."""

    def __init__(self, cfg: RunConfig, layout: dist_utils.DistEnv):
        super().__init__(cfg, layout)
        self.manifest, tokenizer = open_data_dir(cfg.data.dir)
        self.model_cfg = build_model_config(cfg, tokenizer)
        self.objective = objective_for(cfg, self.model_cfg)
        self.loader, self.evaluator = self._build_data(tokenizer)
        for section, model_cfg in self.objective.model_configs().items():
            check_data_fits_model(model_cfg, self.loader.seq_len, f"data.dir: seq_len {self.loader.seq_len}",
                                  "raise it or prepare the data with a smaller --seq-len", section)
        check_resumable(cfg.checkpoint.resume, cfg.out_dir / "checkpoints", run_identity(cfg, self.objective, self.loader))
        self.engine = self._initialize_engine(self._build_model)
        self.state = TrainState()
        self.checkpointer = self._build_checkpointer(tokenizer.path)
        resumed_from = self._restore()
        if layout.is_main:
            save_config(cfg, cfg.out_dir / "config.yaml", self.model_cfg)
        self.metrics = self._open_metrics(resumed_from, max_steps=cfg.train.max_steps, what="", wandb_config={
            **config_to_dict(cfg), "model_resolved": self.objective.model_cfg.to_dict(), **self.objective.meta()})
        self.throughput = self._build_throughput()
        self.max_steps = cfg.train.max_steps
        self.batches = iter(self.loader)
        self.warned_small_eval = False
        self.plan_checked = False

    # ---------------------------------------------------------------- building

    def _build_data(self, tokenizer: TokenizerInfo) -> tuple[PretrainLoader, Evaluator]:
        cfg, layout = self.cfg, self.layout
        shared = dict(rank=layout.rank, world_size=layout.world_size, seed=cfg.run.seed,
                      masking=self.objective.masking)
        seq_len = self.manifest.seq_len
        loader = train_loader(cfg, layout, self.manifest, tokenizer, self.objective)
        eval_loader = EvalLoader(cfg.data.dir, self.manifest, tokenizer,
                                 batch_size=cfg.data.eval_batch_size or cfg.data.batch_size,
                                 token_budget=cfg.data.token_budget(seq_len, eval=True), **shared)
        return loader, Evaluator(eval_loader, cfg.eval.batches, layout.world_size, self.device, self.objective)

    def _build_model(self) -> torch.nn.Module:
        model = self.objective.build(self.layout.rank)
        if self.cfg.model.init_from:
            load_initial_weights(model, self.cfg.model.init_from)
        return model

    def _build_checkpointer(self, tokenizer_dir: Path) -> Checkpointer:
        """Saves the engine plus each rank's data stream and RNGs, and the loop's state once (rank 0)."""
        cfg, layout = self.cfg, self.layout
        per_rank = {"data": self.loader, "rng": RNGState(layout.rank),
                    **self.objective.per_rank_state(self.engine.module)}
        meta = {"config": config_to_dict(cfg), "model_config": self.objective.model_cfg.to_dict(),
                **self.objective.meta()}
        return self._new_checkpointer(cfg.out_dir / "checkpoints", per_rank=per_rank, meta=meta,
                                      every=cfg.checkpoint.every, keep=cfg.checkpoint.keep, tokenizer_dir=tokenizer_dir)

    def _build_throughput(self) -> Throughput:
        on_gpu = self.device.type == "cuda"
        peak = peak_flops(torch.cuda.get_device_name(), self.cfg.train.precision) if on_gpu else None
        flops = self.objective.flops_per_token(self.loader.seq_len)
        return Throughput(self.layout.world_size, flops, peak)

    # ---------------------------------------------------------------- the loop

    def _done(self) -> bool:
        return self.state.step >= self.cfg.train.max_steps

    def _finished_line(self) -> str:
        return (f"its latest checkpoint is at step {self.state.step}, train.max_steps={self.cfg.train.max_steps}; "
                f"raise train.max_steps to continue it")

    def _after_step(self, signalled: bool) -> None:
        step, cfg = self.state.step, self.cfg
        if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.max_steps:
            self._evaluate()
        self.checkpointer.maybe_save(step, signalled=signalled)

    def _finish(self) -> None:
        # the final checkpoint before anything else that can fail (evaluation, summary, W&B)
        self.checkpointer.maybe_save(self.state.step, last=True)
        self._evaluate()

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
                          **self.throughput.report(self.cfg.train.max_steps - self.state.step),
                          **self.clock.report()})

    def _evaluate(self) -> None:
        self.state.last_eval = self.evaluator(self.engine)
        self.metrics.log({"step": self.state.step, "tokens_seen": self.state.tokens, **self.state.last_eval})
        if not self.plan_checked and self.layout.is_main:      # once: the measured stages against the plan
            device = torch.cuda.get_device_name() if self.device.type == "cuda" else None
            cpu = None if device else sum(self.clock.steady_cpu_means().values())
            print(first_check(self.cfg, self.loader.seq_len, self.layout.world_size, device, self.clock.steady_means(),
                              self.cfg.out_dir, cpu), flush=True)
        self.plan_checked = True
        scored = self.state.last_eval.get("eval_tokens", MIN_EVAL_TOKENS)
        if scored < MIN_EVAL_TOKENS and self.layout.is_main and not self.warned_small_eval:
            self.warned_small_eval = True
            warn(f"the held-out evaluation scored only {scored:,} masked tokens, too few for steady held-out "
                 f"numbers; prepare the data with a larger --heldout-fraction, or raise eval.batches (now "
                 f"{self.cfg.eval.batches}; 0: the whole split)")

    # ---------------------------------------------------------------- closing

    def _resolved_config(self) -> dict[str, Any]:
        return config_to_dict(self.cfg)

    def _summary(self) -> dict[str, Any]:
        return summarize(self.cfg, self.state, self.manifest, latest_checkpoint(self.checkpointer.root),
                             self.layout.world_size)


def train_loader(cfg: RunConfig, layout: dist_utils.DistEnv, manifest: Manifest, tokenizer: TokenizerInfo,
                 objective) -> PretrainLoader:
    return PretrainLoader(cfg.data.dir, manifest, tokenizer, batch_size=cfg.data.batch_size,
                          num_workers=cfg.data.num_workers, token_budget=cfg.data.token_budget(manifest.seq_len),
                          rank=layout.rank, world_size=layout.world_size, seed=cfg.run.seed, masking=objective.masking)


def check_run(cfg: RunConfig) -> str:
    """``distaff pretrain --check``: the data, the model it gives and a checkpoint to resume, checked as a run
    checks them before building its engine (as rank 0 of ``WORLD_SIZE``, default 1); a summary line."""
    layout = dist_utils.DistEnv(0, dist_utils.env_from_environ().world_size, 0)
    manifest, tokenizer = open_data_dir(cfg.data.dir)
    model_cfg = build_model_config(cfg, tokenizer)
    objective = objective_for(cfg, model_cfg)
    loader = train_loader(cfg, layout, manifest, tokenizer, objective)
    for section, checked in objective.model_configs().items():
        check_data_fits_model(checked, loader.seq_len, f"data.dir: seq_len {loader.seq_len}",
                              "raise it or prepare the data with a smaller --seq-len", section)
    resume = check_resumable(cfg.checkpoint.resume, cfg.out_dir / "checkpoints", run_identity(cfg, objective, loader))
    return (f"config, data {cfg.data.dir} (seq_len {manifest.seq_len}, tokenizer of {tokenizer.vocab_size} pieces) and "
            f"model ({model_cfg.num_hidden_layers} layers, hidden {model_cfg.hidden_size}, {cfg.train.objective}) fit; "
            + (f"resumes from {resume}" if resume else f"a new run in {cfg.out_dir}")
            + f"; {cfg.train.max_steps} steps on {layout.world_size} rank(s)")


def run_identity(cfg: RunConfig, objective, loader: PretrainLoader) -> RunIdentity:
    """What a checkpoint must match for this run to resume it (train/run/resume_check.py); the data by what the
    loader was built from (the shards' sample counts and the tokenizer's fingerprint), not by its path."""
    data = loader.state_dict()["data"]

    def data_problem(state: dict, where: str) -> str | None:
        if state.get("data", data) == data:
            return None
        return (f"data.dir: the data of {where} differ from this run's {cfg.data.dir} (other shards, or another "
                "tokenizer)")

    return RunIdentity(model=objective.model_cfg.to_dict(), seed=cfg.run.seed, zero_stage=cfg.zero.stage,
                       objective=cfg.train.objective, data_problem=data_problem)


def unigram_baseline_accuracy(manifest: Manifest) -> float | None:
    """MLM accuracy of always predicting the held-out split's most frequent non-special token."""
    split = manifest.splits.get("heldout")
    if split is None or not split.top_tokens or not split.non_special_tokens:
        return None
    return split.top_tokens[0][1] / split.non_special_tokens


def summarize(cfg: RunConfig, state: TrainState, manifest: Manifest, checkpoint: Path | None,
              world_size: int) -> dict[str, Any]:
    """The figures of ``summary.json``, and a short printed report; the plot is drawn here too."""
    out_dir = cfg.out_dir
    baseline = unigram_baseline_accuracy(manifest)
    plot = plot_metrics(out_dir / "metrics.jsonl", out_dir / PLOT_FILE, baseline) if cfg.logging.plot else None
    summary = {"steps": state.step, "tokens": state.tokens, "samples": state.samples, "positions": state.positions,
               "padding_fraction": padding_fraction(state.tokens, state.positions), "packing": cfg.data.packing,
               "world_size": world_size, "train_time_s": round(state.train_time_s, 2),
               "tokens_per_s": state.tokens / state.train_time_s if state.train_time_s else None,
               **state.last_eval,
               "unigram_baseline_accuracy": baseline,
               "run_dir": str(out_dir), "checkpoint": str(checkpoint) if checkpoint else None,
               "metrics": str(out_dir / "metrics.jsonl"), "plot": str(plot) if plot else None}
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


def load_run_config(path: str | None, overrides: list[str]) -> RunConfig:
    """The run config, with a local ``data.dir`` checked: a missing folder or manifest is refused here, before
    any process group or run folder exists."""
    cfg = load_config(path, overrides)
    data_dir = Path(cfg.data.dir)
    if not is_remote(cfg.data.dir) and not (data_dir / MANIFEST_FILE).is_file():
        problem = "does not exist" if not data_dir.exists() else f"holds no {MANIFEST_FILE}"
        raise ConfigError(f"data.dir: {data_dir.resolve()} {problem}; set data.dir to a folder written by "
                          f"`distaff data prepare ... --out DIR`")
    return cfg


def train(cfg: RunConfig, layout: dist_utils.DistEnv) -> int:
    """Run (or resume) training on this rank; the exit code."""
    return Trainer(cfg, layout).run()


def parse_args(argv: list[str]) -> argparse.Namespace:
    return runtime_parse_args("distaff pretrain", __doc__.splitlines()[0], argv)


def main(argv: list[str] | None = None) -> int:
    return run_main("distaff pretrain", __doc__.splitlines()[0], argv, load_run_config, train,
                    Inspection(resolved=config_to_dict, check=check_run))

