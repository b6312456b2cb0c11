"""A rank program for tests/finetune/test_finetune_data.py: each of 2 gloo ranks reads the bundled movie snippets,
walks its share of one training epoch and of the dev set through a tiny classifier, and gathers the dev
predictions with ``gather_rows``; rank 0 writes what was gathered to ``<out>/gathered.json``.

``--config`` names a JSON file: ``tokenizer`` (a tokenizer folder), ``out`` (a folder), ``packed``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import DebertaV2Config

from distaff.train.core import distributed as dist_utils
from distaff.train.data.tokenizer import load_tokenizer_info
from distaff.train.finetune.labelled import InputFormat, LabelledData, load_labelled
from distaff.train.finetune.labelled_batches import EvalBatches, TrainBatches, model_inputs
from distaff.train.finetune.metrics import compute_metrics, gather_rows
from distaff.train.model.classifier import DebertaForSequenceClassification
from distaff.train.model.hf import model_config_from_hf

MOVIES = Path(__file__).resolve().parents[2] / "data" / "movie-snippets.tsv.gz"
EVAL_BATCH, TRAIN_BATCH = 7, 16


def movie_data(tokenizer_dir: str) -> LabelledData:
    return load_labelled(MOVIES, InputFormat(columns=("label", "text")), load_tokenizer_info(tokenizer_dir), 64,
                         regression=False, dev_fraction=0.1, seed=0)


def tiny_classifier(vocab_size: int) -> DebertaForSequenceClassification:
    torch.manual_seed(0)  # the same weights in every process
    config = DebertaV2Config(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=64, max_position_embeddings=128, relative_attention=True,
                             position_buckets=8, max_relative_positions=24, pos_att_type="p2c|c2p",
                             norm_rel_ebd="layer_norm", share_att_key=True, position_biased_input=True,
                             type_vocab_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return DebertaForSequenceClassification(model_config_from_hf(config.to_dict()), 2).eval()


def evaluate(model: DebertaForSequenceClassification, batches: EvalBatches) -> tuple[torch.Tensor, ...]:
    """(logits, labels, weights, example_ids) of this rank's dev batches."""
    rows = []
    with torch.no_grad():
        for batch in batches:
            rows.append((model(**model_inputs(batch)).logits, batch["labels"], batch["weights"], batch["example_ids"]))
    return tuple(torch.cat(column) for column in zip(*rows))


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[argv.index("--config") + 1]).read_text())
    layout = dist_utils.init_distributed(timeout_s=120)
    data = movie_data(spec["tokenizer"])
    model = tiny_classifier(load_tokenizer_info(spec["tokenizer"]).vocab_size)
    train = TrainBatches(data.train, batch_size=TRAIN_BATCH, rank=layout.rank, world_size=layout.world_size, seed=1,
                         pad_id=0, packed=spec["packed"])
    train_ids = torch.cat([batch["example_ids"] for _, batch in zip(range(train.steps_per_epoch), train)])
    dev = EvalBatches(data.dev, batch_size=EVAL_BATCH, rank=layout.rank, world_size=layout.world_size, pad_id=0,
                      packed=spec["packed"])
    logits, labels, weights, example_ids, train_ids = gather_rows(*evaluate(model, dev), train_ids)
    if layout.rank == 0:
        result = {"metrics": compute_metrics(logits, labels, weights), "example_ids": example_ids.tolist(),
                  "logits": logits.tolist(), "train_ids": train_ids.tolist()}
        (Path(spec["out"]) / "gathered.json").write_text(json.dumps(result))
    dist_utils.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
