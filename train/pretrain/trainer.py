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
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from distaff.train.core import distributed as dist_utils
from distaff.train.core.exit_codes import EXIT_BAD_CONFIG, EXIT_FAILURE, EXIT_PREEMPTED
from distaff.train.data.loader import EvalLoader, MixedLoader, PretrainLoader, continues, open_sources
from distaff.train.data.manifest import MANIFEST_FILE, Manifest, is_remote
from distaff.train.data.tokenizer import TokenizerInfo
from distaff.train.data.verify import check_first_samples
from distaff.train.model.config import ModelConfig, check_data_fits_model
from distaff.train.model.flops import peak_flops
from distaff.train.plan.compare import first_check
from distaff.train.pretrain.attached_evals import AttachedEvals, check_eval_inputs, eval_summary
from distaff.train.pretrain.objectives import objective_for
from distaff.train.run.checkpoint import Checkpointer, RNGState, latest_checkpoint
from distaff.train.run.config import ConfigError, RunConfig, config_to_dict, load_config, save_config, source_dirs
from distaff.train.run.engine import loss_scale, set_accumulation
from distaff.train.run.metrics import PLOT_FILE, Throughput, padding_fraction, peak_memory_gb, plot_metrics, warn
from distaff.train.run.model_folder import load_initial_weights
from distaff.train.run.resume_check import RunIdentity, check_resumable
from distaff.train.run.runtime import Inspection, RunBase, TrainState, parse_args as runtime_parse_args, run_main
from distaff.train.run.schedule import Phase, RunSchedule, lr_at
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


class PretrainPlan:
    """A pretraining run up to its engine: the data dir opened, the model configured, the loaders built, the data
    checked against the model and the checkpoint to resume chosen. Built by every rank of a run (``from_rank0``:
    rank 0's text on every rank), and by ``--check``: one set of checks, so a run fails on nothing --check passed."""

    def __init__(self, cfg: RunConfig, layout: dist_utils.DistEnv,
                 from_rank0: Callable[[str], str] = lambda text: text):
        self.sources = run_sources(cfg)
        self.manifest, self.tokenizer = self.sources[cfg.data.first_dir]
        self.schedule = run_schedule(cfg, layout.world_size, self.sources)
        self.model_cfg = build_model_config(cfg, self.tokenizer)
        self.objective = objective_for(cfg, self.model_cfg)
        self.loader = train_loader(cfg, layout, self.sources, self.objective)
        self.eval_loader = EvalLoader(cfg.data.first_dir, self.manifest, self.tokenizer, rank=layout.rank,
                                      world_size=layout.world_size, seed=cfg.run.seed, masking=self.objective.masking,
                                      batch_size=cfg.data.eval_batch_size or cfg.data.batch_size,
                                      token_budget=cfg.data.token_budget(self.manifest.seq_len, eval=True))
        for data_dir, (manifest, _) in self.sources.items():     # on every rank: they refuse together
            check_first_samples(data_dir, manifest)
        check_lengths(self.objective, self.schedule)
        check_eval_inputs(cfg, self.tokenizer)
        self.resume_from = check_resumable(cfg.checkpoint.resume, cfg.out_dir / "checkpoints",
                                           run_identity(cfg, self.objective, self.loader), is_main=layout.is_main,
                                           from_rank0=from_rank0, report=print if layout.is_main else _silent,
                                           branch_from=cfg.checkpoint.branch_from)


def _silent(message: str) -> None:
    """What ranks other than 0 say about the checkpoints rank 0 passed over: nothing (rank 0 says it)."""


