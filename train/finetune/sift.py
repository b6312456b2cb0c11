"""SiFT: scale-invariant fine-tuning (DeBERTa paper, He et al. 2021, "Scale-invariant fine-tuning").

A virtual adversarial regulariser: the classifier should predict the same thing when its
*normalised* word embeddings (the output of ``deberta.embeddings.LayerNorm``) are nudged in the
direction that changes its prediction most. Perturbing after the normalisation keeps a
perturbation of a given size equally strong whatever the scale of the embedding table.

Per training step, on the batch the trainer has just run:

1. ``delta`` <- normal noise of std ``perturbation_size`` (clipped to +-2 std), one vector per token;
2. ``adversarial_steps`` times: run the model with ``delta`` added to the normalised embeddings,
   take the gradient of the divergence from the clean (detached) prediction w.r.t. ``delta`` only,
   and step ``delta`` up it by ``step_size`` times the gradient divided by its per-token max-abs;
3. run the model once more with the final (detached) ``delta`` and return
   ``loss_weight * divergence(perturbed, clean)``, with gradients into the parameters through both
   predictions; the trainer adds it to the task loss.

The divergence is the symmetric KL of the two predicted distributions (classification), or for
regression the squared difference of the predictions: the symmetric KL of two unit-variance
Gaussians centred on them. docs/finetuning.md ("SiFT") gives the sources and the decisions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distaff.train.core.errors import finite_float, shown
from distaff.train.model.config import ConfigError

__all__ = ["SiftConfig", "SiFT", "divergence", "symmetric_kl"]

_TINY = torch.finfo(torch.float32).tiny  # a zero gradient divided by it stays zero


@dataclass
class SiftConfig:
    """The ``sift:`` section of a fine-tuning config; defaults are the official implementation's."""

    enabled: bool = False
    perturbation_size: float = 1e-2     # std of the initial noise on the normalised embeddings
    step_size: float = 1e-4             # largest change of one coordinate per ascent step
    adversarial_steps: int = 1          # ascent steps on the perturbation (0: random noise only)
    loss_weight: float = 1.0            # weight of the adversarial term added to the task loss

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"sift.enabled must be true or false, got {self.enabled!r}")
        if type(self.adversarial_steps) is not int or self.adversarial_steps < 0:  # bool is not a count
            raise ConfigError(f"sift.adversarial_steps must be an integer >= 0, got {self.adversarial_steps!r}")
        for name, positive in (("perturbation_size", True), ("step_size", False), ("loss_weight", False)):
            value = getattr(self, name)
            if isinstance(value, str):      # a number, not text that reads as one
                raise ConfigError(f"sift.{name}: expected a finite number, got {shown(value)}")
            setattr(self, name, finite_float(value, f"sift.{name}", low=0, low_open=positive))


