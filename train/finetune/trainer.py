"""Fine-tuning for sequence classification or regression: ``python -m distaff.train.finetune --config FT.yaml [key=value ...]``.

Same launchers, signals and exit codes as pretraining (:mod:`distaff.train.run.runtime`). Data flows one
way: config -> labelled data (:mod:`distaff.train.finetune.labelled`) -> encoder + fresh HF-layout head
(:class:`~distaff.train.model.classifier.DebertaForSequenceClassification`) -> DeepSpeed engine (layer-wise
lr decay as parameter groups) -> checkpoints and metrics. The dev set is evaluated every
``eval.every`` steps (or every epoch); the checkpoint with the best dev metric is kept under
``<out_dir>/best`` beside the latest ones under ``<out_dir>/checkpoints``, and ``eval.patience``
evaluations without improvement stop the run early.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from distaff.train.core import distributed as dist_utils
from distaff.train.data.errors import DataError
from distaff.train.finetune.classifier_init import load_encoder, resolve_tokenizer
from distaff.train.finetune.config import FinetuneConfig, finetune_config_to_dict, load_finetune_config, save_finetune_config
from distaff.train.finetune.labelled import InputFormat, LabelledData, display_names, load_labelled
from distaff.train.finetune.labelled_batches import EvalBatches, TrainBatches, model_inputs
from distaff.train.finetune.metrics import compute_metrics
from distaff.train.finetune.sift import SiFT
from distaff.train.model.classifier import DebertaForSequenceClassification
from distaff.train.model.config import ConfigError, check_data_fits_model
from distaff.train.model.flops import train_flops_per_token
from distaff.train.run.checkpoint import Checkpointer, RNGState, latest_checkpoint
from distaff.train.run.resume_check import RunIdentity, check_resumable
from distaff.train.run.engine import layer_decay_groups
from distaff.train.run.metrics import PLOT_FILE, Throughput, peak_memory_gb, plot_metrics
from distaff.train.run.runtime import Inspection, RunBase, TrainState, run_main
from distaff.train.run.schedule import lr_at
from distaff.train.run.steps import Objective
from distaff.train.run.steps import forward_batch, to_device
from distaff.train.run.weights import BEST_DIR, CLASSIFIER_TASK



@dataclass
class FinetuneState(TrainState):
    """Pretraining's counters plus what early stopping and the best checkpoint depend on."""
    best_metric: float | None = None
    best_step: int = 0
    last_eval_step: int = -1
    evals_without_improvement: int = 0
    stopped_early: bool = False
    # the epoch arithmetic across a resume on another number of ranks (another number of steps per epoch):
    # the epochs done and the step count when the steps per epoch last changed, and their first value
    steps_per_epoch: int = 0
    first_steps_per_epoch: int = 0
    epochs_before: float = 0.0
    steps_before: int = 0


class ClassificationObjective(Objective):
    """The classifier's loss (plus SiFT's adversarial term when enabled); sums ``[loss * examples, examples]``."""

    num_sums = 2

    def __init__(self, sift: SiFT | None):
        self.sift = sift

    def model_inputs(self, batch: dict) -> dict:
        return model_inputs(batch)

    def training_loss(self, engine, batch: dict, out) -> torch.Tensor:
        if self.sift is None:
            return out.loss
        inputs = {k: v for k, v in model_inputs(batch).items() if k != "labels"}
        # the module, not the engine: DeepSpeed treats any backward through the engine's outputs as training
        return out.loss + self.sift.adversarial_loss(lambda: engine.module(**inputs).logits, out.logits)

    def sums(self, out) -> torch.Tensor:
        examples = torch.tensor(float(out.logits.shape[0]), dtype=torch.float64, device=out.loss.device)
        return torch.stack([out.loss.detach().double() * examples, examples])

    def report(self, sums: list[float]) -> dict[str, float]:
        return {"loss": sums[0] / max(sums[1], 1.0)}


def input_format(cfg: FinetuneConfig) -> InputFormat:
    data = cfg.data
    return InputFormat(text_column=data.text_column, label_column=data.label_column,
                       text_pair_column=data.text_pair_column or None,
                       columns=tuple(data.columns) if data.columns else None)


def load_data(cfg: FinetuneConfig, tokenizer) -> LabelledData:
    """The train and dev sets, tokenised; a bad file is a :class:`DataError` naming it (and the line)."""
    data = cfg.data
    return load_labelled(data.train, input_format(cfg), tokenizer, data.max_len, regression=cfg.regression,
                         dev_file=data.dev or None, dev_fraction=data.dev_fraction, seed=data.split_seed,
                         labels=data.labels or None)


