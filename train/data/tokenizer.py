"""SentencePiece unigram tokenizer: training, the on-disk folder, and the metadata the data pipeline reads.

A tokenizer folder holds
  * ``spm.model``            - the SentencePiece model (what DeBERTa-v3 ships),
  * ``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json`` - a Hugging Face
    ``DebertaV2Tokenizer`` folder, so ``transformers.AutoTokenizer.from_pretrained(dir)`` loads it,
  * ``distaff_tokenizer.json`` - our metadata: special-token ids and the sha256 of ``spm.model``.

Special tokens follow DeBERTa-v3: ``[PAD]=0 [CLS]=1 [SEP]=2 [UNK]=3``. ``[MASK]`` is a SentencePiece
control symbol at id 4 (inside the model, so ``spm.model`` alone knows every id; DeBERTa-v3 instead
appends it after the last piece).
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import sentencepiece as spm

from distaff.train.core.errors import (MAX_COUNT, MAX_PROCESSES, command_main, document_ranges, float_arg, int_arg,
                                       shown, whole_number)
from distaff.train.core.files import check_apart, file_sha256, read_json
from distaff.train.core.progress import ProgressLines
from distaff.train.data.errors import DataError
from distaff.train.data.sources import FORMATS, ReadOptions, ReadStats, check_inputs, iter_documents

log = logging.getLogger(__name__)

METADATA_FILE = "distaff_tokenizer.json"
MODEL_FILE = "spm.model"
SPECIAL_TOKENS = {"pad": "[PAD]", "cls": "[CLS]", "sep": "[SEP]", "unk": "[UNK]", "mask": "[MASK]"}
WORD_START = "\u2581"  # SentencePiece's marker for a piece that begins a word
MAX_ADDED_VOCAB = 1 << 16  # ids Hugging Face's files may add after spm.model's pieces (DeBERTa-v3 adds one)


@dataclass(frozen=True)
class TokenizerInfo:
    path: Path
    vocab_size: int
    pad_id: int
    cls_id: int
    sep_id: int
    unk_id: int
    mask_id: int
    fingerprint: str  # sha256 of spm.model

    @property
    def special_ids(self) -> tuple[int, ...]:
        return (self.pad_id, self.cls_id, self.sep_id, self.unk_id, self.mask_id)

    def processor(self) -> spm.SentencePieceProcessor:
        return spm.SentencePieceProcessor(model_file=str(self.path / MODEL_FILE))


def load_tokenizer_info(path: str | Path) -> TokenizerInfo:
    """Read a tokenizer folder's metadata and check it describes the ``spm.model`` beside it."""
    path = Path(path)
    meta_path = path / METADATA_FILE
    if not meta_path.is_file():
        if (path / MODEL_FILE).is_file():
            return hf_tokenizer_info(path)
        raise FileNotFoundError(f"{meta_path}: tokenizer metadata not found (train one with `distaff tokenizer train`)")
    meta = read_json(meta_path, error=DataError)
    if not isinstance(meta, dict) or not {"fingerprint", "vocab_size", "special_ids"} <= set(meta):
        raise DataError(f"{meta_path}: expected the fields fingerprint, vocab_size and special_ids; is it a distaff "
                        "tokenizer folder?")
    fingerprint = file_sha256(path / MODEL_FILE)
    if fingerprint != meta["fingerprint"]:
        raise DataError(f"{path / MODEL_FILE}: sha256 {fingerprint} does not match {meta_path} ({meta['fingerprint']})")
    vocab_size = whole_number(meta["vocab_size"], f"{meta_path}: vocab_size", low=len(SPECIAL_TOKENS), error=DataError)
    return _info(path, vocab_size, meta["special_ids"], fingerprint, str(meta_path))


