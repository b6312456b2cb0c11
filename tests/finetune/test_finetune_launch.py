"""`--task finetune` for `distaff launch` and `distaff slurm submit`: the fine-tuning config is validated by
its own loader at submit time and the ranks run distaff.train.finetune; the bundled config loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from distaff.launch import cli
from distaff.launch.launcher import plan_launch
from distaff.launch.run_config import resolve_launch_target
from distaff.train.finetune.config import load_finetune_config

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
FT_CONFIG = "run:\n  out_dir: out/ft1\n  name: ft1\nmodel:\n  init_from: m\ndata:\n  train: t.tsv\n  dev_fraction: 0.1\n"


@pytest.fixture()
def ft_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "ft.yaml"
    config.write_text(FT_CONFIG)
    return config


def test_launch_runs_the_finetune_module(ft_config: Path) -> None:
    target = resolve_launch_target(ft_config, ["optim.lr=3e-5"], task="finetune")
    assert target.module == "distaff.train.finetune"
    plan = plan_launch(target, hosts=[], gpus_per_node=2, master_port=29500, env={})
    assert plan.command[-6:] == ["--module", "distaff.train.finetune", "--config", str(ft_config), "optim.lr=3e-5",
                                 f"run.out_dir={ft_config.parent / 'out' / 'ft1'}"]


def test_a_finetune_config_is_checked_by_its_own_loader(ft_config: Path, capsys) -> None:
    argv = ["launch", "--task", "finetune", "--config", str(ft_config), "--dry-run", "optim.layer_decay=2"]
    assert cli.main(argv) == 2
    assert "optim.layer_decay" in capsys.readouterr().err
    # as a pretraining config it is refused for what pretraining lacks
    assert cli.main(["launch", "--config", str(ft_config), "--dry-run"]) == 2


def test_slurm_dry_run_writes_a_finetune_script(ft_config: Path, capsys) -> None:
    argv = ["slurm", "submit", "--task", "finetune", "--config", str(ft_config), "--nodes", "1",
            "--gpus-per-node", "2", "--dry-run"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# {ft_config.parent / 'out' / 'ft1' / 'slurm' / 'finetune.sbatch'}\n")
    assert "--module distaff.train.finetune --config" in out


def test_bundled_sentiment_config_loads() -> None:
    cfg = load_finetune_config(REPO / "configs" / "finetune" / "sentiment-cpu.yaml")
    assert cfg.data.columns == ["label", "text"] and cfg.optim.layer_decay == 0.8 and cfg.data.dev_fraction == 0.2
    assert cfg.model.init_from == "runs/demo/run"    # what scripts/demo.sh writes


def test_distaff_finetune_reports_a_config_error(ft_config: Path, capsys) -> None:
    assert cli.main(["finetune", "--config", str(ft_config), "optim.warmup_ratio=2"]) == 2
    assert "distaff finetune: optim.warmup_ratio" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    assert "finetune" in capsys.readouterr().out
