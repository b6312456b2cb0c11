"""Fine-tuning config errors (each naming its dotted key), layer-wise lr decay against its formula, and the
checks of model.init_from against the tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from finetune_fixtures import MOVIES, TINY, tiny_model
from pretrain_fixtures import rank_env

from distaff.train.data.tokenizer import train_tokenizer
from distaff.train.finetune.classifier_init import load_encoder, resolve_tokenizer
from distaff.train.finetune.config import load_finetune_config
from distaff.train.model.classifier import DebertaForSequenceClassification
from distaff.train.model.config import load_model_config
from distaff.train.model.deberta import DebertaForMaskedLM
from distaff.train.run.config import ConfigError
from distaff.train.run.engine import layer_decay_groups, set_lr
from distaff.train.run.model_folder import save_model_folder

REQUIRED = ["data.train=train.tsv", "data.dev_fraction=0.1", "model.init_from=model"]


@pytest.mark.unit
@pytest.mark.parametrize("overrides, message", [
    (["data.bogus=1"], "data.bogus"),
    (["data.dev=dev.tsv"], "data.dev and data.dev_fraction"),
    (["data.dev_fraction=1.5"], "data.dev_fraction"),
    (["model.hidden_size=64"], "model.hidden_size"),
    (["model.emd=true"], "model.emd"),
    (["model.nonsense=1"], "model.nonsense"),
    (["optim.layer_decay=1.5"], "optim.layer_decay"),
    (["optim.layer_decay=0"], "optim.layer_decay"),
    (["optim.warmup_ratio=0.1", "optim.warmup_steps=10"], "optim.warmup_ratio and optim.warmup_steps"),
    (["eval.metric=pearson"], "eval.metric"),
    (["data.task=regression", "data.labels=[a, b]"], "data.labels"),
    (["data.task=ranking"], "data.task"),
    (["train.epochs=0"], "train.epochs and train.max_steps"),
    (["sift.step_size=-1"], "sift.step_size"),
    (["zero.stage=4"], "zero.stage"),
    (["data.batch_size=0"], "data.batch_size"),
    (["run.seed=18446744073709551617"], "run.seed: must be a whole number from 0 to 4294967295"),
    (["data.split_seed=-1"], "data.split_seed: must be a whole number from 0 to 4294967295"),
])
def test_bad_values_name_their_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_finetune_config(None, REQUIRED + overrides)


@pytest.mark.unit
@pytest.mark.parametrize("missing, key", [(0, "data.train"), (2, "model.init_from")])
def test_required_keys(missing, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_finetune_config(None, [item for i, item in enumerate(REQUIRED) if i != missing])


@pytest.mark.unit
def test_defaults_and_overrides():
    cfg = load_finetune_config(None, REQUIRED + ["data.task=regression", "optim.lr=3e-5", "sift.enabled=true",
                                                 "model.hidden_dropout_prob=0.2"])
    assert cfg.metric == "pearson" and cfg.optim.lr == 3e-5 and cfg.sift.enabled
    assert cfg.model.overrides == {"hidden_dropout_prob": 0.2}
    assert load_finetune_config(None, REQUIRED).metric == "accuracy"


def expected_scale(name: str, num_layers: int, decay: float) -> float:
    """The documented formula, from the parameter's name alone."""
    if name.startswith("deberta.embeddings."):
        return decay ** num_layers
    if name.startswith("deberta.encoder.layer."):
        layer = int(name.split(".")[3]) + 1          # 1-based
        return decay ** (num_layers - layer)
    return 1.0


@pytest.mark.unit
def test_layer_decay_groups_follow_the_formula():
    config = load_model_config("tiny", **{**TINY, "num_hidden_layers": 3}, vocab_size=100)
    model = DebertaForSequenceClassification(config, 3)
    groups = layer_decay_groups(model, weight_decay=0.01, layer_decay=0.7)
    optimizer = torch.optim.AdamW(groups, lr=1.0)
    set_lr(type("Engine", (), {"optimizer": optimizer})(), 2e-4)
    names = {id(p): n for n, p in model.named_parameters()}
    seen = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = names[id(param)]
            assert group["lr"] == pytest.approx(2e-4 * expected_scale(name, 3, 0.7)), name
            assert group["weight_decay"] == (0.01 if param.ndim >= 2 else 0.0), name
            seen += 1
    assert seen == len(names)
    lrs = sorted({round(g["lr"], 12) for g in optimizer.param_groups})
    assert len(lrs) == 4      # embeddings, layers 1 and 2, and layer 3 with the head


