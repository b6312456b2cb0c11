"""Shared helpers for the fine-tuning tests: a tokenizer and a tiny model folder (cached per session), configs.

The model is a freshly initialised tiny DeBERTa saved as a distaff model folder: what a pretraining
run hands to fine-tuning, minus the minutes of pretraining (these tests check the fine-tuning machinery,
not what pretraining taught the model).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import torch

from distaff.train.data.tokenizer import train_tokenizer
from distaff.train.model.config import load_model_config
from distaff.train.model.deberta import DebertaForMaskedLM
from distaff.train.run.model_folder import save_model_folder
from pretrain_fixtures import write_sections

REPO = Path(__file__).resolve().parents[2]
MOVIES = REPO / "data" / "movie-snippets.tsv.gz"
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
        "max_position_embeddings": 64, "position_buckets": 16}
MAX_LEN = 48


def tiny_model(base: Path) -> Path:
    """A tokenizer trained on the movie snippets' text and a tiny model folder using it; cached under ``base``."""
    folder = base / "tiny-model"
    if (folder / "model.safetensors").is_file():
        return folder
    base.mkdir(parents=True, exist_ok=True)
    text = base / "movie-text.txt"
    with gzip.open(MOVIES, "rt") as handle:
        text.write_text("".join(line.split("\t", 1)[1] for line in handle))
    tokenizer = train_tokenizer([text], 600, base / "tokenizer", num_threads=1)
    config = load_model_config("tiny", **TINY, vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_id)
    torch.manual_seed(0)
    return save_model_folder(DebertaForMaskedLM(config), folder, tokenizer.path)


def write_ft_config(path: Path, model_dir: Path, out_dir: Path, **sections) -> Path:
    """A small fine-tuning config on the movie snippets; ``sections`` update the defaults."""
    values = {
        "run": {"out_dir": str(out_dir), "name": out_dir.name, "seed": 3},
        "model": {"init_from": str(model_dir), "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
        "data": {"train": str(MOVIES), "dev_fraction": 0.1, "columns": ["label", "text"], "max_len": MAX_LEN,
                 "batch_size": 8},
        "train": {"max_steps": 8},
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "eval": {"every": 4},
    }
    return write_sections(path, values, sections)
