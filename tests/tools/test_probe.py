"""``distaff probe`` end to end on a small random model: the held-out sentences, the files and results it writes,
random features at chance on labels that ignore the text, a word-order rule fine-tuning reads off, bad input."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from distaff.train.finetune.labelled import Example, read_texts
from distaff.train.tools.baselines import PROBE_L2, fit_and_score, frozen_encoder
from distaff.train.tools.probe import Encoder, finetune, main, parse_args
from distaff.train.tools.probe_overlap import pretrained_on
from distaff.train.tools.probe_tasks import probe_sentences

pytestmark = pytest.mark.integration

FAST = ["train.max_steps=4", "data.max_len=32", "data.batch_size=8", "zero.stage=0"]


def _examples(rows: list[tuple[int, str]]) -> list[Example]:
    return [Example(text, None, str(label), f"rows:{i}") for i, (label, text) in enumerate(rows, 1)]


def _order_rows(n: int, seed: int) -> list[tuple[int, str]]:
    """Shuffled filler around "dull" and "superb": label 1 when "superb" comes first. Both words are in every
    sentence, so the label is in the order alone (a bag of words is at chance)."""
    rng = random.Random(seed)
    filler = ["the", "plot", "actors", "music", "scenes", "story", "cast", "ending", "film", "was"]
    rows = []
    for i in range(n):
        words = rng.sample(filler, 6)
        first, second = sorted(rng.sample(range(7), 2))
        words.insert(first, "superb" if i % 2 else "dull")
        words.insert(second + 1, "dull" if i % 2 else "superb")
        rows.append((i % 2, " ".join(words)))
    return rows


def test_random_features_stay_at_chance_when_the_labels_ignore_the_text(small_model_dir: Path, sample_data: Path):
    """The bundled sentences with coin-flip labels: a probe of random features must not find anything (and the
    same probe does read the words off them, so it is not blind)."""
    sentences = probe_sentences(read_texts(sample_data / "movie-snippets.tsv.gz", 1))[:1200]
    coin = random.Random(3)
    features = frozen_encoder(small_model_dir)
    noise = _examples([(coin.randrange(2), s) for s in sentences])
    accuracy = fit_and_score(noise[:900], noise[900:], features, PROBE_L2, seed=0).dev_accuracy
    assert 0.4 < accuracy < 0.6, accuracy   # 300 dev rows: chance +- 1.7 standard errors
    words = _examples([(int(" film" in s), s) for s in sentences])
    assert fit_and_score(words[:900], words[900:], features, PROBE_L2, seed=0).dev_accuracy > 0.75


def test_fine_tuning_reads_a_word_order_rule_off(small_model_dir: Path, tmp_path: Path):
    """Fine-tuning (the path ``--finetune`` takes) learns which of two words comes first, which a bag of words
    cannot see; the frozen random features do not hold it either."""
    rows = _order_rows(600, seed=0)
    train_file, dev_file = tmp_path / "train.tsv", tmp_path / "dev.tsv"
    train_file.write_text("".join(f"{label}\t{text}\n" for label, text in rows[:500]))
    dev_file.write_text("".join(f"{label}\t{text}\n" for label, text in rows[500:]))
    # a rate for this 0.15M-parameter model; dropout and layer-wise decay off, so 60 steps suffice
    args = parse_args(["--text", "x.txt", "--model", str(small_model_dir), "--out", str(tmp_path), "--",
                       "train.max_steps=60", "eval.every=60", "data.max_len=32", "zero.stage=0", "optim.lr=1e-2",
                       "optim.layer_decay=1.0", "model.hidden_dropout_prob=0", "model.attention_probs_dropout_prob=0",
                       "model.pooler_dropout=0"])
    summary = finetune(Encoder("small", small_model_dir), train_file, dev_file, ["0", "1"], tmp_path / "run", 1, args)
    assert summary["steps"] == 60 and summary["eval_accuracy"] >= 0.9, summary
    probe = fit_and_score(_examples(rows[:500]), _examples(rows[500:]), frozen_encoder(small_model_dir), PROBE_L2, 0)
    assert probe.dev_accuracy < 0.7, probe


def _probe_args(small_model_dir: Path, data_dir: Path, texts: list[Path], out: Path, finetune: bool) -> list[str]:
    return ["--text", *map(str, texts), "--text-column", "1", "--model", f"small={small_model_dir}", "--random",
            "--bow", "--seeds", "1", "2", "--max-sentences", "800", "--pretraining-data", str(data_dir),
            *(["--finetune", "40"] if finetune else []), "--out", str(out), "--", *FAST]


def test_the_command_writes_tasks_results_and_a_table(small_model_dir: Path, data_dir: Path, corpus_files: list[Path],
                                                       sample_data: Path, tmp_path: Path, capsys):
    """Austen paragraphs the data dir trained on, then the bundled movie sentences: the trained-on sentences are
    dropped, every task is written, probed on two seeds beside random weights and the bag of words, and
    fine-tuned; run again into the same folder, it writes the same tasks byte for byte."""
    austen = tmp_path / "austen.txt"
    austen.write_text("\n\n".join(corpus_files[0].read_text(encoding="utf-8").split("\n\n")[100:160]), encoding="utf-8")
    out = tmp_path / "out"
    texts = [austen, sample_data / "movie-snippets.tsv.gz"]
    assert main(_probe_args(small_model_dir, data_dir, texts, out, finetune=True)) == 0
    printed = capsys.readouterr().out
    assert "probe small" in printed and "finetune 40 small" in printed and "probe small - random, bshift" in printed

    tasks = json.loads((out / "tasks.json").read_text())
    overlap = tasks["overlap"]
    assert overlap["kept"] == 800 and overlap["in_pretraining_text"] > 50 and overlap["unchecked_models"] == []
    kept = [line.split("\t", 1)[1] for line in (out / "tasks" / "sentlen.tsv").read_text().splitlines()]
    assert len(kept) == 800 and not any(pretrained_on(kept, data_dir))   # sentlen holds every sentence as written
    results = json.loads((out / "results.json").read_text())
    methods = {(r["method"], r["arm"], r["labels"]) for r in results["rows"]}
    assert {("probe", "small", "all"), ("probe", "random", "all"), ("bow", "bag of words", "all"),
            ("finetune", "small", 40), ("finetune", "random", 40), ("bow", "bag of words", 40)} <= methods
    assert all(r["seeds"] == [1, 2] and len(r["per_seed"]) == 2 for r in results["rows"])
    assert {(d["method"], d["task"]) for d in results["differences"]} >= {("probe", t) for t in tasks["tasks"]}
    summaries = sorted((out / "finetune" / "bshift").glob("seed-*/40-*/summary.json"))
    assert len(summaries) == 4 and all(json.loads(p.read_text())["steps"] == 4 for p in summaries)

    tasks_before = {p: p.read_bytes() for p in (out / "tasks").iterdir()}
    assert main(_probe_args(small_model_dir, data_dir, texts, out, finetune=False)) == 0
    assert {p: p.read_bytes() for p in (out / "tasks").iterdir()} == tasks_before


def test_bad_input_is_one_line_naming_it(small_model_dir: Path, sample_data: Path, tmp_path: Path, capsys):
    movie = str(sample_data / "movie-snippets.tsv.gz")
    out = str(tmp_path / "out")
    assert main(["--text", movie, "--model", str(small_model_dir), "--out", out]) == 2
    assert "--text-column" in capsys.readouterr().err
    assert main(["--text", movie, "--text-column", "1", "--model", str(tmp_path / "nowhere"), "--out", out]) == 2
    assert "nowhere" in capsys.readouterr().err
    assert main(["--text", movie, "--text-column", "1", "--model", f"random={small_model_dir}", "--out", out]) == 2
    assert "must be distinct" in capsys.readouterr().err
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("data:\n  dir: gone/data\n")
    assert main(["--text", movie, "--text-column", "1", "--model", str(run), "--out", out]) == 2
    err = capsys.readouterr().err
    assert "gone/data" in err and "--pretraining-data" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("text", ["", "One short line. Another one here.\n", "all lower case text. " * 400])
def test_text_without_enough_sentences_is_one_line_naming_the_count(small_model_dir: Path, tmp_path: Path, capsys,
                                                                   text: str):
    path = tmp_path / "few.txt"
    path.write_text(text)
    code = main(["--text", str(path), "--model", str(small_model_dir), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "0 usable sentences" in err and "at least 100" in err and "few.txt" in err


def test_a_text_column_that_only_looks_like_an_index_is_a_name(small_model_dir: Path, tmp_path: Path, capsys):
    table = tmp_path / "t.tsv"
    table.write_text("a\tb\nx\ty\n")
    assert main(["--text", str(table), "--text-column", "²", "--model", str(small_model_dir),
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no column '²'" in err, err


def test_the_demo_script_asks_for_the_demo_first(tmp_path: Path):
    script = Path(__file__).resolve().parents[2] / "scripts" / "probe-demo.sh"
    done = subprocess.run(["bash", str(script)], env={**os.environ, "DISTAFF_DEMO_DIR": str(tmp_path / "none")},
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "run scripts/demo.sh first" in done.stderr


def test_the_demo_script_refuses_an_output_folder_over_the_demo_it_probes(tmp_path: Path):
    """``rm -rf`` of the probe's folder would delete the pretrained demo (DISTAFF_PROBE_DIR=DISTAFF_DEMO_DIR)."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "probe-demo.sh"
    (tmp_path / "demo" / "run").mkdir(parents=True)
    (tmp_path / "demo" / "run" / "summary.json").write_text("{}")
    env = {**os.environ, "DISTAFF_DEMO_DIR": str(tmp_path / "demo"), "DISTAFF_PROBE_DIR": str(tmp_path / "demo")}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (f"probe-demo.sh: output folder {tmp_path / 'demo'}: contains the input "
                                   f"{tmp_path / 'demo' / 'run'}, which this command reads (writing there could "
                                   "overwrite or delete it); name an output apart from its inputs")
    assert (tmp_path / "demo" / "run" / "summary.json").is_file()


