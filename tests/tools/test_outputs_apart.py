"""No command writes a folder over what it reads: an output that is, lies inside or contains an input (symlinks and
``..`` resolved) is refused in one line naming both, with or without ``--overwrite``, before anything is deleted
(``distaff.train.core.files.check_apart``, used by every writer of a folder); and a write killed mid-way
(``replaced_folder``, which ``average``, ``export-hf`` and ``grow`` write through) leaves nothing behind for good:
the next write of the same folder removes the partial copy, or puts back the old folder it had moved aside."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from distaff.launch.cli import main as distaff_main
from distaff.train.core.errors import UserError
from distaff.train.core.files import check_apart, replaced_folder
from distaff.train.finetune.config import load_finetune_config
from distaff.train.run.checkpoint_files import check_apart_from_checkpoints
from distaff.train.run.config import ConfigError, load_config
from distaff.train.tools.ablate import load_ablation
from distaff.train.tools.baselines import main as baselines_main

pytestmark = pytest.mark.unit

SENTINEL = "the user's file"


def user_folder(path: Path) -> Path:
    """A folder holding a file the user owns (what a refused command must leave as it was)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "mine.txt").write_text(SENTINEL)
    return path


def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    for step in (8, 16):
        user_folder(run / "checkpoints" / f"step-{step:08d}")
    (run / "metrics.jsonl").write_text("{}\n")
    return run


def assert_untouched(*folders: Path) -> None:
    for folder in folders:
        assert (folder / "mine.txt").read_text() == SENTINEL, folder


def assert_refused(capsys, argv: list[str], *named: str) -> str:
    """``distaff ARGV`` exits 2 with one line on stderr naming each of ``named``."""
    assert distaff_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert all(name in err for name in named), (named, err)
    return err


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_average_over_its_run_or_one_of_its_checkpoints_is_refused(tmp_path, capsys, overwrite):
    run = run_dir(tmp_path)
    older, newest = run / "checkpoints" / "step-00000008", run / "checkpoints" / "step-00000016"
    assert_refused(capsys, ["average", str(run), "--out", str(run), *overwrite],
                   f"--out {run}: is the checkpoint {run}")
    assert_refused(capsys, ["average", str(run), "--out", str(newest), *overwrite],
                   f"--out {newest}: lies inside the checkpoint's checkpoints folder {run / 'checkpoints'}")
    assert_refused(capsys, ["average", str(older), str(newest), "--out", str(newest), *overwrite],
                   f"--out {newest}: is the checkpoint {newest}")
    assert_refused(capsys, ["average", str(older), "--out", str(tmp_path), *overwrite],
                   f"--out {tmp_path}: contains the checkpoint {older}")
    assert_untouched(older, newest)
    assert (run / "metrics.jsonl").is_file()


def test_an_output_may_lie_in_a_run_directory_beside_its_checkpoints(tmp_path):
    """``runs/x/avg`` is where ``distaff evals`` looks for a run's averages: inside the run, apart from its
    checkpoints."""
    run = run_dir(tmp_path)
    check_apart_from_checkpoints(("--out", run / "avg"), [("checkpoint", run)])
    with pytest.raises(UserError, match="lies inside the checkpoint"):
        check_apart_from_checkpoints(("--out", run / "checkpoints" / "step-00000008" / "x"),
                                     [("checkpoint", run / "checkpoints" / "step-00000008")])


def test_export_and_grow_into_their_own_run_are_refused_through_symlinks_and_dots(tmp_path, capsys):
    run = run_dir(tmp_path)
    alias = tmp_path / "alias"
    alias.symlink_to(run)
    assert_refused(capsys, ["export-hf", str(run), str(alias), "--overwrite"], f"output folder {alias} ({run}): is "
                   f"the checkpoint {run}")
    dotted = f"{run}/x/../checkpoints"
    assert_refused(capsys, ["export-hf", str(alias), dotted, "--overwrite"],
                   f"output folder {dotted} ({run / 'checkpoints'}): is the checkpoint's checkpoints folder "
                   f"{alias / 'checkpoints'} ({run / 'checkpoints'})")
    assert_refused(capsys, ["grow", str(run / "checkpoints"), str(run / "checkpoints" / "grown"), "--hidden-size",
                            "64", "--overwrite"], "output folder", "lies inside the model")
    assert_refused(capsys, ["grow", str(run), str(tmp_path), "--num-layers", "4"], "contains the model")
    assert_untouched(*(run / "checkpoints").iterdir())