def symmetric_kl(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``KL(p || q) + KL(q || p)`` of the softmax distributions over the last dim, batch mean, float32."""
    log_p, log_q = F.log_softmax(logits.float(), -1), F.log_softmax(target.float(), -1)
    return ((log_p.exp() - log_q.exp()) * (log_p - log_q)).sum(-1).mean()


def divergence(logits: torch.Tensor, target: torch.Tensor, regression: bool) -> torch.Tensor:
    """Symmetric KL for class logits; for regression outputs the mean squared difference (the symmetric
    KL of two unit-variance Gaussians centred on the predictions). Float32 whatever the inputs' dtype."""
    if regression:
        return (logits.float() - target.float()).pow(2).mean()
    return symmetric_kl(logits, target)


class _RandomState:
    """The RNG state of the CPU and of ``device`` when it is a GPU, to replay one dropout draw."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


class _Perturbation:
    """The per-token perturbation ``delta`` (float32), drawn at the first perturbed forward from the shape of
    the normalised embeddings, and the ascent step on it.

    As a forward hook it adds ``delta`` to the module's output. Every perturbed forward replays the random
    state the first one had there, so all of them draw the same dropout masks (the model's dropouts all come
    after the embedding LayerNorm) and the ascent sees ``delta``'s effect alone."""

    def __init__(self, size: float):
        self.size = size
        self.delta: torch.Tensor | None = None
        self.random_state: _RandomState | None = None
        self.ascending = True  # False: the last forward, whose delta is a constant

    def __call__(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        if self.delta is None:
            noise = torch.randn(output.shape, device=output.device, dtype=torch.float32) * self.size
            self.delta = noise.clamp(-2 * self.size, 2 * self.size).requires_grad_()
            self.random_state = _RandomState(output.device)
        else:
            self.random_state.restore()
        delta = self.delta if self.ascending else self.delta.detach()
        return (output.float() + delta).to(output.dtype)

    def ascend(self, logits: torch.Tensor, target: torch.Tensor, regression: bool, step_size: float) -> bool:
        """One normalised gradient-ascent step on ``delta`` of the divergence of ``logits`` (computed with
        ``delta``) from ``target``; False (``delta`` kept) when the gradient is not finite. Only ``delta``'s
        gradient is computed: nothing reaches the parameters.

        The divergence's gradient w.r.t. the logits is rescaled per example to a max-abs of 1 before it goes
        back through the model. Each token's gradient comes from its own example alone, so a per-example factor
        leaves the per-token normalised step as it is; but unscaled, an fp16 backward of a divergence this
        small underflows to zero for most tokens."""
        wide = logits.float()
        (upstream,) = torch.autograd.grad(divergence(wide, target, regression), wide)
        rows = upstream.reshape(upstream.shape[0], -1)
        upstream = (rows / rows.abs().amax(-1, keepdim=True).clamp_min(_TINY)).view_as(upstream)
        (grad,) = torch.autograd.grad(wide, self.delta, upstream)
        if not bool(torch.isfinite(grad).all()):
            return False
        step = grad / grad.abs().amax(-1, keepdim=True).clamp_min(_TINY)
        self.delta = (self.delta.detach() + step_size * step).requires_grad_()
        return True


def _model_logits(forward: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``forward()``, refusing logits that came through a DeepSpeed engine's ``forward``.

    DeepSpeed (0.19 here) hooks the engine's outputs so that any backward through them is a training
    backward: the ascent's gradient w.r.t. the perturbation would then be refused (ZeRO-0) or would start
    the gradient reduction (ZeRO-2 fails in it). The module's own ZeRO-3 hooks gather its parameters
    whichever way it is called, so SiFT's forwards call ``engine.module``."""
    logits = forward()
    if hasattr(logits, "_backward_hook_managers"):  # where DeepSpeed keeps those output hooks
        raise ValueError("SiFT: forward() must run the model itself (lambda: engine.module(**batch).logits), "
                         "not the DeepSpeed engine (engine(**batch)): a backward through the engine's "
                         "outputs is a training backward to DeepSpeed")
    return logits


class SiFT:
    """Scale-invariant fine-tuning for a :class:`~distaff.train.model.classifier.DebertaForSequenceClassification`.

    ``model`` is the module itself (under DeepSpeed, ``engine.module``): SiFT hooks its embedding
    LayerNorm during its own forwards only. ``skipped_updates`` counts ascent steps skipped because
    the perturbation's gradient was not finite.
    """

    def __init__(self, cfg: SiftConfig, model: nn.Module):
        embeddings = getattr(getattr(model, "deberta", None), "embeddings", None)
        if not isinstance(getattr(embeddings, "LayerNorm", None), nn.Module) or not hasattr(model, "regression"):
            raise TypeError(f"SiFT needs a DebertaForSequenceClassification (deberta.embeddings.LayerNorm, "
                            f".regression), got {type(model).__name__}; under DeepSpeed pass engine.module")
        self.cfg = cfg
        self.regression: bool = bool(model.regression)
        self.perturbed_module: nn.Module = embeddings.LayerNorm  # its output is what SiFT perturbs
        self.skipped_updates = 0

    def adversarial_loss(self, forward: Callable[[], torch.Tensor], clean_logits: torch.Tensor) -> torch.Tensor:
        """``loss_weight`` x the divergence between the model's predictions with and without the
        adversarial perturbation, to add to the task loss before backward (a float32 scalar; zero, with no
        forward run, when SiFT is disabled).

        ``forward`` reruns the model on this step's batch and returns its logits; under DeepSpeed it calls
        the module, ``lambda: engine.module(**batch).logits``, not the engine (see :func:`_model_logits`).
        ``clean_logits`` are this step's logits from the normal forward (through the engine), with their graph."""
        if not self.cfg.enabled or self.cfg.loss_weight == 0:
            return torch.zeros((), dtype=torch.float32, device=clean_logits.device)
        target = clean_logits.detach()
        perturbation = _Perturbation(self.cfg.perturbation_size)
        with self._perturbing(perturbation):
            for _ in range(self.cfg.adversarial_steps):
                if not perturbation.ascend(_model_logits(forward), target, self.regression, self.cfg.step_size):
                    self.skipped_updates += 1
            perturbation.ascending = False
            perturbed = _model_logits(forward)
        return self.cfg.loss_weight * divergence(perturbed, clean_logits, self.regression)

    @contextmanager
    def _perturbing(self, perturbation: _Perturbation) -> Iterator[None]:
        handle = self.perturbed_module.register_forward_hook(perturbation)
        try:
            yield
        finally:
            handle.remove()
