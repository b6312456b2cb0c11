"""Evaluations attached to a run's checkpoints, for real (issue 43).

One run started by ``distaff launch`` (2 gloo ranks, real shards) with two evaluations beside training
(``evals.mode: side``): a word-order probe on the bundled movie sentences (2 seeds, every 40 steps) and a small
fine-tune on movie sentiment (1 seed, the last checkpoint alone). Checkpoints every 20 steps, 2 kept, so the
checkpoints being evaluated are pruned meanwhile and read from their pins. The first evaluation is killed
(SIGKILL to its process group) once it holds its work folder, while training goes on or, on a loaded machine where
the niced (19) evaluation starts only after the last step, while the trainer waits for it: either way the run trains
every step, its checkpoints stay sound, the killed evaluation is run again and every selected checkpoint gets its
results, filed in ``evals.jsonl`` (config hash, seeds), the run's W&B run (resumed by its id, offline here) and
TensorBoard. Then a decay branch and an average of the run's checkpoints: ``distaff evals RUN`` evaluates them
(backfill, after the run ended), lists them in its table beside the run's checkpoints and plots them; run again, it
runs nothing.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from pretrain_fixtures import (PYTHON, REPO, metrics, prepare_data, rank_env, run_log, torchrun, train_losses,
                               wandb_runs, write_config)

from distaff.train.core.distributed import free_port
from distaff.train.run.checkpoint_files import checkpoint_problem

pytestmark = pytest.mark.integration

STEPS, CHECKPOINT_EVERY, EVAL_EVERY = 160, 20, 40
MOVIES = REPO / "data" / "movie-snippets.tsv.gz"


def distaff(tmp: Path, *args: str, log: str) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, "-m", "distaff.launch.cli", *args], env=rank_env(tmp), cwd=tmp,
                            stdout=open(tmp / log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def finished(proc: subprocess.Popen, tmp: Path, log: str, timeout: float = 400) -> str:
    code = proc.wait(timeout=timeout)
    text = (tmp / log).read_text()
    assert code == 0, text[-6000:]
    return text


def labelled_files(tmp: Path) -> tuple[Path, Path]:
    """300 training and 300 dev rows of the bundled movie sentiment sample (both labels in each)."""
    rows = gzip.open(MOVIES, "rt").read().splitlines()
    train, dev = tmp / "movies-train.tsv", tmp / "movies-dev.tsv"
    train.write_text("\n".join(rows[0::10]) + "\n")
    dev.write_text("\n".join(rows[5::10]) + "\n")
    return train, dev


def evaluations(train: Path, dev: Path) -> dict:
    return {"every": EVAL_EVERY, "mode": "side", "tasks": [
        {"name": "wordorder", "kind": "probe", "text": str(MOVIES), "text_column": "1", "probe_tasks": ["bshift"],
         "max_sentences": 300, "seeds": [1, 2]},
        {"name": "sentiment", "kind": "finetune", "train": str(train), "dev": str(dev), "max_steps": 4,
         "every": STEPS, "seeds": [1], "overrides": ["data.batch_size=16", "data.max_len=48"]}]}


def kill_first_evaluation(run: Path, proc: subprocess.Popen, timeout: float = 180) -> int:
    """SIGKILL the process group of step 40's evaluation once it holds its work folder; the step training is at."""
    lock = run / "evals" / "work" / f"checkpoints__step-{EVAL_EVERY:08d}" / ".distaff.lock"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            pid = json.loads(lock.read_text())["pid"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.05)
            continue
        step = max(train_losses(run))
        os.killpg(pid, signal.SIGKILL)      # the evaluation leads its own session: its probe dies with it
        return step
    raise AssertionError(f"step {EVAL_EVERY}'s evaluation never started (run exited {proc.poll()})")


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]


