"""Dynamic MLM masking (whole words, n-gram spans) and batch collation, padded or packed.

Span selection follows the official DeBERTa ``NGramMaskGenerator`` (itself from XLNet): the words are
walked in windows; each window draws an n-gram length n in 1..max_ngram with probability proportional
to 1/n, spans ``n / mlm_probability`` words and masks one n-word span inside it, so a fraction
``mlm_probability`` of the words - and so, in expectation, of the maskable tokens - is chosen whatever
n is. Every chosen token becomes ``[MASK]`` (80%), a random non-special token (10%) or stays (10%).
Words are SentencePiece words: a word starts at a piece beginning with U+2581 (or right after a
special token) and takes the continuation pieces after it. Special tokens and padding are never chosen.

Differences from the original: the whole batch is processed as numpy arrays (no Python loop over
words), so windows run over the batch's words end to end instead of restarting per sequence; a span
is placed wholly inside its window instead of possibly spilling into the next; the window length is
``n / mlm_probability`` exactly rather than rounded down; and there is no per-sequence cap of
``round(mlm_probability * length)`` tokens - the cap only ever lowers the rate (to ~14% on our
corpora), while without it the expected rate is exactly ``mlm_probability`` of the maskable tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from distaff.kernels import IGNORE_INDEX
from distaff.train.data.errors import DataError, length_problem
from distaff.train.data.tokenizer import TokenizerInfo, word_start_table

if TYPE_CHECKING:
    import torch


@dataclass
class MaskingConfig:
    mlm_probability: float = 0.15
    mask_token_fraction: float = 0.8
    random_token_fraction: float = 0.1
    whole_word: bool = True
    max_ngram: int = 3

    def __post_init__(self) -> None:
        if not 0.0 < self.mlm_probability < 1.0:
            raise ValueError(f"mlm_probability {self.mlm_probability} must lie in (0, 1)")
        if self.mask_token_fraction < 0 or self.random_token_fraction < 0 or \
                self.mask_token_fraction + self.random_token_fraction > 1.0:
            raise ValueError(f"mask_token_fraction {self.mask_token_fraction} + random_token_fraction "
                             f"{self.random_token_fraction} must lie in [0, 1]")
        if self.max_ngram < 1:
            raise ValueError(f"max_ngram {self.max_ngram} must be >= 1")


def is_packed(batch: dict) -> bool:
    return "cu_seqlens" in batch


def batch_counts(batch: dict) -> list[int]:
    """``[real tokens, samples, positions computed]`` of a collated batch (positions include padding)."""
    ids = batch["input_ids"]
    if is_packed(batch):
        return [ids.numel(), batch["cu_seqlens"].numel() - 1, ids.numel()]
    return [int(batch["attention_mask"].sum()), ids.shape[0], ids.numel()]


class MLMCollator:
    """Turns token arrays (``[CLS] ... [SEP]``, each at most ``seq_len``) into masked training batches."""

    def __init__(self, tokenizer: TokenizerInfo, masking: MaskingConfig | None, seq_len: int):
        """``masking`` None: no input is changed and every non-special token is a target (an all-token
        objective, T-TA's)."""
        self.masking = masking
        self.seq_len = seq_len
        self.pad_id = tokenizer.pad_id
        self.mask_id = tokenizer.mask_id
        special = np.zeros(tokenizer.vocab_size, dtype=bool)
        special[list(tokenizer.special_ids)] = True
        self.is_special = special
        self.is_word_start = np.asarray(word_start_table(tokenizer.processor()), dtype=bool) | special
        self.random_ids = np.flatnonzero(~special)
        if masking is not None:
            lengths = np.arange(1, masking.max_ngram + 1)
            self.ngram_lengths = lengths
            self.ngram_probs = (1.0 / lengths) / (1.0 / lengths).sum()

    # -- batching -----------------------------------------------------------------------------------------
    def pad(self, samples: Sequence[np.ndarray]) -> np.ndarray:
        ids = np.full((len(samples), self.seq_len), self.pad_id, dtype=np.int64)
        for row, sample in enumerate(samples):
            problem = length_problem(len(sample), self.seq_len)
            if problem:
                raise DataError(f"sample of {problem}")
            ids[row, :len(sample)] = sample
        return ids

    def __call__(self, samples: Sequence[np.ndarray], rng: np.random.Generator) -> dict[str, torch.Tensor]:
        """Padded batch: ``input_ids``, ``attention_mask``, ``labels`` (long ``[B, seq_len]``)."""
        import torch    # here, not at the top: a run config (data.masking) is read without torch (distaff plan)

        ids = self.pad(samples)
        input_ids, labels = self.mask(ids, rng)
        return {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(
            (ids != self.pad_id).astype(np.int64)), "labels": torch.from_numpy(labels)}

    def packed(self, samples: Sequence[np.ndarray], rng: np.random.Generator) -> dict[str, torch.Tensor | int]:
        """Packed batch for variable-length attention: the sequences concatenated without padding.

        ``input_ids``/``labels``/``position_ids`` are 1-D over all tokens; sequence i is
        ``cu_seqlens[i]:cu_seqlens[i+1]`` (int32, length B+1); ``max_seqlen`` is the longest sequence.
        """
        import torch    # see __call__

        ids = self.pad(samples)
        input_ids, labels = self.mask(ids, rng)
        keep = ids != self.pad_id
        lengths = keep.sum(axis=1)
        cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        positions = np.broadcast_to(np.arange(self.seq_len), ids.shape)
        return {"input_ids": torch.from_numpy(input_ids[keep]), "labels": torch.from_numpy(labels[keep]),
                "position_ids": torch.from_numpy(positions[keep]), "cu_seqlens": torch.from_numpy(cu_seqlens),
                "max_seqlen": int(lengths.max(initial=0))}

    # -- masking ------------------------------------------------------------------------------------------
    def mask(self, ids: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(masked input ids, labels) for a padded ``[B, N]`` int64 array; labels are ``IGNORE_INDEX`` where not chosen."""
        if self.masking is None:
            return ids.copy(), np.where(self.is_special[ids], IGNORE_INDEX, ids)
        chosen = self.choose(ids, rng)
        labels = np.where(chosen, ids, IGNORE_INDEX)
        input_ids = ids.copy()
        positions = np.flatnonzero(chosen)
        draw = rng.random(len(positions))
        cfg = self.masking
        to_mask = draw < cfg.mask_token_fraction
        to_random = (draw >= cfg.mask_token_fraction) & (draw < cfg.mask_token_fraction + cfg.random_token_fraction)
        flat = input_ids.reshape(-1)
        flat[positions[to_mask]] = self.mask_id
        flat[positions[to_random]] = rng.choice(self.random_ids, size=int(to_random.sum()))
        return input_ids, labels

    def choose(self, ids: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Boolean ``[B, N]``: the tokens to predict (whole words in n-gram spans)."""
        special = self.is_special[ids]
        candidate = ~special
        if self.masking.whole_word:
            after_special = np.ones_like(special)
            after_special[:, 1:] = special[:, :-1]
            word_start = candidate & (self.is_word_start[ids] | after_special)
        else:
            word_start = candidate
        # Words never cross rows: a row's first non-special token always starts a word.
        word_of_token = np.cumsum(word_start.reshape(-1)).reshape(ids.shape) - 1
        num_words = int(word_start.sum())
        if num_words == 0:
            return np.zeros_like(candidate)
        return candidate & self._choose_words(num_words, rng)[np.maximum(word_of_token, 0)]

    def _choose_words(self, num_words: int, rng: np.random.Generator) -> np.ndarray:
        """One n-gram span per window of ``n / mlm_probability`` words, over ``num_words`` words."""
        p = self.masking.mlm_probability
        # Each window spans at least 1/p words, so this many windows always cover every word.
        count = int((num_words + 1) * p) + 2
        n = rng.choice(self.ngram_lengths, size=count, p=self.ngram_probs)
        edges = np.floor(np.concatenate([[0.0], np.cumsum(n / p)])).astype(np.int64)
        offset, window = edges[:-1], np.diff(edges)
        inside = offset < num_words
        n, offset, window = n[inside], offset[inside], np.minimum(window[inside], num_words - offset[inside])
        span = np.minimum(n, window)
        start = offset + (rng.random(len(n)) * (window - span + 1)).astype(np.int64)
        marks = np.bincount(start, minlength=num_words + 1) - np.bincount(start + span, minlength=num_words + 1)
        return np.cumsum(marks)[:num_words] > 0
