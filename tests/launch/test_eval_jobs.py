"""``evals.mode: slurm`` (issue 43): each selected checkpoint's evaluation is a Slurm job of its own.

The job script (launch/eval_jobs.py): what it asks for (``evals.slurm``), the dependency that runs a run's
evaluation jobs one at a time (``--dependency=singleton`` on ``<run.name>-evals``), requeue safety, checked as
``distaff slurm submit`` checks its own (one line naming the key), and shown by ``distaff slurm submit --dry-run``.
Then for real, on the suite's local Slurm cluster: a run (one rank, beside the cluster) submits a job per selected
checkpoint; the first is requeued while it runs; both complete one after the other, and their results land in the
run once each, the pins gone.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from pretrain_fixtures import PYTHON, REPO, prepare_data, rank_env, write_config
from slurm_cluster import SlurmCluster

from distaff.launch import cli
from distaff.launch.eval_jobs import EvalJob, render_eval_job
from distaff.train.core.errors import ConfigError
from distaff.train.run.config import EvalsSlurmSection

MOVIES = REPO / "data" / "movie-snippets.tsv.gz"
PROBE = {"name": "wordorder", "kind": "probe", "text": str(MOVIES), "text_column": "1", "max_sentences": 300}


def _job(tmp_path: Path, **slurm) -> EvalJob:
    return EvalJob(run_dir=tmp_path / "run", run_name="run1", checkpoint=tmp_path / "run" / "evals" / "pinned" /
                   "step-00000100", slurm=EvalsSlurmSection(**slurm), workdir=tmp_path, python="/venv/bin/python")


@pytest.mark.unit
def test_the_job_script_asks_for_its_resources_runs_after_its_runs_earlier_jobs_and_requeues(tmp_path):
    script = render_eval_job(_job(tmp_path, cpus=4, mem="16G", time="01:00:00", partition="short",
                                  sbatch=["--qos=low"]))
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert header == ["#SBATCH --job-name=run1-evals", "#SBATCH --dependency=singleton", "#SBATCH --nodes=1",
                      "#SBATCH --ntasks=1", "#SBATCH --cpus-per-task=4",
                      f"#SBATCH --output={tmp_path}/run/slurm/evals-%j.out", "#SBATCH --open-mode=append",
                      "#SBATCH --requeue", f"#SBATCH --chdir={tmp_path}", "#SBATCH --mem=16G",
                      "#SBATCH --partition=short", "#SBATCH --time=01:00:00", "#SBATCH --qos=low"]
    assert "export OMP_NUM_THREADS=4\nexport CUDA_VISIBLE_DEVICES= DS_ACCELERATOR=cpu\n" in script
    assert script.rstrip().endswith(f"exec /venv/bin/python -m distaff.train.tools.evals {tmp_path}/run --checkpoint "
                                    f"{tmp_path}/run/evals/pinned/step-00000100")
    gpu = render_eval_job(_job(tmp_path, gpus=1))
    assert "#SBATCH --gpus=1\n" in gpu and "CUDA_VISIBLE_DEVICES" not in gpu


@pytest.mark.unit
@pytest.mark.parametrize("change, message", [
    ({"mem": "16 GB"}, "evals.slurm.mem '16 GB': expected a Slurm size"),
    ({"time": "soon"}, "--time 'soon': not a Slurm time limit"),
    ({"sbatch": ["--dependency=afterok:1"]}, "evals.slurm.sbatch '--dependency=afterok:1': the evaluation job sets"),
    ({"sbatch": ["--requeue"]}, "evals.slurm.sbatch '--requeue': the evaluation job sets"),
    ({"partition": "a\nb"}, "evals.slurm.partition 'a\\nb': contains a control character"),
])
def test_a_bad_job_request_is_one_line_naming_the_key(tmp_path, change, message):
    with pytest.raises(ConfigError) as err:
        render_eval_job(_job(tmp_path, **change))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.unit
def test_slurm_submit_dry_run_shows_the_evaluation_job_too(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text(f"run: {{out_dir: out/run1, name: run1}}\ndata: {{dir: data}}\ncheckpoint: {{every: 50}}\n"
                      f"evals: {{every: 100, mode: slurm, tasks: [{json.dumps(PROBE)}], slurm: {{cpus: 3}}}}\n")
    assert cli.main(["slurm", "submit", "--config", str(config), "--nodes", "1", "--gpus-per-node", "1", "--cpu",
                     "--dry-run"]) == 0
    out = capsys.readouterr().out
    job = out[out.index("# each selected checkpoint's evaluation job"):]
    assert "#SBATCH --job-name=run1-evals\n#SBATCH --dependency=singleton\n" in job
    assert "#SBATCH --cpus-per-task=3\n" in job and "--checkpoint " + str(tmp_path / "out/run1/evals/pinned/step-N") in job
    assert not (tmp_path / "out").exists()
    config.write_text(config.read_text().replace("cpus: 3", "cpus: 3, mem: lots"))
    assert cli.main(["slurm", "submit", "--config", str(config), "--nodes", "1", "--gpus-per-node", "1", "--cpu",
                     "--dry-run"]) == 2
    assert capsys.readouterr().err.startswith("distaff slurm: evals.slurm.mem 'lots': expected a Slurm size")


def _eval_job_of(out: str) -> str:
    return out[out.index("# each selected checkpoint's evaluation job"):].split("\n", 1)[1]


@pytest.mark.unit
@pytest.mark.parametrize("container", ["--apptainer=/images/distaff.sif",
                                       "--container-image=nvcr.io#nvidia/pytorch:24.01-py3"])
def test_the_evaluation_job_runs_with_the_training_jobs_set_up_lines_and_container(tmp_path, capsys, monkeypatch,
                                                                                   container):
    """What ``distaff slurm submit --dry-run`` shows is what the trainer's submitter writes later from the run's
    launch record: the training job's set-up lines verbatim, its container and python, not its --gres."""
    from distaff.launch import eval_jobs, slurm
    from distaff.launch.run_config import LAUNCH_RECORD, record_launch

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text(f"run: {{out_dir: out/run1, name: run1}}\ndata: {{dir: data}}\ncheckpoint: {{every: 50}}\n"
                      f"evals: {{every: 100, mode: slurm, tasks: [{json.dumps(PROBE)}]}}\n")
    (tmp_path / "site.sh").write_text("module load cuda/12.4\n")
    submit = ["submit", "--config", str(config), "--nodes", "1", "--gpus-per-node", "2", "--gres=gpu:2",
              "--setup-file=site.sh", "--setup", 'export HF_HOME="/scratch/$USER/hf"', container,
              f"--container-mounts=/data:/data,{tmp_path}"]      # the run's paths at their own path
    assert cli.main(["slurm", *submit, "--dry-run"]) == 0
    shown = _eval_job_of(capsys.readouterr().out)
    subprocess.run(["bash", "-n"], input=shown, text=True, check=True)
    setup = 'set -e\ntrap \'echo "distaff: node $SLURM_NODEID: a set-up line failed with status $?" >&2\' ERR\n' \
            'module load cuda/12.4\nexport HF_HOME="/scratch/$USER/hf"\ntrap - ERR\nset +e\n'
    runner = f"python -m distaff.train.tools.evals {tmp_path}/out/run1 --checkpoint {tmp_path}/out/run1/evals/pinned/step-N"
    if container.startswith("--apptainer"):     # set-up lines on the host, then the runner in the image
        assert setup + f"exec apptainer exec --bind /data:/data,{tmp_path} /images/distaff.sif {runner}\n" in shown, shown
    else:                                       # a one-task pyxis step runs both in the image
        assert setup + f"exec {runner}\n" in shown and re.search(
            r"^exec srun --ntasks=1 --cpus-per-task=2 '--container-image=nvcr.io#nvidia/pytorch:24.01-py3' "
            rf"--container-workdir={tmp_path} --container-mounts=/data:/data,{tmp_path} bash -c \"\$eval_script\"$", shown, re.M), shown
    assert "--gres" not in shown and "--gpus" not in shown

    # the trainer's submitter (later, from the run's launch record) writes the same script
    run = tmp_path / "out" / "run1"
    record_launch(run, "slurm", slurm._parser()[1].parse_intermixed_args(submit))
    (run / "config.yaml").write_text(config.read_text())
    monkeypatch.chdir(run)      # the job runs in (and reads the set-up file from) the folder the run was submitted from
    assert eval_jobs.main([str(run), "--checkpoint", str(run / "evals" / "pinned" / "step-N"), "--dry-run"]) == 0
    written = capsys.readouterr().out
    assert written.split("\n", 1)[1].split("# submit with:")[0] == shown.rstrip("\n") + "\n"

    # a recorded value the training script would refuse is refused here too, in one line
    record = json.loads((run / LAUNCH_RECORD).read_text())
    record["args"]["container_mounts"] = "/data:/data;reboot"
    (run / LAUNCH_RECORD).write_text(json.dumps(record))
    assert eval_jobs.main([str(run), "--checkpoint", str(run / "evals" / "pinned" / "step-N"), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("distaff evals (slurm job): --container-mounts '/data:/data;reboot': contains ';'") and \
        "\n" not in err, err


# ---------------------------------------------------------------- for real

def _submitted(run: Path) -> list[str]:
    """Job ids the run's submitter logged, in order."""
    text = "".join(p.read_text() for p in sorted((run / "evals" / "logs").glob("*.log")))
    return re.findall(r"submitted job (\d+)", text)


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_each_checkpoint_submits_a_dependent_job_whose_results_land_in_the_run(slurm: SlurmCluster, sample_data,
                                                                            tmp_path_factory, monkeypatch):
    from distaff.launch import slurm as slurm_launcher
    from distaff.launch.run_config import record_launch

    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    tmp = tmp_path_factory.mktemp("eval-jobs")
    run = tmp / "run"
    config = write_config(tmp / "run.yaml", data, run, train={"max_steps": 12}, checkpoint={"every": 6, "keep": 1},
                          evals={"every": 6, "mode": "slurm", "tasks": [{**PROBE, "seeds": [1, 2]}],
                                 "slurm": {"cpus": 1, "mem": "1G"}})
    # as `distaff slurm submit --setup ...` records the run's launch: its evaluation jobs run the same set-up lines
    monkeypatch.chdir(tmp)
    record_launch(run, "slurm", slurm_launcher._parser()[1].parse_intermixed_args(
        ["--config", str(config), "--nodes", "1", "--gpus-per-node", "1", "--cpu",
         "--setup", 'echo "site set-up ran in $PWD with $(basename "$(command -v sbatch)")"']))
    env = {**rank_env(tmp), "SLURM_CONF": str(slurm.conf)}
    trained = subprocess.run([PYTHON, "-m", "distaff.train.pretrain", "--config", str(config)], env=env, cwd=tmp,
                             capture_output=True, text=True, timeout=300)
    assert trained.returncode == 0, trained.stdout[-4000:] + trained.stderr[-4000:]
    jobs = _submitted(run)
    assert len(jobs) == 2, trained.stdout[-3000:]
    logs = lambda: "\n".join(p.read_text() for p in (run / "slurm").glob("evals-*.out"))  # noqa: E731

    # Requeued while it runs (as preemption would): the job starts again and records only what is missing.
    _wait(lambda: (run / "evals" / "work" / "checkpoints__step-00000006" / ".distaff.lock").is_file(), 180,
          f"job {jobs[0]} never started evaluating\n{slurm.log_tail()}")
    slurm.run("scontrol", "requeue", jobs[0])
    for job in jobs:
        state = slurm.wait_for(job, {"COMPLETED"}, timeout=240)
        assert state == "COMPLETED", f"job {job} {state}\n{logs()}\n{slurm.log_tail()}"
    assert slurm.job_field(jobs[0], "Restarts") == "1", logs()
    # one after the other: the second waited for the first (singleton)
    assert slurm.job_field(jobs[1], "StartTime") >= slurm.job_field(jobs[0], "EndTime")
    assert "restart_count=1" in logs()
    assert logs().count(f"site set-up ran in {tmp} with sbatch") == 3, logs()    # 2 jobs, one requeued

    records = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]
    assert sorted((r["step"], r["seed"]) for r in records) == [(6, 1), (6, 2), (12, 1), (12, 2)], logs()
    assert not list((run / "evals" / "pinned").iterdir())
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-00000012"]   # keep: 1