def _info(path: Path, vocab_size: int, ids: object, fingerprint: str, where: str) -> TokenizerInfo:
    """The tokenizer's description, every special id a piece of its vocabulary (a [MASK] id beyond it would pass
    every check and fail the first training step's embedding lookup)."""
    if not isinstance(ids, dict) or set(SPECIAL_TOKENS) - set(ids):
        raise DataError(f"{where}: special_ids must name {list(SPECIAL_TOKENS)}, got {shown(ids)}")
    checked = {name: whole_number(ids[name], f"{where}: special_ids.{name}", high=vocab_size - 1, error=DataError)
               for name in SPECIAL_TOKENS}
    return TokenizerInfo(path=path, vocab_size=vocab_size, pad_id=checked["pad"], cls_id=checked["cls"],
                         sep_id=checked["sep"], unk_id=checked["unk"], mask_id=checked["mask"],
                         fingerprint=fingerprint)


def hf_tokenizer_info(path: Path) -> TokenizerInfo:
    """A Hugging Face DeBERTa-v2/v3 folder's own ``spm.model``, without our metadata (as the public checkpoints
    ship it). Special ids are the model's pieces, except a token the model lacks: DeBERTa-v3 appends ``[MASK]``
    after the last piece and records its id in ``added_tokens.json``, ``tokenizer_config.json`` or
    ``tokenizer.json``, which are read for it."""
    processor = spm.SentencePieceProcessor(model_file=str(path / MODEL_FILE))
    ids = {}
    for name, piece in SPECIAL_TOKENS.items():
        piece_id = processor.piece_to_id(piece)
        found = piece_id != processor.unk_id() or piece == SPECIAL_TOKENS["unk"]
        ids[name] = piece_id if found else _added_token_id(path, piece)
    vocab_size = max(processor.get_piece_size(), max(ids.values()) + 1)
    if vocab_size > MAX_ADDED_VOCAB + processor.get_piece_size():
        raise DataError(f"{path}: an added token's id {max(ids.values())} is far beyond the {processor.get_piece_size()} "
                        "pieces of spm.model; check added_tokens.json / tokenizer_config.json / tokenizer.json")
    return _info(path, vocab_size, ids, file_sha256(path / MODEL_FILE), str(path))


def _added_token_id(path: Path, token: str) -> int:
    """The id Hugging Face's files beside ``spm.model`` give ``token`` (a token added after the model's pieces)."""
    def read(name: str) -> dict:
        file = path / name
        found = read_json(file, error=DataError) if file.is_file() else {}
        if not isinstance(found, dict):
            raise DataError(f"{file}: expected a JSON object, got {shown(found)}")
        return found

    added = dict(read("added_tokens.json"))
    added.update({entry["content"]: int(key) for key, entry in read("tokenizer_config.json")
                  .get("added_tokens_decoder", {}).items()})
    added.update({entry["content"]: int(entry["id"]) for entry in read("tokenizer.json").get("added_tokens", [])})
    if token not in added:
        raise DataError(f"{path / MODEL_FILE}: no {token} piece, and neither added_tokens.json, tokenizer_config.json "
                         f"nor tokenizer.json in {path} gives its id (is this a DeBERTa-v2/v3 tokenizer?)")
    return whole_number(added[token], f"{path}: the id of {token}", error=DataError)


def word_start_table(processor: spm.SentencePieceProcessor) -> list[bool]:
    """Per id: does the piece begin a word (leading U+2581)? Special ids count as word starts."""
    return [processor.id_to_piece(i).startswith(WORD_START) or processor.is_control(i) or processor.is_unknown(i)
            for i in range(processor.get_piece_size())]


def _pieces(line: str, max_bytes: int) -> Iterator[str]:
    """``line``, or when it is longer than ``max_bytes`` UTF-8 bytes, its consecutive pieces of at most that many,
    cut at the last space of each (inside a character never)."""
    encoded = line.encode()
    if len(encoded) <= max_bytes:
        yield line
        return
    start = 0
    while start < len(encoded):
        end = min(start + max_bytes, len(encoded))
        if end < len(encoded):
            space = encoded.rfind(b" ", start + 1, end + 1)
            end = space if space > start else end
            while end > start + 1 and encoded[end] & 0xC0 == 0x80:     # a UTF-8 continuation byte
                end -= 1
        piece = encoded[start:end].decode()
        if piece.strip():
            yield piece
        start = end