def test_embed_probe_prepare_and_tokenizer_outputs_apart_from_their_inputs(tmp_path, capsys):
    model, corpus = user_folder(tmp_path / "model"), user_folder(tmp_path / "corpus")
    text = corpus / "text.txt"
    text.write_text("one line\n")
    assert_refused(capsys, ["embed", "--model", str(model), "--input", str(text), "--out", str(corpus), "--overwrite"],
                   f"--out {corpus}: contains the --input {text}")
    assert_refused(capsys, ["embed", "--model", str(model), "--input", str(text), "--out", str(model / "emb")],
                   "lies inside the --model")
    assert_refused(capsys, ["probe", "--text", str(text), "--model", str(model), "--out", str(model)],
                   f"--out {model}: is the --model")
    assert_refused(capsys, ["data", "prepare", "--input", str(text), "--tokenizer", str(model), "--seq-len", "64",
                            "--out", str(corpus)], f"--out {corpus}: contains the --input {text}")
    assert_refused(capsys, ["data", "prepare", "--input", str(text), "--tokenizer", str(model), "--seq-len", "64",
                            "--out", str(model)], "is the --tokenizer")
    assert_refused(capsys, ["tokenizer", "train", "--input", str(text), "--vocab-size", "100", "--out", str(corpus)],
                   f"--out {corpus}: contains the --input {text}")
    run = run_dir(tmp_path)                 # a run to embed or probe: beside its checkpoints is fine, not in them
    assert_refused(capsys, ["probe", "--text", str(text), "--model", f"mlm={run}", "--out", str(run / "checkpoints")],
                   f"--out {run / 'checkpoints'}: is the --model mlm's checkpoints folder")
    assert_refused(capsys, ["embed", "--model", str(run), "--input", str(text), "--out", str(run / "emb"),
                            "--tokenizer", str(run / "emb" / "tok")], "contains the --tokenizer")
    assert_untouched(model, corpus)
    assert text.read_text() == "one line\n" and not (corpus / ".distaff.lock").exists()


def test_a_result_file_over_the_training_file_is_refused(tmp_path, capsys):
    data = tmp_path / "train.tsv"
    data.write_text("1\tgood\n0\tbad\n")
    assert baselines_main(["--train", str(data), "--json", str(data)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"distaff baselines: --json {data}: is the --train {data}") and "\n" not in err
    assert data.read_text() == "1\tgood\n0\tbad\n"


def test_a_runs_out_dir_apart_from_its_data_and_init_checkpoints(tmp_path):
    data, init = user_folder(tmp_path / "data"), user_folder(tmp_path / "run" / "checkpoints" / "step-00000100")
    cases = [([f"data.dir={data}", f"run.out_dir={data}"], f"run.out_dir {data}: is the data.dir {data}"),
             ([f"data.dir={data}/../data/", f"run.out_dir={tmp_path}"], "contains the data.dir"),
             ([f"data.dir={data}", f"run.out_dir={tmp_path / 'run'}", f"model.init_from={init}"],
              "contains the model.init_from"),
             ([f"data.dir=", f"data.sources=[{{dir: {tmp_path / 'other'}}}, {{dir: {data}}}]",
               f"run.out_dir={data / 'run'}"], "lies inside the data.sources[1].dir"),
             ([f"data.dir={data}", f"run.out_dir={init}", "checkpoint.branch_from=" + str(init)],
              "is the checkpoint.branch_from")]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match="^run.out_dir") as caught:
            load_config(None, overrides)
        assert message in str(caught.value) and "\n" not in str(caught.value)
    load_config(None, [f"data.dir={data}", f"run.out_dir={tmp_path / 'run'}"])     # apart: accepted


