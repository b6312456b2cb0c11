"""``distaff embed``: sentence embeddings of a text file, optionally whitened (BERT-whitening).

One line of the input file is one text; row ``i`` of ``embeddings.npy`` is line ``i + 1`` (a blank
line is an error, so rows and lines never drift apart). A text is encoded as ``[CLS] pieces
[SEP]`` (cut to ``--max-length`` tokens) by the full encoder, EMD and MLM head not involved, and
pooled: the mean over its tokens, or the ``[CLS]`` vector.

Whitening (Su et al., 2021): from a sample of the embeddings, their mean ``mu`` and covariance
``C = U diag(s) U^T``; then ``x -> (x - mu) U_k diag(s_k)^(-1/2)`` keeps the ``k`` directions of
largest variance and makes them uncorrelated with unit variance (on the sample: mean 0, identity
covariance, by construction). The transform is saved beside the embeddings (``whitening.safetensors``
with ``mean`` and ``W``, and ``whitening.json``) and ``--transform DIR`` applies a saved one to new
text, so later text lands in the same space. No pickle anywhere.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from distaff.train.core.errors import MAX_COUNT, MAX_SEED, command_main, document_ranges, int_arg
from distaff.train.core.files import check_apart, check_out_dir, chmod_default, read_json
from distaff.train.core.threads import configure_threads
from distaff.train.data.errors import DataError
from distaff.train.data.manifest import MAX_SEQ_LEN
from distaff.train.data.tokenizer import TokenizerInfo, load_tokenizer_info
from distaff.train.finetune.classifier_init import ENCODER_PREFIX, load_encoder
from distaff.train.model.config import ConfigError, ModelConfig
from distaff.train.model.deberta import DebertaModel
from distaff.train.run.checkpoint_files import check_apart_from_checkpoints

POOLINGS = ("mean", "cls")
TRANSFORM_WEIGHTS, TRANSFORM_META = "whitening.safetensors", "whitening.json"


def read_lines(path: str | Path) -> list[str]:
    """The texts of a ``.txt`` / ``.txt.gz`` file, one per line; blank lines are named errors."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--input: file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err})") from None
    blank = next((i for i, line in enumerate(lines, 1) if not line.strip()), None)
    if blank is not None:
        raise DataError(f"{path}:{blank}: blank line (each line is one text and one row of the output)")
    if not lines:
        raise DataError(f"{path}: no lines to embed")
    return lines


def encode(texts: list[str], tokenizer: TokenizerInfo, max_length: int) -> list[list[int]]:
    pieces = tokenizer.processor().encode(texts)
    return [[tokenizer.cls_id, *ids[: max_length - 2], tokenizer.sep_id] for ids in pieces]


@torch.no_grad()
def embed_ids(encoder: DebertaModel, sequences: list[list[int]], pooling: str, batch_size: int = 32) -> np.ndarray:
    """``[len(sequences), hidden_size]`` float64 pooled encoder outputs (padding never pooled)."""
    device = next(encoder.parameters()).device
    encoder.eval()
    rows = []
    for start in range(0, len(sequences), batch_size):
        batch = sequences[start:start + batch_size]
        width = max(len(s) for s in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)   # padding: masked, so its id changes nothing
        mask = torch.zeros_like(ids)
        for i, seq in enumerate(batch):
            ids[i, : len(seq)], mask[i, : len(seq)] = torch.tensor(seq), 1
        hidden = encoder(ids.to(device), mask.to(device)).double()
        weights = mask.to(device).double().unsqueeze(-1)
        pooled = hidden[:, 0] if pooling == "cls" else (hidden * weights).sum(1) / weights.sum(1)
        rows.append(pooled.cpu().numpy())
    return np.concatenate(rows)