def _document_lines(inputs: Sequence[str | Path], max_bytes: int | None, options: ReadOptions,
                    stats: ReadStats) -> Iterator[str]:
    # Documents are read with the data pipeline's readers (same formats, same errors); SentencePiece
    # trains on lines, so each document is split into its non-empty lines.
    seen = 0
    for doc in iter_documents(inputs, options, stats):
        for line in doc.text.split("\n"):
            if line.strip():
                yield line
                seen += len(line)
                if max_bytes is not None and seen >= max_bytes:
                    return


def _training_lines(inputs: Sequence[str | Path], max_bytes: int | None, options: ReadOptions,
                    stats: ReadStats, max_line_bytes: int) -> Iterator[str]:
    """The inputs' lines as SentencePiece reads them: it drops a line longer than ``max_line_bytes`` (its
    ``max_sentence_length``) without a word, so such a line is cut into pieces, and the lines cut are counted
    and reported once all are read."""
    long_lines = 0
    for line in _document_lines(inputs, max_bytes, options, stats):
        if len(line) * 4 > max_line_bytes and len(line.encode()) > max_line_bytes:   # 4: UTF-8's widest character
            long_lines += 1
        yield from _pieces(line, max_line_bytes)
    if long_lines:
        log.warning("distaff tokenizer: %d line(s) longer than %s bytes were cut at spaces into pieces of at most "
                    "that many (SentencePiece would have dropped them)", long_lines, f"{max_line_bytes:,}")


def _reported(lines: Iterator[str], progress: ProgressLines) -> Iterator[str]:
    """``lines``, counted into ``progress``; its last line once SentencePiece has read them all."""
    for line in lines:
        progress.add(len(line))
        yield line
    progress.done("read; training the unigram model")


def _train_spm(lines: Iterator[str], model: io.BytesIO, vocab_size: int, character_coverage: float,
               num_threads: int, max_sentence_length: int, seed_sentences: int) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines, model_writer=model,
        vocab_size=vocab_size, model_type="unigram", character_coverage=character_coverage,
        pad_id=0, pad_piece=SPECIAL_TOKENS["pad"], bos_id=1, bos_piece=SPECIAL_TOKENS["cls"],
        eos_id=2, eos_piece=SPECIAL_TOKENS["sep"], unk_id=3, unk_piece=SPECIAL_TOKENS["unk"],
        control_symbols=[SPECIAL_TOKENS["mask"]], num_threads=num_threads,
        max_sentence_length=max_sentence_length, input_sentence_size=seed_sentences,
        shuffle_input_sentence=True, minloglevel=2)


def _training_error(err: RuntimeError, inputs: Sequence[str | Path], vocab_size: int, stats: ReadStats) -> Exception:
    """SentencePiece's internal message about too little text as a DataError naming the inputs, what was
    skipped (a binary file's documents are, with --skip-bad) and what to do; any other error as it is."""
    where = f"{', '.join(map(str, inputs))} (skipped: {dict(stats.skipped) or 'nothing'})"
    if "sentences_.empty()" in str(err):
        return DataError(f"no text to train on in {where}: every line is empty or skipped; give text files")
    most = re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", str(err))
    if most:
        return DataError(f"--vocab-size {vocab_size}: the text of {where} supports at most {most.group(1)} pieces; "
                         f"give more text (are the inputs text files?) or a --vocab-size of at most {most.group(1)}")
    return err


