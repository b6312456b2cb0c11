"""A rank program for tests/finetune/test_sift_zero.py: a tiny DebertaForSequenceClassification fine-tuned with SiFT
through a real DeepSpeed engine (the ZeRO stage from the config) on real movie-review sentences.

``--config`` names a JSON file: ``stage``, ``precision``, ``steps``, ``out`` (a folder), ``sift`` (SiftConfig
fields), ``dropout`` and ``through_engine`` (SiFT's forwards call the engine instead of ``engine.module``: a
misuse SiFT must refuse). Every rank writes ``<out>/rank<r>.json``: per step the task loss, the adversarial term and the
skipped ascent updates; and the full fp32 weights before and after training (DeepSpeed's own
``safe_get_full_fp32_param`` under ZeRO-2/3), as lists, so the test compares the stages' runs.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from collections import Counter
from pathlib import Path

import torch

from distaff.train.core import distributed as dist_utils
from distaff.train.finetune.sift import SiFT, SiftConfig
from distaff.train.model.classifier import DebertaForSequenceClassification
from distaff.train.model.config import ModelConfig
from distaff.train.run import engine as engine_utils
from distaff.train.run.config import RunConfig

REPO = Path(__file__).resolve().parents[2]
SPECIALS = ("[PAD]", "[CLS]", "[UNK]")  # ids 0, 1, 2
VOCAB_SIZE, SEQ_LEN, BATCH = 400, 24, 4


def movie_batches(world_size: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """This rank's batches of the sentences in data/movie-snippets.tsv.gz, as ids over its most common
    lower-cased words (``[CLS]`` first, padded to the longest row)."""
    with gzip.open(REPO / "data" / "movie-snippets.tsv.gz", "rt", encoding="utf-8") as handle:
        rows = [line.rstrip("\n").split("\t", 1) for line in handle]
    words = [re.findall(r"[a-z']+", text.lower()) for _, text in rows]
    common = [w for w, _ in Counter(w for sentence in words for w in sentence).most_common(VOCAB_SIZE - len(SPECIALS))]
    vocab = {w: i for i, w in enumerate(SPECIALS + tuple(common))}
    examples = [([1] + [vocab.get(w, 2) for w in sentence][: SEQ_LEN - 1], int(label))
                for (label, _), sentence in zip(rows, words)]
    batches = []
    for start in range(rank * BATCH, len(examples) - BATCH, world_size * BATCH):
        chunk = examples[start:start + BATCH]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in chunk])
        batches.append((ids, (ids != 0).long(), torch.tensor([label for _, label in chunk])))
    return batches


def build_engine(stage: int, precision: str, dropout: float, world_size: int):
    torch.manual_seed(0)  # the same initial weights on every rank and every stage
    config = ModelConfig(vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=SEQ_LEN, position_buckets=8,
                         hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    model = DebertaForSequenceClassification(config, num_labels=2)
    run = RunConfig()
    run.data.batch_size, run.train.precision, run.zero.stage = BATCH, precision, stage
    run.optim.lr, run.optim.weight_decay = 3e-3, 0.0
    return engine_utils.initialize(model, run, world_size)


def full_weights(engine) -> dict[str, list[float]]:
    from deepspeed.utils import safe_get_full_fp32_param

    weights = {}
    for name, param in engine.module.named_parameters():
        master = safe_get_full_fp32_param(param)  # a collective under ZeRO-2/3; None under ZeRO-0
        weights[name] = (param if master is None else master).detach().float().flatten().tolist()
    return weights


def train(engine, sift: SiFT, batches, steps: int, through_engine: bool) -> list[dict]:
    history = []
    model = engine if through_engine else engine.module
    for step in range(steps):
        ids, mask, labels = batches[step % len(batches)]
        out = engine(ids, mask, labels=labels)
        extra = sift.adversarial_loss(lambda: model(ids, mask).logits, out.logits)
        engine.backward(out.loss + extra)
        engine.step()
        history.append({"loss": out.loss.item(), "sift": extra.item(), "dtype": str(extra.dtype),
                        "logits_dtype": str(out.logits.dtype), "skipped": sift.skipped_updates})
    return history


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[argv.index("--config") + 1]).read_text())
    layout = dist_utils.init_distributed(60)
    engine = build_engine(spec["stage"], spec.get("precision", "fp32"), spec["dropout"], layout.world_size)
    sift = SiFT(SiftConfig(**spec["sift"]), engine.module)
    before = full_weights(engine)
    torch.manual_seed(100 + layout.rank)  # each rank its own noise and dropout, the same in every stage
    history = train(engine, sift, movie_batches(layout.world_size, layout.rank), spec["steps"],
                    spec.get("through_engine", False))
    report = {"history": history, "before": before, "after": full_weights(engine)}
    (Path(spec["out"]) / f"rank{layout.rank}.json").write_text(json.dumps(report))
    dist_utils.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