def fit_whitening(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``mean [D]`` and ``W [D, k]`` such that ``(x - mean) @ W`` has mean 0 and identity covariance."""
    n, d = x.shape
    if not 0 < k <= d:
        raise ConfigError(f"--whiten {k}: must be between 1 and the embedding size {d}")
    mean = x.mean(0)
    cov = (x - mean).T @ (x - mean) / n
    u, s, _ = np.linalg.svd(cov)
    if s[k - 1] <= 1e-10 * s[0]:
        raise ConfigError(f"--whiten {k}: the fitting sample ({n} texts) spans only {int((s > 1e-10 * s[0]).sum())} "
                         f"directions; lower --whiten or raise --fit-sample")
    return mean, u[:, :k] / np.sqrt(s[:k])


def save_transform(out: Path, mean: np.ndarray, w: np.ndarray, meta: dict) -> None:
    tensors = {"mean": torch.from_numpy(mean.copy()), "W": torch.from_numpy(np.ascontiguousarray(w))}
    save_file(tensors, out / TRANSFORM_WEIGHTS)
    chmod_default(out / TRANSFORM_WEIGHTS)
    (out / TRANSFORM_META).write_text(json.dumps(meta, indent=1) + "\n")


def load_transform(folder: str | Path) -> tuple[np.ndarray, np.ndarray, dict]:
    folder = Path(folder)
    for name in (TRANSFORM_WEIGHTS, TRANSFORM_META):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"--transform: {folder / name} not found (a folder written by "
                                    "`distaff embed --whiten K`)")
    tensors = load_file(folder / TRANSFORM_WEIGHTS)
    meta = read_json(folder / TRANSFORM_META, error=ConfigError)
    if not isinstance(meta, dict) or meta.get("pooling") not in POOLINGS:
        raise ConfigError(f"--transform: {folder / TRANSFORM_META}: no pooling ({' or '.join(POOLINGS)}) recorded; "
                          "a folder written by `distaff embed --whiten K` holds it: write the transform again")
    return tensors["mean"].numpy(), tensors["W"].numpy(), meta


def model_and_tokenizer(path: str | Path, tokenizer_dir: str | Path | None = None, field: str = "--model"
                        ) -> tuple[DebertaModel, ModelConfig, TokenizerInfo]:
    """The encoder at ``path`` (on the GPU when there is one), its config, and ``tokenizer_dir`` or the tokenizer
    saved beside it. ``path`` is anything fine-tuning starts from (:func:`load_encoder`): a distaff run,
    checkpoint or model folder, or an HF DeBERTa-v2/v3 folder with or without a head (public v3 checkpoints
    and distaff's RTD export are bare ``DebertaV2Model`` folders)."""
    source = load_encoder(path, {}, field)
    encoder = DebertaModel(source.config)
    encoder.load_state_dict({key.removeprefix(ENCODER_PREFIX): t for key, t in source.weights.items()}, strict=True)
    tokenizer_dir = tokenizer_dir or source.tokenizer_dir
    if tokenizer_dir is None:
        raise FileNotFoundError(f"{field} {path}: no tokenizer beside the weights; pass --tokenizer DIR")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return encoder.to(device), source.config, load_tokenizer_info(tokenizer_dir)


def _pooling(args: argparse.Namespace, saved: dict | None) -> str:
    """``--pooling``, or the saved transform's; both given must agree."""
    if saved is None:
        return args.pooling or "mean"
    if args.pooling and args.pooling != saved["pooling"]:
        raise ConfigError(f"--pooling {args.pooling}: the transform in {args.transform} was fitted on "
                         f"{saved['pooling']!r} pooling (--transform); drop --pooling or use the same one")
    return saved["pooling"]


def _whitening(args: argparse.Namespace, x: np.ndarray, out: Path, saved) -> tuple[np.ndarray, np.ndarray] | None:
    """The saved transform (checked against ``x``), a new one fitted on a sample of ``x``, or None."""
    if saved is not None:
        mean, w, meta = saved
        if w.shape[0] != x.shape[1]:
            raise ConfigError(f"--transform {args.transform}: fitted on {w.shape[0]}-dim embeddings, but "
                             f"--model {args.model} gives {x.shape[1]}")
        return mean, w
    if not args.whiten:
        return None
    rows = np.arange(len(x))
    if args.fit_sample and args.fit_sample < len(x):
        rows = np.sort(np.random.default_rng(args.seed).choice(len(x), args.fit_sample, replace=False))
    mean, w = fit_whitening(x[rows], args.whiten)
    np.save(out / "fit_rows.npy", rows)
    save_transform(out, mean, w, {"pooling": args.pooling or "mean", "k": args.whiten, "fit_rows": len(rows),
                                  "fit_input": str(args.input), "seed": args.seed, "model": str(args.model),
                                  "max_length": args.max_length, "hidden_size": x.shape[1]})
    return mean, w


def embed(args: argparse.Namespace) -> Path:
    """Write ``embeddings.npy`` (float32) and ``embeddings.json`` (plus the transform) under ``args.out``."""
    out = Path(args.out)
    check_apart_from_checkpoints(("--out", out), [("--model", args.model)])
    check_apart(("--out", out), [("--input", args.input), ("--transform", args.transform),
                                 ("--tokenizer", args.tokenizer)])
    check_out_dir(out, args.overwrite, "--out", "write into it")
    saved = load_transform(args.transform) if args.transform else None
    pooling = _pooling(args, saved[2] if saved else None)
    texts = read_lines(args.input)
    encoder, config, tokenizer = model_and_tokenizer(args.model, args.tokenizer)
    max_length = args.max_length or config.max_position_embeddings
    x = embed_ids(encoder, encode(texts, tokenizer, max_length), pooling, args.batch_size)
    out.mkdir(parents=True, exist_ok=True)
    whitening = _whitening(args, x, out, saved)
    if whitening is not None:
        x = (x - whitening[0]) @ whitening[1]
    np.save(out / "embeddings.npy", x.astype(np.float32))
    (out / "embeddings.json").write_text(json.dumps(
        {"rows": len(x), "dim": x.shape[1], "pooling": pooling, "model": str(args.model), "input": str(args.input),
         "max_length": max_length, "whitened": whitening is not None,
         "transform": str(args.transform or (out if whitening is not None else "")) or None}, indent=1) + "\n")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="distaff embed", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="distaff model folder, checkpoint / run directory, "
                        "or HF DeBERTa-v2/v3 folder (with or without a head)")
    parser.add_argument("--input", required=True, help="text file (.txt or .txt.gz), one text per line")
    parser.add_argument("--out", required=True, help="output folder (embeddings.npy, embeddings.json, transform)")
    parser.add_argument("--pooling", choices=POOLINGS, help="mean over tokens (default) or the [CLS] vector")
    parser.add_argument("--whiten", type=int_arg("--whiten", high=MAX_COUNT),
                        default=0, metavar="K", help="fit whitening to K dimensions")
    parser.add_argument("--fit-sample", type=int_arg("--fit-sample", high=MAX_COUNT), default=0, metavar="N",
                        help="fit the whitening on N random lines (default: all)")
    parser.add_argument("--transform", help="folder of a saved transform to apply (from an earlier --whiten run)")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the one stored with the model)")
    parser.add_argument("--max-length", type=int_arg("--max-length", high=MAX_SEQ_LEN),
                        default=0, help="tokens per text, [CLS]/[SEP] included "
                        "(default: the model's max_position_embeddings)")
    parser.add_argument("--batch-size", type=int_arg("--batch-size", low=1, high=MAX_COUNT), default=32)
    parser.add_argument("--overwrite", action="store_true", help="write into --out even if it already holds files")
    parser.add_argument("--seed", type=int_arg("--seed", high=MAX_SEED), default=0, help="seed of the fitting sample")
    args = document_ranges(parser).parse_args(argv)
    if args.whiten and args.transform:
        parser.error("--whiten and --transform: fit a new transform or apply a saved one, not both")
    if args.max_length and args.max_length < 3:
        parser.error(f"--max-length {args.max_length}: must be at least 3 ([CLS], a piece, [SEP])")
    return args


def main(argv: list[str] | None = None) -> int:
    return command_main("distaff embed", _main, argv)


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    configure_threads(announce=False)
    out = embed(args)
    meta = json.loads((out / "embeddings.json").read_text())
    print(f"distaff embed: wrote {out / 'embeddings.npy'} ({meta['rows']} x {meta['dim']}, {meta['pooling']} pooling"
          f"{', whitened' if meta['whitened'] else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