def train_tokenizer(inputs: Sequence[str | Path], vocab_size: int, out_dir: str | Path, *,
                    character_coverage: float = 0.9995, max_input_bytes: int | None = None,
                    num_threads: int = 2, max_sentence_length: int = 16384, seed_sentences: int = 2_000_000,
                    model_max_length: int = 512, read: ReadOptions | None = None,
                    progress: bool = False) -> TokenizerInfo:
    """Train a unigram SentencePiece model on ``inputs`` and write a complete tokenizer folder (``progress``:
    log lines on stderr while reading)."""
    check_inputs(inputs)
    check_apart(("--out", out_dir), [("--input", path) for path in inputs])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, stats = io.BytesIO(), ReadStats()
    try:
        lines = _training_lines(inputs, max_input_bytes, read or ReadOptions(), stats, max_sentence_length)
        if progress:
            lines = _reported(lines, ProgressLines("distaff tokenizer train", "lines"))
        _train_spm(lines, model, vocab_size, character_coverage, num_threads, max_sentence_length, seed_sentences)
    except RuntimeError as err:
        raise _training_error(err, inputs, vocab_size, stats) from None
    (out_dir / MODEL_FILE).write_bytes(model.getvalue())
    _write_hf_files(out_dir, model_max_length)
    processor = spm.SentencePieceProcessor(model_file=str(out_dir / MODEL_FILE))
    meta = {
        "format": "distaff-tokenizer/1",
        "model_type": "unigram",
        "vocab_size": processor.get_piece_size(),
        "special_ids": {name: processor.piece_to_id(piece) for name, piece in SPECIAL_TOKENS.items()},
        "fingerprint": file_sha256(out_dir / MODEL_FILE),
        "sources": [str(p) for p in inputs],
    }
    (out_dir / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return load_tokenizer_info(out_dir)


def _write_hf_files(out_dir: Path, model_max_length: int) -> None:
    """Write the Hugging Face side: a slow-tokenizer config, then the converted ``tokenizer.json``."""
    tokens = {f"{name}_token": piece for name, piece in SPECIAL_TOKENS.items()}
    config = {"tokenizer_class": "DebertaV2Tokenizer", "vocab_type": "spm", "do_lower_case": False,
              "split_by_punct": False, "bos_token": SPECIAL_TOKENS["cls"], "eos_token": SPECIAL_TOKENS["sep"],
              "model_max_length": model_max_length, **tokens}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(tokens, indent=2) + "\n")
    try:
        from transformers import AutoTokenizer
    except ImportError:  # transformers is optional at training time; the config above already loads
        log.warning("transformers not installed: %s has no tokenizer.json (converted on first load)", out_dir)
        return
    AutoTokenizer.from_pretrained(str(out_dir)).save_pretrained(str(out_dir))


def main(argv: list[str] | None = None) -> int:
    return command_main("distaff tokenizer", _main, argv)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="distaff tokenizer", description="train a SentencePiece unigram tokenizer")
    sub = parser.add_subparsers(dest="action", required=True)
    train = sub.add_parser("train", help="train spm.model + a Hugging Face tokenizer folder")
    train.add_argument("--input", nargs="+", required=True, help=f"{FORMATS} files")
    train.add_argument("--vocab-size", type=int_arg("--vocab-size", low=len(SPECIAL_TOKENS) + 1, high=MAX_COUNT),
                       required=True)
    train.add_argument("--out", required=True, help="output folder")
    train.add_argument("--character-coverage", type=float_arg("--character-coverage", low=0, low_open=True, high=1),
                       default=0.9995)
    train.add_argument("--max-input-mb", type=float_arg("--max-input-mb", low=0, low_open=True), default=None,
                       help="train on the first MB of text only")
    train.add_argument("--threads", type=int_arg("--threads", low=1, high=MAX_PROCESSES), default=2)
    train.add_argument("--skip-bad", action="store_true", help="skip, count and log bad documents instead of failing")
    train.add_argument("--text-field", default="text",
                       help=".jsonl field, or .parquet/.tsv/.csv column, holding the text (default: text)")
    args = document_ranges(parser).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    max_bytes = None if args.max_input_mb is None else int(args.max_input_mb * 1e6)
    info = train_tokenizer(args.input, args.vocab_size, args.out, character_coverage=args.character_coverage,
                           max_input_bytes=max_bytes, num_threads=args.threads,
                           read=ReadOptions(text_field=args.text_field, skip_bad=args.skip_bad),
                           progress=True)
    print(f"wrote {info.path}: vocab {info.vocab_size}, sha256 {info.fingerprint[:12]}")
    return 0
