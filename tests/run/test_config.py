"""The run config: YAML + dotted overrides, typed and validated, errors naming the key."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from distaff.train.model.hf import hf_config_dict
from distaff.train.run.config import ConfigError, config_from_dict, config_to_dict, load_config, save_config

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
RUN_CONFIGS = sorted((REPO / "configs" / "run").glob("*.yaml"))


def test_shipped_run_configs_load():
    assert {p.name for p in RUN_CONFIGS} >= {"tiny-cpu.yaml", "deberta-v3-base.yaml"}
    for path in RUN_CONFIGS:
        cfg = load_config(path)
        assert cfg.data.dir and cfg.train.max_steps > 0
    base = load_config(REPO / "configs" / "run" / "deberta-v3-base.yaml")
    assert base.model_config().emd and base.train.precision == "bf16"


def test_pretraining_turns_emd_on_unless_the_run_turns_it_off():
    assert load_config(None, ["data.dir=/d"]).model_config().emd
    assert not load_config(None, ["data.dir=/d", "model.emd=false"]).model_config().emd


def test_overrides_are_typed_and_applied(tmp_path):
    cfg = load_config(REPO / "configs" / "run" / "tiny-cpu.yaml",
                      ["optim.lr=3e-4", "zero.stage=3", "wandb.tags=[a, b]", "model.num_hidden_layers=2",
                       "data.masking.whole_word=false", f"run.out_dir={tmp_path}"])
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.zero.stage == 3 and cfg.wandb.tags == ["a", "b"]
    assert cfg.model_config().num_hidden_layers == 2
    assert cfg.data.masking.whole_word is False
    assert cfg.out_dir == tmp_path


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["data.dir=/d", "model.hidden_size=64", "model.num_attention_heads=2", "optim.lr=2e-4"])
    path = tmp_path / "config.yaml"
    save_config(cfg, path, cfg.model_config())
    saved = yaml.safe_load(path.read_text())
    assert saved["model"]["hidden_size"] == 64 and saved["model"]["position_buckets"] == 32  # every field spelled out
    again = load_config(path)
    assert again.model_config() == cfg.model_config()
    assert config_to_dict(again)["optim"] == config_to_dict(cfg)["optim"]


@pytest.mark.parametrize("override, key", [
    ("optim.lrr=1", "optim.lrr"),                       # unknown key in a section
    ("nosuchsection.x=1", "nosuchsection"),             # unknown section
    ("model.hiden_size=64", "model.hiden_size"),        # not a ModelConfig field
    ("train.max_steps=ten", "train.max_steps"),         # wrong type
    ("train.max_steps=1.5", "train.max_steps"),
    ("logging.every=true", "logging.every"),            # bool is not an int
    ("train.precision=fp8", "train.precision"),         # not one of the choices
    ("wandb.mode=sometimes", "wandb.mode"),
    ("wandb.tags=notalist", "wandb.tags"),
    ("zero.stage=4", "zero.stage"),
    ("data.batch_size=0", "data.batch_size"),
    ("optim.betas=[0.9]", "optim.betas"),
    ("zero.offload_param=true", "zero.offload_param"),  # needs stage 3
    ("model.hidden_size=130", "hidden_size"),           # not divisible by the heads: the model config says so
    ("data.masking.mlm_probability=1.5", "data.masking: mlm_probability"),
    ("data.masking.random_token_fraction=0.5", "data.masking: mask_token_fraction"),
    ("model.preset=no-such-preset", "no-such-preset"),
    ("data.packing=packed", "data.packing"),             # padded | varlen
    ("data.tokens_per_batch=4096", "data.tokens_per_batch"),  # a token budget needs packing=varlen
    ("data.tokens_per_batch=-1", "data.tokens_per_batch"),
    ("run.seed=18446744073709551617", "run.seed: must be a whole number from 0 to 4294967295"),
    ("run.seed=-1", "run.seed: must be a whole number"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, ["data.dir=/d", override])


def test_bad_yaml_files_name_the_problem(tmp_path):
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match="not found"):
        load_config(missing)
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  max_steps: 10\n  grad_acum: 2\ndata:\n  dir: /d\n")
    with pytest.raises(ConfigError, match=r"train\.grad_acum"):
        load_config(bad)
    with pytest.raises(ConfigError, match="data.dir"):
        config_from_dict({})
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        load_config(None, ["data.dir"])


def test_pretrain_cli_reports_bad_keys_before_starting(capsys):
    from distaff.train.pretrain.trainer import EXIT_BAD_CONFIG, main

    config = REPO / "configs" / "run" / "tiny-cpu.yaml"
    assert main(["--config", str(config), "optim.lrr=1e-3"]) == EXIT_BAD_CONFIG
    assert "optim.lrr" in capsys.readouterr().err
    assert main(["--config", str(config), "train.precision=fp64"]) == EXIT_BAD_CONFIG
    assert "train.precision" in capsys.readouterr().err


def test_flop_count_includes_position_terms_and_emd():
    from distaff.train.model.flops import mfu, peak_flops, train_flops_per_token

    cfg = load_config(REPO / "configs" / "run" / "deberta-v3-base.yaml").model_config()
    no_emd, plain = cfg.replace(emd=False), cfg.replace(emd=False, pos_att_type=[])
    per_token = train_flops_per_token(no_emd, 512)
    # c2p + p2c at N = 2k = 512: 2 terms x 2 D N per layer, x3 for fwd+bwd, plus the position projections
    extra = 12 * 3 * (2 * 2 * 768 * 512 + 2 * 2 * 512 * 768 * 768 / 512)
    assert per_token - train_flops_per_token(plain, 512) == pytest.approx(extra)
    # EMD: two applications of the last layer instead of one
    assert train_flops_per_token(cfg, 512) > per_token
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12 and peak_flops("cpu", "fp32") is None
    assert mfu(1e5, per_token, 989e12) == pytest.approx(1e5 * per_token / 989e12)


@pytest.mark.parametrize("override", ["optim.lr=.inf", "train.grad_clip=.nan", "optim.betas=[0.9, .nan]",
                                      "data.masking.mlm_probability=-.inf", "optim.eps=nan"])
def test_non_finite_float_values_are_rejected_naming_the_key(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match="expected a finite number") as err:
        load_config(None, ["data.dir=/d", override])
    assert str(err.value).startswith(key.replace("optim.betas", "optim.betas[1]"))


def test_token_budget_defaults_to_the_padded_batch_positions():
    padded = load_config(None, ["data.dir=/d", "data.batch_size=6"])
    assert padded.data.packing == "padded" and padded.data.token_budget(128) == 0
    varlen = load_config(None, ["data.dir=/d", "data.batch_size=6", "data.packing=varlen", "data.eval_batch_size=2"])
    assert varlen.data.token_budget(128) == 6 * 128 and varlen.data.token_budget(128, eval=True) == 2 * 128
    chosen = load_config(None, ["data.dir=/d", "data.packing=varlen", "data.tokens_per_batch=5000"])
    assert chosen.data.token_budget(128) == 5000


def test_rtd_refuses_init_from_naming_both_keys_and_takes_packed_batches(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(load_config(None, ["data.dir=/d"]).model_config())))
    override = f"model.init_from={tmp_path}"
    load_config(None, ["data.dir=/d", override])            # valid for MLM
    with pytest.raises(ConfigError, match=r"model\.init_from") as err:
        load_config(None, ["data.dir=/d", "train.objective=rtd", override])
    assert re.search(r"rtd\.init_discriminator", str(err.value)), err.value
    packed = load_config(None, ["data.dir=/d", "train.objective=rtd", "data.packing=varlen"])
    assert (packed.train.objective, packed.data.packing) == ("rtd", "varlen")


def _alias_bomb(depth: int) -> str:
    """The red-team's shape: ``[&a0 [x x10], &a1 [*a0 x10], ...]``, a few hundred bytes for 10^depth values."""
    levels = ["&a0 [" + ", ".join(["x"] * 10) + "]"]
    levels += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, depth + 1)]
    return "[" + ", ".join(levels) + "]"


