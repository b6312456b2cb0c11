"""DeBERTa-v3 pretraining: replaced-token detection (RTD) with gradient-disentangled embedding sharing.

ELECTRA's recipe as DeBERTa-v3 uses it: a small MLM *generator* (by default the discriminator's
config with half its layers) predicts the masked positions; a token is sampled from its
distribution at each of them (temperature 1, no gradient through the sampling); the
*discriminator* reads the original sequence with those positions replaced and classifies every
real token as original or replaced. A sampled token equal to the original counts as original.
Both networks take padded ``[B, N]`` batches or packed ones (``cu_seqlens``: attention within each
document, the RTD head reading each document's own ``[CLS]``), with the same results per real token.
Loss = generator MLM loss + ``weight`` x RTD loss (binary cross-entropy over real tokens), or the two
combined by another ``rtd.loss_weighting`` (:mod:`distaff.train.model.loss_weighting`).

Embedding sharing (``rtd.embedding_sharing``):

- ``none``: two word-embedding tables.
- ``es``: one table, updated by both losses (ELECTRA).
- ``gdes`` (default, DeBERTa-v3): the discriminator's table is ``sg(E_G) + E_delta``. ``E_delta`` is
  the discriminator's own ``word_embeddings`` parameter, initialised to zero; the generator's vectors
  enter detached, so the MLM loss alone updates ``E_G`` and the RTD loss only ``E_delta``. Exported
  discriminators hold the sum, as Hugging Face's v3 checkpoints do.

The sampling draws from its own generator (:class:`ReplacementSampler`), seeded per rank and saved
in every checkpoint, so a resumed run draws the same replacements. Evaluation samples from a second
stream reset at every evaluation, so held-out figures use the same replacements each time and never
move the training stream.
"""

from __future__ import annotations

import base64
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from distaff import kernels
from distaff.train.model.loss_weighting import LossWeighting
from distaff.train.model.deberta import (DebertaForMaskedLM, DebertaModel, LayerNorm, Layout, Packed, _dense_gelu,
                                         batch_layout, init_weights, labelled_positions)
from distaff.train.model.config import ModelConfig

EMBEDDING_SHARING = ("none", "es", "gdes")
# AUC of the replaced class from a histogram of the discriminator's logits (additive, so it sums
# over micro-batches and ranks): AUC_BINS equal bins over [-AUC_LOGIT_RANGE, AUC_LOGIT_RANGE].
AUC_BINS = 64
AUC_LOGIT_RANGE = 8.0
# The per-batch sums an RTD forward returns, in this order, then the two AUC histograms.
# The two weight sums are each effective loss weight times ``masked`` and ``real``: additive, and
# divided by those counts they give the weights (the same in every forward of a step).
SUM_NAMES = ("gen_loss_sum", "masked", "gen_correct", "rtd_loss_sum", "real", "rtd_correct", "replaced",
             "predicted_replaced", "true_positives", "gen_weight_sum", "rtd_weight_sum")
NUM_SUMS = len(SUM_NAMES) + 2 * AUC_BINS
# Rows of [rows, V] sampling logits built at once: bounds the sampling's memory at large vocabularies.
SAMPLE_CHUNK_ELEMENTS = 1 << 26


class RTDHead(nn.Module):
    """The per-token replaced/original classifier: ``classifier(gelu(dense(LN(h + h_cls))))``.

    Structure and parameter names (``mask_predictions.{dense, LayerNorm, classifier}``) are those of
    the official DeBERTa-v3 checkpoints. Its output is one logit per token: nothing of vocabulary size.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, cfg.kernel_impl)
        self.classifier = nn.Linear(cfg.hidden_size, 1)
        self.impl = cfg.kernel_impl

    def forward(self, hidden: torch.Tensor, mask: Layout | None = None) -> torch.Tensor:
        """``[B, N, H]`` -> logits ``[B, N]`` (positive: replaced); packed (``mask`` a :class:`Packed`),
        ``[T, H]`` -> ``[T]``, each token reading its own sequence's ``[CLS]``."""
        states = self.LayerNorm(hidden + sequence_starts(hidden, mask))
        return self.classifier(_dense_gelu(self.dense, states, self.impl)).squeeze(-1)