class Trainer(RunBase):
    """One rank of a run: ``Trainer(cfg, layout).run()`` builds, loops, closes; returns the exit code."""

    def __init__(self, cfg: RunConfig, layout: dist_utils.DistEnv):
        super().__init__(cfg, layout)
        plan = PretrainPlan(cfg, layout, lambda text: dist_utils.broadcast_text(text, self.device))
        self.sources, self.schedule, self.manifest = plan.sources, plan.schedule, plan.manifest
        self.model_cfg, self.objective = plan.model_cfg, plan.objective
        self.loader, self.resume_from = plan.loader, plan.resume_from
        self.evaluator = Evaluator(plan.eval_loader, cfg.eval.batches, layout.world_size, self.device, self.objective)
        self.phase: Phase | None = None     # the phase the loader and the log are in (set at the first step)
        self.global_batch = 0
        self.engine = self._initialize_engine(self._build_model)
        self.state = TrainState()
        self.checkpointer = self._build_checkpointer(plan.tokenizer.path)
        resumed_from = self._restore()
        if isinstance(self.loader, MixedLoader) and self.loader.from_single_stream and layout.is_main:
            self.loader.tokens[0] = self.state.tokens      # what the single stream read, all of it source 0's
        if layout.is_main:
            save_config(cfg, cfg.out_dir / "config.yaml", self.model_cfg)
        self.metrics = self._open_metrics(resumed_from, max_steps=cfg.train.max_steps, what="", wandb_config={
            **config_to_dict(cfg), "model_resolved": self.objective.model_cfg.to_dict(), **self.objective.meta()})
        self.throughput = self._build_throughput()
        # every rank: inline evaluations make a process group; a signal ends rank 0's wait for one
        self.evals = AttachedEvals(cfg, layout, stop_requested=lambda: self.preemption.signum != 0)
        self.max_steps = cfg.train.max_steps
        self.batches = iter(self.loader)
        self.warned_small_eval = False
        self.plan_checked = False

    # ---------------------------------------------------------------- building

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
        flops = self.objective.flops_per_token(self.schedule.phases[0].seq_len)
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
        self._save(step, signalled=signalled)
        self.evals.poll()

    def _finish(self) -> None:
        # the final checkpoint before anything else that can fail (evaluation, summary, W&B)
        self._save(self.state.step, last=True)
        self._evaluate()
        self.evals.finish()

    def _save(self, step: int, signalled: bool = False, last: bool = False) -> None:
        """A checkpoint when one is due, then its attached evaluations (train/pretrain/attached_evals.py)."""
        before = self.checkpointer.saved_step
        self.checkpointer.maybe_save(step, signalled=signalled, last=last)
        self.evals.after_checkpoint(step, saved=self.checkpointer.saved_step != before, signalled=signalled)

    def _lr(self, step: int) -> float:
        optim = self.cfg.optim
        return lr_at(step, lr=optim.lr, warmup_steps=optim.warmup_steps, max_steps=self.cfg.train.max_steps,
                     schedule=optim.schedule, min_lr_ratio=optim.min_lr_ratio, decay_start=optim.decay_start,
                     decay_steps=optim.decay_steps, decay_shape=optim.decay_shape)

    def _micro_batches(self, step: int) -> int:
        """The step's shape from the schedule (train/run/schedule.py): a phase the loader is not in yet is given to
        it; the engine accumulates the step's micro-batches."""
        shape = self.schedule.at(step)
        if shape.phase != self.phase:
            self._enter(shape.phase, step)
        set_accumulation(self.engine, shape.micro_batches, shape.phase.batch_size)
        self.global_batch = shape.global_batch
        return shape.micro_batches

    def _enter(self, phase: Phase, step: int) -> None:
        """Give ``phase`` to the loader; a switch (the loader was in another phase: not a run resumed inside this
        one) is logged."""
        mixed = isinstance(self.loader, MixedLoader)
        switched = mixed and phase.index > 0 and self.loader.phase != phase.index
        if mixed:
            base = self.objective.masking
            self.loader.set_phase(phase.index, dict(phase.sources), batch_size=phase.batch_size,
                                  token_budget=phase_token_budget(self.cfg, phase),
                                  masking=None if base is None else replace(base, mlm_probability=phase.mask_rate))
        if switched:
            before = self.schedule.phases[phase.index - 1]
            self.metrics.log({"step": step + 1, "tokens_seen": self.state.tokens, "phase": phase.index,
                              "phase_change": phase.changes(before)})
        self.throughput.flops_per_token = self.objective.flops_per_token(phase.seq_len)
        self.phase = phase

    def _tokens_by_source(self) -> dict[str, int]:
        """Each source's real tokens so far, over all ranks (collective)."""
        if not isinstance(self.loader, MixedLoader):
            return {self.cfg.data.dir: self.state.tokens}
        local = self.loader.tokens_by_source()
        totals = dist_utils.all_reduce_sum([float(n) for n in local.values()], self.device)
        return {source: int(n) for source, n in zip(local, totals)}

    def _log_train(self, objective_metrics: dict[str, float | None]) -> None:
        grad_norm = self.engine.get_global_grad_norm()
        evals = self.evals.timing()
        self.throughput.exclude(evals.get("evals_inline_s", 0.0))      # an inline evaluation's pause: no training
        self.metrics.log({"step": self.state.step, **objective_metrics,
                          "lr": self.engine.optimizer.param_groups[0]["lr"],
                          "grad_norm": None if grad_norm is None else float(grad_norm),
                          "loss_scale": loss_scale(self.engine), "tokens_seen": self.state.tokens,
                          "tokens_by_source": self._tokens_by_source(), "global_batch": self.global_batch,
                          "nonfinite_steps": self.state.nonfinite_steps,
                          "peak_mem_gb": peak_memory_gb(),
                          **self.throughput.report(self.cfg.train.max_steps - self.state.step),
                          **self.clock.report(), **evals})

    def _evaluate(self) -> None:
        with self.throughput.paused():      # no training: not in the next step line's tokens/s and ETA
            self._evaluate_held_out()

    def _evaluate_held_out(self) -> None:
        self.state.last_eval = self.evaluator(self.engine)
        self.metrics.log({"step": self.state.step, "tokens_seen": self.state.tokens, **self.state.last_eval})
        if not self.plan_checked and self.layout.is_main:      # once: the measured stages against the plan
            device = torch.cuda.get_device_name() if self.device.type == "cuda" else None
            cpu = None if device else self.clock.steady_cpu_means()
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
        summary = summarize(self.cfg, self.state, self.manifest, latest_checkpoint(self.checkpointer.root),
                            self.layout.world_size)
        if self.evals.enabled and self.cfg.evals.mode == "inline":
            summary["evals_inline_s"] = round(self.evals.inline_total_s, 2)
        return summary

    def _close(self, exit_code: int) -> None:
        self.evals.close(exit_code)
        super()._close(exit_code)


