"""Presets by name from any folder (``--config tiny-cpu``), resolved from the installed ``distaff.configs``
package; a path still works, an unknown name lists the presets of its kind and names the closest; ``distaff
presets`` lists them all with what each is for; a mistyped key names the closest valid one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from distaff.launch import cli
from distaff.train.core.presets import description, preset_file, preset_names
from distaff.train.finetune.config import load_finetune_config
from distaff.train.model.config import load_model_config
from distaff.train.run.config import ConfigError, config_file, load_config
from distaff.train.tools.ablate import load_ablation

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind", ["model", "run", "finetune", "ablation"])
def test_each_kind_lists_its_installed_files(kind):
    files = sorted(p.stem for p in (REPO / "configs" / kind).glob("*.yaml"))
    assert files and preset_names(kind) == files
    for name in files:
        assert preset_file(name, kind) == preset_file(f"{name}.yaml", kind) == REPO / "configs" / kind / f"{name}.yaml"


def test_a_name_resolves_from_any_folder_and_a_path_still_works(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config_file("tiny-cpu") == REPO / "configs" / "run" / "tiny-cpu.yaml"
    assert load_config("tiny-cpu").run.name == "tiny-cpu"
    assert load_finetune_config("sentiment-cpu").run.name == "sentiment-cpu"
    assert load_ablation("positions-cpu").name == "positions-cpu"       # its base, tiny-cpu, by name too
    own = tmp_path / "tiny-cpu"             # a file of that name in the working folder wins
    own.write_text((REPO / "configs" / "run" / "tiny-cpu.yaml").read_text().replace("name: tiny-cpu", "name: mine"))
    assert load_config("tiny-cpu").run.name == "mine"
    assert load_config(REPO / "configs" / "run" / "deberta-v3-base.yaml").train.precision == "bf16"


@pytest.mark.parametrize("value, kind, meant", [
    ("tiny", "run", "tiny-cpu"), ("configs/run/nowhere.yaml", "run", None), ("tiny-cpu", "finetune", "sentiment-cpu"),
    ("nothing", "ablation", None), ("sentiment-cup", "finetune", "sentiment-cpu")])
def test_an_unknown_name_lists_the_presets_of_its_kind_and_the_closest(value, kind, meant, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        config_file(value, kind)
    assert str(info.value) == (f"config file not found: {value} (nor a {kind} preset of that name; presets: "
                               f"{', '.join(preset_names(kind))}; `distaff presets` describes them)"
                               + (f"; did you mean {meant}?" if meant else ""))


def test_distaff_presets_lists_every_preset_of_every_kind_with_its_first_comment_line(capsys):
    assert cli.main(["presets"]) == 0
    out = capsys.readouterr().out
    for kind in ("run", "model", "finetune", "ablation"):
        assert f"\n{kind}: " in f"\n{out}"
        for name in preset_names(kind):
            first = next(line for line in (REPO / "configs" / kind / f"{name}.yaml").read_text().splitlines()
                         if line.startswith("#"))
            text = description(kind, name)
            assert text and text in first and not text.endswith((",", "-")), (kind, name, text)
            assert re.search(rf"^  {re.escape(name)} +{re.escape(text)}$", out, re.M), (name, text)
    assert "deberta-v3-large" in out.split("model:")[1] and "tiny-cpu" in out.split("model:")[0]
    assert cli.main(["presets", "model"]) == 0 and "run:" not in capsys.readouterr().out


def test_distaff_presets_names_the_closest_kind_of_a_mistyped_one(capsys):
    assert cli.main(["presets", "modle"]) == 2
    assert capsys.readouterr().err.strip() == ("distaff presets: unknown kind 'modle'; kinds: run, model, finetune, "
                                               "ablation; did you mean model?")


@pytest.mark.parametrize("overrides, message", [
    (["optim.lrr=1"], "unknown config key(s) ['optim.lrr']"),
    (["optimm.lr=1"], "unknown config key(s) ['optimm']"),
    (["model.hiden_size=64"], "unknown config key(s) ['model.hiden_size'] (not ModelConfig fields)"),
])
def test_a_mistyped_pretraining_key_names_the_closest_valid_one(overrides, message):
    meant = {"optim.lrr=1": "optim.lr", "optimm.lr=1": "optim", "model.hiden_size=64": "model.hidden_size"}[overrides[0]]
    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", overrides)
    assert str(info.value).startswith(message) and str(info.value).endswith(f"; did you mean {meant}?")


def test_a_mistyped_fine_tuning_key_names_the_closest_valid_one_each_when_several():
    with pytest.raises(ConfigError) as info:
        load_finetune_config("sentiment-cpu", ["data.text_colum=x", "data.label_colum=y"])
    assert str(info.value).endswith("; did you mean data.label_column for data.label_colum, data.text_column for "
                                    "data.text_colum?")


def test_a_mistyped_model_preset_or_field_names_the_closest():
    with pytest.raises(ConfigError, match=r"unknown model preset 'deberta-v3-bse'.*; did you mean 'deberta-v3-base'\?$"):
        load_model_config("deberta-v3-bse")
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['hiden_size'\]; did you mean hidden_size\?$"):
        load_model_config("tiny", hiden_size=64)
    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", ["run.zzzzzz=1"])
    assert "did you mean" not in str(info.value)      # nothing close: no guess


def test_launch_takes_a_preset_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["launch", "--config", "tiny-cpu", "--gpus-per-node", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"--config {REPO / 'configs' / 'run' / 'tiny-cpu.yaml'} run.out_dir={tmp_path / 'runs' / 'tiny-cpu'}" in out
    assert cli.main(["launch", "--task", "finetune", "--config", "sentiment-cpu", "--dry-run"]) == 0
    assert f"--module distaff.train.finetune --config {REPO / 'configs' / 'finetune' / 'sentiment-cpu.yaml'}" in \
        capsys.readouterr().out


@pytest.mark.parametrize("command", [["pretrain"], ["finetune"], ["launch"], ["slurm", "submit"], ["ablate"]])
def test_config_help_points_at_the_preset_listing(command, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([*command, "--help"])
    assert info.value.code == 0
    assert "`distaff presets` lists them" in " ".join(capsys.readouterr().out.split())


def test_the_large_run_preset_is_the_base_one_with_the_large_model_and_a_2048_sequence_batch():
    base, large = load_config("deberta-v3-base"), load_config("deberta-v3-large")
    model = large.model_config()
    assert (model.num_hidden_layers, model.hidden_size, model.num_attention_heads) == (24, 1024, 16)
    assert large.data.batch_size * large.train.grad_accum * 8 == 2048
    assert (large.optim, large.train.precision, large.zero.stage) == (base.optim, "bf16", 1)
    assert model.emd and large.run.out_dir == "runs/deberta-v3-large"