def test_a_bare_hugging_face_folder_is_probed_like_its_source_and_named_unchecked(small_model_dir: Path,
                                                                                   sample_data: Path, tmp_path: Path,
                                                                                   capsys):
    """Public DeBERTa-v3 checkpoints and distaff's RTD export are ``DebertaV2Model`` folders with no pretraining
    text on record: they are probed (random weights in their architecture beside them) and reported unchecked."""
    from transformers import DebertaV2Model

    from distaff.train.model.hf import to_hf
    from distaff.train.run.model_folder import load_model

    model, tokenizer_dir = load_model(small_model_dir)
    bare = to_hf(model, tmp_path / "hf", tokenizer_dir)
    DebertaV2Model.from_pretrained(bare).save_pretrained(bare)   # the encoder alone, as public v3 folders ship
    out = tmp_path / "out"
    assert main(["--text", str(sample_data / "movie-snippets.tsv.gz"), "--text-column", "1", "--model", f"hf={bare}",
                 "--model", f"source={small_model_dir}", "--random", "--tasks", "bshift", "sentlen",
                 "--max-sentences", "400", "--out", str(out)]) == 0
    assert "overlap NOT checked for ['hf', 'source']" in capsys.readouterr().out
    rows = {(r["arm"], r["task"]): r["per_seed"] for r in json.loads((out / "results.json").read_text())["rows"]}
    assert all(rows[("hf", task)] == rows[("source", task)] for task in ("bshift", "sentlen"))
    assert ("random", "bshift") in rows