@pytest.mark.timeout(30)
def test_a_yaml_alias_bomb_is_refused_at_once_from_a_file_and_an_override(tmp_path, capsys):
    from distaff.train.pretrain.trainer import EXIT_BAD_CONFIG, main

    bomb = _alias_bomb(8)                                   # 10^8 values once expanded
    assert len(bomb) < 1000
    config = tmp_path / "bomb.yaml"
    config.write_text(f"data:\n  dir: /d\nrun:\n  name: {bomb}\n")
    for argv, source in ((["--config", str(config)], str(config)), (["data.dir=/d", f"run.name={bomb}"], "override run.name")):
        assert main(argv) == EXIT_BAD_CONFIG
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and len(err) < 300, err[:500]
        assert f"distaff pretrain: {source}: its YAML aliases add more than 10,000 values" in err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("nested", ["[" * 5000 + "]" * 5000, "[" * 80 + "]" * 80,
                                    "".join("  " * i + f"k{i}:\n" for i in range(3000)) + "  " * 3000 + "v: 1\n"])
def test_deeply_nested_yaml_is_one_line(tmp_path, capsys, nested):
    from distaff.train.pretrain.trainer import EXIT_BAD_CONFIG, main

    config = tmp_path / "deep.yaml"
    config.write_text(f"data:\n  dir: /d\nwandb:\n  tags: {nested}\n" if nested.startswith("[") else nested)
    assert main(["--config", str(config)]) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "nested" in err and str(config) in err, err[:500]


def test_a_long_written_out_list_is_not_an_alias_bomb(tmp_path):
    """Only values that aliases add count: 20,000 labels written out are a config, not an attack."""
    from distaff.train.core.config_yaml import load_yaml

    labels = load_yaml("labels: [" + ", ".join(f"c{i}" for i in range(20_000)) + "]", "ft.yaml")["labels"]
    assert len(labels) == 20_000


