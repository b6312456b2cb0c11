"""The held-out share when the user gives none: every k-th document, with k as large as it can be (at most
every 100th, 1%) while the held-out documents still hold :data:`MIN_HELDOUT_TOKENS` tokens.

The documents are read and tokenized once before the prepare, counting tokens only; a large corpus stops
the count as soon as every 100th document holds enough, so the cost is that of a few MB of text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from distaff.train.data.prepare import encode_documents
from distaff.train.data.sources import ReadOptions, ReadStats, check_inputs, iter_file_documents
from distaff.train.data.tokenizer import load_tokenizer_info

# Fewer held-out tokens leave evaluations a few hundred masked tokens: accuracy moves in coarse steps.
MIN_HELDOUT_TOKENS = 20_000
MAX_EVERY = 100      # a large corpus holds out 1%
MIN_EVERY = 5        # a small one at most 20%: less than that is left to train on otherwise
MARGIN = 1.25        # aim above the minimum: [CLS]/[SEP] and shard boundaries are not counted here
BATCH_CHARS = 1 << 20


@dataclass(frozen=True)
class HeldoutChoice:
    every: int             # every k-th document is held out
    tokens: int            # the tokens of those documents (without [CLS]/[SEP])
    enough: bool           # whether they reach MIN_HELDOUT_TOKENS

    def line(self) -> str:
        """What was chosen and why, in one line."""
        why = (f"about {self.tokens:,} tokens, {MIN_HELDOUT_TOKENS:,} or more wanted" if self.enough else
               f"only about {self.tokens:,} tokens: the corpus is small for a steady held-out split")
        return (f"distaff data prepare: holding out 1 document in {self.every} ({100 / self.every:.1f}%, {why});"
                f" --heldout-fraction sets it")


def _held_tokens(lengths: Sequence[int], every: int) -> int:
    """Tokens of documents number every, 2 x every, ... (numbered from 1, as the prepare numbers them)."""
    return int(sum(lengths[every - 1::every]))


def choose_every(lengths: Sequence[int]) -> HeldoutChoice:
    """The largest k in [MIN_EVERY, MAX_EVERY] whose held-out documents hold the minimum with a margin, from
    each document's token count (of the whole corpus, or of a prefix in which k = MAX_EVERY is enough)."""
    for every in range(MAX_EVERY, MIN_EVERY - 1, -1):
        tokens = _held_tokens(lengths, every)
        if tokens >= MARGIN * MIN_HELDOUT_TOKENS:
            return HeldoutChoice(every, tokens, True)
    tokens = _held_tokens(lengths, MIN_EVERY)
    return HeldoutChoice(MIN_EVERY, tokens, tokens >= MIN_HELDOUT_TOKENS)


def _token_counts(processor, texts: list[str]) -> list[int]:
    return [len(ids) for ids in encode_documents(processor, texts, np.dtype(np.int32))]


def choose_heldout(inputs: Sequence[str], tokenizer_dir: str, read: ReadOptions) -> HeldoutChoice:
    """Count each document's tokens until every 100th document holds enough (or the corpus ends); choose k."""
    paths = check_inputs(inputs)                   # the prepare's own errors, in its order
    processor = load_tokenizer_info(tokenizer_dir).processor()
    lengths: list[int] = []
    batch: list[str] = []
    chars = 0
    stats = ReadStats()
    for path in paths:
        for doc in iter_file_documents(path, read, stats):
            batch.append(doc.text)
            chars += len(doc.text)
            if chars < BATCH_CHARS:
                continue
            lengths += _token_counts(processor, batch)
            batch, chars = [], 0
            if _held_tokens(lengths, MAX_EVERY) >= MARGIN * MIN_HELDOUT_TOKENS:
                return choose_every(lengths)
    lengths += _token_counts(processor, batch)
    return choose_every(lengths)
