"""MLM masking on real token sequences: rates, whole words, n-gram spans, specials, packed form."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from data_fixtures import SEQ_LEN

from distaff.train.data.collator import IGNORE_INDEX, MaskingConfig, MLMCollator
from distaff.train.data.manifest import read_manifest
from distaff.train.data.shards import iter_shard
from distaff.train.data.tokenizer import load_tokenizer_info, word_start_table


@pytest.fixture(scope="module")
def samples(data_dir: Path) -> list[np.ndarray]:
    manifest = read_manifest(data_dir)
    out = []
    for shard in manifest.splits["train"].shards:
        with open(data_dir / shard.path, "rb") as f:
            out += [a for _, a in iter_shard(f, shard.path, np.dtype(manifest.dtype))]
    return out


@pytest.mark.integration
@pytest.mark.parametrize("masking", [MaskingConfig(), MaskingConfig(whole_word=False, max_ngram=1)],
                         ids=["wwm-3gram", "token"])
def test_masking_rates_and_specials(tokenizer_dir: Path, samples: list[np.ndarray], masking: MaskingConfig) -> None:
    info = load_tokenizer_info(tokenizer_dir)
    collator = MLMCollator(info, masking, SEQ_LEN)
    batch = collator(samples[:6000], np.random.default_rng(0))
    original = torch.from_numpy(collator.pad(samples[:6000]))
    labels, inputs, attention = batch["labels"], batch["input_ids"], batch["attention_mask"]
    chosen = labels != IGNORE_INDEX
    assert torch.equal(labels[chosen], original[chosen])
    assert torch.equal(attention, (original != info.pad_id).long())
    special = torch.isin(original, torch.tensor(info.special_ids))
    assert not chosen[special].any()  # no special token (nor padding) is ever chosen
    assert torch.equal(inputs[~chosen], original[~chosen])  # nothing outside the chosen tokens changes
    maskable = attention.bool() & ~special
    assert abs(chosen.sum().item() / maskable.sum().item() - 0.15) < 0.005
    picked = inputs[chosen]
    assert abs((picked == info.mask_id).float().mean().item() - 0.8) < 0.01
    kept = (picked == original[chosen]).float().mean().item()
    assert abs(kept - 0.1) < 0.01  # a random replacement equals the original rarely (1/vocab)
    assert not torch.isin(picked[picked != info.mask_id], torch.tensor(info.special_ids)).any()


@pytest.mark.integration
def test_whole_words_and_ngram_spans(tokenizer_dir: Path, samples: list[np.ndarray]) -> None:
    info = load_tokenizer_info(tokenizer_dir)
    collator = MLMCollator(info, MaskingConfig(), SEQ_LEN)
    ids = collator.pad(samples[:3000])
    chosen = collator.choose(ids, np.random.default_rng(1))
    special = np.isin(ids, info.special_ids)
    after_special = np.ones_like(special)
    after_special[:, 1:] = special[:, :-1]
    starts = np.asarray(word_start_table(info.processor()))[ids] | special | after_special
    continuation = ~starts & (ids != info.pad_id)
    # A continuation piece is chosen exactly when the piece before it is: words are masked whole.
    prev_chosen = np.zeros_like(chosen)
    prev_chosen[:, 1:] = chosen[:, :-1]
    assert np.array_equal(chosen[continuation], prev_chosen[continuation])
    assert continuation[chosen].any()  # the check above is not vacuous
    # Runs of consecutive chosen words: 1, 2 and 3 word spans all occur, 1 most often (p ~ 1/n).
    runs = []
    for row_chosen, row_starts in zip(chosen, starts):
        words = row_chosen[row_starts]
        edges = np.flatnonzero(np.diff(np.concatenate([[0], words.astype(np.int8), [0]])))
        runs += (edges[1::2] - edges[::2]).tolist()
    counts = np.bincount(runs, minlength=4)
    assert counts[1] > counts[2] > counts[3] > 0


@pytest.mark.integration
def test_packed_form_matches_padded(tokenizer_dir: Path, samples: list[np.ndarray]) -> None:
    info = load_tokenizer_info(tokenizer_dir)
    collator = MLMCollator(info, MaskingConfig(), SEQ_LEN)
    batch = samples[100:132]
    padded = collator(batch, np.random.default_rng(5))
    packed = collator.packed(batch, np.random.default_rng(5))
    keep = padded["attention_mask"].bool()
    lengths = torch.tensor([len(s) for s in batch])
    assert packed["cu_seqlens"].dtype == torch.int32
    assert torch.equal(packed["cu_seqlens"], torch.cat([torch.zeros(1), lengths.cumsum(0)]).int())
    assert packed["max_seqlen"] == int(lengths.max())
    assert torch.equal(packed["input_ids"], padded["input_ids"][keep])
    assert torch.equal(packed["labels"], padded["labels"][keep])
    assert torch.equal(packed["position_ids"][: len(batch[0])], torch.arange(len(batch[0])))


@pytest.mark.integration
def test_masking_is_a_function_of_the_rng(tokenizer_dir: Path, samples: list[np.ndarray]) -> None:
    collator = MLMCollator(load_tokenizer_info(tokenizer_dir), MaskingConfig(), SEQ_LEN)
    a, b = (collator(samples[:64], np.random.default_rng(9)) for _ in range(2))
    c = collator(samples[:64], np.random.default_rng(10))
    assert torch.equal(a["labels"], b["labels"]) and not torch.equal(a["labels"], c["labels"])


@pytest.mark.unit
@pytest.mark.parametrize("bad", [dict(mlm_probability=0.0), dict(mask_token_fraction=0.95), dict(max_ngram=0)])
def test_bad_masking_config(bad: dict) -> None:
    with pytest.raises(ValueError):
        MaskingConfig(**bad)