def test_a_fine_tuning_run_and_an_ablation_apart_from_what_they_read(tmp_path):
    labelled = user_folder(tmp_path / "labelled")
    (labelled / "train.tsv").write_text("1\tgood\n")
    with pytest.raises(ConfigError, match=r"^run.out_dir .*: contains the data.train .*train.tsv") as caught:
        load_finetune_config(None, [f"model.init_from={tmp_path / 'model'}", f"data.train={labelled / 'train.tsv'}",
                                    "data.dev_fraction=0.2", f"run.out_dir={labelled}"])
    assert "\n" not in str(caught.value)
    pretrained = run_dir(tmp_path)          # a pretraining run to start from: beside its checkpoints is fine
    common = [f"model.init_from={pretrained}", f"data.train={labelled / 'train.tsv'}", "data.dev_fraction=0.2"]
    with pytest.raises(ConfigError, match=r"^run.out_dir .*: lies inside the model.init_from's checkpoints folder"):
        load_finetune_config(None, [*common, f"run.out_dir={pretrained / 'checkpoints' / 'ft'}"])
    try:
        load_finetune_config(None, [*common, f"run.out_dir={pretrained / 'ft'}"])
    except ConfigError as err:      # the fake run has no model to read: any other refusal is not the guard's
        assert "run.out_dir" not in str(err), err
    spec = tmp_path / "ablation.yaml"
    spec.write_text(yaml.safe_dump({"name": "a", "base": "tiny-cpu", "out_dir": str(labelled), "tokens": 1000,
                                    "prepare": {"input": [str(labelled / "train.tsv")]},
                                    "variants": [{"name": "base"}]}))
    with pytest.raises(ConfigError, match=r": out_dir .*: contains the prepare.input") as caught:
        load_ablation(spec)
    assert "\n" not in str(caught.value)


def test_check_apart_relations_holders_and_remote_dirs(tmp_path):
    parent = tmp_path / "parent"
    for out, relation in [(parent, "is"), (parent / "a" / "b", "lies inside"), (tmp_path, "contains")]:
        with pytest.raises(UserError, match=f"^--out {out}: {relation} the input {parent}"):
            check_apart(("--out", out), [("input", parent)])
    check_apart(("--out", parent / "branches" / "x"), [], holders=[("run", parent)])     # a holder may hold it
    with pytest.raises(UserError, match="contains the run"):
        check_apart(("--out", tmp_path), [], holders=[("run", parent)])
    check_apart(("--out", tmp_path), [("data", f"pipe:cat {tmp_path}/x.tar"), ("none", None), ("empty", "")])
    check_apart(("--out", tmp_path / "parent-2"), [("input", parent)])       # a common prefix is not inside
    check_apart(("--out", "nul\x00byte"), [("input", parent)])       # no file has that name: refused where it is used


KILLED_WRITE = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from distaff.train.core.files import replaced_folder

    out, when = Path(sys.argv[1]), sys.argv[2]
    real_replace = os.replace

    def replace_then_die(src, dst):     # SIGKILL right after the old folder is moved aside
        real_replace(src, dst)
        os.kill(os.getpid(), signal.SIGKILL)

    with replaced_folder(out) as fresh:
        (fresh / "weights.bin").write_bytes(b"half")
        if when == "writing":
            os.kill(os.getpid(), signal.SIGKILL)
        os.replace = replace_then_die
""")


def killed_write(out: Path, when: str) -> None:
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITE, str(out), when], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def test_a_write_killed_mid_way_is_cleaned_by_the_next_one(tmp_path):
    out = user_folder(tmp_path / "avg")
    killed_write(out, "writing")
    assert [name.split("-")[0] for name in leftovers(out)] == [".avg.partial"]
    assert_untouched(out)
    with replaced_folder(out) as fresh:
        (fresh / "weights.bin").write_bytes(b"whole")
    assert leftovers(out) == [] and (out / "weights.bin").read_bytes() == b"whole"

    user_folder(out)
    killed_write(out, "moving")            # killed between moving the old folder aside and moving the new one in
    assert not out.exists() and len(leftovers(out)) == 2
    with pytest.raises(RuntimeError):
        with replaced_folder(out):         # the next write puts the old folder back first, whatever it then does
            raise RuntimeError("the next write fails too")
    assert leftovers(out) == []
    assert_untouched(out)


def test_a_live_writers_partial_folder_is_left_alone(tmp_path):
    out = tmp_path / "avg"
    host = os.uname().nodename.replace(".", "_").replace("-", "_")
    live = tmp_path / f".avg.partial-{host}-{os.getpid()}-abc123"
    live.mkdir()
    with replaced_folder(out) as fresh:
        (fresh / "weights.bin").write_bytes(b"whole")
    assert live.is_dir() and (out / "weights.bin").is_file()