def sequence_starts(hidden: torch.Tensor, mask: Layout | None) -> torch.Tensor:
    """Each token's ``[CLS]`` state: the first position of its row (padded, broadcast over the row), or of
    its sequence when packed (a token at ``position_ids`` p of a packed batch has its sequence's first
    token p places before it: no host read of ``cu_seqlens``)."""
    if not isinstance(mask, Packed):
        return hidden[:, :1]
    tokens = torch.arange(hidden.shape[0], device=hidden.device)
    return hidden.index_select(0, tokens - mask.position_ids)


class Discriminator(nn.Module):
    """``DebertaV2Model`` plus the RTD head: what the HF v3 checkpoints hold (``deberta.*``, ``mask_predictions.*``)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.deberta = DebertaModel(config)
        self.mask_predictions = RTDHead(config)
        self.apply(lambda module: init_weights(module, config.initializer_range))

    def forward(self, input_ids: torch.Tensor, attention_mask: Layout | None = None,
                token_type_ids: torch.Tensor | None = None, word_offset: torch.Tensor | None = None) -> torch.Tensor:
        """Replaced-token logits ``[B, N]`` (``[T]`` when ``attention_mask`` is a :class:`Packed` layout)."""
        hidden = self.deberta(input_ids, attention_mask, token_type_ids, word_offset=word_offset)
        return self.mask_predictions(hidden, attention_mask)


def _rng_to_text(generator: torch.Generator) -> str:
    return base64.b64encode(generator.get_state().numpy().tobytes()).decode("ascii")


def _text_to_rng(generator: torch.Generator, text: str) -> None:
    generator.set_state(torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8))


class ReplacementSampler:
    """Draws the generator's replacements: Gumbel-max over its logits with noise from a torch
    generator on the logits' device, seeded for each draw from a CPU stream (``seed``) whose state
    is this object's checkpointed state. Training and evaluation use separate streams; the
    evaluation stream restarts from ``seed`` at each :meth:`restart_eval`."""

    def __init__(self, seed: int):
        self.seed = seed
        self.train_stream = torch.Generator().manual_seed(seed)
        self.eval_stream = torch.Generator().manual_seed(seed + 1)

    def restart_eval(self) -> None:
        self.eval_stream.manual_seed(self.seed + 1)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "train_stream": _rng_to_text(self.train_stream)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = state["seed"]
        _text_to_rng(self.train_stream, state["train_stream"])
        self.restart_eval()

    @torch.no_grad()
    def sample(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               training: bool) -> torch.Tensor:
        """A token id per row of ``rows`` ``[M, E]``, drawn from ``softmax(rows @ weight.T + bias)``;
        the logits are built a chunk of rows at a time."""
        stream = self.train_stream if training else self.eval_stream
        draw_seed = int(torch.randint(0, 2**62, (1,), generator=stream))
        noise_rng = torch.Generator(device=rows.device).manual_seed(draw_seed)
        chunk = max(1, SAMPLE_CHUNK_ELEMENTS // weight.shape[0])
        picked = []
        for start in range(0, rows.shape[0], chunk):
            logits = F.linear(rows[start:start + chunk], weight, bias).float()
            # argmax(logits + Gumbel) = argmax(logits - log(Exp(1))): a sample from the softmax
            noise = torch.empty_like(logits).exponential_(generator=noise_rng)
            picked.append((logits - noise.log_()).argmax(-1))
        return torch.cat(picked) if picked else rows.new_zeros(0, dtype=torch.long)


class RTDOutput(NamedTuple):
    """A NamedTuple (ZeRO-3 finds tensors in tuples, not in dataclasses); ``sums`` is what the trainer logs."""

    loss: torch.Tensor                  # generator MLM loss and RTD loss, weighted (``LossWeighting``)
    sums: torch.Tensor                  # float64 [NUM_SUMS]: SUM_NAMES then the AUC histograms
    generator_loss: torch.Tensor
    rtd_loss: torch.Tensor
    rtd_logits: torch.Tensor            # [B, N] ([T] packed)
    replaced: torch.Tensor              # [B, N] ([T]) bool: the discriminator's labels
    discriminator_ids: torch.Tensor     # [B, N] ([T]): the sequence the discriminator read


class ReplacedTokenDetection(nn.Module):
    """Generator (``DebertaForMaskedLM``) + discriminator, embeddings shared per ``sharing``."""

    def __init__(self, generator: ModelConfig, discriminator: ModelConfig, *, sharing: str = "gdes",
                 weight: float = 50.0, seed: int = 0, loss_weighting: str = "fixed"):
        super().__init__()
        if sharing not in EMBEDDING_SHARING:
            raise ValueError(f"rtd.embedding_sharing: must be one of {list(EMBEDDING_SHARING)}, got {sharing!r}")
        if sharing != "none" and generator.embedding_size != discriminator.embedding_size:
            raise ValueError(f"rtd.generator: embedding_size {generator.embedding_size} differs from the "
                             f"discriminator's {discriminator.embedding_size}; shared embeddings need one width")
        self.generator = DebertaForMaskedLM(generator)
        self.discriminator = Discriminator(discriminator)
        self.sharing = sharing
        if sharing == "es":
            self.discriminator.deberta.embeddings.word_embeddings = self.generator.word_embeddings
        elif sharing == "gdes":
            nn.init.zeros_(self.discriminator.deberta.embeddings.word_embeddings.weight)
        self.sampler = ReplacementSampler(seed)
        self.weighting = LossWeighting(loss_weighting, (1.0, weight))

    def train(self, mode: bool = True) -> "ReplacedTokenDetection":
        super().train(mode)
        if not mode:
            self.sampler.restart_eval()
        return self

    @torch.no_grad()
    def start_from_discriminator(self, state: dict[str, torch.Tensor]) -> None:
        """Continue from a trained discriminator's weights (``state``, the RTD head optional). With
        shared embeddings its table becomes the generator's (under GDES ``E_delta`` stays zero, so the
        discriminator reads exactly the trained table)."""
        key = "deberta.embeddings.word_embeddings.weight"
        if self.sharing != "none":
            state = dict(state)
            self.generator.word_embeddings.weight.copy_(state.pop(key))
        missing = self.discriminator.load_state_dict(state, strict=False).missing_keys
        # the table was set through the generator (or, under GDES, is E_delta, which stays zero)
        if any(not k.startswith("mask_predictions.") and k != key for k in missing):
            raise ValueError(f"discriminator weights missing: {missing}")

    def discriminator_word_embeddings(self) -> torch.Tensor:
        """The discriminator's effective word-embedding table (with GDES: ``E_G + E_delta``)."""
        own = self.discriminator.deberta.embeddings.word_embeddings.weight
        return own + self.generator.word_embeddings.weight if self.sharing == "gdes" else own

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                max_seqlen: int | None = None) -> RTDOutput:
        """``input_ids`` are the masked sequences and ``labels`` the originals at the masked positions
        (``IGNORE_INDEX`` elsewhere), as the MLM collator makes them: padded ``[B, N]`` with
        ``attention_mask``, or packed (``MLMCollator.packed``: 1-D over tokens, ``cu_seqlens``,
        ``max_seqlen``, ``position_ids``), where both networks attend within each sequence only. The
        labelled positions come in the same order either way, so the same sampler state draws the
        same replacements for the same documents."""
        if labels is None:
            raise ValueError("ReplacedTokenDetection needs labels (the masked positions' original tokens)")
        mask = batch_layout(input_ids, attention_mask, position_ids, cu_seqlens, max_seqlen)
        labelled = labelled_positions(labels)
        targets = labels.reshape(-1).index_select(0, labelled)
        _, decoded = self.generator.decode(input_ids, mask, token_type_ids)
        rows = self.generator.lm_head.transform(decoded.flatten(0, -2).index_select(0, labelled))
        generated = self.generator.labelled_loss(rows, targets)
        sampled = self.sampler.sample(rows.detach(), self.generator.word_embeddings.weight.detach(),
                                      self.generator.lm_head.bias.detach(), self.training)
        original = torch.where(labels == kernels.IGNORE_INDEX, input_ids, labels)
        fake = original.reshape(-1).index_copy(0, labelled, sampled).view_as(input_ids)
        offset = self.generator.word_embeddings(fake).detach() if self.sharing == "gdes" else None
        logits = self.discriminator(fake, mask, token_type_ids, word_offset=offset)
        replaced = fake != original
        # packed batches hold real tokens only
        real_logits, real_labels = ((logits.float(), replaced) if isinstance(mask, Packed)
                                    else (logits[mask.bool()].float(), replaced[mask.bool()]))
        rtd_loss = F.binary_cross_entropy_with_logits(real_logits, real_labels.float(), reduction="sum") \
            / real_labels.numel()
        loss, weights = self.weighting([generated.loss, rtd_loss])
        sums = batch_sums(generated, rtd_loss, real_logits.detach(), real_labels, weights)
        return RTDOutput(loss, sums, generated.loss, rtd_loss, logits, replaced, fake)