def run_sources(cfg: RunConfig) -> dict[str, tuple[Manifest, TokenizerInfo]]:
    """Every data dir's manifest and tokenizer, one tokenizer for all (checked)."""
    return open_sources(list(dict.fromkeys(source_dirs(cfg).values())))


def run_schedule(cfg: RunConfig, world_size: int, sources: dict[str, tuple[Manifest, TokenizerInfo]]) -> RunSchedule:
    return RunSchedule(cfg, world_size, {d: manifest.seq_len for d, (manifest, _) in sources.items()})


def phase_token_budget(cfg: RunConfig, phase: Phase) -> int:
    """Tokens per packed micro-batch in ``phase`` (0: padded batches)."""
    if cfg.data.packing == "padded":
        return 0
    return cfg.data.tokens_per_batch or phase.batch_size * phase.seq_len


def train_loader(cfg: RunConfig, layout: dist_utils.DistEnv, sources: dict[str, tuple[Manifest, TokenizerInfo]],
                 objective) -> PretrainLoader | MixedLoader:
    """``data.dir`` alone: its stream; with ``data.sources`` or ``phases``: the mixed stream of every source."""
    if cfg.data.dir and not cfg.phases:
        manifest, tokenizer = sources[cfg.data.dir]
        return PretrainLoader(cfg.data.dir, manifest, tokenizer, batch_size=cfg.data.batch_size,
                              num_workers=cfg.data.num_workers, token_budget=cfg.data.token_budget(manifest.seq_len),
                              rank=layout.rank, world_size=layout.world_size, seed=cfg.run.seed,
                              masking=objective.masking)
    return MixedLoader(sources, rank=layout.rank, world_size=layout.world_size, num_workers=cfg.data.num_workers,
                       seed=cfg.run.seed, masking=objective.masking)


def check_lengths(objective, schedule: RunSchedule) -> None:
    """The model takes the longest sequences of any phase."""
    longest = max(schedule.phases, key=lambda phase: phase.seq_len)
    for section, model_cfg in objective.model_configs().items():
        check_data_fits_model(model_cfg, longest.seq_len, f"{longest.key}: seq_len {longest.seq_len}",
                              "raise it or prepare the data with a smaller --seq-len", section)


