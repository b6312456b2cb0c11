"""The JSONL record files a run writes (issue 48, cause 2): one reader for ``evals.jsonl``, its failures and
``metrics.jsonl``. A bad line (null, a string, a list where a name belongs, a torn last line) is passed over,
counted and reported once with its line number; a NaN or inf value is a diverged checkpoint, shown as such; two
records of one (checkpoint, evaluation, seed) count once, by the newest; an ``evals.jsonl`` that is a folder is one
line and exit 2; a write that fails for want of room names the file and leaves no part of its line."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain_fixtures import REPO

from distaff.train.core.errors import UserError
from distaff.train.core.files import read_records
from distaff.train.plan.compare import measured_means
from distaff.train.run.config import load_config, save_config
from distaff.train.run.metrics import MetricsLogger, plot_metrics, read_metrics
from distaff.train.tools.evals import records
from distaff.train.tools.evals.cli import main as evals_main

pytestmark = pytest.mark.unit

MOVIES = str(REPO / "data" / "movie-snippets.tsv.gz")
PROBE = {"name": "wordorder", "kind": "probe", "text": MOVIES, "text_column": "1", "seeds": [1, 2]}


def _run_dir(tmp_path: Path) -> tuple[Path, str]:
    """A run directory with the config its trainer saved (one probe evaluation) and no checkpoint left."""
    cfg = load_config("tiny-cpu", ["checkpoint.every=5", f"evals.tasks={json.dumps([PROBE])}"])
    run = tmp_path / "run"
    run.mkdir()
    save_config(cfg, run / "config.yaml")
    return run, records.task_hash(cfg.evals.tasks[0])


def _result(step: int, seed: int, value: float, task_hash: str, **changed) -> dict:
    return {"step": step, "checkpoint": f"checkpoints/step-{step}", "source": "run", "name": "wordorder",
            "kind": "probe", "seed": seed, "metric": "accuracy", "value": value, "metrics": {"bshift": value},
            "seeds": [1, 2], "config_hash": "c", "task_hash": task_hash, "seconds": 1.0, "time": "t", **changed}


def _lines(*items) -> str:
    return "".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items)


def test_bad_lines_are_counted_diverged_values_shown_and_the_newest_record_counts(tmp_path, capsys):
    run, task = _run_dir(tmp_path)
    text = _lines(_result(10, 1, 0.5, task), _result(10, 2, 0.7, task),
                  "null", '"a string"', json.dumps(_result(10, 1, 0.6, task, name=["wordorder"])),
                  _result(20, 1, math.nan, task), _result(20, 2, math.inf, task),
                  _result(30, 1, 0.8, task), _result(30, 2, math.nan, task),
                  _result(10, 1, 0.9, task))                 # seed 1 of step 10 run again: the newest counts
    (run / records.EVALS_FILE).write_text(text + '{"step": 40, "checkpoint": "checkpoints/st')   # torn by a kill
    assert evals_main([str(run), "--table"]) == 0
    out, err = capsys.readouterr()
    rows = {line.split("  ")[0]: line for line in out.splitlines() if line.startswith("step ")}
    assert "0.8000 +- 0.1414 (2)" in rows["step 10"]        # (0.9 + 0.7) / 2: the older 0.5 not averaged in
    assert "diverged (2 of 2)" in rows["step 20"] and "diverged (1 of 2)" in rows["step 30"]
    assert "step 40" not in rows
    warnings = [line for line in err.splitlines() if "passed over" in line]
    assert len(warnings) == 1, err                           # reported once, though the file is read several times
    assert "4 line(s)" in warnings[0] and "line 3, 4, 5, 11" in warnings[0] and "torn" in warnings[0]
    assert (run / "evals.png").is_file()                     # the plot leaves the diverged checkpoints out


def test_an_evals_file_that_is_a_folder_is_one_line_and_exit_2(tmp_path, capsys):
    run, _ = _run_dir(tmp_path)
    (run / records.EVALS_FILE).mkdir()
    assert evals_main([str(run), "--table"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"distaff evals: {run / records.EVALS_FILE}: not a file (evaluation results are kept in this "
                   "file); move it out of the way")


FULL_DISK = """
import resource, signal, sys
from distaff.train.tools.evals import records
path = sys.argv[1]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # the write fails with EFBIG instead of killing the process
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    records.append(__import__("pathlib").Path(path), {"value": 1.0, "padding": "x" * 400})
except OSError as err:
    from distaff.train.core.errors import describe
    print(describe(err))
"""


def test_a_write_that_finds_no_room_names_the_file_and_leaves_no_torn_line(tmp_path):
    path = tmp_path / records.EVALS_FILE
    path.write_text(json.dumps({"value": 0.5}) + "\n")
    before = path.read_bytes()
    done = subprocess.run([sys.executable, "-c", FULL_DISK, str(path), str(len(before) + 100)],
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == f"{path}: a file reached the file-size limit (`ulimit -f`; raise it, e.g. ulimit " \
                                  "-f unlimited)"
    assert path.read_bytes() == before                       # the part that fitted was cut off again


def test_a_torn_line_left_by_a_crash_is_ended_before_the_next_record(tmp_path, capsys):
    path = tmp_path / "evals" / "failures.jsonl"
    path.parent.mkdir()
    path.write_text('{"checkpoint": "a", "na')
    failure = {"checkpoint": "b", "name": "x", "seed": 1, "error": "boom"}
    records.append(path, failure)
    assert records.read_failures(path) == [failure]
    assert "line 1" in capsys.readouterr().err


def test_a_number_that_is_not_one_makes_the_line_no_record(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(_lines({"step": 1}, {"step": True}, {"step": 1.5}, {"step": "2"}, [{"step": 3}], {}))
    assert read_records(path, {"step": (int,)}, "records") == [{"step": 1}]
    with pytest.raises(UserError, match="not a file"):
        read_records(tmp_path, {"step": (int,)}, "records")


def test_metrics_readers_pass_over_a_torn_line(tmp_path, capsys):
    """The resume's cut, the plot and ``plan --compare``'s means read ``metrics.jsonl`` through the same reader."""
    path = tmp_path / "metrics.jsonl"
    stages = {"forward_s": 0.5, "backward_s": 1.0}
    path.write_text(_lines({"step": 1, "loss": 3.0, **stages}, {"step": 2, "loss": "x", **stages},
                           {"step": 3, "loss": 2.0, **stages, "backward_s": None}, "[1, 2]",
                           {"step": 4, "loss": 1.0, **stages}) + '{"step": 5, "lo')
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]
    assert plot_metrics(path, tmp_path / "metrics.png") is not None
    means, count = measured_means(path)
    assert count == 2 and means["forward"] == 0.5     # steps 1, 2 and 4 have numbers; the first (warm-up) left out
    MetricsLogger(tmp_path, enabled=True, max_steps=10, start_step=3, progress_bar=False)   # a resume from step 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    assert capsys.readouterr().err.count("passed over") == 1