@pytest.mark.timeout(900)
def test_side_evaluations_survive_a_kill_file_with_the_run_and_backfill_branches_and_averages(sample_data,
                                                                                              tmp_path_factory):
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    tmp = tmp_path_factory.mktemp("evals")
    run = tmp / "run"
    config = write_config(tmp / "run.yaml", data, run, train={"max_steps": STEPS},
                          optim={"lr": 3e-3, "warmup_steps": 2, "schedule": "wsd", "decay_start": STEPS},
                          checkpoint={"every": CHECKPOINT_EVERY, "keep": 2},
                          logging={"every": 1, "progress_bar": False, "tensorboard": True},
                          evals=evaluations(*labelled_files(tmp)))
    proc = distaff(tmp, "launch", "--config", str(config), "--gpus-per-node", "2", "--master-port", str(free_port()),
                   log="run.log")
    killed_at = kill_first_evaluation(run, proc)
    log = finished(proc, tmp, "run.log")

    # Training is whole: every step once, the kept checkpoints sound, the evaluations' pins gone. The kill came while
    # the run was alive (kill_first_evaluation checks it); killed_at == STEPS: the trainer was waiting in finish().
    assert killed_at <= STEPS and sorted(train_losses(run)) == list(range(1, STEPS + 1))
    kept = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert kept == ["step-00000140", "step-00000160"]
    assert [checkpoint_problem(run / "checkpoints" / name) for name in kept] == [None, None]
    assert json.loads((run / "summary.json").read_text())["finished"]
    assert "the evaluation of step-00000040 failed (killed by signal 9" in log and "running it again" in log, log
    assert not list((run / "evals" / "pinned").iterdir())

    # Every selected checkpoint has its results, each (step, evaluation, seed) once, with the run's config hash.
    found = records(run)
    assert sorted((r["step"], r["name"], r["seed"]) for r in found) == sorted(
        [(s, "wordorder", seed) for s in (40, 80, 120, 160) for seed in (1, 2)] + [(160, "sentiment", 1)])
    fingerprint = json.loads((run / "summary.json").read_text())["config_fingerprint"]
    assert {r["config_hash"] for r in found} == {fingerprint}
    assert all(r["metric"] == "accuracy" and 0 <= r["value"] <= 1 for r in found)
    assert {tuple(r["seeds"]) for r in found if r["name"] == "wordorder"} == {(1, 2)}
    # step 40's checkpoint was pruned (2 kept): its evaluation read the pin
    assert "reading " + str(run / "evals" / "pinned" / "step-00000040") in (run / "evals" / "logs" /
                                                                            "step-00000040.log").read_text()

    _filed_in_wandb_and_tensorboard(run, found)
    _branch_and_average_backfilled(tmp, run, data)


def _filed_in_wandb_and_tensorboard(run: Path, found: list[dict]) -> None:
    """The run's W&B run (its id, offline files here) and TensorBoard hold each evaluation at its checkpoint's step."""
    (train_id, _), = wandb_runs(run)
    rows = [row for run_id, history in wandb_runs(run / "evals") if run_id == train_id for row in history.values()]
    charted = {(row["progress/step"], key): value for row in rows for key, value in row.items()
               if key.startswith("eval/") and key.endswith("/accuracy")}
    probe = {step: [r["value"] for r in found if r["step"] == step and r["name"] == "wordorder"]
             for step in (40, 80, 120, 160)}
    for step, values in probe.items():
        assert charted[(step, "eval/wordorder/accuracy")] == pytest.approx(sum(values) / 2)
    assert (160, "eval/sentiment/accuracy") in charted
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = {}
    for events in (run / "tensorboard").glob("events.out.tfevents*"):
        reader = EventAccumulator(str(events), size_guidance={"scalars": 0})
        reader.Reload()
        for tag in reader.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in reader.Scalars(tag)})
    assert sorted(scalars["eval/wordorder/accuracy"]) == [40, 80, 120, 160]
    assert scalars["eval/wordorder/accuracy"][80] == pytest.approx(sum(probe[80]) / 2)


