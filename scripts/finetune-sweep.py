"""Fine-tune the demo's pretrained model on the bundled sentiment sample, against random initialisation.

    python scripts/finetune-sweep.py --init runs/demo/run --seeds 1 2 3 [--lr 1e-3 --epochs 4 ...]

The exploration behind the settings of ``configs/finetune/sentiment-cpu.yaml`` (docs/finetuning.md):
a plain single-process torch loop, no DeepSpeed, so that many settings can be tried in CPU minutes.
``--init`` is anything ``distaff.train.model_folder.load_model`` reads (run directory, checkpoint,
model folder, HF export); ``random`` in ``--arms`` builds the same architecture from fresh weights.
The dev split is :func:`distaff.train.baselines.dev_split` of the run's seed, as for the bag-of-words
baseline. One JSON line per (arm, seed) goes to stdout and to ``--log``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from distaff.train.baselines import dev_split, read_labelled
from distaff.train.classifier import DebertaForSequenceClassification
from distaff.train.model_folder import load_model
from distaff.train.tokenizer import load_tokenizer_info

REPO = Path(__file__).resolve().parents[1]


def encode(texts: list[str], tokenizer_dir: Path, max_len: int) -> list[list[int]]:
    """``[CLS] pieces [SEP]``, as the pretraining shards frame a document."""
    info = load_tokenizer_info(tokenizer_dir)
    pieces = info.processor().encode(texts)
    return [[info.cls_id] + ids[: max_len - 2] + [info.sep_id] for ids in pieces]


def batches(rows: list[int], ids: list[list[int]], labels: list[int], size: int, pad_id: int,
            generator: torch.Generator | None):
    """Padded batches. Training (a generator): shuffled, then sorted by length within windows of 8
    batches so that little is padding, the batches in shuffled order. Evaluation: sorted by length."""
    if generator is None:
        chunks = [sorted(rows, key=lambda i: len(ids[i]))[start:start + size] for start in range(0, len(rows), size)]
    else:
        order = [rows[i] for i in torch.randperm(len(rows), generator=generator)]
        windows = [sorted(order[start:start + 8 * size], key=lambda i: len(ids[i]))
                   for start in range(0, len(order), 8 * size)]
        chunks = [window[start:start + size] for window in windows for start in range(0, len(window), size)]
        chunks = [chunks[i] for i in torch.randperm(len(chunks), generator=generator)]
    for chunk in chunks:
        width = max(len(ids[i]) for i in chunk)
        tokens = torch.full((len(chunk), width), pad_id)
        for row, i in enumerate(chunk):
            tokens[row, : len(ids[i])] = torch.tensor(ids[i])
        yield tokens, (tokens != pad_id).long(), torch.tensor([labels[i] for i in chunk])


def param_groups(model: DebertaForSequenceClassification, lr: float, decay: float, weight_decay: float):
    """Layer-wise learning-rate decay: the head at ``lr``, layer k of L at ``lr * decay**(L-k)``, the
    embeddings at ``lr * decay**(L+1)``; no weight decay on biases and LayerNorm weights."""
    layers = model.config.num_hidden_layers
    groups: dict[tuple[float, float], list] = {}
    for name, param in model.named_parameters():
        if name.startswith("deberta.embeddings"):
            depth = layers + 1
        elif name.startswith("deberta.encoder.layer."):
            depth = layers - int(name.split(".")[3])
        elif name.startswith("deberta.encoder."):  # relative-position embeddings and their LayerNorm
            depth = layers + 1
        else:
            depth = 0
        wd = 0.0 if param.ndim == 1 else weight_decay
        groups.setdefault((lr * decay**depth, wd), []).append(param)
    return [{"params": params, "lr": group_lr, "initial_lr": group_lr, "weight_decay": wd}
            for (group_lr, wd), params in groups.items()]


def build(args, arm: str, seed: int) -> DebertaForSequenceClassification:
    mlm, _ = load_model(args.init)
    cfg = mlm.config.replace(emd=False, hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout)
    torch.manual_seed(seed)
    model = DebertaForSequenceClassification(cfg, 2, pooler_dropout=args.dropout, pooling=args.pooling)
    if arm == "pretrained":
        model.deberta.load_state_dict(mlm.deberta.state_dict(), strict=True)
    return model


def run(args, arm: str, seed: int, ids, labels) -> dict:
    started = time.time()
    model = build(args, arm, seed)
    train_rows, dev_rows = dev_split(len(labels), args.dev_fraction, seed)
    optimizer = torch.optim.AdamW(param_groups(model, args.lr, args.llrd, args.weight_decay), betas=(0.9, 0.98), eps=1e-6)
    steps = args.epochs * math.ceil(len(train_rows) / args.batch)
    warmup = int(args.warmup * steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min((step + 1) / max(1, warmup), max(0.0, (steps - step) / max(1, steps - warmup))))
    generator = torch.Generator().manual_seed(seed)
    pad = model.config.pad_token_id
    history = []
    for _ in range(args.epochs):
        model.train()
        for tokens, mask, target in batches(train_rows, ids, labels, args.batch, pad, generator):
            loss = model(tokens, mask, labels=target).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
        history.append(round(evaluate(model, dev_rows, ids, labels, args), 4))
    return {"arm": arm, "seed": seed, "dev_accuracy": history[-1], "per_epoch": history,
            "seconds": round(time.time() - started, 1)}


@torch.no_grad()
def evaluate(model, dev_rows, ids, labels, args) -> float:
    model.eval()
    right = 0
    for tokens, mask, target in batches(dev_rows, ids, labels, 128, model.config.pad_token_id, None):
        right += int((model(tokens, mask).logits.argmax(1) == target).sum())
    return right / len(dev_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--init", type=Path, default=REPO / "runs" / "demo" / "run")
    parser.add_argument("--data", type=Path, default=REPO / "data" / "movie-snippets.tsv.gz")
    parser.add_argument("--arms", nargs="+", default=["pretrained", "random"], choices=["pretrained", "random"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--dev-fraction", type=float, default=0.2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=float, default=0.1, help="share of the steps")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--llrd", type=float, default=1.0, help="layer-wise learning-rate decay factor")
    parser.add_argument("--pooling", choices=["cls", "mean"], default="cls")
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--log", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _, tokenizer_dir = load_model(args.init)
    labels, texts = read_labelled(args.data)
    ids = encode(texts, tokenizer_dir, args.max_len)
    settings = {k: v for k, v in vars(args).items() if k not in ("arms", "seeds", "log", "threads")}
    for seed in args.seeds:
        for arm in args.arms:
            line = json.dumps({**run(args, arm, seed, ids, labels), **{k: str(v) for k, v in settings.items()}})
            print(line, flush=True)
            if args.log:
                with args.log.open("a") as handle:
                    handle.write(line + "\n")


if __name__ == "__main__":
    main()