def check_run(cfg: RunConfig) -> str:
    """``distaff pretrain --check``: the checks a run makes before building its engine (:class:`PretrainPlan`, as
    rank 0 of ``WORLD_SIZE``, default 1); a summary line. A remote data dir is not read: its ``pipe:`` command
    would run (the run checks it when it starts)."""
    layout = dist_utils.DistEnv(0, dist_utils.env_from_environ().world_size, 0)
    remote = [d for d in source_dirs(cfg).values() if is_remote(d)]
    if remote:
        return (f"config fits; data dir {remote[0]} is remote and was not read (--check runs no command and "
                "fetches nothing): its data, the model's vocabulary and a checkpoint to resume are checked when the "
                f"run starts; {cfg.train.max_steps} steps on {layout.world_size} rank(s)")
    plan = PretrainPlan(cfg, layout)
    model_cfg, resume = plan.model_cfg, plan.resume_from
    return (f"config, data {cfg.data.first_dir} (seq_len {plan.manifest.seq_len}, tokenizer of "
            f"{plan.tokenizer.vocab_size} pieces) and model ({model_cfg.num_hidden_layers} layers, hidden "
            f"{model_cfg.hidden_size}, {cfg.train.objective}) fit; "
            + (f"resumes from {resume}" if resume else f"a new run in {cfg.out_dir}")
            + f"; {cfg.train.max_steps} steps on {layout.world_size} rank(s)" + eval_summary(cfg.evals))


def run_identity(cfg: RunConfig, objective, loader: PretrainLoader | MixedLoader) -> RunIdentity:
    """What a checkpoint must match for this run to resume it (train/run/resume_check.py); the data by what the
    loader was built from (the shards' sample counts and the tokenizer's fingerprint), not by its path."""
    data = loader.state_dict()["data"]

    def data_problem(state: dict, where: str) -> str | None:
        saved = state.get("data", data)
        if saved == data or continues(saved, data):
            return None
        if isinstance(saved, list) and not isinstance(data, list):
            return (f"data.sources/phases: {where} was written by a run that read several sources or phases; this "
                    "run reads data.dir alone: give it the run's data.sources and phases")
        return (f"{'data.sources/phases' if isinstance(data, list) else 'data.dir'}: the data of {where} differ from "
                f"this run's {cfg.data.first_dir} (other shards or sources, or another tokenizer)")

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


def missing_inputs(cfg: RunConfig) -> list[str]:
    """One line for each local data dir of the run that is missing or holds no manifest (remote ones are read when
    the run starts)."""
    missing = []
    for key, value in source_dirs(cfg).items():
        data_dir = Path(value)
        if not is_remote(value) and not (data_dir / MANIFEST_FILE).is_file():
            problem = "does not exist" if not data_dir.exists() else f"holds no {MANIFEST_FILE}"
            missing.append(f"{key}: {data_dir.resolve()} {problem}; set {key} to a folder written by "
                           f"`distaff data prepare ... --out DIR`")
    return missing


def load_run_config(path: str | None, overrides: list[str]) -> RunConfig:
    """The run config, with every local data dir checked: a missing folder or manifest is refused here, before
    any process group or run folder exists."""
    cfg = load_config(path, overrides)
    missing = missing_inputs(cfg)
    if missing:
        raise ConfigError(missing[0])
    return cfg


def train(cfg: RunConfig, layout: dist_utils.DistEnv) -> int:
    """Run (or resume) training on this rank; the exit code."""
    return Trainer(cfg, layout).run()


def parse_args(argv: list[str]) -> argparse.Namespace:
    return runtime_parse_args("distaff pretrain", __doc__.splitlines()[0], argv)


def main(argv: list[str] | None = None) -> int:
    return run_main("distaff pretrain", __doc__.splitlines()[0], argv, load_run_config, train,
                    Inspection(resolved=config_to_dict, check=check_run, load=load_config, missing=missing_inputs,
                               needs="the data (manifest, tokenizer, shards), the model against the data, the "
                                     "schedule's sources and phases, a checkpoint to resume"))