def batch_sums(generated: kernels.MaskedLMLoss, rtd_loss: torch.Tensor, logits: torch.Tensor,
               replaced: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One batch's additive counts (``SUM_NAMES``, then histograms of the replaced and original
    tokens' logits), float64 on the batch's device: they sum over micro-batches and ranks.
    ``weights``: the generator's and the discriminator's effective loss weights."""
    predicted = logits > 0
    masked = generated.num_labelled.double()
    counts = torch.stack([generated.loss.detach().double() * masked, masked, generated.num_correct.double(),
                          rtd_loss.detach().double() * replaced.numel(),
                          torch.tensor(replaced.numel(), dtype=torch.float64, device=logits.device),
                          (predicted == replaced).sum().double(), replaced.sum().double(),
                          predicted.sum().double(), (predicted & replaced).sum().double(),
                          weights[0].to(logits.device) * masked, weights[1].to(logits.device) * replaced.numel()])
    clamped = logits.clamp(-AUC_LOGIT_RANGE, AUC_LOGIT_RANGE)
    hist_replaced = torch.histc(clamped[replaced], AUC_BINS, -AUC_LOGIT_RANGE, AUC_LOGIT_RANGE)
    hist_original = torch.histc(clamped[~replaced], AUC_BINS, -AUC_LOGIT_RANGE, AUC_LOGIT_RANGE)
    return torch.cat([counts, hist_replaced.double(), hist_original.double()])


def histogram_auc(replaced: list[float], original: list[float]) -> float | None:
    """P(a replaced token scores above an original one), ties within a bin counted half; None
    without both classes."""
    positives, negatives = sum(replaced), sum(original)
    if positives == 0 or negatives == 0:
        return None
    below, wins = 0.0, 0.0
    for pos, neg in zip(replaced, original):
        wins += pos * (below + 0.5 * neg)
        below += neg
    return wins / (positives * negatives)


def mean_losses(sums: list[float]) -> tuple[float, float]:
    """The generator's and the discriminator's mean losses from global sums."""
    named = dict(zip(SUM_NAMES, sums))
    return named["gen_loss_sum"] / max(named["masked"], 1.0), named["rtd_loss_sum"] / max(named["real"], 1.0)


def report(sums: list[float], weight: float) -> dict[str, float | None]:
    """Global sums -> the logged metrics (generator and discriminator). ``loss`` is always
    ``gen_loss + weight x rtd_loss`` (comparable whatever ``rtd.loss_weighting``); ``weight_gen`` and
    ``weight_rtd`` are the effective weights the step's loss used."""
    named = dict(zip(SUM_NAMES, sums))
    hists = sums[len(SUM_NAMES):]
    masked, real = max(named["masked"], 1.0), max(named["real"], 1.0)
    gen_loss, rtd_loss = mean_losses(sums)
    predicted, replaced = named["predicted_replaced"], named["replaced"]
    return {"loss": gen_loss + weight * rtd_loss,
            "weight_gen": named["gen_weight_sum"] / masked, "weight_rtd": named["rtd_weight_sum"] / real, "gen_loss": gen_loss, "gen_accuracy": named["gen_correct"] / masked,
            "rtd_loss": rtd_loss, "rtd_accuracy": named["rtd_correct"] / real,
            "rtd_precision": named["true_positives"] / predicted if predicted else None,
            "rtd_recall": named["true_positives"] / replaced if replaced else None,
            "rtd_auc": histogram_auc(hists[:AUC_BINS], hists[AUC_BINS:]),
            "replaced_rate": replaced / real, "rtd_baseline_accuracy": 1.0 - replaced / real,
            "masked_replaced_rate": replaced / masked}
