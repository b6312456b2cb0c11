"""One optimizer step over micro-batches, and one evaluation pass over the held-out split.

Batches are padded (``attention_mask``, ``[B, N]``) or packed (``cu_seqlens``, 1-D over tokens: see
``MLMCollator.packed``); both go to the model as keyword arguments.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from distaff.kernels import IGNORE_INDEX

from distaff.train.core import distributed as dist_utils
from distaff.train.data.collator import batch_counts, is_packed
from distaff.train.data.loader import EvalLoader
from distaff.train.run.metrics import NO_CLOCK, StageClock


class Objective:
    """What every objective shares: the model's inputs are the whole batch and its training loss is the
    model's own (fine-tuning adds SiFT's adversarial term)."""

    num_sums: int

    def model_inputs(self, batch: dict) -> dict:
        return batch

    def training_loss(self, engine, batch: dict, out) -> torch.Tensor:
        return out.loss

    def after_step(self, model: nn.Module, sums: list[float]) -> None:
        """Called with each finite step's global sums (the same on every rank)."""


def to_device(batch: dict[str, torch.Tensor | int], device: torch.device) -> dict[str, torch.Tensor | int]:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def forward_batch(engine, batch: dict[str, torch.Tensor | int], device: torch.device):
    batch = to_device(batch, device)
    return engine(batch.pop("input_ids"), **batch)


def _loss_weights(micro_batches: list[dict], world_size: int, device: torch.device) -> list[float] | None:
    """Packed batches: the factor turning each micro-batch's mean loss into its share of the mean over
    every labelled token of the step on all ranks (one small collective). DeepSpeed divides the
    gradients by ``grad_accum`` and averages them over ranks, hence the ``world_size * grad_accum``.
    Padded batches keep the mean of the micro-batch means (None)."""
    if not is_packed(micro_batches[0]):
        return None
    local = [float((b["labels"] != IGNORE_INDEX).sum()) for b in micro_batches]
    total = dist_utils.all_reduce_sum([sum(local)], device)[0]
    return [n * world_size * len(micro_batches) / max(total, 1.0) for n in local]


def train_step(engine, batches: Iterator[dict], grad_accum: int, device: torch.device, objective: Objective,
               world_size: int = 1, clock: StageClock = NO_CLOCK) -> torch.Tensor:
    """Forward and backward over ``grad_accum`` micro-batches, stopping short of the optimizer step
    (:func:`optimizer_step`, once the ranks have agreed the loss was finite); this rank's sums
    (the objective's, then ``tokens, samples, positions``) as a float64 tensor on ``device`` (kept
    there so micro-batches queue without a host sync); ``tokens`` are real tokens, ``positions``
    include padding; ``clock`` times the stages (data wait, forward, backward)."""
    micro_batches = [next(batches) for _ in range(grad_accum)]
    clock.lap("data_wait")
    weights = _loss_weights(micro_batches, world_size, device)
    sums = torch.zeros(objective.num_sums + 3, dtype=torch.float64, device=device)
    for micro, batch in enumerate(micro_batches):
        # set, not counted by DeepSpeed: its count assumes every step has the same number of micro-batches
        engine.set_gradient_accumulation_boundary(micro == grad_accum - 1)
        counts = batch_counts(batch)
        batch = to_device(batch, device)
        out = forward_batch(engine, objective.model_inputs(batch), device)
        loss = objective.training_loss(engine, batch, out)
        clock.lap("forward")
        engine.backward(loss if weights is None else loss * weights[micro])
        clock.lap("backward")
        if micro < grad_accum - 1:
            engine.step()   # below the accumulation boundary DeepSpeed only counts the micro-step
        sums[:-3] += objective.sums(out)
        sums[-3:] += torch.tensor(counts, dtype=torch.float64, device=device)
    return sums


def _base_optimizer(optimizer):
    """The torch optimizer under DeepSpeed's wrappers (ZeRO, bf16/fp16), which updates the weights."""
    while getattr(optimizer, "optimizer", None) is not None and optimizer.optimizer is not optimizer:
        optimizer = optimizer.optimizer
    return optimizer


def optimizer_step(engine, skip: bool) -> None:
    """The accumulation boundary's ``engine.step()``. With ``skip`` (a non-finite loss on some rank),
    DeepSpeed still runs its collectives and clears the gradients on every rank alike, but the base
    optimizer's update is a no-op: weights and Adam moments stay as they were."""
    if not skip:
        engine.step()
        return
    base = _base_optimizer(engine.optimizer)
    base.step = lambda *args, **kwargs: None
    try:
        engine.step()
    finally:
        del base.step


class Evaluator:
    """The objective's metrics on the held-out split (``eval_`` keys), token-weighted over all ranks.

    Every rank runs the same number of batches (ZeRO-3 forwards are collective), and the global
    RNG is forked so evaluating never changes the training run's random stream.
    """

    def __init__(self, loader: EvalLoader, max_batches: int, world_size: int, device: torch.device,
                 objective: Objective):
        self.loader, self.max_batches = loader, max_batches
        self.world_size, self.device, self.objective = world_size, device, objective

    @torch.no_grad()
    def __call__(self, engine) -> dict[str, float]:
        engine.eval()
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            sums = self._local_sums(engine)
        engine.train()
        sums = dist_utils.all_reduce_sum(sums, self.device)
        if sums[1] == 0:    # both objectives' second sum counts the masked tokens
            raise RuntimeError(f"evaluation saw no labelled tokens: is the held-out split of "
                               f"{self.loader.data_dir} empty?")
        return self.objective.eval_report(sums)

    def _local_sums(self, engine) -> torch.Tensor:
        """This rank's objective sums, over batches every rank has."""
        sums = torch.zeros(self.objective.num_sums, dtype=torch.float64, device=self.device)
        done, batches = 0, iter(self.loader)
        while self.max_batches == 0 or done < self.max_batches:
            batch = next(batches, None)
            have = dist_utils.all_reduce_sum([0.0 if batch is None else 1.0], self.device)[0]
            if have < self.world_size:
                break
            sums += self.objective.sums(forward_batch(engine, batch, self.device))
            done += 1
        return sums
