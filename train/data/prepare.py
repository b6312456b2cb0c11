"""``distaff data prepare``: raw text -> tokenized, packed webdataset shards + manifest.

The input is cut into *blocks*: consecutive documents of one file holding about ``shard_mb`` MB of
text. Each block is tokenized, packed and written by a worker process as one train shard and (when
it holds any held-out documents) one held-out shard, named after the block. Block boundaries and the
held-out choice (every k-th document) depend only on the inputs and settings, so an interrupted run
resumes by re-reading the inputs and skipping every block recorded as finished in the state file -
finished shards are never re-tokenized or rewritten.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import sys
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from distaff.train.core.files import atomic_write_text, file_sha256, read_json
from distaff.train.core.progress import ProgressLines
from distaff.train.data import manifest as mf
from distaff.train.data.errors import DataError
from distaff.train.data.shards import token_dtype, write_shard
from distaff.train.data.sources import ReadOptions, ReadStats, check_inputs, iter_file_documents
from distaff.train.data.tokenizer import TokenizerInfo, load_tokenizer_info

log = logging.getLogger(__name__)

STATE_FILE = "prepare_state.json"
COUNTS_DIR = "prepare_counts"  # per-block token histograms, summed into the manifest at the end
TOP_TOKENS = 20
MAX_PIECE_CHARS = 1 << 16  # longer documents are tokenized in pieces of this many characters (memory bound)


@dataclass(frozen=True)
class PrepareConfig:
    inputs: tuple[str, ...]
    tokenizer_dir: str
    seq_len: int
    out_dir: str
    read: ReadOptions = ReadOptions()
    pack_documents: bool = False  # fill sequences with several documents, [SEP]-separated
    shard_mb: float = 16.0  # raw text per block (= per train shard)
    heldout_every: int = 100  # every k-th document goes to the held-out split; 0 = none
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)  # 0 = tokenize in this process
    progress: bool | None = None  # None: a bar when stderr is a terminal

    def settings(self, tokenizer: TokenizerInfo) -> dict:
        """What must match for a resumed run to continue the same output."""
        return {"inputs": [{"path": str(Path(p).resolve()), "bytes": Path(p).stat().st_size} for p in self.inputs],
                "tokenizer": tokenizer.fingerprint, "seq_len": self.seq_len, "read": asdict(self.read),
                "pack_documents": self.pack_documents, "shard_mb": self.shard_mb,
                "heldout_every": self.heldout_every}


@dataclass
class Block:
    index: int
    texts: list[str]
    heldout: list[bool]
    nbytes: int


def pack_sequences(docs: Sequence[Sequence[int]], seq_len: int, cls_id: int, sep_id: int,
                   across_documents: bool, dtype: np.dtype) -> list[np.ndarray]:
    """``[CLS] tokens [SEP]`` sequences of at most ``seq_len``; long documents are split, never dropped.

    With ``across_documents`` a sequence holds consecutive documents as ``[CLS] a [SEP] b [SEP]``.
    """
    if seq_len < 3:
        raise ValueError(f"seq_len {seq_len} leaves no room for tokens between [CLS] and [SEP]")
    sequences: list[np.ndarray] = []
    current: list[int] = []
    for ids in docs:
        start = 0
        while start < len(ids):
            if not current:
                current = [cls_id]
            room = seq_len - len(current) - 1
            take = ids[start:start + room]
            current.extend(take.tolist() if isinstance(take, np.ndarray) else take)
            current.append(sep_id)
            start += len(take)
            if not across_documents or len(current) >= seq_len - 1:
                sequences.append(np.asarray(current, dtype=dtype))
                current = []
    if current:
        sequences.append(np.asarray(current, dtype=dtype))
    return sequences


def split_long_text(text: str, max_chars: int = MAX_PIECE_CHARS) -> Iterator[str]:
    """``text`` in pieces of at most ``max_chars``, each cut just before a whitespace character (in the last
    tenth of the piece) where there is one: SentencePiece then tokenizes the pieces exactly as the whole,
    since a word after a space starts a new token either way. A stretch without whitespace (e.g. text
    without spaces) is cut at ``max_chars``, where the tokens may differ from those of the whole."""
    start = 0
    while len(text) - start > max_chars:
        stop = start + max_chars
        cut = max(text.rfind(space, stop - max_chars // 10, stop) for space in " \n\t")
        cut = cut if cut > start else stop
        yield text[start:cut]
        start = cut
    yield text[start:]


def encode_documents(processor, texts: Sequence[str], dtype: np.dtype) -> list[np.ndarray]:
    """Each text's token ids as one array. Texts are encoded in batches of about ``MAX_PIECE_CHARS`` of
    text and over-long ones piece by piece (:func:`split_long_text`), so the tokenizer's own memory (its
    lattice and Python int lists, ~30 bytes per character) stays bounded whatever one document's length;
    what is kept is 2-4 bytes per token."""
    parts: list[list[np.ndarray]] = [[] for _ in texts]
    batch: list[tuple[int, str]] = []
    batch_chars = 0

    def flush() -> None:
        for (owner, _), ids in zip(batch, processor.encode([piece for _, piece in batch], num_threads=1)):
            parts[owner].append(np.asarray(ids, dtype=dtype))
        batch.clear()

    for index, text in enumerate(texts):
        for piece in split_long_text(text):
            batch.append((index, piece))
            batch_chars += len(piece)
            if batch_chars >= MAX_PIECE_CHARS:
                flush()
                batch_chars = 0
    flush()
    return [np.concatenate(doc) if len(doc) > 1 else (doc[0] if doc else np.zeros(0, dtype=dtype)) for doc in parts]


def _token_counts(sequences: Sequence[np.ndarray], vocab_size: int, per_chunk: int = 1 << 14) -> np.ndarray:
    """Token histogram; in chunks, as bincount copies its input to int64 (4x a uint16 block)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(sequences), per_chunk):
        counts += np.bincount(np.concatenate(sequences[start:start + per_chunk]), minlength=vocab_size)
    return counts


