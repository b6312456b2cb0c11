"""What a site adds to a Slurm job (launch/slurm_site.py), as ``distaff slurm submit --dry-run`` writes it: set-up
lines verbatim on every node before the launch, a pyxis or Apptainer container, ``--gres`` for the GPUs; every
other value with a shell metacharacter or a newline refused in one line. The set-up lines run for real on the
local Slurm (tests/launch/test_slurm_e2e.py); the containers only as scripts bash parses, since neither pyxis nor
Apptainer is installed here."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from distaff.launch import cli
from distaff.launch.script_values import NODE_SCRIPT_END

pytestmark = pytest.mark.unit


@pytest.fixture()
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", "/nonexistent-home")     # the run's folder outside it (pyxis may mount the home)
    path = tmp_path / "run.yaml"
    path.write_text("run: {out_dir: out/run1, name: run1}\ndata: {dir: data/austen}\ntrain: {max_steps: 10}\n")
    return path


def _submit(config: Path, capsys, *options: str, gpus: int = 4) -> tuple[int, str, str]:
    """``distaff slurm submit --dry-run`` of a 2-node job: exit code, the script (bash has parsed it), stderr."""
    code = cli.main(["slurm", "submit", "--config", str(config), "--nodes", "2", "--gpus-per-node", str(gpus),
                     "--gpu-kind", "H100-SXM", "--dry-run", *options])
    out, err = capsys.readouterr()
    script = out[out.index("#!/bin/bash"):out.index("# submit with:")] if code == 0 else ""
    if script:
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    return code, script, err


def _node_script(script: str) -> str:
    return script.split(f"<<'{NODE_SCRIPT_END}'\n")[1].split(f"\n{NODE_SCRIPT_END}\n")[0]


def test_set_up_lines_run_verbatim_on_every_node_before_the_launch(config: Path, capsys) -> None:
    setup = config.parent / "site.sh"
    setup.write_text("module purge\n  module load cuda/12.4 nccl   # indented, with a comment\n\n"
                     "source /shared/env.sh\n")
    lines = ['export NCCL_SOCKET_IFNAME="ib0"; ulimit -n 65536', "[ -d /scratch ] && export TMPDIR=/scratch/$USER"]
    code, script, _ = _submit(config, capsys, "--setup-file", str(setup), "--setup", lines[0], "--setup", lines[1])
    assert code == 0
    node = _node_script(script).splitlines()
    expected = ["module purge", "  module load cuda/12.4 nccl   # indented, with a comment", "",
                "source /shared/env.sh", *lines]
    start = node.index("set -e") + 2          # after the ERR trap that names a failing line's node
    assert node[start:start + len(expected)] == expected and node[start + len(expected)] == "trap - ERR"
    assert node.index("trap - ERR") < next(i for i, line in enumerate(node) if "distaff.launch.node_ranks" in line)
    assert script.count("#SBATCH --gpus-per-node=4") == 1     # the GPU request as before


@pytest.mark.parametrize("line, problem", [
    ("module load a\nrm -rf /", "contains a control character (U+000A, a newline)"),
    ("module load a\r", "(a file with Windows line ends: convert it with dos2unix)"),
    (NODE_SCRIPT_END, "would end the per-node script early"),
])
def test_a_set_up_line_is_one_line(config: Path, capsys, line: str, problem: str) -> None:
    code, _, err = _submit(config, capsys, "--setup", line)
    assert code == 2 and err.count("\n") == 1 and err.startswith("distaff slurm: --setup: ") and problem in err, err
    setup = config.parent / "site.sh"
    setup.write_bytes(b"module purge\r\nmodule load cuda\r\n")
    code, _, err = _submit(config, capsys, "--setup-file", str(setup))
    assert code == 2 and f"--setup-file {setup}, line 1: 'module purge\\r'" in err and "dos2unix" in err, err


@pytest.mark.parametrize("option", ["--container-image", "--container-mounts", "--apptainer", "--gres"])
@pytest.mark.parametrize("value", ["a;touch INJECTED", "$(id)", "`id`", "a b", "x|y", "a&b", "x>y", "'q'", '"q"',
                                   "a\\b", "-x", "a\nb", "*"])
def test_site_values_with_shell_metacharacters_are_refused_in_one_line(config: Path, capsys, option: str,
                                                                      value: str) -> None:
    extra = ["--apptainer", "img.sif"] if option == "--container-mounts" else []
    code, _, err = _submit(config, capsys, f"{option}={value}", *extra)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"distaff slurm: {option} "), err
    assert not (config.parent / "out").exists()


def test_a_pyxis_container_runs_each_node_script_in_the_image(config: Path, capsys) -> None:
    mounts = f"/shared:/shared,/scratch:/scratch:ro,{config.parent}"    # the run's folder at its own path
    code, script, err = _submit(config, capsys, "--container-image", "nvcr.io#nvidia/pytorch:24.01-py3",
                                "--container-mounts", mounts, "--setup", "nvidia-smi")
    assert code == 0 and "warning" not in err
    srun = re.search(r"^srun .*?bash -c \"\$node_script\" 2>\"\$srun_lines\"$", script, re.S | re.M).group(0)
    assert ("'--container-image=nvcr.io#nvidia/pytorch:24.01-py3' "
            f"--container-workdir={config.parent} --container-mounts={mounts} ") in srun
    assert "# Every node runs python: inside the container nvcr.io#nvidia/pytorch:24.01-py3." in script
    assert "\npython -m distaff.launch.node_ranks --nproc-per-node=4" in script    # the image's python
    code, script, _ = _submit(config, capsys, "--container-image", "img.sqsh", "--python", "/opt/conda/bin/python",
                              "--container-mounts", str(config.parent))
    assert "\n/opt/conda/bin/python -m distaff.launch.node_ranks" in script


def test_apptainer_wraps_each_python_the_nodes_run(config: Path, capsys) -> None:
    code, script, _ = _submit(config, capsys, "--apptainer", "docker://nvcr.io/nvidia/pytorch:24.01-py3",
                              "--container-mounts", "/shared", "--setup", "module load apptainer")
    assert code == 0
    prefix = "apptainer exec --nv --bind /shared docker://nvcr.io/nvidia/pytorch:24.01-py3 python "
    node = _node_script(script)
    assert f"\n{prefix}-m distaff.launch.node_ranks" in node and f"$({prefix}-c " in node    # the ranks, the affinity
    assert node.index("module load apptainer") < node.index("apptainer exec")               # set-up on the host
    assert "--container-image" not in script
    config.parent.joinpath("out").mkdir()
    cpu = cli.main(["slurm", "submit", "--config", str(config), "--nodes", "1", "--gpus-per-node", "1", "--cpu",
                    "--apptainer", "img.sif", "--dry-run"])
    assert cpu == 0 and "apptainer exec img.sif python -m distaff.launch.node_ranks" in capsys.readouterr().out


@pytest.mark.parametrize("options, problem", [
    (["--container-image", "a.sqsh", "--apptainer", "b.sif"], "--container-image (pyxis) and --apptainer exclude"),
    (["--container-mounts", "/a:/a"], "--container-mounts: there is no container to mount into"),
    (["--gres", "gpu:a100:2"], "--gres 'gpu:a100:2': 2 GPU(s) per node for --gpus-per-node 4 ranks"),
    (["--gres", "nvme:1"], "--gres 'nvme:1': requests no GPU"),
    (["--max-requeues", "-1"], "--max-requeues: expected a whole number >= 0 and <= 1,000, got '-1'"),
    (["--max-requeues", "1e30"], "--max-requeues: expected a whole number >= 0 and <= 1,000, got '1e30'"),
    (["--cpu", "--gres", "gpu:a100:4"], "--gres 'gpu:a100:4' with --cpu: a job of CPU ranks requests no GPU; leave "
                                        "the gpu entry out of --gres (or --cpu out, to run on the GPUs)"),
])
def test_site_requests_that_cannot_work_are_refused(config: Path, capsys, options: list[str], problem: str) -> None:
    code, _, err = _submit(config, capsys, *options)
    assert code == 2 and err.startswith("distaff slurm: ") and err.count("\n") == 1 and problem in err, err


def test_gres_requests_the_gpus_instead_of_gpus_per_node(config: Path, capsys) -> None:
    code, script, _ = _submit(config, capsys, "--gres", "gpu:h100:4,nvme:1")
    assert code == 0 and "#SBATCH --gres=gpu:h100:4,nvme:1\n" in script and "--gpus-per-node" not in script
    assert "max_requeues=3\n" in script           # the default bound on stalled or lost attempts


# ---------------------------------------------------------------- what a container sees

def test_a_container_that_does_not_mount_the_config_is_refused_in_the_dry_run(config: Path, capsys) -> None:
    code, script, err = _submit(config, capsys, "--container-image", "img.sqsh", "--container-mounts", "/shared")
    assert code == 2 and script == "" and err.count("\n") == 1, err
    assert err.startswith(f"distaff slurm: --container-image: the container does not see --config {config}; ")
    for unseen in (f"run.out_dir {config.parent}/out/run1", f"data.dir {config.parent}/data/austen",
                   f"the submit folder (the container's working folder) {config.parent}"):
        assert unseen in err
    assert "(--container-mounts /shared); mount each at its own path" in err


def test_a_path_mounted_elsewhere_in_the_container_is_named_with_where_it_lands(config: Path, capsys) -> None:
    code, _, err = _submit(config, capsys, "--apptainer", "img.sif", "--container-mounts",
                           f"{config.parent}/data:/data", "data.dir=/elsewhere/shards")
    # Apptainer mounts the working folder (the config, the run) itself; the data is neither there nor mounted
    assert code == 2 and "the container does not see data.dir /elsewhere/shards at that path" in err, err
    code, _, err = _submit(config, capsys, "--apptainer", "img.sif", "--container-mounts",
                           f"{config.parent}/data:/data")     # the data also at /data: still at its own path too
    assert code == 0 and "warning" not in err, err
    code, _, err = _submit(config, capsys, "--container-image", "img.sqsh", "--container-mounts",
                           f"{config.parent}:/work")
    assert code == 2 and f"--config {config} (mounted at /work/run.yaml)" in err, err


def test_mounted_paths_pass_and_the_home_and_an_outside_python_are_warnings(config: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(config.parent))          # the run's folder is under the home
    code, script, err = _submit(config, capsys, "--container-image", "img.sqsh")
    assert code == 0 and script, err
    assert err.count("--container-image: warning: ") == 4 and "under the home, which pyxis mounts only" in err
    monkeypatch.setenv("HOME", "/nonexistent-home")
    code, _, err = _submit(config, capsys, "--apptainer", "img.sif", "--python", "/opt/venv/bin/python")
    assert code == 0 and "--apptainer: warning: --python /opt/venv/bin/python is not inside the container's " \
                         "mounts: it must be the image's own\n" in err, err
    code, _, err = _submit(config, capsys, "--container-image", "img.sqsh", "--container-mounts", f"{config.parent}:"
                           f"{config.parent}:ro", "--python", f"{config.parent}/venv/bin/python")
    assert code == 0 and "warning" not in err, err
def test_a_cpu_job_keeps_a_gres_request_that_is_no_gpu(config: Path, capsys) -> None:
    """``--cpu`` refuses a GPU in ``--gres`` (above); other generic resources are still requested."""
    code, script, _ = _submit(config, capsys, "--cpu", "--gres", "nvme:1")
    assert code == 0 and "#SBATCH --gres=nvme:1\n" in script and "#SBATCH --gpus-per-node" not in script