@pytest.mark.integration
def test_layer_decay_survives_a_deepspeed_engine(tmp_path):
    """The lr_scale of every group reaches the optimizer DeepSpeed (ZeRO-2) steps, and set_lr applies it."""
    script = f"""
import json, os, torch
from distaff.train.core import distributed as dist_utils
from distaff.train.finetune.config import load_finetune_config
from distaff.train.model.classifier import DebertaForSequenceClassification
from distaff.train.model.config import load_model_config
from distaff.train.run.engine import initialize, layer_decay_groups, set_lr
cfg = load_finetune_config(None, {REQUIRED!r} + ["zero.stage=2", "optim.layer_decay=0.5"])
dist_utils.init_distributed(60)
model = DebertaForSequenceClassification(load_model_config("tiny", **{TINY!r}, vocab_size=100), 2)
names = {{id(p): n for n, p in model.named_parameters()}}
groups = layer_decay_groups(model, 0.01, 0.5)
members = [[names[id(p)] for p in g["params"]] for g in groups]
engine = initialize(model, cfg, 1, groups)
set_lr(engine, 1e-3)
# ZeRO-2 steps flat fp32 partitions, one per group, in the groups' order
print(json.dumps([[group_names, g["lr"]] for group_names, g in zip(members, engine.optimizer.param_groups, strict=True)]))
"""
    env = {**rank_env(tmp_path), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    groups = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sum(len(names) for names, _ in groups) == sum(1 for _ in DebertaForSequenceClassification(
        load_model_config("tiny", **TINY, vocab_size=100), 2).parameters())
    for names, lr in groups:
        for name in names:
            assert lr == pytest.approx(1e-3 * expected_scale(name, TINY["num_hidden_layers"], 0.5)), name


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.getbasetemp() / "finetune-model")


@pytest.mark.integration
def test_a_tokenizer_the_model_was_not_trained_with_is_refused(model_dir, tmp_path):
    import gzip

    text = tmp_path / "other.txt"   # the same kind of text, a smaller vocabulary: other ids for the same pieces
    with gzip.open(MOVIES, "rt") as handle:
        text.write_text("".join(line.split("\t", 1)[1] for line in handle.readlines()[:800]))
    other = train_tokenizer([text], 200, tmp_path / "other-tokenizer", num_threads=1)
    source = load_encoder(model_dir, {})
    with pytest.raises(ConfigError, match="not the tokenizer model.init_from"):
        resolve_tokenizer(source, str(other.path), str(model_dir))
    assert resolve_tokenizer(source, "", str(model_dir)).path == model_dir / "tokenizer"


@pytest.mark.integration
def test_a_vocabulary_larger_than_the_embeddings_is_refused(model_dir, tmp_path):
    """A model folder whose embedding table is smaller than its tokenizer's vocabulary (e.g. the tokenizer
    was swapped for a bigger one)."""
    config = load_model_config("tiny", **TINY, vocab_size=100)
    folder = save_model_folder(DebertaForMaskedLM(config), tmp_path / "small", model_dir / "tokenizer")
    with pytest.raises(ConfigError, match=r"600 pieces .* vocab_size=100"):
        resolve_tokenizer(load_encoder(folder, {}), "", str(folder))


@pytest.mark.unit
def test_init_from_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="model.init_from"):
        load_encoder(tmp_path / "missing", {})


@pytest.mark.integration
def test_hf_folder_starts_the_encoder(model_dir, tmp_path):
    """An HF DebertaV2ForMaskedLM folder gives the same encoder weights as the distaff folder it came from."""
    from distaff.train.model.hf import to_hf
    from distaff.train.run.model_folder import load_model

    model, tokenizer = load_model(model_dir)
    hf = to_hf(model, tmp_path / "hf", tokenizer)
    ours, theirs = load_encoder(model_dir, {}), load_encoder(hf, {})
    assert ours.weights.keys() == theirs.weights.keys()
    for key, tensor in ours.weights.items():
        torch.testing.assert_close(theirs.weights[key], tensor, rtol=0, atol=0, msg=key)
    assert theirs.config.to_dict() == ours.config.to_dict()


@pytest.mark.unit
@pytest.mark.parametrize("unset", ["data.columns=[]", "data.columns=null"])
def test_a_presets_columns_can_be_unset_by_an_override(unset):
    """sentiment-cpu names a header-less file's columns; a file with a header row needs them unset."""
    from distaff.train.finetune.trainer import input_format

    assert load_finetune_config("sentiment-cpu", ["model.init_from=/m"]).data.columns == ["label", "text"]
    cfg = load_finetune_config("sentiment-cpu", ["model.init_from=/m", unset])
    assert cfg.data.columns == [] and input_format(cfg).columns is None and input_format(cfg).has_header


@pytest.mark.unit
def test_label_names_give_the_export_readable_labels_and_refuse_what_names_no_class():
    from distaff.train.finetune.labelled import display_names

    cfg = load_finetune_config("sentiment-cpu", [])
    assert display_names(["0", "1"], cfg.data.label_names) == ["negative", "positive"]   # the preset names them
    assert display_names(["0", "1"], {}) == ["0", "1"] and display_names(None, {"0": "x"}) is None
    assert display_names(["0", "1", "2"], {"1.0": "one"}) == ["0", "one", "2"]     # 1.0 is the class "1"
    with pytest.raises(ConfigError, match=r"data.label_names: \['3'\] is not a label of the data"):
        display_names(["0", "1"], {3: "three"})
    with pytest.raises(ConfigError, match="two classes would both be called"):
        display_names(["0", "1"], {0: "same", 1: "same"})
    with pytest.raises(ConfigError, match=r"data.label_names.0: must be a non-empty name"):
        load_finetune_config("sentiment-cpu", ["data.label_names={0: ''}"])
    with pytest.raises(ConfigError, match="data.label_names: a regression task"):
        load_finetune_config("sentiment-cpu", ["data.task=regression", "eval.metric=pearson"])
