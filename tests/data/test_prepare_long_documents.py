"""One huge line or document in ``prepare`` (issue 15, item 9): it is tokenized in pieces cut at whitespace, so
its tokens are those of the whole text and the memory it costs is a small multiple of its size (it was 27-35x:
a 16 MB line took 565 MB above the baseline, tokenizer lattice and Python int lists, and an int64 histogram)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from data_fixtures import read_sample

from distaff.train.data.prepare import encode_documents, split_long_text
from distaff.train.data.tokenizer import load_tokenizer_info

pytestmark = pytest.mark.integration

# Run in a fresh process: prepare one input with workers=0 and print the peak resident set (KiB on Linux).
_MEASURE = """
import resource, sys
from distaff.launch.cli import main
code = main(["data", "prepare", "--input", sys.argv[1], "--tokenizer", sys.argv[2], "--seq-len", "64",
             "--out", sys.argv[3], "--workers", "0", "--no-progress", "--heldout-fraction", "0"])
print("maxrss_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
sys.exit(code)
"""


def _one_line(sample_data: Path, path: Path, nbytes: int) -> Path:
    text = read_sample(sample_data / "shakespeare.txt.gz", 400_000).replace("\n", " ")
    path.write_text((text * (nbytes // len(text) + 1))[:nbytes] + "\n")
    return path


def _peak_rss_bytes(input_path: Path, tokenizer_dir: Path, out: Path) -> int:
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(input_path), str(tokenizer_dir), str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return int(proc.stdout.split("maxrss_kib")[-1]) * 1024


def test_pieces_cut_before_whitespace_and_cover_the_text():
    text = "word " * 50_000 + "x" * 30_000 + " tail"
    pieces = list(split_long_text(text, max_chars=10_000))
    assert "".join(pieces) == text
    assert all(len(p) <= 10_000 for p in pieces)
    for piece, following in zip(pieces, pieces[1:]):  # cut before whitespace, else forced at the limit
        assert following[0].isspace() or (len(piece) == 10_000 and piece[-1] == following[0] == "x")
    assert sum(not p[0].isspace() for p in pieces[1:]) == 3       # only in the 30,000 x's without a space
    assert list(split_long_text("short")) == ["short"]


def test_a_long_document_tokenizes_in_pieces_as_a_whole(tokenizer_dir, sample_data):
    tokenizer = load_tokenizer_info(tokenizer_dir)
    processor = tokenizer.processor()
    long_doc = read_sample(sample_data / "shakespeare.txt.gz", 300_000).replace("\n", " ")
    texts = ["", "A short one.", long_doc, "And another."]
    ids = encode_documents(processor, texts, np.dtype(np.uint16))
    assert len(list(split_long_text(long_doc))) > 3                # really cut into pieces
    for text, got in zip(texts, ids):
        assert got.dtype == np.uint16
        assert got.tolist() == processor.encode(text)


@pytest.mark.timeout(300)
def test_a_multi_megabyte_line_costs_a_bounded_multiple_of_its_size(tokenizer_dir, sample_data, tmp_path):
    small = _one_line(sample_data, tmp_path / "small.txt", 100_000)
    huge = _one_line(sample_data, tmp_path / "huge.txt", 6_000_000)
    baseline = _peak_rss_bytes(small, tokenizer_dir, tmp_path / "out-small")
    peak = _peak_rss_bytes(huge, tokenizer_dir, tmp_path / "out-huge")
    extra = peak - baseline
    # measured ~6x (the line's bytes and text, its tokens and the packed samples); before the split, 35x
    assert extra < 10 * 6_000_000, f"{extra / 1e6:.0f} MB above the baseline for a 6 MB line"
