"""One optimizer step over micro-batches, and one evaluation pass over the held-out split."""

from __future__ import annotations

from typing import Iterator

import torch

from . import distributed as dist_utils
from .data.loader import EvalLoader
from .objectives import MaskedLMObjective, ReplacedTokenDetectionObjective

Objective = MaskedLMObjective | ReplacedTokenDetectionObjective


def forward_batch(engine, batch: dict[str, torch.Tensor], device: torch.device):
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    return engine(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])


def train_step(engine, batches: Iterator[dict], grad_accum: int, device: torch.device,
               objective: Objective) -> torch.Tensor:
    """Forward and backward over ``grad_accum`` micro-batches, stopping short of the optimizer step
    (:func:`optimizer_step`, once the ranks have agreed the loss was finite); this rank's sums
    (the objective's, then ``tokens, samples``) as a float64 tensor on ``device`` (kept there so
    micro-batches queue without a host sync)."""
    sums = torch.zeros(objective.num_sums + 2, dtype=torch.float64, device=device)
    for micro in range(grad_accum):
        batch = next(batches)
        ids = batch["input_ids"]
        out = forward_batch(engine, batch, device)
        engine.backward(out.loss)
        if micro < grad_accum - 1:
            engine.step()   # below the accumulation boundary DeepSpeed only counts the micro-step
        sums[:-2] += objective.sums(out)
        sums[-2:] += torch.tensor([ids.numel(), ids.shape[0]], dtype=torch.float64, device=device)
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
