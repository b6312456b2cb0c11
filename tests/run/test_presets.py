"""Presets by name from any folder (``--config tiny-cpu``), resolved from the installed ``distaff.configs``
package; a path still works, and an unknown name lists the presets of its kind."""

from __future__ import annotations

from pathlib import Path

import pytest

from distaff.launch import cli
from distaff.train.core.presets import preset_file, preset_names
from distaff.train.finetune.config import load_finetune_config
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


@pytest.mark.parametrize("value, kind", [("tiny", "run"), ("configs/run/nowhere.yaml", "run"),
                                         ("tiny-cpu", "finetune"), ("nothing", "ablation")])
def test_an_unknown_name_lists_the_presets_of_its_kind(value, kind, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        config_file(value, kind)
    assert str(info.value) == (f"config file not found: {value} (nor a {kind} preset of that name; presets: "
                               f"{', '.join(preset_names(kind))})")


def test_launch_takes_a_preset_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["launch", "--config", "tiny-cpu", "--gpus-per-node", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"--config {REPO / 'configs' / 'run' / 'tiny-cpu.yaml'} run.out_dir={tmp_path / 'runs' / 'tiny-cpu'}" in out
    assert cli.main(["launch", "--task", "finetune", "--config", "sentiment-cpu", "--dry-run"]) == 0
    assert f"--module distaff.train.finetune --config {REPO / 'configs' / 'finetune' / 'sentiment-cpu.yaml'}" in \
        capsys.readouterr().out