def _process_block(block: Block, config: PrepareConfig, tokenizer: TokenizerInfo) -> dict:
    """Tokenize, pack and write one block's shards; return their stats (runs in a worker)."""
    dtype = token_dtype(tokenizer.vocab_size)
    ids = encode_documents(tokenizer.processor(), block.texts, dtype)
    result: dict = {"index": block.index, "bytes": block.nbytes, "splits": {}}
    for split, wanted in (("train", False), ("heldout", True)):
        docs = [doc for doc, is_heldout in zip(ids, block.heldout) if is_heldout == wanted]
        sequences = pack_sequences(docs, config.seq_len, tokenizer.cls_id, tokenizer.sep_id,
                                   config.pack_documents, dtype)
        if not sequences:
            continue
        relpath = f"{split}/shard-{block.index:06d}.tar"
        write_shard(Path(config.out_dir) / relpath, sequences)
        counts = _token_counts(sequences, tokenizer.vocab_size)
        np.save(Path(config.out_dir) / COUNTS_DIR / f"{split}-{block.index:06d}.npy", counts)
        result["splits"][split] = {"path": relpath, "samples": len(sequences), "tokens": int(counts.sum()),
                                   "sha256": file_sha256(Path(config.out_dir) / relpath)}
    return result


_WORKER_ARGS: tuple[PrepareConfig, TokenizerInfo] | None = None


def _init_worker(config: PrepareConfig, tokenizer: TokenizerInfo) -> None:
    global _WORKER_ARGS
    _WORKER_ARGS = (config, tokenizer)


def _worker_process_block(block: Block) -> dict:
    assert _WORKER_ARGS is not None
    return _process_block(block, *_WORKER_ARGS)


def iter_blocks(config: PrepareConfig, stats: ReadStats, done: set[int]) -> Iterator[Block | int]:
    """Blocks in order; a finished block is yielded as its index only (its text is never kept)."""
    block_bytes = int(config.shard_mb * 1e6)
    index, doc_number = 0, 0
    for path in check_inputs(config.inputs):
        texts: list[str] = []
        heldout: list[bool] = []
        nbytes = 0
        for doc in iter_file_documents(path, config.read, stats):
            doc_number += 1
            if index not in done:
                texts.append(doc.text)
                heldout.append(config.heldout_every > 0 and doc_number % config.heldout_every == 0)
            nbytes += len(doc.text)
            if nbytes >= block_bytes:
                yield index if index in done else Block(index, texts, heldout, nbytes)
                index, texts, heldout, nbytes = index + 1, [], [], 0
        if nbytes:
            yield index if index in done else Block(index, texts, heldout, nbytes)
            index += 1


class _State:
    """Finished blocks, persisted after each one so a crash loses at most the blocks in flight."""

    def __init__(self, out_dir: Path, settings: dict):
        self.path = out_dir / STATE_FILE
        self.blocks: dict[int, dict] = {}
        if self.path.is_file():
            saved = read_json(self.path, error=DataError)
            if not isinstance(saved, dict) or saved.get("settings") != settings:
                raise DataError(f"{self.path}: this output dir holds a prepare with different inputs or settings; "
                                "use a new --out (or delete it)")
            self.blocks = {int(k): v for k, v in saved["blocks"].items()}
        self.settings = settings

    def finished(self, out_dir: Path) -> set[int]:
        """Blocks recorded as finished whose shards are still on disk."""
        return {index for index, block in self.blocks.items()
                if all((out_dir / s["path"]).is_file() for s in block["splits"].values())}

    def record(self, result: dict) -> None:
        self.blocks[result["index"]] = result
        atomic_write_text(self.path, json.dumps({"settings": self.settings, "blocks": self.blocks}))


