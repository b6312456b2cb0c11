"""Combining an objective's several losses into the one minimised (``rtd.loss_weighting``).

Each loss ``L_i`` has a configured weight ``w_i`` (RTD: 1 for the generator's MLM loss,
``rtd.weight`` for the discriminator's). The methods:

- ``fixed``: ``sum_i w_i L_i``.
- ``initial``: ``sum_i w_i L_i / L_i(0)``, each loss relative to its value at the first step, so
  losses of different scales start with equal say (times ``w_i``). ``L_i(0)`` is the first
  finite step's mean over every rank and micro-batch, taken from the step's global sums (so all
  ranks record the same values) and saved in each checkpoint; that first step itself divides each
  micro-batch's losses by their own (detached) values.
- ``uncertainty``: homoscedastic task uncertainty (Kendall, Gal and Cipolla, CVPR 2018):
  ``sum_i exp(-s_i) L_i + s_i`` with a learned log-variance ``s_i`` per loss. The paper's
  classification form is ``exp(-s) L + s / 2`` and its regression form ``(exp(-s) L + s) / 2``; we
  use ``exp(-s) L + s``, whose optimum ``exp(-s_i) = 1 / L_i`` weighs every loss by its inverse
  current value, whatever its kind. ``s_i`` starts at ``-log w_i`` (the first step weighs as
  ``fixed`` does); it is a model parameter (ZeRO shards, checkpoints and clips it with the rest)
  and, being 1-D, takes no weight decay (:func:`distaff.train.run.engine.parameter_groups`).

The effective weight of each loss (``w_i``, ``w_i / L_i(0)`` or ``exp(-s_i)``) is returned with
the loss so the objective can log it.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import nn

LOSS_WEIGHTINGS = ("fixed", "initial", "uncertainty")
# the smallest loss `initial` divides by: a rank whose first micro-batch has no labelled token has a loss of 0
MIN_INITIAL_LOSS = 1e-12


class InitialLosses:
    """``initial``'s recorded ``L_i(0)``: checkpointed per rank (every rank holds the same values)."""

    def __init__(self) -> None:
        self.values: list[float] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"values": self.values}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values = state["values"]

    def load_resized_state_dict(self, states: list[dict[str, Any]]) -> None:
        self.load_state_dict(states[0])


class LossWeighting(nn.Module):
    """Combines losses ``L_i`` (configured weights ``weights``) by ``method``, one of :data:`LOSS_WEIGHTINGS`."""

    def __init__(self, method: str, weights: Sequence[float]):
        super().__init__()
        if method not in LOSS_WEIGHTINGS:
            raise ValueError(f"loss weighting must be one of {list(LOSS_WEIGHTINGS)}, got {method!r}")
        if not all(w > 0 for w in weights):
            raise ValueError(f"loss weights must be positive, got {list(weights)}")
        self.method, self.weights = method, [float(w) for w in weights]
        self.initial = InitialLosses()
        if method == "uncertainty":
            self.log_variance = nn.Parameter(torch.tensor([-math.log(w) for w in self.weights]))

    def forward(self, losses: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The combined loss, and each loss's effective weight (float64, detached)."""
        if self.method == "uncertainty":
            log_variance = self.log_variance.float()
            weights = torch.exp(-log_variance)
            total = (weights * torch.stack([loss.float() for loss in losses]) + log_variance).sum()
            return total, weights.detach().double()
        weights = self.weights
        if self.method == "initial":
            scales = self.initial.values or [loss.detach().clamp_min(MIN_INITIAL_LOSS) for loss in losses]
            weights = [w / scale for w, scale in zip(weights, scales)]
        total = weights[0] * losses[0]
        for weight, loss in zip(weights[1:], losses[1:]):
            total = total + weight * loss
        device = losses[0].device
        return total, torch.stack([torch.as_tensor(w, dtype=torch.float64, device=device) for w in weights])

    def record(self, global_losses: Sequence[float]) -> None:
        """After each finite step, the losses' global means: ``initial`` keeps the first step's."""
        if self.method == "initial" and self.initial.values is None:
            self.initial.values = [max(float(loss), MIN_INITIAL_LOSS) for loss in global_losses]
