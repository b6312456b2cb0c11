"""``pip install .`` (the container recipes' install, and any user's install that is not editable) holds the whole
package: every module and data file of the folders setup.cfg maps into ``distaff``, and nothing at the top level.

The suite runs from an editable install, which finds any module of a mapped folder by its path; a subpackage missing
from setup.cfg's ``packages`` list is absent only from a built wheel (``distaff.kernels.attention`` and
``distaff.train.tools.evals`` were: every container image lacked the attention kernels)."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _setup_options() -> configparser.SectionProxy:
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    return setup["options"]


def _mapped_folders() -> dict[str, str]:
    """``{"distaff.kernels": "kernels", ...}``: setup.cfg's ``package_dir``."""
    pairs = (line.split("=") for line in _setup_options()["package_dir"].strip().splitlines())
    return {name.strip(): folder.strip() for name, folder in pairs}


def _tracked(folders: list[str]) -> list[str]:
    """The files git tracks under ``folders`` (a clean clone's tree: no caches, no local leftovers)."""
    listed = subprocess.run(["git", "ls-files", "--", *folders], cwd=REPO, capture_output=True, text=True, check=True)
    return listed.stdout.split()


def _in_package(path: str, mapped: dict[str, str]) -> str:
    """Where a tracked file lands in the installed package: ``kernels/attention/op.py`` ->
    ``distaff/kernels/attention/op.py``."""
    for name, folder in mapped.items():
        if path.startswith(folder + "/"):
            return name.replace(".", "/") + path[len(folder):]
    raise AssertionError(f"{path} is under no mapped folder")


@pytest.mark.unit
def test_setup_cfg_lists_every_package_of_the_mapped_folders() -> None:
    mapped = _mapped_folders()
    on_disk = {_in_package(path, mapped).rsplit("/", 1)[0].replace("/", ".")
               for path in _tracked(list(mapped.values())) if path.endswith("/__init__.py")}
    listed = set(_setup_options()["packages"].split())
    missing = sorted(on_disk - listed)
    assert missing == [], f"packages missing from setup.cfg's [options] packages: {missing}"
    assert listed - on_disk == set(), f"setup.cfg lists packages with no folder: {sorted(listed - on_disk)}"


@pytest.mark.integration
def test_a_built_wheel_holds_every_module_and_data_file_and_no_top_level_folder(tmp_path: Path) -> None:
    # Built from a copy of the tracked build inputs: setuptools builds in the source tree and reuses its build/
    # folder, where a package from an earlier build would stay and hide one missing now.
    mapped = _mapped_folders()
    source = tmp_path / "source"
    for path in _tracked(["setup.cfg", "pyproject.toml", "README.md", *mapped.values()]):
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / path, source / path)
    # No build isolation: the build backend (setuptools) comes from the environment, nothing is downloaded.
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "wheel")], check=True, capture_output=True, timeout=600)
    wheel, = (tmp_path / "wheel").glob("distaff-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    package_data = (".yaml", ".json")  # the presets, the planner's tables (setup.cfg's package_data)
    wanted = {_in_package(path, mapped) for path in _tracked(list(mapped.values()))
              if path.endswith((".py", *package_data))}
    assert wanted - names == set(), f"missing from the wheel: {sorted(wanted - names)[:20]}"
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"distaff"}, top
    # Installed alone (its dependencies are this environment's), the package imports from where it was installed.
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=600)
    probe = ("import distaff, distaff.kernels.attention, distaff.train.tools.evals, distaff.launch.cli; "
             "print(distaff.kernels.attention.__file__)")
    imported = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(target)})
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert Path(imported.stdout.strip()).is_relative_to(target), imported.stdout