def missing_inputs(cfg: FinetuneConfig) -> list[str]:
    """One line for each file or folder the run reads that is not there: the encoder, the labelled files, a tokenizer
    named apart from the encoder's."""
    missing = []
    if not Path(cfg.model.init_from).exists():
        missing.append(f"model.init_from: {Path(cfg.model.init_from).resolve()} does not exist; set it to a "
                       "pretraining run's folder (scripts/demo.sh writes runs/demo/run), one of its checkpoints or a "
                       "Hugging Face model folder")
    for key, value in (("data.train", cfg.data.train), ("data.dev", cfg.data.dev), ("data.tokenizer", cfg.data.tokenizer)):
        if value and not Path(value).exists():
            missing.append(f"{key}: {Path(value).resolve()} does not exist")
    return missing


class FinetunePlan:
    """A fine-tuning run up to its engine: the encoder, tokenizer and labelled data loaded, the batches dealt, the
    steps planned and a checkpoint to resume checked. Built by every rank of a run, and by ``--check``."""

    def __init__(self, cfg: FinetuneConfig, layout: dist_utils.DistEnv,
                 from_rank0: Callable[[str], str] = lambda text: text):
        self.cfg, self.layout = cfg, layout
        missing = missing_inputs(cfg)
        if missing:
            raise ConfigError(missing[0])
        self.source = load_encoder(cfg.model.init_from, cfg.model.overrides)
        self.tokenizer = resolve_tokenizer(self.source, cfg.data.tokenizer, cfg.model.init_from)
        self.model_cfg = self.source.config
        check_data_fits_model(self.model_cfg, cfg.data.max_len, f"data.max_len {cfg.data.max_len}",
                              "lower data.max_len (the architecture is model.init_from's)")
        self.data = load_data(cfg, self.tokenizer)
        self.num_labels = 1 if cfg.regression else len(self.data.label_names)
        # the names an export shows (id2label), checked against the data's labels now, not at the first save
        self.label_names = display_names(self.data.label_names, cfg.data.label_names)
        self.loader = TrainBatches(self.data.train, batch_size=cfg.data.batch_size, rank=layout.rank,
                                   world_size=layout.world_size, seed=cfg.run.seed, pad_id=self.tokenizer.pad_id,
                                   packed=cfg.data.packing == "varlen")
        self.steps_per_epoch, self.max_steps = self._plan_steps()
        self.resume_from = self._check_resumable(from_rank0)

    def _plan_steps(self) -> tuple[int, int]:
        """Optimizer steps per epoch and in the run (``train.max_steps``, else ``train.epochs`` epochs)."""
        cfg = self.cfg
        per_epoch = self.loader.steps_per_epoch // cfg.train.grad_accum
        if per_epoch == 0:
            raise ConfigError(f"train.grad_accum: {cfg.train.grad_accum} micro-batches exceed the "
                              f"{self.loader.steps_per_epoch} an epoch of {cfg.data.train} holds on "
                              f"{self.layout.world_size} rank(s)")
        return per_epoch, cfg.train.max_steps or cfg.train.epochs * per_epoch

    def _check_resumable(self, from_rank0: Callable[[str], str]) -> Path | None:
        """The checkpoint to resume, chosen and verified as the run chooses it; one this run would resume with another
        model, ZeRO stage, task or seed, or whose batches were dealt otherwise (another batch size or data), is
        refused now, before the engine is built, naming the key (train/run/resume_check.py, shared with
        pretraining)."""
        cfg, main = self.cfg, self.layout.is_main
        return check_resumable(cfg.checkpoint.resume, cfg.out_dir / "checkpoints",
                               RunIdentity(model=self.model_cfg.to_dict(), seed=cfg.run.seed,
                                           zero_stage=cfg.zero.stage, objective=cfg.data.task,
                                           data_problem=self.loader.resume_problem),
                               is_main=main, from_rank0=from_rank0, report=print if main else lambda line: None)


def check_run(cfg: FinetuneConfig) -> str:
    """``distaff finetune --check``: everything a run checks before building its engine; a summary line."""
    plan = FinetunePlan(cfg, dist_utils.DistEnv(0, dist_utils.env_from_environ().world_size, 0))
    labels = "regression" if cfg.regression else f"{plan.num_labels} classes"
    return (f"config, model {cfg.model.init_from} and data fit ({len(plan.data.train)} train / {len(plan.data.dev)} dev "
            f"examples, {labels}); " + (f"resumes from {plan.resume_from}" if plan.resume_from else
                                         f"a new run in {cfg.out_dir}")
            + f"; {plan.max_steps} steps ({plan.steps_per_epoch} per epoch) on {plan.layout.world_size} rank(s)")


