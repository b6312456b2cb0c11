"""The ``evals`` section of a run config (issue 43): a bad entry is one line naming the field, from the config reader
and from ``distaff pretrain --check`` (the run's own validation, PretrainPlan: files that must exist, a held-out data
dir prepared with the run's tokenizer); which checkpoints each evaluation selects; the names the run layer writes
out for the layers it may not import stay equal to theirs."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import pytest

from pretrain_fixtures import REPO, prepare_data, write_config

from distaff.train.finetune.config import CLASSIFICATION_METRICS, REGRESSION_METRICS
from distaff.train.pretrain.attached_evals import tasks_at
from distaff.train.pretrain.trainer import main as pretrain_main
from distaff.train.run.config import FINETUNE_METRICS, PROBE_TASKS, ConfigError, load_config
from distaff.train.tools.probe_tasks import TASKS


MOVIES = str(REPO / "data" / "movie-snippets.tsv.gz")
PROBE = {"name": "wordorder", "kind": "probe", "text": MOVIES, "text_column": "1", "seeds": [1, 2]}
FINETUNE = {"name": "sentiment", "kind": "finetune", "train": MOVIES, "dev_fraction": 0.2, "max_steps": 30}


def _config(tasks: list, **evals) -> list[str]:
    import json

    return ["checkpoint.every=5", f"evals.tasks={json.dumps(tasks)}", *(f"evals.{k}={v}" for k, v in evals.items())]


BAD = {
    "unknown kind": ([{**PROBE, "kind": "prob"}], {}, r"evals\.tasks\[0\]\.kind: 'prob' is not a kind of evaluation; "
                     r"one of \['probe', 'finetune', 'heldout'\]; did you mean probe\?"),
    "no kind": ([{"name": "x", "text": MOVIES}], {}, r"evals\.tasks\[0\]\.kind: required"),
    "duplicate names": ([PROBE, {**FINETUNE, "name": "wordorder"}], {},
                        r"evals\.tasks\[1\]\.name: 'wordorder' is the name of evals\.tasks\[0\] too"),
    "seed 0": ([{**PROBE, "seeds": [1, 0]}], {}, r"evals\.tasks\[0\]\.seeds\[1\]: a seed must be a positive whole"),
    "negative seed": ([{**PROBE, "seeds": [-3]}], {}, r"evals\.tasks\[0\]\.seeds\[0\]: a seed must be a positive"),
    "no seeds": ([{**PROBE, "seeds": []}], {}, r"evals\.tasks\[0\]\.seeds: give at least one seed"),
    "a seed twice": ([{**PROBE, "seeds": [2, 2]}], {}, r"evals\.tasks\[0\]\.seeds: \[2, 2\] names a seed twice"),
    "finetune without train": ([{"name": "s", "kind": "finetune", "dev": MOVIES}], {},
                               r"evals\.tasks\[0\]\.train: required for a finetune evaluation"),
    "finetune without dev": ([{"name": "s", "kind": "finetune", "train": MOVIES}], {},
                             r"evals\.tasks\[0\]\.dev: a finetune evaluation scores on a dev file"),
    "probe without text": ([{"name": "p", "kind": "probe"}], {}, r"evals\.tasks\[0\]\.text: required for a probe"),
    "heldout without data": ([{"name": "h", "kind": "heldout"}], {}, r"evals\.tasks\[0\]\.data: required"),
    "another kind's setting": ([{**FINETUNE, "text": MOVIES}], {},
                               r"evals\.tasks\[0\]\.text: a setting of a probe evaluation, not of this finetune one"),
    "unknown probing task": ([{**PROBE, "probe_tasks": ["bshfit"]}], {},
                             r"evals\.tasks\[0\]\.probe_tasks\[0\]: must be one of \['bshift'"),
    "unknown key": ([{**PROBE, "textcolumn": "1"}], {}, r"evals\.tasks\[0\]\.textcolumn.*did you mean "
                    r"evals\.tasks\[0\]\.text_column\?"),
    "an override the evaluation sets": ([{**FINETUNE, "overrides": ["run.seed=3"]}], {},
                                        r"evals\.tasks\[0\]\.overrides: run\.seed is set by the evaluation itself"),
    "unknown metric": ([{**FINETUNE, "metric": "auc"}], {}, r"evals\.tasks\[0\]\.metric: 'auc' is not a fine-tuning"),
    "bad name": ([{**PROBE, "name": "word order"}], {}, r"evals\.tasks\[0\]\.name: 'word order' may hold letters"),
    "every off the checkpoints": ([PROBE], {"every": 7}, r"evals\.every: 7 is not a multiple of checkpoint\.every=5"),
    "a task's every off them": ([{**PROBE, "every": 12}], {}, r"evals\.tasks\[0\]\.every: 12 is not a multiple of "
                                r"checkpoint\.every=5"),
    "unknown mode": ([PROBE], {"mode": "beside"}, r"evals\.mode: must be one of \['inline', 'side', 'slurm'\]"),
    "no timeout": ([PROBE], {"timeout_s": 0}, r"evals\.timeout_s: must be positive, got 0"),
}


@pytest.mark.unit
@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_evals_entry_is_one_line_naming_the_field(case):
    tasks, evals, message = BAD[case]
    with pytest.raises(ConfigError, match=message) as err:
        load_config("tiny-cpu", _config(tasks, **evals))
    assert "\n" not in str(err.value)


@pytest.mark.unit
def test_good_entries_load_and_select_their_checkpoints():
    cfg = load_config("tiny-cpu", _config([PROBE, {**FINETUNE, "every": 500}], every=250)
                      + ["checkpoint.every=250", "train.max_steps=1100"])
    probe, finetune = cfg.evals.tasks
    assert (probe.seeds, finetune.dev_fraction, cfg.evals.mode) == ([1, 2], 0.2, "side")
    selected = {step: [t.name for t in tasks_at(cfg.evals, step, 1100)] for step in (250, 500, 750, 1000, 1100)}
    assert selected == {250: ["wordorder"], 500: ["wordorder", "sentiment"], 750: ["wordorder"],
                        1000: ["wordorder", "sentiment"], 1100: ["wordorder", "sentiment"]}   # the last: all
    assert tasks_at(load_config("tiny-cpu", _config([PROBE])).evals, 250, 1000) == []  # every 0: the last alone


@pytest.mark.unit
def test_evals_are_not_part_of_the_run_fingerprint():
    from distaff.train.run.config import config_fingerprint, config_to_dict

    plain = config_to_dict(load_config("tiny-cpu", ["checkpoint.every=5"]))
    attached = config_to_dict(load_config("tiny-cpu", _config([PROBE], every=5)))
    assert config_fingerprint(plain) == config_fingerprint(attached)


@pytest.mark.unit
def test_the_run_layer_names_the_probing_tasks_and_metrics_as_their_owners_do():
    assert PROBE_TASKS == TASKS
    assert set(FINETUNE_METRICS) == set(CLASSIFICATION_METRICS) | set(REGRESSION_METRICS)


@pytest.mark.integration
@pytest.mark.parametrize("case", ["missing text", "missing dev", "not a data dir", "another tokenizer"])
def test_check_refuses_what_the_evaluations_cannot_read_in_one_line(case, sample_data, tmp_path_factory, tmp_path,
                                                                   capsys, monkeypatch, request):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    tasks = {"missing text": ([{**PROBE, "text": str(tmp_path / "gone.txt")}], r"evals\.tasks\[0\]\.text: .*gone\.txt does "
                              "not exist"),
             "missing dev": ([{**FINETUNE, "dev_fraction": 0.0, "dev": str(tmp_path)}], r"evals\.tasks\[0\]\.dev: .* is not "
                             "a file"),
             "not a data dir": ([{"name": "h", "kind": "heldout", "data": str(tmp_path)}], r"evals\.tasks\[0\]\.data: .*"
                                r"holds no manifest\.json"),
             "another tokenizer": ([{"name": "h", "kind": "heldout", "data": str(other_data(request))}],
                                   r"evals\.tasks\[0\]\.data: .* was prepared with another tokenizer")}[case]
    config = write_config(tmp_path / "run.yaml", data, tmp_path / "run", checkpoint={"every": 4},
                          evals={"every": 4, "tasks": tasks[0]})
    assert pretrain_main(["--config", str(config), "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(tasks[1], err), err
    assert not (tmp_path / "run").exists()


def other_data(request) -> Path:
    """A data dir prepared with another tokenizer (the data tests' session fixture)."""
    return request.getfixturevalue("data_dir")


@pytest.mark.integration
def test_check_names_the_evaluations_it_found(sample_data, tmp_path_factory, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    config = write_config(tmp_path / "run.yaml", data, tmp_path / "run", checkpoint={"every": 4},
                          evals={"every": 4, "tasks": [PROBE, FINETUNE]})
    assert pretrain_main(["--config", str(config), "--check"]) == 0
    out = capsys.readouterr().out
    assert "evaluations wordorder (probe, 2 seed(s)), sentiment (finetune, 1 seed(s)) at every 4 steps and the last, " \
           "side" in out, out
    assert gzip.open(MOVIES).read(1)   # the bundled file the entries name is there
