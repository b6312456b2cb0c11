"""``distaff ablate``: a tiny ablation end to end (real shards, single-rank runs as subprocesses,
W&B offline), the report read back against the runs' own summaries, resuming, and config errors."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from pretrain_fixtures import REPO, prepare_data, rank_env, wandb_runs, write_config

from distaff.train.tools.ablate import (PlannedRun, load_ablation, main, paired_differences, plan_runs, run_parallel,
                                  variant_config, write_job_scripts)
from distaff.train.core.exit_codes import EXIT_PREEMPTED
from distaff.train.core.runlock import DirLock
from distaff.train.run.config import ConfigError, config_fingerprint

VARIANTS = [{"name": "relative", "overrides": {"model.emd": False}},
            {"name": "rope", "overrides": {"model.emd": False, "model.relative_attention": False,
                                           "model.pos_att_type": [], "model.rope": True}}]


def _ablation(tmp_path, base_config, **changes):
    values = {"name": "tiny-abl", "base": str(base_config), "out_dir": str(tmp_path / "abl"), "tokens": 1000,
              "seeds": [3, 4], "evals": 2, "variants": VARIANTS, **changes}
    path = tmp_path / "abl.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


@pytest.fixture(scope="module")
def base_config(sample_data, tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    data_dir = prepare_data(base, sample_data)
    return write_config(tmp_path_factory.mktemp("abl-base") / "base.yaml", data_dir, base / "unused",
                        checkpoint={"every": 0, "keep": 1})


def _ablate(config, tmp_path):
    return subprocess.run([sys.executable, "-m", "distaff.launch.cli", "ablate", "--config", str(config)],
                          env=rank_env(tmp_path), capture_output=True, text=True, timeout=300)


@pytest.mark.integration
def test_tiny_ablation_end_to_end_and_resumed(base_config, tmp_path):
    config = _ablation(tmp_path, base_config, parallel=2)
    first = _ablate(config, tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    root = tmp_path / "abl"
    rows = list(csv.DictReader(open(root / "ablation.csv")))
    for variant in ("relative", "rope"):
        summaries = [json.loads((root / "runs" / variant / f"seed-{s}" / "summary.json").read_text()) for s in (3, 4)]
        assert [s["steps"] for s in summaries] == [4, 4]   # ceil(1000 tokens / (4 x 64 per step))
        overall = next(r for r in rows if r["variant"] == variant and r["seed"] == "all")
        for key in ("eval_loss", "eval_accuracy", "tokens_per_s"):
            values = [s[key] for s in summaries]
            mean = sum(values) / 2
            assert float(overall[f"{key}_mean"]) == pytest.approx(mean, rel=1e-12)
            assert float(overall[f"{key}_std"]) == pytest.approx(abs(values[0] - values[1]) / 2 ** 0.5, rel=1e-9)
        per_run = {r["seed"]: float(r["eval_loss"]) for r in rows if r["variant"] == variant and r["seed"] != "all"}
        assert per_run == {"3": summaries[0]["eval_loss"], "4": summaries[1]["eval_loss"]}
        records = [json.loads(x) for x in (root / "runs" / variant / "seed-3" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]   # eval.every from `evals: 2`
    assert summaries[0]["eval_loss"] != summaries[1]["eval_loss"]           # seeds differ
    assert (root / "ablation.png").stat().st_size > 5000
    report = (root / "ablation.md").read_text()
    assert "| rope | 2 |" in report and f"| rope | {summaries[0]['eval_loss']:.4f} | " in report
    relative = [json.loads((root / "runs" / "relative" / f"seed-{s}" / "summary.json").read_text()) for s in (3, 4)]
    diffs = [rope["eval_loss"] - rel["eval_loss"] for rope, rel in zip(summaries, relative)]
    paired_std = abs(diffs[0] - diffs[1]) / 2 ** 0.5
    assert f"| rope | 2 | {sum(diffs) / 2:+.4f} +- {paired_std:.4f} |" in report
    starts = [line for line in first.stdout.splitlines() if " steps -> " in line]
    assert [line.split("] ")[1].split(":")[0] for line in starts] == [
        "relative seed 3", "rope seed 3", "relative seed 4", "rope seed 4"]       # seed by seed
    (run_id, _history), = wandb_runs(root / "runs" / "rope" / "seed-4")
    assert run_id
    renamed = _ablation(tmp_path, base_config, parallel=2, name="renamed")   # only W&B's group changes
    again = _ablate(renamed, tmp_path)
    assert again.returncode == 0 and again.stdout.count("done before") == 4, again.stdout[-2000:]
    assert list(csv.DictReader(open(root / "ablation.csv"))) == rows

    # the red-team repro: an edited variant is not reported with the old run's numbers
    edited = [VARIANTS[0], {**VARIANTS[1], "overrides": {**VARIANTS[1]["overrides"], "optim.lr": 0.0123}}]
    stale = _ablate(_ablation(tmp_path, base_config, parallel=2, variants=edited), tmp_path)
    message = stale.stderr.strip()
    assert stale.returncode == 2 and "done before" not in stale.stdout and len(message.splitlines()) == 1, message
    assert f"{root / 'runs' / 'rope' / 'seed-3'}: this run was made with other settings" in message
    assert "optim.lr: 0.001 -> 0.0123" in message or "optim.lr: " in message and "0.0123" in message
    assert f"delete {root / 'runs' / 'rope' / 'seed-3'}" in message
    assert list(csv.DictReader(open(root / "ablation.csv"))) == rows


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_an_interrupted_ablation_resumes_the_stopped_run_to_its_budget(base_config, tmp_path):
    """The red-team repro: SIGTERM once the second run has a checkpoint; the stopped run (which writes a summary
    on its way out) is not 'done': the next ablate resumes it to the planned steps, and only then compares."""
    config = _ablation(tmp_path, base_config, tokens=40 * 4 * 64, seeds=[3], evals=2,
                       overrides={"checkpoint.every": 5, "checkpoint.keep": 2})
    root = tmp_path / "abl"
    second = root / "runs" / "rope" / "seed-3"
    ablate = subprocess.Popen([sys.executable, "-m", "distaff.launch.cli", "ablate", "--config", str(config)],
                              env=rank_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not (second / "checkpoints" / "step-00000005").is_dir() and time.monotonic() < deadline:
        time.sleep(0.05)
    ablate.send_signal(signal.SIGTERM)
    output = ablate.communicate(timeout=200)[0]
    assert ablate.returncode == EXIT_PREEMPTED, output[-3000:]
    assert "interrupted (SIGTERM); the runs in progress saved a checkpoint" in output
    stopped = json.loads((second / "summary.json").read_text())
    assert stopped.get("finished") is not True and 5 <= stopped["steps"] < 40, stopped

    again = _ablate(config, tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count("done before") == 1 and "rope seed 3 (not finished before: resuming)" in again.stdout
    assert f"resuming from {second / 'checkpoints'}" in (second.parent / "seed-3.log").read_text()
    resumed = json.loads((second / "summary.json").read_text())
    assert resumed["finished"] is True and resumed["steps"] == 40
    rows = list(csv.DictReader(open(root / "ablation.csv")))
    assert {r["variant"]: r["steps"] for r in rows if r["seed"] == "3"} == {"relative": "40", "rope": "40"}


@pytest.fixture()
def unprepared_base(tmp_path):
    """A run config whose data dir does not exist yet: enough for planning (seq_len from ``prepare``)."""
    return write_config(tmp_path / "base.yaml", tmp_path / "data", tmp_path / "unused")


@pytest.mark.unit
def test_script_launcher_writes_one_job_per_run(unprepared_base, tmp_path):
    prepare = {"input": "corpus.txt", "seq_len": 64}  # one path, or a list
    config = _ablation(tmp_path, unprepared_base, launcher="script", ranks=2, prepare=prepare)
    cfg = load_ablation(config)
    scripts = write_job_scripts(cfg, plan_runs(cfg))
    assert [s.name for s in scripts] == ["relative-seed-3.sh", "rope-seed-3.sh", "relative-seed-4.sh", "rope-seed-4.sh"]
    text = scripts[-1].read_text()
    assert "torchrun --nproc_per_node 2" in text and "train.max_steps=2" in text and "wandb.group=tiny-abl" in text
    assert plan_runs(cfg)[0].max_steps == 2   # 1000 tokens / (2 ranks x 4 x 64)
    assert "data.dir=" + str(tmp_path / "abl" / "data") in text


@pytest.mark.unit
@pytest.mark.parametrize("change,message", [
    ({"variants": []}, "variants: expected a non-empty list"),
    ({"variants": [VARIANTS[0], VARIANTS[0]]}, r"variants\[1\].name: 'relative' is used twice"),
    ({"variants": [{"name": "x", "overrides": {"model.bogus": 1}}]}, r"variants\[x\]: .*model.bogus"),
    ({"variants": [{"name": "x", "override": {}}]}, r"unknown key\(s\) \['variants\[0\].override'\]"),
    ({"seeds": []}, "seeds: expected a non-empty list"),
    ({"seeds": [1, 1]}, "seeds: repeated seed"),
    ({"tokens": 0}, "tokens: must be positive"),
    ({"tokens": "many"}, "tokens: expected int"),
    ({"launcher": "slurm"}, "launcher: must be one of"),
    ({"parallel": 0}, "parallel: must be positive"),
    ({"parallel": 2, "ranks": 2}, r"parallel: 2 runs at once needs ranks: 1 .*got ranks: 2"),
    ({"parallel": 2, "launcher": "script"}, r"parallel: .*launcher: sequential .*launcher: script"),
    ({"base": "nowhere.yaml"}, r"base: config file not found: nowhere.yaml \(nor a run preset .*presets: .*tiny-cpu"),
    ({"colour": "red"}, r"unknown key\(s\) \['colour'\]"),
])
def test_config_errors_name_the_key(unprepared_base, tmp_path, change, message, capsys):
    config = _ablation(tmp_path, unprepared_base, **change)  # a "base" in change replaces the real one
    with pytest.raises(ConfigError, match=message):
        load_ablation(config)
    assert main(["--config", str(config)]) == 2
    assert str(config) in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.parametrize("mode", [[], ["--report"]])
def test_a_second_ablation_on_one_out_dir_is_refused_naming_the_first(unprepared_base, tmp_path, capsys, mode):
    config = _ablation(tmp_path, unprepared_base, prepare={"input": str(tmp_path / "corpus.txt")})
    (tmp_path / "abl" / "runs").mkdir(parents=True)
    log = tmp_path / "abl" / "runs" / "relative" / "seed-3.log"
    log.parent.mkdir()
    log.write_text("the first ablation's run log\n")
    with DirLock(tmp_path / "abl", "out_dir"):               # the first ablation, running
        assert main(["--config", str(config), *mode]) == 2
    err = capsys.readouterr().err
    assert f"distaff ablate: {config}: out_dir: {tmp_path / 'abl'} is in use by pid {os.getpid()}" in err
    assert log.read_text() == "the first ablation's run log\n" and not (tmp_path / "abl" / "ablation.csv").exists()


@pytest.mark.unit
def test_bundled_positions_ablation_plans_equal_budgets(monkeypatch):
    monkeypatch.chdir(REPO)  # its paths are relative to the repository root, like the run configs
    cfg = load_ablation("configs/ablation/positions-cpu.yaml")
    runs = plan_runs(cfg)
    assert [v.name for v in cfg.variants] == ["relative+emd", "relative", "absolute", "rope"]
    assert len(runs) == 12 and {r.max_steps for r in runs} == {1563} and cfg.prepare.input == ["data/austen-emma-pride.txt.gz"]
    rope = variant_config(cfg, cfg.variants[3], 1).model_config(vocab_size=4000)
    assert rope.rope and not rope.relative_attention and not rope.emd and rope.pos_att_type == []


def _job(tmp_path, name: str, body: str) -> tuple[str, list[str], PlannedRun]:
    """A job whose command is a small Python program; ``OUT`` in it is the run folder."""
    run = PlannedRun(name, 1, tmp_path / "runs" / name, [], 1)
    program = f"import json, os, signal, sys, time\nfrom pathlib import Path\nOUT = Path({str(run.out_dir)!r})\n{body}"
    return name, [sys.executable, "-c", program], run


# a run: notes its start and end times, then writes its summary, finished after the 1 step planned
EMPTY = config_fingerprint({})     # the fingerprint of the (empty) config the fake runs below are planned with
FINISHING = ("OUT.mkdir(parents=True); t0 = time.time(); time.sleep(3)\n"
             "(OUT / 'summary.json').write_text(json.dumps({'start': t0, 'end': time.time(), 'finished': True, "
             f"'steps': 1, 'config_fingerprint': '{EMPTY}'}}))")


@pytest.mark.unit
def test_parallel_runs_at_most_n_at_once_and_a_failure_leaves_the_others_going(tmp_path, capsys):
    jobs = [_job(tmp_path, "a", FINISHING), _job(tmp_path, "broken", "print('boom'); sys.exit(3)"),
            _job(tmp_path, "b", FINISHING), _job(tmp_path, "c", FINISHING)]
    failures = run_parallel(jobs, 2, env={})
    broken_log = tmp_path / "runs" / "broken.log"
    assert failures == [f"broken failed (exit 3); see {broken_log}"] and "boom" in broken_log.read_text()
    spans = [json.loads((tmp_path / "runs" / name / "summary.json").read_text()) for name in "abc"]
    at_each_start = [sum(t["start"] <= s["start"] < t["end"] for t in spans) for s in spans]
    assert max(at_each_start) == 2     # b started while a ran; never three at once
    assert spans[0]["start"] < spans[1]["start"] < spans[2]["start"]        # plan order
    no_summary = _job(tmp_path, "silent", "pass")                           # exit 0 without a summary: failed too
    assert run_parallel([no_summary], 1, env={}) == [f"silent failed (exit 0); see {tmp_path / 'runs' / 'silent.log'}"]


@pytest.mark.unit
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_runs_in_progress_and_keeps_finished_summaries(tmp_path, signum):
    # a long run writes its pid, and on SIGTERM a marker (as pretrain saves a checkpoint) before exiting
    long = ("OUT.mkdir(parents=True)\n"
            "signal.signal(signal.SIGTERM, lambda *a: ((OUT / 'terminated').write_text('x'), sys.exit(75)))\n"
            "(OUT / 'pid').write_text(str(os.getpid())); time.sleep(120)")
    # 2 slots: quick finishes, then the two long runs hold both until the signal, so `never` cannot start
    jobs = [_job(tmp_path, "quick", "OUT.mkdir(parents=True); (OUT / 'summary.json').write_text("
                            f"'{{\"finished\": true, \"steps\": 1, \"config_fingerprint\": \"{EMPTY}\"}}')"),
            _job(tmp_path, "long-1", long), _job(tmp_path, "long-2", long), _job(tmp_path, "never", FINISHING)]
    # SIGINT as a terminal delivers it: a background shell (CI under nohup, `cmd &`) starts us with SIGINT
    # ignored, and Python then never turns it into KeyboardInterrupt
    driver = ("import sys, json, signal\nfrom pathlib import Path\nfrom distaff.train.tools.ablate import PlannedRun, run_parallel\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "jobs = [(l, c, PlannedRun(l, 1, Path(p), [], 1)) for l, c, p in json.loads(sys.argv[1])]\n"
              "try:\n    run_parallel(jobs, 2, env={})\nexcept KeyboardInterrupt:\n    sys.exit(130)\n")
    spec = json.dumps([(label, command, str(run.out_dir)) for label, command, run in jobs])
    parent = subprocess.Popen([sys.executable, "-c", driver, spec])
    pid_files = [tmp_path / "runs" / name / "pid" for name in ("long-1", "long-2")]
    deadline = time.monotonic() + 60
    while not all(f.is_file() for f in pid_files) and time.monotonic() < deadline:
        time.sleep(0.1)
    parent.send_signal(signum)
    assert parent.wait(timeout=60) == 130
    for name in ("long-1", "long-2"):
        assert (tmp_path / "runs" / name / "terminated").is_file()             # SIGTERM reached the run
    assert (tmp_path / "runs" / "quick" / "summary.json").is_file()              # finished run kept
    assert not (tmp_path / "runs" / "never").exists()                            # queued run never started
    for pid_file in pid_files:
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)                                # stopped and reaped


@pytest.mark.unit
def test_paired_differences_use_only_seeds_both_variants_finished(unprepared_base, tmp_path):
    cfg = load_ablation(_ablation(tmp_path, unprepared_base, seeds=[3, 4, 5]))
    rows = [{"variant": "relative", "seed": 3, "eval_loss": 5.0}, {"variant": "rope", "seed": 3, "eval_loss": 5.5},
            {"variant": "relative", "seed": 4, "eval_loss": 6.0}, {"variant": "rope", "seed": 4, "eval_loss": 5.75},
            {"variant": "rope", "seed": 5, "eval_loss": 1.0}]
    assert paired_differences(cfg, rows) == {"rope": [0.5, -0.25]}


DERIVED = [{"name": "linear", "overrides": {}},
           {"name": "wsd", "overrides": {"optim.schedule": "wsd", "checkpoint.every": 2}},
           {"name": "wsd-decay", "branch": {"of": "wsd", "decay": 0.5, "shape": "linear"}},
           {"name": "wsd-avg", "average": {"of": "wsd", "last": 3}},
           {"name": "wsd-last", "average": {"of": "wsd", "last": 1}}]


@pytest.mark.unit
def test_branches_and_averages_plan_from_their_parent_run(unprepared_base, tmp_path):
    cfg = load_ablation(_ablation(tmp_path, unprepared_base, tokens=8 * 4 * 64, seeds=[3], variants=DERIVED,
                                  prepare={"input": "corpus.txt", "seq_len": 64}))
    runs = {run.variant: run for run in plan_runs(cfg)}
    assert {name: run.max_steps for name, run in runs.items()} == dict.fromkeys(runs, 8)
    parent, branch = runs["wsd"], runs["wsd-decay"]
    assert "optim.decay_start=8" in parent.overrides and "checkpoint.keep=3" in parent.overrides   # stable; 4 6 8 kept
    assert branch.parent is parent and runs["wsd-avg"].parent is parent and runs["wsd-avg"].average.last == 3
    assert {"optim.decay_start=4", "optim.decay_steps=4", "optim.decay_shape=linear", "checkpoint.resume=auto",
            f"checkpoint.branch_from={(parent.out_dir / 'checkpoints' / 'step-00000004').resolve()}",
            f"run.out_dir={tmp_path / 'abl' / 'runs' / 'wsd-decay' / 'seed-3'}"} <= set(branch.overrides)
    assert runs["wsd-avg"].config == parent.config and not runs["wsd-avg"].overrides


@pytest.mark.unit
@pytest.mark.parametrize("variants,message", [
    ([{"name": "b", "branch": {"of": "a", "decay": 0.2}}], r"variants\[0\]\.branch\.of: 'a' is not an earlier variant"),
    ([DERIVED[0], {"name": "b", "branch": {"of": "linear", "decay": 1.5}}], r"branch\.decay: .* between 0 and 1"),
    ([DERIVED[0], {"name": "b", "branch": {"of": "linear", "decay": 0.2}}],
     r"variant linear: other variants branch from it, so it needs optim\.schedule: wsd"),
    ([DERIVED[0], {"name": "b", "average": {"of": "linear", "last": 2}}],
     r"variant linear: other variants average its last checkpoints, so it needs checkpoint\.every"),
    ([DERIVED[0], {"name": "b", "average": {"of": "linear", "last": 0}}], r"average\.last: a number of checkpoints"),
    ([DERIVED[0], {"name": "b", "average": {"of": "linear", "last": 1}, "overrides": {"optim.lr": 1}}],
     r"an average trains nothing"),
    ([DERIVED[0], {"name": "b", "overrides": {"train.objective": "rtd"}}], r"variants train different objectives"),
])
def test_bad_branches_and_averages_are_one_line(unprepared_base, tmp_path, variants, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_ablation(_ablation(tmp_path, unprepared_base, variants=variants))
    assert "\n" not in str(err.value)


@pytest.mark.integration
@pytest.mark.timeout(500)
def test_a_decay_branch_and_averages_run_after_their_parent_and_are_reported(base_config, tmp_path):
    config = _ablation(tmp_path, base_config, tokens=8 * 4 * 64, seeds=[3], evals=4, variants=DERIVED[1:],
                       overrides={"eval.batches": 0})
    done = _ablate(config, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = tmp_path / "abl" / "runs"
    summary = {v["name"]: json.loads((runs / v["name"] / "seed-3" / "summary.json").read_text()) for v in DERIVED[1:]}
    assert {name: s["steps"] for name, s in summary.items()} == dict.fromkeys(summary, 8)
    losses = {name: {r["step"]: r["loss"] for r in map(json.loads, (runs / name / "seed-3" / "metrics.jsonl")
                                                       .read_text().splitlines()) if "loss" in r}
              for name in ("wsd", "wsd-decay")}
    # the branch continues its parent's step 4 exactly: step 5 still runs at the peak rate, the decay changes step 6 on
    assert sorted(losses["wsd-decay"]) == [6, 8] and losses["wsd-decay"][6] == losses["wsd"][6]
    assert losses["wsd-decay"][8] != losses["wsd"][8]
    # an average of the last checkpoint alone, scored in one process, is the run's own final evaluation
    assert summary["wsd-last"]["eval_loss"] == summary["wsd"]["eval_loss"]
    assert summary["wsd-avg"]["eval_loss"] != summary["wsd"]["eval_loss"]
    averaged = json.loads((runs / "wsd-avg" / "seed-3" / "checkpoint" / "distaff" / "meta.json").read_text())
    assert [s["step"] for s in averaged["averaged_from"]] == [4, 6, 8]
    report = (tmp_path / "abl" / "ablation.md").read_text()
    assert "`wsd-decay` is a decay branch of `wsd`" in report and "| wsd-avg | 1 |" in report
    assert f"| wsd-avg | wsd | 1 | {summary['wsd-avg']['eval_loss'] - summary['wsd']['eval_loss']:+.4f} +- 0.0000 |" \
        in report                                   # each made variant against the run it was made from
    again = _ablate(config, tmp_path)
    assert again.returncode == 0 and again.stdout.count("done before") == 4, again.stdout[-2000:]
