"""Pretraining throughput on one GPU: distaff's DeBERTa (fused kernels) vs Hugging Face's DebertaV2ForMaskedLM.

Both models run the same loop under the same DeepSpeed config (bf16, ZeRO-0, AdamW, clipping) on
the same synthetic batches (random tokens, 15% labelled): deberta-v3-base, seq 512 by default.
MFU uses the same model FLOP count for both (distaff.train.model.flops: c2p/p2c and position
projections included, MLM head on labelled tokens only), so the two MFU figures compare directly.

    python benchmarks/pretrain.py [--batch-size 32] [--seq-len 512] [--steps 30] [--warmup 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def synthetic_batches(batch: int, seq_len: int, vocab: int, count: int, device: torch.device) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        ids = torch.randint(5, vocab, (batch, seq_len), generator=gen)
        labels = torch.where(torch.rand(batch, seq_len, generator=gen) < 0.15, ids, torch.full_like(ids, -100))
        out.append({"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
                    "labels": labels.to(device)})
    return out


def run(name: str, model: torch.nn.Module, args, flops_per_token: float, peak: float) -> dict:
    from distaff.train.run.config import load_config
    from distaff.train.run.engine import initialize

    cfg = load_config(None, ["data.dir=unused", f"data.batch_size={args.batch_size}", "train.precision=bf16",
                             "zero.stage=0", "optim.lr=1e-4"])
    engine = initialize(model, cfg, world_size=1)
    batches = synthetic_batches(args.batch_size, args.seq_len, args.vocab, args.steps + args.warmup, engine.device)
    torch.cuda.reset_peak_memory_stats()
    for i, batch in enumerate(batches):
        if i == args.warmup:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    tokens_per_s = args.steps * args.batch_size * args.seq_len / elapsed
    result = {"name": name, "tokens_per_s": tokens_per_s, "mfu": tokens_per_s * flops_per_token / peak,
              "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30, "step_ms": 1000 * elapsed / args.steps}
    del engine
    torch.cuda.empty_cache()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=128100)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/pretrain.py needs a CUDA GPU (it measures GPU throughput and MFU); none found.",
              file=sys.stderr)
        return 1
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM

    from distaff.train.model.config import load_model_config
    from distaff.train.model.deberta import DebertaForMaskedLM
    from distaff.train.model.flops import peak_flops, train_flops_per_token
    from distaff.train.model.hf import hf_config_dict

    cfg = load_model_config("deberta-v3-base", vocab_size=args.vocab, max_position_embeddings=args.seq_len)
    device_name = torch.cuda.get_device_name()
    peak = peak_flops(device_name, "bf16")
    if peak is None:
        print(f"unknown peak FLOP/s for {device_name!r}: add it to distaff.train.model.flops.PEAK_FLOPS", file=sys.stderr)
        return 1
    flops_per_token = train_flops_per_token(cfg, args.seq_len)
    torch.manual_seed(0)
    results = [run("distaff (fused kernels)", DebertaForMaskedLM(cfg), args, flops_per_token, peak)]
    torch.manual_seed(0)
    hf = DebertaV2ForMaskedLM(DebertaV2Config(**hf_config_dict(cfg)))
    results.append(run("HF DebertaV2ForMaskedLM", hf, args, flops_per_token, peak))

    print(f"\ndeberta-v3-base MLM training, seq {args.seq_len}, batch {args.batch_size}, bf16, DeepSpeed ZeRO-0, "
          f"1x {device_name} (peak {peak / 1e12:.0f} TFLOP/s), {flops_per_token / 1e9:.2f} GFLOP/token")
    print(f"| {'model':<26} | {'tokens/s':>10} | {'MFU':>6} | {'step ms':>8} | {'peak mem GB':>11} |")
    print(f"|{'-' * 28}|{'-' * 12}|{'-' * 8}|{'-' * 10}|{'-' * 13}|")
    for r in results:
        print(f"| {r['name']:<26} | {r['tokens_per_s']:>10,.0f} | {100 * r['mfu']:>5.1f}% | {r['step_ms']:>8.1f} "
              f"| {r['peak_mem_gb']:>11.1f} |")
    print(f"speed-up: {results[0]['tokens_per_s'] / results[1]['tokens_per_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