class FinetuneTrainer(RunBase):
    """One rank of a fine-tuning run: ``FinetuneTrainer(cfg, layout).run()``; returns the exit code."""

    def __init__(self, cfg: FinetuneConfig, layout: dist_utils.DistEnv):
        super().__init__(cfg, layout)
        plan = FinetunePlan(cfg, layout, lambda text: dist_utils.broadcast_text(text, self.device))
        source, self.tokenizer, self.model_cfg, self.data = plan.source, plan.tokenizer, plan.model_cfg, plan.data
        self.num_labels, self.loader, self.label_names = plan.num_labels, plan.loader, plan.label_names
        self.resume_from = plan.resume_from
        self.steps_per_epoch, self.max_steps = plan.steps_per_epoch, plan.max_steps
        self.engine = self._initialize_engine(lambda: self._build_model(source.weights), self._param_groups())
        sift = SiFT(cfg.sift, self.engine.module) if cfg.sift.enabled else None
        self.objective = ClassificationObjective(sift)
        self.state = FinetuneState()
        self.checkpointer = self._checkpointer(cfg.out_dir / "checkpoints", cfg.checkpoint.every, cfg.checkpoint.keep)
        self.best = self._checkpointer(cfg.out_dir / BEST_DIR, 0, 1)
        resumed_from = self._restore()
        if layout.is_main:
            save_finetune_config(cfg, cfg.out_dir / "config.yaml")
        self.metrics = self._open_metrics(
            resumed_from, max_steps=self.max_steps, what=self._describe(),
            wandb_config={**finetune_config_to_dict(cfg), "model_resolved": self.model_cfg.to_dict(),
                          "labels": self.data.label_names})
        self.throughput = Throughput(layout.world_size, train_flops_per_token(self.model_cfg, cfg.data.max_len, 0.0),
                                     None)
        self.batches = iter(self.loader)

    # ---------------------------------------------------------------- building

    def _build_model(self, weights: dict[str, torch.Tensor]) -> DebertaForSequenceClassification:
        model = DebertaForSequenceClassification(self.model_cfg, self.num_labels, self.cfg.model.pooler_dropout)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        fresh = [k for k in missing if not k.startswith(("pooler.", "classifier."))]
        if fresh or unexpected:
            raise ValueError(f"model.init_from {self.cfg.model.init_from}: missing {fresh[:5]}, unexpected "
                             f"{unexpected[:5]} encoder weights")
        return model

    def _param_groups(self):
        """Layer-wise lr decay groups when ``optim.layer_decay`` < 1, else the engine's default groups."""
        optim = self.cfg.optim
        if optim.layer_decay == 1.0:
            return None
        return lambda model: layer_decay_groups(model, optim.weight_decay, optim.layer_decay)

    def _checkpointer(self, root: Path, every: int, keep: int) -> Checkpointer:
        meta = {"task": CLASSIFIER_TASK, "config": finetune_config_to_dict(self.cfg),
                "model_config": self.model_cfg.to_dict(), "num_labels": self.num_labels,
                "label_names": self.label_names,
                "pooler_dropout": self.cfg.model.pooler_dropout}
        per_rank = {"data": self.loader, "rng": RNGState(self.layout.rank)}
        return self._new_checkpointer(root, per_rank=per_rank, meta=meta, every=every, keep=keep,
                                      tokenizer_dir=self.tokenizer.path)

    def _describe(self) -> str:
        data, cfg = self.data, self.cfg
        labels = "regression" if cfg.regression else f"{self.num_labels} classes {data.label_names}"
        skipped = sum(data.stats.skipped.values())
        return (f"; {len(data.train)} train / {len(data.dev)} dev examples ({labels}"
                f"{f', {skipped} skipped' if skipped else ''}), {self.steps_per_epoch} steps per epoch, "
                f"{self.max_steps} steps")

    # ---------------------------------------------------------------- the loop

    def _restore(self) -> Path | None:
        resumed_from = super()._restore()
        self._continue_plan()
        self.finished_before = resumed_from is not None and self._done()
        return resumed_from

    def _continue_plan(self) -> None:
        """A run by epochs resumed with another number of steps per epoch (other ranks or batch size) keeps its
        epochs: the epochs done so far are carried over, and the steps left are counted in the new steps."""
        state = self.state
        if state.steps_per_epoch and state.steps_per_epoch != self.steps_per_epoch:
            state.epochs_before, state.steps_before = self._epoch(state.step), state.step
        state.steps_per_epoch = self.steps_per_epoch
        state.first_steps_per_epoch = state.first_steps_per_epoch or self.steps_per_epoch
        if not self.cfg.train.max_steps:
            left = max(0.0, self.cfg.train.epochs - state.epochs_before)
            self.max_steps = state.steps_before + round(left * self.steps_per_epoch)

    def _epoch(self, step: int) -> float:
        """Epochs of data read after optimizer step ``step``: never less after a resume than before it."""
        state = self.state
        per_epoch = state.steps_per_epoch or self.steps_per_epoch
        return state.epochs_before + (step - state.steps_before) / per_epoch

    def _done(self) -> bool:
        return self.state.step >= self.max_steps or self.state.stopped_early

    def _finished_line(self) -> str:
        train = self.cfg.train
        if self.state.stopped_early:
            return (f"it stopped early at step {self.state.step} (eval.patience={self.cfg.eval.patience}); the best "
                    f"checkpoint is under {self.cfg.out_dir / BEST_DIR}")
        length = f"train.max_steps={train.max_steps}" if train.max_steps else f"train.epochs={train.epochs}"
        return (f"its latest checkpoint is at step {self.state.step}, the run's {self.max_steps} steps ({length}); "
                f"raise {length.split('=')[0]} to continue it")

    def _lr(self, step: int) -> float:
        """By steps with ``train.max_steps``; by epochs otherwise, counted in this run's steps per epoch, so that a
        resume on other ranks continues the schedule where it was (no second warmup, no jump)."""
        optim, state = self.cfg.optim, self.state
        if self.cfg.train.max_steps or not state.first_steps_per_epoch:
            at, total, scale = step, self.max_steps, 1.0
        else:
            # the steps this many ranks would have taken to get here (exactly ``step`` when nothing was resized)
            at = state.epochs_before * self.steps_per_epoch + (step - state.steps_before)
            total = self.cfg.train.epochs * self.steps_per_epoch
            scale = self.steps_per_epoch / state.first_steps_per_epoch     # warmup_steps were the first ranks' steps
        warmup = optim.warmup_steps * scale if optim.warmup_steps else round(optim.warmup_ratio * total)
        return lr_at(at, lr=optim.lr, warmup_steps=warmup, max_steps=total, schedule=optim.schedule,
                     min_lr_ratio=optim.min_lr_ratio)

    def _log_train(self, values: dict[str, float]) -> None:
        grad_norm = self.engine.get_global_grad_norm()
        self.metrics.log({"step": self.state.step, "epoch": self._epoch(self.state.step), **values,
                          "lr": self._lr(self.state.step - 1),
                          "grad_norm": None if grad_norm is None else float(grad_norm),
                          "nonfinite_steps": self.state.nonfinite_steps, "peak_mem_gb": peak_memory_gb(),
                          **self.throughput.report(self.max_steps - self.state.step), **self.clock.report()})

    def _eval_due(self) -> bool:
        every = self.cfg.eval.every or self.steps_per_epoch
        return self.state.step % every == 0

    def _next_eval_step(self) -> int:
        every = self.cfg.eval.every or self.steps_per_epoch
        return min(self.max_steps, (self.state.step // every + 1) * every)

    def _after_step(self, signalled: bool) -> None:
        step = self.state.step
        if self._eval_due() and step < self.max_steps:
            self._evaluate()
        self.checkpointer.maybe_save(step, signalled=signalled)

    def _finish(self) -> None:
        self.checkpointer.maybe_save(self.state.step, last=True)
        if self.state.last_eval_step != self.state.step:
            self._evaluate()

    # ---------------------------------------------------------------- evaluation

    def _evaluate(self) -> None:
        with self.throughput.paused():      # no training: not in the next step line's tokens/s and ETA
            self._evaluate_dev()

    def _evaluate_dev(self) -> None:
        """Dev metrics; a better ``eval.metric`` saves the best checkpoint, ``eval.patience`` evaluations
        without one stop the run."""
        state, metric = self.state, self.cfg.metric
        values = {f"eval_{key}": value for key, value in self._dev_metrics().items()}
        state.last_eval = values
        state.last_eval_step = state.step
        self.metrics.log({"step": state.step, **values})
        current = values[f"eval_{metric}"]
        if self._improves(current):
            state.best_metric, state.best_step, state.evals_without_improvement = current, state.step, 0
            self.best.save(state.step)
        else:
            state.evals_without_improvement += 1
            patience = self.cfg.eval.patience
            if patience and state.evals_without_improvement >= patience and state.step < self.max_steps:
                state.stopped_early = True
                if self.layout.is_main:
                    print(f"distaff: early stop at step {state.step}: dev {metric} has not improved on "
                          f"{state.best_metric:.4f} (step {state.best_step}) for {patience} evaluation(s)", flush=True)

    def _improves(self, value: float) -> bool:
        best = self.state.best_metric
        if not np.isfinite(value):
            return False
        if best is None:
            return True
        return value < best if self.cfg.metric == "loss" else value > best

    @torch.no_grad()
    def _dev_metrics(self) -> dict[str, float]:
        """Every rank predicts its share of the dev set; the logits meet in one sum over the ranks (each
        example's row is filled by exactly one rank), then every rank computes the same metrics."""
        dev = self.data.dev
        logits = torch.zeros(len(dev), self.num_labels, dtype=torch.float64, device=self.device)
        loader = EvalBatches(dev, batch_size=self.cfg.data.eval_batch_size or self.cfg.data.batch_size,
                             rank=self.layout.rank, world_size=self.layout.world_size, pad_id=self.tokenizer.pad_id,
                             packed=self.cfg.data.packing == "varlen")
        self.engine.eval()
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            for batch in loader:
                batch = to_device(batch, self.device)
                out = forward_batch(self.engine, model_inputs(batch), self.device)
                real = batch["weights"] > 0
                logits[batch["example_ids"][real]] = out.logits[real].double().view(-1, self.num_labels)
        self.engine.train()
        logits = torch.tensor(dist_utils.all_reduce_sum(logits.flatten(), self.device),
                              dtype=torch.float64).view(len(dev), self.num_labels)
        if self.cfg.regression:
            logits = logits.squeeze(-1)
        labels = torch.from_numpy(dev.labels)
        loss = self.engine.module.loss(logits, labels)
        return {"loss": float(loss), **compute_metrics(logits, labels)}

    # ---------------------------------------------------------------- closing

    def _resolved_config(self) -> dict[str, Any]:
        return finetune_config_to_dict(self.cfg)

    def _summary(self) -> dict[str, Any]:
        cfg, state, out_dir = self.cfg, self.state, self.cfg.out_dir
        plot = plot_metrics(out_dir / "metrics.jsonl", out_dir / PLOT_FILE) if cfg.logging.plot else None
        best = latest_checkpoint(out_dir / BEST_DIR)
        summary = {"steps": state.step, "epochs": self._epoch(state.step), "max_steps": self.max_steps,
                   "stopped_early": state.stopped_early, "task": cfg.data.task, "labels": self.data.label_names,
                   "train_examples": len(self.data.train), "dev_examples": len(self.data.dev),
                   "skipped": dict(self.data.stats.skipped), "metric": cfg.metric,
                   "best_metric": state.best_metric, "best_step": state.best_step,
                   "best_checkpoint": str(best) if best else None, **state.last_eval,
                   "world_size": self.layout.world_size, "train_time_s": round(state.train_time_s, 2),
                   "checkpoint": str(latest_checkpoint(self.checkpointer.root)), "run_dir": str(out_dir),
                   "metrics": str(out_dir / "metrics.jsonl"), "plot": str(plot) if plot else None}
        # a run stopped before its first dev evaluation (Ctrl-C, a signal) has no best yet: said so, not "n/a at step 0"
        best_line = (f"best dev {cfg.metric} {state.best_metric:.4f} at step {state.best_step} ({best})"
                     if state.best_metric is not None else f"best dev {cfg.metric}: none yet (stopped before the "
                     f"first dev evaluation, due at step {self._next_eval_step()})")
        print(f"distaff: summary\n  steps {state.step}/{self.max_steps}"
              f"{' (stopped early)' if state.stopped_early else ''} on {self.layout.world_size} rank(s) in "
              f"{state.train_time_s:.0f} s\n  {best_line}\n  run directory {out_dir}", flush=True)
        return summary


def train(cfg: FinetuneConfig, layout: dist_utils.DistEnv) -> int:
    """Run (or resume) fine-tuning on this rank; the exit code."""
    try:
        return FinetuneTrainer(cfg, layout).run()
    except DataError as err:    # every rank reads the files: they refuse together, as for a bad config value
        raise ConfigError(str(err)) from None


def main(argv: list[str] | None = None) -> int:
    return run_main("distaff finetune", __doc__.splitlines()[0], argv, load_finetune_config, train,
                    Inspection(resolved=finetune_config_to_dict, check=_check_run, load=load_finetune_config,
                               missing=missing_inputs, needs="the encoder and its tokenizer, the labelled data and "
                                                             "its labels, the steps per epoch, a checkpoint to resume"))


def _check_run(cfg: FinetuneConfig) -> str:
    try:
        return check_run(cfg)
    except DataError as err:
        raise ConfigError(str(err)) from None