def test_anchors_and_merge_keys_within_the_bound_still_work(tmp_path):
    config = tmp_path / "anchors.yaml"
    config.write_text("data: {dir: /d}\nwandb:\n  tags: &tags [a, b]\n  group: g\n"
                      "rtd:\n  generator: &gen {num_hidden_layers: 1}\n")
    cfg = load_config(config)
    assert cfg.wandb.tags == ["a", "b"] and cfg.rtd.generator == {"num_hidden_layers": 1}


@pytest.mark.parametrize("text,line,key", [
    ("optim:\n  lr: 1.0e-3\n  lr: 1.0e-2\ndata: {dir: /d}\n", 3, "lr"),
    ("optim:\n  lr: 1.0e-3\ndata: {dir: /d}\noptim:\n  warmup_steps: 2\n", 4, "optim"),
    ("data: {dir: /d, dir: /e}\n", 1, "dir"),
])
def test_a_key_written_twice_is_refused_naming_both_lines(tmp_path, text, line, key):
    config = tmp_path / "twice.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=rf"{re.escape(str(config))}, line {line}: key '{key}' is written twice"):
        load_config(config)


def test_a_yaml_syntax_error_is_one_line_naming_the_line(tmp_path):
    config = tmp_path / "broken.yaml"
    config.write_text("data:\n  dir: /d\noptim: [1, 2\ntrain: {}\n")
    with pytest.raises(ConfigError) as raised:
        load_config(config)
    assert len(str(raised.value).splitlines()) == 1 and f"{config}, line 4" in str(raised.value)


@pytest.mark.parametrize("raw, where", [
    (b"run:\n  name: caf\xe9\n", "line 2, byte 12: byte 0xe9 is not UTF-8"),
    (b"run:\n  name: a\x00b\n", "line 2, byte 10: a NUL byte"),
])
def test_a_config_that_is_not_utf8_text_is_one_line_naming_it_in_every_command(tmp_path, capsys, monkeypatch, raw,
                                                                               where):
    """Issue 41, cause 5: a Latin-1 byte or a NUL gave tracebacks naming no file. Every command that reads a config:
    the two trainers (their run and --check), launch, slurm, plan, ablate, and a model preset file."""
    from distaff.launch import cli
    from distaff.train.finetune.trainer import main as finetune_main
    from distaff.train.pretrain.trainer import main as pretrain_main
    from distaff.train.tools.ablate import main as ablate_main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = tmp_path / "bad.yaml"
    config.write_bytes(raw)
    model = tmp_path / "model.yaml"
    model.write_bytes(raw.replace(b"run:\n  name", b"hidden_size: 32\nname"))
    calls = [(lambda: pretrain_main(["--config", str(config)]), "distaff pretrain"),
             (lambda: pretrain_main(["--config", str(config), "--check"]), "distaff pretrain"),
             (lambda: finetune_main(["--config", str(config)]), "distaff finetune"),
             (lambda: finetune_main(["--config", str(config), "--check"]), "distaff finetune"),
             (lambda: cli.main(["launch", "--config", str(config), "--dry-run"]), "distaff launch"),
             (lambda: cli.main(["slurm", "submit", "--config", str(config), "--nodes", "1", "--gpus-per-node", "1",
                                "--dry-run"]), "distaff slurm"),
             (lambda: cli.main(["plan", "--config", str(config), "--gpus", "1xA100-80GB"]), "distaff plan"),
             (lambda: ablate_main(["--config", str(config), "--dry-run"]), "distaff ablate")]
    for call, prog in calls:
        assert call() == 2, prog
        err = capsys.readouterr().err
        assert err.startswith(f"{prog}: ") and err.count("\n") == 1 and "Traceback" not in err, err
        assert f"bad.yaml, {where}" in err, err
    assert pretrain_main(["--config", "tiny-cpu", f"model.preset={model}", "--check"]) == 2
    err = capsys.readouterr().err
    assert "model.yaml, line 2, byte " in err and where.split(": ", 1)[1] in err, err


@pytest.mark.parametrize("command", ["pretrain", "finetune"])
def test_print_config_says_what_watchdog_s_0_stands_for(command, capsys):
    from distaff.launch import cli

    preset = {"pretrain": "tiny-cpu", "finetune": "sentiment-cpu"}[command]
    assert cli.main([command, "--config", preset, "--print-config", "distributed.timeout_s=120"]) == 0
    out = capsys.readouterr().out
    assert "\n  watchdog_s: 0  # 0: distributed.timeout_s, 120 s\n" in out
    assert yaml.safe_load(out)["distributed"] == {"timeout_s": 120, "watchdog_s": 0}   # still the same YAML
    assert cli.main([command, "--config", preset, "--print-config", "distributed.watchdog_s=60"]) == 0
    assert "\n  watchdog_s: 60\n" in capsys.readouterr().out                          # a value of its own: as is
