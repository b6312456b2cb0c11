"""Regenerate the bundled real-text samples in data/ from the full corpora they were cut from.

    python scripts/sample-data.py [--source DIR]

``--source`` (default: ``shared/data`` beside the checkout) holds
``corpus/{austen,shakespeare,python-docs,linux-docs}.txt.gz`` and ``labelled/movie-snippets.tsv.gz``
(provenance: data/README.md). Nothing in the package or the tests runs this script: it exists so
that every bundled slice can be reproduced byte for byte.
Files are compressed with ``gzip -9 -n`` (no name or time stamp), so reruns give identical bytes.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import random
import subprocess
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"
MOVIE_ROWS, MOVIE_SEED = 3000, 0


def _read(path: Path) -> str:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read()


def _write(name: str, text: str) -> None:
    packed = subprocess.run(["gzip", "-9", "-n"], input=text.encode("utf-8"), capture_output=True, check=True).stdout
    (DATA / name).write_bytes(packed)
    print(f"{name}: {len(text):,} characters, {len(packed):,} bytes, sha256 {hashlib.sha256(packed).hexdigest()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data")
    source = parser.parse_args().source
    corpus = source / "corpus"

    # Emma (lines 1-16235) and Pride and Prejudice (lines 47769-60798) of the six novels.
    austen = _read(corpus / "austen.txt.gz").split("\n")
    _write("austen-emma-pride.txt.gz", "\n".join(austen[:16235]) + "\n" + "\n".join(austen[47768:60798]) + "\n")
    _write("shakespeare.txt.gz", _read(corpus / "shakespeare.txt.gz")[:400_000])
    python_docs = _read(corpus / "python-docs.txt.gz")
    _write("python-docs.txt.gz", python_docs[:400_000])
    # Text the test tokenizer never sees (it trains on the first 400,000 characters).
    _write("python-docs-heldout.txt.gz", python_docs[700_000:760_000])
    _write("linux-docs.txt.gz", _read(corpus / "linux-docs.txt.gz")[:10_000])

    rows = _read(source / "labelled" / "movie-snippets.tsv.gz").splitlines()
    keep = sorted(random.Random(MOVIE_SEED).sample(range(len(rows)), MOVIE_ROWS))
    _write("movie-snippets.tsv.gz", "".join(rows[i] + "\n" for i in keep))
    # The other sentences, labels dropped: in-domain text for pretraining that shares no sentence with the
    # labelled sample. One per paragraph (blank-line separated), so each is a document to `distaff data prepare`.
    labelled = {rows[i].split("\t", 1)[1] for i in keep}
    unlabelled = dict.fromkeys(text for row in rows if (text := row.split("\t", 1)[1]) not in labelled)
    _write("movie-unlabelled.txt.gz", "".join(text + "\n\n" for text in unlabelled))


if __name__ == "__main__":
    main()
