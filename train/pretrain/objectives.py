"""Pretraining objectives (``train.objective``): what the trainer builds and logs, behind one interface.

An objective builds the model from the run config, turns a forward's output into additive sums
(summed over micro-batches and ranks by the step, then into metrics), names the per-rank state
it adds to checkpoints, counts its FLOPs, and says what export needs to rebuild the model. The
trainer and the step only ever talk to this interface, so they hold no branch per objective.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distaff.train.data.collator import MaskingConfig
from distaff.train.model.config import ModelConfig
from distaff.train.model import rtd
from distaff.train.model.deberta import DebertaForMaskedLM, MaskedLMOutput
from distaff.train.model.flops import train_flops_per_token
from distaff.train.run.config import ConfigError, RunConfig
from distaff.train.run.metrics import perplexity
from distaff.train.run.steps import Objective


class MaskedLMObjective(Objective):
    """Masked-LM: sums ``[loss * labelled, labelled, correct]``."""

    num_sums = 3

    def __init__(self, cfg: RunConfig, model_cfg: ModelConfig):
        self.cfg, self.model_cfg = cfg, model_cfg
        self.masking: MaskingConfig | None = cfg.data.masking  # what the data collator does to the input

    def model_configs(self) -> dict[str, ModelConfig]:
        """Each network's config, by the run-config section that sets it."""
        return {"model": self.model_cfg}

    def build(self, rank: int) -> nn.Module:
        return DebertaForMaskedLM(self.model_cfg)

    def sums(self, out: MaskedLMOutput) -> torch.Tensor:
        labelled = out.num_labelled.double()
        return torch.stack([out.loss.detach().double() * labelled, labelled, out.num_correct.double()])

    def report(self, sums: list[float]) -> dict[str, float]:
        loss_sum, labelled, correct = sums
        return {"loss": loss_sum / max(labelled, 1.0), "accuracy": correct / max(labelled, 1.0)}

    def eval_report(self, sums: list[float]) -> dict[str, float]:
        values = self.report(sums)
        return {"eval_loss": values["loss"], "eval_accuracy": values["accuracy"],
                "eval_perplexity": perplexity(values["loss"]), "eval_tokens": int(sums[1])}

    def per_rank_state(self, model: nn.Module) -> dict[str, Any]:
        return {}

    def flops_per_token(self, seq_len: int) -> float:
        return train_flops_per_token(self.model_cfg, seq_len, self.cfg.data.masking.mlm_probability)

    def meta(self) -> dict[str, Any]:
        return {}


class ReplacedTokenDetectionObjective(Objective):
    """DeBERTa-v3's RTD (:mod:`distaff.train.model.rtd`); ``model_cfg`` is the discriminator's."""

    num_sums = rtd.NUM_SUMS

    def __init__(self, cfg: RunConfig, model_cfg: ModelConfig):
        self.cfg = cfg
        # the RTD head reads the encoder output: the discriminator has no Enhanced Mask Decoder
        self.model_cfg = model_cfg.replace(emd=False)
        self.generator_cfg = cfg.generator_config(model_cfg)
        self.masking: MaskingConfig | None = cfg.data.masking

    def model_configs(self) -> dict[str, ModelConfig]:
        return {"model": self.model_cfg, "rtd.generator": self.generator_cfg}

    def build(self, rank: int) -> nn.Module:
        """Same weights on every rank (the caller seeds), a different sampling stream per rank;
        the discriminator from ``rtd.init_discriminator`` when set."""
        model = rtd.ReplacedTokenDetection(self.generator_cfg, self.model_cfg, sharing=self.cfg.rtd.embedding_sharing,
                                           weight=self.cfg.rtd.weight, seed=sampling_seed(self.cfg.run.seed, rank),
                                           loss_weighting=self.cfg.rtd.loss_weighting)
        source = self.cfg.rtd.init_discriminator
        if source:
            from distaff.train.model.hf import discriminator_hf_state

            try:
                state = discriminator_hf_state(source, model.discriminator)
            except (FileNotFoundError, ValueError) as err:
                raise ConfigError(f"rtd.init_discriminator: {err}") from None
            model.start_from_discriminator(state)
            if rank == 0:
                head = "with" if any(k.startswith("mask_predictions.") for k in state) else "without (fresh head)"
                print(f"distaff: discriminator initialised from {source}, {head} its RTD head", flush=True)
        return model

    def sums(self, out: rtd.RTDOutput) -> torch.Tensor:
        return out.sums

    def report(self, sums: list[float]) -> dict[str, float | None]:
        return rtd.report(sums, self.cfg.rtd.weight)

    def eval_report(self, sums: list[float]) -> dict[str, float | None]:
        # the loss weights are the training step's: no held-out figure
        values = {f"eval_{key}": value for key, value in self.report(sums).items() if not key.startswith("weight_")}
        return {**values, "eval_perplexity": perplexity(values["eval_gen_loss"]), "eval_tokens": int(sums[4])}

    def per_rank_state(self, model: nn.Module) -> dict[str, Any]:
        initial = {"initial_losses": model.weighting.initial} if self.cfg.rtd.loss_weighting == "initial" else {}
        return {"sampler": model.sampler, **initial}

    def after_step(self, model: nn.Module, sums: list[float]) -> None:
        """``initial`` weighting records the first finite step's global mean losses."""
        model.weighting.record(rtd.mean_losses(sums))

    def flops_per_token(self, seq_len: int) -> float:
        """Both networks, forward and backward; the RTD head instead of an MLM head in the
        discriminator; the sampling's vocabulary projection (forward only) on the masked tokens."""
        masked = self.cfg.data.masking.mlm_probability
        disc, gen = self.model_cfg, self.generator_cfg
        head = 3 * (2 * disc.hidden_size * disc.hidden_size + 2 * disc.hidden_size)
        sampling = masked * 2 * gen.embedding_size * gen.vocab_size
        return (train_flops_per_token(gen, seq_len, masked) + train_flops_per_token(disc, seq_len, 0.0)
                + head + sampling)

    def meta(self) -> dict[str, Any]:
        return {"generator_config": self.generator_cfg.to_dict()}


class AllTokenObjective(MaskedLMObjective):
    """T-TA (Shin et al., ACL 2020): a model with ``tta`` (no output depends on its own input token)
    predicts every non-special token of the unmasked input; sums and metrics are masked-LM's."""

    def __init__(self, cfg: RunConfig, model_cfg: ModelConfig):
        # T-TA's layers take their queries from positions: the Enhanced Mask Decoder has no place in it
        super().__init__(cfg, model_cfg.replace(emd=False, tta=True))
        self.masking = None

    def flops_per_token(self, seq_len: int) -> float:
        return train_flops_per_token(self.model_cfg, seq_len, 1.0)  # every token goes through the head


OBJECTIVES = {"mlm": MaskedLMObjective, "rtd": ReplacedTokenDetectionObjective, "tta": AllTokenObjective}


def sampling_seed(seed: int, rank: int) -> int:
    return seed * 1_000_003 + 104_729 * (rank + 1)


def objective_for(cfg: RunConfig, model_cfg: ModelConfig) -> MaskedLMObjective | ReplacedTokenDetectionObjective:
    return OBJECTIVES[cfg.train.objective](cfg, model_cfg)