def _branch_and_average_backfilled(tmp: Path, run: Path, data: Path) -> None:
    branch = run / "branches" / "decay-160-4"
    finished(distaff(tmp, "decay", str(run), "--from", str(STEPS), "--steps", "4", "evals.tasks=null",
                     log="decay.log"), tmp, "decay.log")
    finished(distaff(tmp, "average", str(run), "--last", "2", "--out", str(run / "averages" / "last2"),
                     log="average.log"), tmp, "average.log")
    before = len(records(run))
    out = finished(distaff(tmp, "evals", str(run), log="evals.log"), tmp, "evals.log")
    # the branch's end is filed with the branch, the average with the run
    assert sorted((r["step"], r["name"], r["seed"]) for r in records(branch)) == [
        (164, "sentiment", 1), (164, "wordorder", 1), (164, "wordorder", 2)]
    averaged = [r for r in records(run)[before:]]
    assert sorted((r["checkpoint"], r["name"], r["seed"]) for r in averaged) == [
        ("averages/last2", "sentiment", 1), ("averages/last2", "wordorder", 1), ("averages/last2", "wordorder", 2)]
    assert all(r["source"] == "average" and r["step"] == STEPS for r in averaged)
    table = out[out.index("== evaluations of"):]
    for label in ("step 40", "step 160", "decay-160-4 step 164", "average last2 (steps 140, 160)"):
        assert label in table, table
    # each cell: the mean over seeds +- their standard deviation (how many seeds), as the records give them
    seeds80 = [r["value"] for r in records(run) if r["step"] == 80 and r["name"] == "wordorder"]
    row80 = next(line for line in table.splitlines() if line.startswith("step 80 "))
    assert f"{statistics.mean(seeds80):.4f} +- {statistics.stdev(seeds80):.4f} (2)" in row80, table
    assert (run / "evals.png").is_file()

    again = finished(distaff(tmp, "evals", str(run), log="again.log"), tmp, "again.log")
    assert "nothing to run: every selected checkpoint has its results" in again, again
    assert len(records(run)) == before + 3 and len(records(branch)) == 3


@pytest.mark.timeout(300)
def test_inline_evaluations_pause_every_rank_and_are_logged_apart_from_the_step_time(sample_data, tmp_path_factory):
    """``evals.mode: inline`` on 2 ranks: rank 0 evaluates each selected checkpoint between two steps while the other
    rank waits in the evaluations' own group; the pause is logged as ``evals_inline_s`` beside the step time, which
    (with tokens/s and the ETA) counts training alone (issue 48: the pause was counted as training)."""
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    tmp = tmp_path_factory.mktemp("evals-inline")
    run = tmp / "run"
    probe = {"name": "wordorder", "kind": "probe", "text": str(MOVIES), "text_column": "1", "max_sentences": 200}
    config = write_config(tmp / "run.yaml", data, run, train={"max_steps": 8}, checkpoint={"every": 4},
                          wandb={"mode": "disabled"}, evals={"every": 4, "mode": "inline", "tasks": [probe]})
    proc = torchrun(config, tmp)
    assert proc.returncode == 0, run_log(proc)
    assert sorted(train_losses(run)) == list(range(1, 9))
    assert sorted((r["step"], r["seed"]) for r in records(run)) == [(4, 1), (8, 1)]
    paused = {r["step"]: r["evals_inline_s"] for r in metrics(run) if "evals_inline_s" in r}
    # step 4's evaluation ran between steps 4 and 5: the first log line after it carries its seconds
    assert paused[5] >= records(run)[0]["seconds"] > 0 and paused[4] == 0, paused
    after = next(r for r in metrics(run) if r["step"] == 5 and "step_time_s" in r)
    assert after["step_time_s"] < paused[5] and after["eta_s"] < paused[5], (after, paused)   # the pause left out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["evals_inline_s"] >= sum(r["seconds"] for r in records(run)), summary
    assert not list((run / "evals" / "pinned").iterdir())
