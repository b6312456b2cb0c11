"""The container recipes (scripts/container/Dockerfile for pyxis/enroot, distaff.def for Apptainer) build the
package the way scripts/setup-env.sh installs it: from every folder setup.cfg maps into ``distaff``, pinned by
constraints.txt, torch first. Neither Docker nor Apptainer runs here: the recipes are read, not built."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "scripts" / "container"


def _package_inputs() -> set[str]:
    """What ``pip install .`` reads: the build files, the README (long_description) and each mapped folder."""
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    folders = {line.split("=")[1].strip() for line in setup["options"]["package_dir"].strip().splitlines()}
    return {"setup.cfg", "pyproject.toml", "README.md", "constraints.txt", *folders}


def _docker_copies() -> set[str]:
    copies = re.findall(r"^COPY (.+) \S+$", (RECIPES / "Dockerfile").read_text(), re.M)
    return {path for line in copies for path in line.split()}


def _apptainer_copies() -> set[str]:
    files = (RECIPES / "distaff.def").read_text().split("%files\n")[1].split("\n\n")[0]
    return {line.split()[0] for line in files.strip().splitlines()}


def test_both_recipes_copy_what_the_package_is_built_from_and_nothing_else() -> None:
    assert _docker_copies() == _apptainer_copies() == _package_inputs()


def test_both_recipes_install_from_the_constraints_torch_first() -> None:
    for recipe in ("Dockerfile", "distaff.def"):
        steps = re.findall(r"pip install --no-cache-dir -c constraints\.txt (\S+)", (RECIPES / recipe).read_text())
        assert steps == ["torch", "."], recipe
    setup_env = (REPO / "scripts" / "setup-env.sh").read_text()
    assert "-c constraints.txt torch" in setup_env           # the same order the venv is made in


def test_both_recipes_start_from_the_same_base() -> None:
    docker = re.search(r"^FROM (\S+)$", (RECIPES / "Dockerfile").read_text(), re.M).group(1)
    apptainer = re.search(r"^From: (\S+)$", (RECIPES / "distaff.def").read_text(), re.M).group(1)
    assert docker == apptainer
