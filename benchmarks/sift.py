"""What SiFT costs per fine-tuning step: a DebertaForSequenceClassification training step (forward, backward,
AdamW) without SiFT and with it at 0, 1 and 2 ascent steps, on one device, plain PyTorch (no DeepSpeed).

Each SiFT step adds ``adversarial_steps + 1`` forwards, ``adversarial_steps`` backwards to the perturbation
only (no weight gradients) and the final perturbed forward's share of the main backward. Prints one markdown
table (median ms per step over ``--steps`` after ``--warmup``, and the ratio to the step without SiFT).
Defaults: the deberta-v3-base preset, 32 x 128 tokens, bf16 on a GPU / fp32 on the CPU. ``--cpu-smoke``
runs a tiny model to check the script; its timings mean little.

    python benchmarks/sift.py [--preset deberta-v3-base] [--batch-size 32] [--seq-len 128] [--steps 20]
    python benchmarks/sift.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from distaff.train.finetune.sift import SiFT, SiftConfig
from distaff.train.model.classifier import DebertaForSequenceClassification
from distaff.train.model.config import load_model_config

SMOKE_MODEL = dict(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                   max_position_embeddings=64, position_buckets=16)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(model, sift: SiFT | None, batch: dict, steps: int, warmup: int) -> float:
    """Median milliseconds of a training step (SiFT's term added when ``sift`` is given)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    times = []
    for step in range(warmup + steps):
        _sync(batch["input_ids"].device)
        start = time.perf_counter()
        out = model(**inputs, labels=batch["labels"])
        loss = out.loss if sift is None else out.loss + sift.adversarial_loss(lambda: model(**inputs).logits,
                                                                               out.logits)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(batch["input_ids"].device)
        if step >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="deberta-v3-base")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cpu-smoke", action="store_true", help="a tiny model on the CPU")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.cpu_smoke:
        config = load_model_config("tiny", **SMOKE_MODEL)
        args.batch_size, args.seq_len, args.steps, args.warmup = 4, 32, 3, 1
    else:
        config = load_model_config(args.preset)
    torch.manual_seed(0)
    model = DebertaForSequenceClassification(config, num_labels=2).to(device=device, dtype=dtype).train()
    batch = {"input_ids": torch.randint(5, config.vocab_size, (args.batch_size, args.seq_len), device=device),
             "attention_mask": torch.ones(args.batch_size, args.seq_len, dtype=torch.long, device=device),
             "labels": torch.randint(0, 2, (args.batch_size,), device=device)}
    name = "tiny (smoke)" if args.cpu_smoke else args.preset
    print(f"SiFT step cost: {name}, {args.batch_size} x {args.seq_len} tokens, {dtype}, "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}\n")
    print("| SiFT | ms / step | x without SiFT |\n| --- | --- | --- |")
    baseline = time_steps(model, None, batch, args.steps, args.warmup)
    print(f"| off | {baseline:.1f} | 1.00 |")
    for steps in (0, 1, 2):
        sift = SiFT(SiftConfig(enabled=True, adversarial_steps=steps), model)
        ms = time_steps(model, sift, batch, args.steps, args.warmup)
        print(f"| {steps} ascent step{'s' if steps != 1 else ''} | {ms:.1f} | {ms / baseline:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
