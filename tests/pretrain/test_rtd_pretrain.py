"""RTD pretraining on 2 CPU ranks under real DeepSpeed ZeRO-3: exact resume of both networks and of
the sampling stream after SIGUSR1, the metrics of both networks (JSONL, W&B, plot, summary), and the
export: the discriminator as a ``DebertaV2Model`` folder, the generator as ``DebertaV2ForMaskedLM``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pretrain_fixtures import (metrics, prepare_data, preempted_run, rank_logs, spawn_ranks, wait_all, wandb_runs,
                               write_config)

from distaff.train.run.weights import fp32_state_dict, model_from_meta

from distaff.train.model.hf import discriminator_from_hf
from distaff.train.tools.export import main as export_main

pytestmark = pytest.mark.integration

STEPS = 8
SECTIONS = dict(train={"max_steps": STEPS, "objective": "rtd"}, zero={"stage": 3},
                checkpoint={"every": 0, "keep": 1}, eval={"every": 4, "batches": 2})
TRACKED = ("loss", "gen_loss", "gen_accuracy", "rtd_loss", "rtd_accuracy", "rtd_auc", "replaced_rate")
TEXT = ["Shall I compare thee to a summer's day? Thou art more lovely and more temperate.",
        "Now is the winter of our discontent made glorious summer by this sun of York."]


def rtd_run(base: Path, sample_data: Path) -> Path:
    """The uninterrupted 2-rank ZeRO-3 RTD run (cached per session)."""
    out = base / "rtd-run"
    if (out / "summary.json").is_file():
        return out
    data = prepare_data(base, sample_data)
    folder = base / "rtd-uninterrupted"
    folder.mkdir(exist_ok=True)
    procs = spawn_ranks(write_config(folder / "run.yaml", data, out, **SECTIONS), folder)
    assert wait_all(procs, timeout=240) == [0, 0], rank_logs(folder)
    return out


def tracked(run_dir: Path) -> dict[int, tuple]:
    return {r["step"]: tuple(r[k] for k in TRACKED) for r in metrics(run_dir) if "loss" in r}


def eval_records(run_dir: Path) -> list[dict]:
    return [r for r in metrics(run_dir) if "eval_loss" in r]


@pytest.mark.timeout(400)
def test_zero3_rtd_resume_is_exact_for_both_networks_and_the_sampling(sample_data, tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    full = rtd_run(base, sample_data)
    expected = tracked(full)
    assert sorted(expected) == list(range(1, STEPS + 1))

    tmp = tmp_path_factory.mktemp("rtd-interrupted")
    run_dir = tmp / "run"
    config = write_config(tmp / "run.yaml", prepare_data(base, sample_data), run_dir, **SECTIONS)
    stopped_at, latest = preempted_run(config, tmp, run_dir, after_step=2, signal_rank=0)
    assert 2 <= stopped_at < STEPS
    samplers = [json.loads((latest / "distaff" / f"rank-0000{r}.json").read_text())["sampler"] for r in (0, 1)]
    assert samplers[0]["seed"] != samplers[1]["seed"]                 # each rank its own stream

    procs = spawn_ranks(config, tmp)
    assert wait_all(procs, timeout=240) == [0, 0], rank_logs(tmp)
    assert f"resuming from {latest}" in (tmp / "rank0.log").read_text()
    assert tracked(run_dir) == expected               # both networks and the replacements, bit for bit
    assert eval_records(run_dir) == eval_records(full)


@pytest.mark.timeout(300)
def test_rtd_run_reports_both_networks(sample_data, tmp_path_factory):
    out = rtd_run(tmp_path_factory.getbasetemp(), sample_data)
    train = [r for r in metrics(out) if "loss" in r]
    keys = {"gen_loss", "gen_accuracy", "rtd_loss", "rtd_accuracy", "rtd_auc", "rtd_precision", "rtd_recall",
            "replaced_rate", "rtd_baseline_accuracy", "masked_replaced_rate", "tokens_per_s", "grad_norm"}
    assert all(keys <= r.keys() for r in train)
    first, last = train[0], train[-1]
    assert last["gen_loss"] < first["gen_loss"] and last["rtd_loss"] < first["rtd_loss"]
    assert first["loss"] == pytest.approx(first["gen_loss"] + 50.0 * first["rtd_loss"])
    assert all(0.05 < r["replaced_rate"] < 0.25 for r in train)       # ~15% masked, nearly all replaced early
    evals = eval_records(out)
    assert [r["step"] for r in evals] == [4, STEPS]
    assert {"eval_gen_loss", "eval_rtd_auc", "eval_rtd_accuracy", "eval_replaced_rate"} <= evals[0].keys()
    # held-out replacements are drawn afresh from the same stream at each evaluation
    assert evals[0]["eval_tokens"] == evals[1]["eval_tokens"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_rtd_auc"] == evals[-1]["eval_rtd_auc"]
    assert (out / "metrics.png").stat().st_size > 1000
    (_, history), = wandb_runs(out)
    assert history[STEPS]["rtd/auc"] == train[-1]["rtd_auc"]


@pytest.mark.timeout(300)
def test_rtd_export_loads_in_transformers(sample_data, tmp_path_factory, tmp_path):
    from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification, AutoTokenizer

    run = rtd_run(tmp_path_factory.getbasetemp(), sample_data)
    checkpoint = run / "checkpoints" / f"step-{STEPS:08d}"
    meta = json.loads((checkpoint / "distaff" / "meta.json").read_text())
    ours = model_from_meta(meta, "meta.json")
    ours.load_state_dict(fp32_state_dict(checkpoint))
    ours.eval()
    residual = ours.discriminator.deberta.embeddings.word_embeddings.weight
    assert residual.abs().sum() > 0 and ours.sharing == "gdes"          # the RTD loss trained E_delta

    disc_dir, gen_dir = tmp_path / "discriminator", tmp_path / "generator"
    assert export_main([str(run), str(disc_dir)]) == 0
    assert export_main([str(run), str(gen_dir), "--generator"]) == 0
    tokenizer = AutoTokenizer.from_pretrained(disc_dir)
    batch = tokenizer(TEXT, padding=True, return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    keep = mask.bool()

    hf_disc = AutoModel.from_pretrained(disc_dir).eval()
    assert type(hf_disc).__name__ == "DebertaV2Model"
    stored = load_file(disc_dir / "model.safetensors")
    torch.testing.assert_close(stored["deberta.embeddings.word_embeddings.weight"],
                               ours.discriminator_word_embeddings().detach())             # E_G + E_delta
    assert {"mask_predictions.dense.weight", "mask_predictions.LayerNorm.weight",
            "mask_predictions.classifier.weight"} <= stored.keys()
    with torch.no_grad():
        offset = ours.generator.word_embeddings(ids)
        expected = ours.discriminator.deberta(ids, mask, word_offset=offset)
        got = hf_disc(input_ids=ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(got[keep], expected[keep], rtol=1e-4, atol=1e-4)
        classifier = AutoModelForSequenceClassification.from_pretrained(disc_dir, num_labels=2).eval()
        assert classifier(input_ids=ids, attention_mask=mask).logits.shape == (2, 2)

        reloaded, has_head = discriminator_from_hf(disc_dir)       # keeps mask_predictions.*
        assert has_head
        torch.testing.assert_close(reloaded.eval()(ids, mask), ours.discriminator(ids, mask, word_offset=offset),
                                   rtol=1e-4, atol=1e-4)

        hf_gen = AutoModelForMaskedLM.from_pretrained(gen_dir).eval()
        generator = model_from_meta({**meta, "generator_config": {**meta["generator_config"], "emd": False}},
                                    "meta.json").generator
        generator.load_state_dict({k[len("generator."):]: v for k, v in fp32_state_dict(checkpoint).items()
                                   if k.startswith("generator.") and ".emd." not in k and not k.startswith("generator.emd.")})
        expected_logits = generator.eval()(ids, mask).logits
        torch.testing.assert_close(hf_gen(input_ids=ids, attention_mask=mask).logits[keep], expected_logits[keep],
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.timeout(300)
def test_using_an_rtd_run_as_one_model_says_what_to_export(sample_data, tmp_path_factory, tmp_path, capsys):
    """grow, embed and fine-tuning given an RTD run (two networks) name the export that gives them one model,
    instead of dumping the state dict's keys; the export named works."""
    from distaff.train.finetune.classifier_init import load_encoder
    from distaff.train.model.config import ConfigError
    from distaff.train.tools.embed import main as embed_main
    from distaff.train.tools.grow import main as grow_main

    run = rtd_run(tmp_path_factory.getbasetemp(), sample_data)
    checkpoint = run / "checkpoints" / f"step-{STEPS:08d}"
    hint = (f"{checkpoint}: a checkpoint of an RTD run holds a generator and a discriminator, not one model; export "
            f"the one you want and use that folder: `distaff export-hf {checkpoint} OUT` writes the discriminator")
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXT) + "\n")
    for command, argv in ((grow_main, [str(run), str(tmp_path / "grown")]),
                          (embed_main, ["--model", str(run), "--input", str(texts), "--out", str(tmp_path / "e")])):
        assert command(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and hint in err, err[-2000:]
    with pytest.raises(ConfigError, match=re.escape(f"model.init_from: {hint}")):
        load_encoder(run, {})
    assert export_main([str(run), str(tmp_path / "disc")]) == 0 and export_main([str(run), str(tmp_path / "gen"),
                                                                                 "--generator"]) == 0
    assert embed_main(["--model", str(tmp_path / "disc"), "--input", str(texts), "--out", str(tmp_path / "e")]) == 0
    assert load_encoder(tmp_path / "disc", {}).config.hidden_size > 0
    assert grow_main([str(tmp_path / "gen"), str(tmp_path / "grown")]) == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharing, stage", [("es", 3), ("none", 0)])
def test_other_sharing_modes_train_and_export(sharing, stage, sample_data, tmp_path_factory, tmp_path):
    from transformers import AutoModel

    base = tmp_path_factory.getbasetemp()
    out = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", prepare_data(base, sample_data), out,
                          **{**SECTIONS, "train": {"max_steps": 4, "objective": "rtd"}, "zero": {"stage": stage},
                             "eval": {"every": 0, "batches": 2}, "rtd": {"embedding_sharing": sharing}})
    assert wait_all(spawn_ranks(config, tmp_path), timeout=240) == [0, 0], rank_logs(tmp_path)
    checkpoint = out / "checkpoints" / "step-00000004"
    ours = model_from_meta(json.loads((checkpoint / "distaff" / "meta.json").read_text()), "meta.json")
    ours.load_state_dict(fp32_state_dict(checkpoint))
    gen_table = ours.generator.word_embeddings.weight
    disc_table = ours.discriminator.deberta.embeddings.word_embeddings.weight
    assert (disc_table is gen_table) == (sharing == "es")
    assert export_main([str(out), str(tmp_path / "hf")]) == 0
    hf = AutoModel.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(5, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).last_hidden_state, ours.eval().discriminator.deberta(ids),
                                   rtol=1e-4, atol=1e-4)
