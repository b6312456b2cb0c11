"""``distaff data prepare ...`` and ``distaff data verify DIR``."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from distaff.train.core.errors import MAX_PROCESSES, command_main, document_ranges, float_arg, int_arg
from distaff.train.core.files import check_apart
from distaff.train.core.runlock import DirLock
from distaff.train.data.heldout import MIN_HELDOUT_TOKENS, choose_heldout
from distaff.train.data.manifest import MAX_SEQ_LEN, MIN_SEQ_LEN, SplitInfo
from distaff.train.data.prepare import PrepareConfig, prepare
from distaff.train.data.sources import FORMATS, ReadOptions
from distaff.train.data.verify import verify

MOSTLY_PADDING_BELOW = 0.5   # sequences fuller than this on average waste less than half of a padded batch


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distaff data", description="prepare and verify webdataset shards")
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("prepare", help="tokenize text into shards + manifest (resumes an interrupted run)")
    p.add_argument("--input", nargs="+", required=True, help=f"{FORMATS} files")
    p.add_argument("--tokenizer", required=True, help="folder written by `distaff tokenizer train`")
    p.add_argument("--seq-len", type=int_arg("--seq-len", low=MIN_SEQ_LEN, high=MAX_SEQ_LEN), required=True,
                   help="tokens per sequence, [CLS] and [SEP] included")
    p.add_argument("--out", required=True, help="output data dir")
    p.add_argument("--doc-per-file", action="store_true", help=".txt: each file is one document "
                   "(default: documents are separated by blank lines)")
    p.add_argument("--text-field", default="text",
                   help=".jsonl field, or .parquet/.tsv/.csv column, holding the text (default: text)")
    p.add_argument("--pack-documents", action="store_true", help="fill sequences with several documents")
    p.add_argument("--heldout-fraction", type=float_arg("--heldout-fraction", low=0, high=1, high_open=True),
                   default=None,
                   help=f"share of documents held out (0: none; default: 1%%, more for a small corpus, so that the "
                        f"held-out split holds {MIN_HELDOUT_TOKENS:,} tokens or more)")
    p.add_argument("--shard-mb", type=float_arg("--shard-mb", low=0, low_open=True), default=16.0,
                   help="MB of raw text per shard")
    p.add_argument("--workers", type=int_arg("--workers", high=MAX_PROCESSES), default=None,
                   help="tokenizer processes (default: all cores; 0: in this process)")
    p.add_argument("--skip-bad", action="store_true", help="skip, count and log bad documents instead of failing")
    p.add_argument("--no-progress", action="store_true")
    v = sub.add_parser("verify", help="check every shard against the manifest")
    v.add_argument("data_dir")
    return document_ranges(parser)


def _heldout_every(args: argparse.Namespace, read: ReadOptions) -> int:
    """Every k-th document held out: from --heldout-fraction, or chosen for the corpus (and said so)."""
    if args.heldout_fraction is None:
        choice = choose_heldout(args.input, args.tokenizer, read)
        print(choice.line())
        return choice.every
    return round(1 / args.heldout_fraction) if args.heldout_fraction > 0 else 0


def _prepare(args: argparse.Namespace) -> int:
    check_apart(("--out", args.out), [*(("--input", path) for path in args.input), ("--tokenizer", args.tokenizer)])
    read = ReadOptions(doc_per_file=args.doc_per_file, text_field=args.text_field, skip_bad=args.skip_bad)
    config = PrepareConfig(
        inputs=tuple(args.input), tokenizer_dir=args.tokenizer, seq_len=args.seq_len, out_dir=args.out,
        read=read, pack_documents=args.pack_documents, shard_mb=args.shard_mb,
        heldout_every=_heldout_every(args, read),
        progress=False if args.no_progress else None,
        **({} if args.workers is None else {"workers": args.workers}))
    with DirLock(Path(args.out), "--out"):     # one prepare per folder; a second is refused, naming the first
        manifest = prepare(config)
    for name, split in manifest.splits.items():
        print(f"{name}: {len(split.shards)} shards, {split.samples} samples, {split.tokens} tokens")
    if not config.pack_documents:
        _warn_if_mostly_padding(manifest.splits["train"], config.seq_len)
    heldout = manifest.splits["heldout"]
    if config.heldout_every and heldout.tokens < MIN_HELDOUT_TOKENS:
        print(f"distaff data prepare: warning: the held-out split has only {heldout.tokens:,} tokens "
              f"({heldout.samples} sequences), too few for steady held-out loss and accuracy; raise "
              f"--heldout-fraction to hold out {MIN_HELDOUT_TOKENS:,} tokens or more", file=sys.stderr)
    for reason, count in sorted(manifest.skipped.items()):
        print(f"skipped {count}: {reason}")
    return 0


def _warn_if_mostly_padding(train: SplitInfo, seq_len: int) -> None:
    """One line when the sequences (one document each) would leave most of every padded batch as padding."""
    filled = train.tokens / max(1, train.samples * seq_len)
    if filled < MOSTLY_PADDING_BELOW:
        print(f"distaff data prepare: warning: the sequences hold {train.tokens / max(1, train.samples):,.0f} tokens "
              f"on average of --seq-len {seq_len}: about {1 - filled:.0%} of every batch would be padding; "
              "--pack-documents fills each sequence with several documents, or keep one document per sequence "
              "and train with data.packing=varlen (docs/pretraining.md, Packed training)", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    action = argv[0] if argv and argv[0] in ("prepare", "verify") else ""
    return command_main(f"distaff data {action}".strip(), _main, argv)


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    if args.action == "prepare":
        return _prepare(args)
    problems = verify(args.data_dir)
    for problem in problems:
        print(problem)
    print(f"{args.data_dir}: {len(problems)} problem(s)" if problems else f"{args.data_dir}: ok")
    return 1 if problems else 0
