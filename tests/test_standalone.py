"""A clone runs alone: the code and tests read real text only from the repository's data/ folder."""

from __future__ import annotations

import gzip
import hashlib
import re
from pathlib import Path

import pytest
from data_fixtures import SLICES

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[1]
# Folders a user's clone runs from. Exempt: the script that cuts data/ from the full corpora, and this test.
CHECKED = ("configs", "kernels", "launch", "scripts", "tests", "train")
EXEMPT = {REPO_ROOT / "scripts" / "sample-data.py", Path(__file__).resolve()}
# `../shared`, "shared/data", and the same path built with pathlib ("shared" / "data") or os.path.join.
OUTSIDE = re.compile(r"\.\./shared|shared[\"']?\s*[/,]\s*[\"']?data")


def outside_references(roots: list[Path]) -> list[str]:
    """``path:line`` for each line of a text file under ``roots`` that names the corpora beside the checkout."""
    hits = []
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in {".py", ".sh", ".yaml", ".json"}):
            if path in EXEMPT:
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if OUTSIDE.search(line):
                    hits.append(f"{path}:{number}")
    return hits


def test_no_code_reads_data_beside_the_checkout() -> None:
    assert outside_references([REPO_ROOT / name for name in CHECKED]) == []


def test_the_scan_finds_such_a_reference(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text('CORPUS = "../shared/data/corpus"\n')
    (tmp_path / "b.py").write_text('ROOT = REPO.parent / "shared" / "data"\n')
    (tmp_path / "c.sh").write_text("cat corpus.txt\n")
    assert outside_references([tmp_path]) == [f"{tmp_path / 'a.py'}:1", f"{tmp_path / 'b.py'}:1"]


def test_sample_data_is_inside_the_repository(sample_data: Path) -> None:
    samples = [sample_data / name for name, _ in SLICES.values()] + sorted(sample_data.glob("*.gz"))
    for path in samples:
        assert path.is_file() and path.resolve().is_relative_to(REPO_ROOT), path


def test_every_bundled_file_has_its_provenance_and_checksum(sample_data: Path) -> None:
    readme = (sample_data / "README.md").read_text(encoding="utf-8")
    listed = dict(re.findall(r"^([0-9a-f]{64})  (\S+)$", readme, re.M))
    files = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sample_data.glob("*.gz")}
    assert {name: digest for digest, name in listed.items()} == files
    for name in files:
        assert f"| `{name}` |" in readme, f"{name} has no row in data/README.md"


def test_unlabelled_movie_text_shares_no_sentence_with_the_labelled_sample(sample_data: Path) -> None:
    with gzip.open(sample_data / "movie-snippets.tsv.gz", "rt", encoding="utf-8") as f:
        labelled = [line.split("\t", 1)[1] for line in f.read().splitlines()]
    with gzip.open(sample_data / "movie-unlabelled.txt.gz", "rt", encoding="utf-8") as f:
        unlabelled = [line for line in f.read().split("\n") if line]
    assert len(labelled) == 3000 and len(unlabelled) == 7566
    assert len(set(unlabelled)) == len(unlabelled), "a sentence appears twice"
    assert not set(unlabelled) & set(labelled)