def _split_info(out_dir: Path, blocks: dict[int, dict], split: str, tokenizer: TokenizerInfo) -> mf.SplitInfo:
    shards, counts = [], np.zeros(tokenizer.vocab_size, dtype=np.int64)
    for index in sorted(blocks):
        info = blocks[index]["splits"].get(split)
        if info is not None:
            shards.append(mf.ShardInfo(**info))
            counts += np.load(out_dir / COUNTS_DIR / f"{split}-{index:06d}.npy", allow_pickle=False)
    counts[list(tokenizer.special_ids)] = 0
    top = np.argsort(-counts, kind="stable")[:TOP_TOKENS]
    return mf.SplitInfo(shards=shards, top_tokens=[(int(i), int(counts[i])) for i in top if counts[i] > 0],
                        non_special_tokens=int(counts.sum()))


def prepare(config: PrepareConfig) -> mf.Manifest:
    """Run (or resume) a prepare and write the manifest; returns it."""
    check_inputs(config.inputs)
    if config.seq_len < 3:
        raise DataError(f"--seq-len {config.seq_len}: sequences need room for [CLS], a token and [SEP] (3 or more)")
    tokenizer = load_tokenizer_info(config.tokenizer_dir)
    out_dir = Path(config.out_dir)
    (out_dir / COUNTS_DIR).mkdir(parents=True, exist_ok=True)
    state = _State(out_dir, config.settings(tokenizer))
    done = state.finished(out_dir)
    if done:
        log.info("resuming %s: %d finished blocks are kept", out_dir, len(done))
    stats = ReadStats()
    # The bar counts raw text bytes, so its rate is the prepare throughput in MB/s; a log (not a terminal)
    # gets a line now and then instead.
    lines = ProgressLines("distaff data prepare", "blocks") if config.progress is None and not sys.stderr.isatty() \
        else None
    with tqdm(unit="B", unit_scale=True, desc="prepare", disable=None if config.progress is None
              else not config.progress) as bar:
        def advance(nbytes: int) -> None:
            bar.update(nbytes)
            if lines is not None:
                lines.add(nbytes)

        _run_blocks(config, tokenizer, state, iter_blocks(config, stats, done), advance)
    if lines is not None:
        lines.done("tokenized")
    mf.copy_tokenizer(tokenizer, out_dir)
    manifest = mf.Manifest(
        seq_len=config.seq_len, dtype=token_dtype(tokenizer.vocab_size).name, vocab_size=tokenizer.vocab_size,
        tokenizer_fingerprint=tokenizer.fingerprint,
        special_ids={"pad": tokenizer.pad_id, "cls": tokenizer.cls_id, "sep": tokenizer.sep_id,
                     "unk": tokenizer.unk_id, "mask": tokenizer.mask_id},
        pack_documents=config.pack_documents,
        sources=[{"path": str(p), "bytes": Path(p).stat().st_size} for p in config.inputs],
        splits={split: _split_info(out_dir, state.blocks, split, tokenizer) for split in mf.SPLITS},
        skipped=dict(stats.skipped))
    if manifest.splits["train"].samples == 0:
        raise DataError(f"no training samples: every document of {list(config.inputs)} was empty or skipped")
    mf.write_manifest(out_dir, manifest)
    for reason, count in sorted(stats.skipped.items()):
        log.warning("skipped %d input item(s): %s", count, reason)
    return manifest


def _run_blocks(config: PrepareConfig, tokenizer: TokenizerInfo, state: _State, blocks: Iterator[Block | int],
                advance: Callable[[int], None]) -> None:
    def finish(result: dict) -> None:
        state.record(result)
        advance(result["bytes"])

    new_blocks = (block for block in blocks if isinstance(block, Block))  # ints: finished in an earlier run
    if config.workers == 0:
        for block in new_blocks:
            finish(_process_block(block, config, tokenizer))
        return
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ctx.Pool(config.workers, initializer=_init_worker, initargs=(config, tokenizer)) as pool:
        in_flight: deque = deque()
        for block in new_blocks:
            in_flight.append(pool.apply_async(_worker_process_block, (block,)))
            # Bounded read-ahead: the reader never holds more than 2 blocks per worker in memory.
            while len(in_flight) >= 2 * config.workers:
                finish(in_flight.popleft().get())
        while in_flight:
            finish(in_flight.popleft().get())
