"""The tree is the architecture: each package imports only the layers below it (docs/architecture.md).

Every import is checked, including those inside functions, so a lazy import cannot hide a dependency
that points upwards or sideways."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {"kernels": "distaff.kernels", "train": "distaff.train", "launch": "distaff.launch"}

# package -> the distaff packages it may import (itself always allowed). One way, bottom to top:
# kernels <- core <- data, model <- run <- plan <- pretrain, finetune <- tools <- launch.
ALLOWED = {
    "distaff.kernels": set(),
    "distaff.kernels.aot": {"distaff.kernels"},
    "distaff.kernels.attention": {"distaff.kernels"},  # the fused attention: its contract and tables
    "distaff.train.core": set(),
    "distaff.train.data": {"distaff.kernels", "distaff.train.core"},
    "distaff.train.model": {"distaff.kernels", "distaff.train.core"},
    "distaff.train.run": {"distaff.kernels", "distaff.train.core", "distaff.train.data", "distaff.train.model"},
    # A pretraining run compares its measured stage times with its plan (train/plan/compare.py).
    "distaff.train.pretrain": {"distaff.kernels", "distaff.train.core", "distaff.train.data", "distaff.train.model",
                               "distaff.train.run", "distaff.train.plan"},
    "distaff.train.finetune": {"distaff.kernels", "distaff.train.core", "distaff.train.data", "distaff.train.model",
                               "distaff.train.run"},
    "distaff.train.tools": {"distaff.kernels", "distaff.train.core", "distaff.train.data", "distaff.train.model",
                            "distaff.train.run", "distaff.train.pretrain", "distaff.train.finetune", "distaff.train.plan"},
    # The evaluations attached to checkpoints call the tools that evaluate (probe, checkpoint_eval, export).
    "distaff.train.tools.evals": {"distaff.kernels", "distaff.train.core", "distaff.train.data", "distaff.train.model",
                                  "distaff.train.run", "distaff.train.pretrain", "distaff.train.finetune",
                                  "distaff.train.tools"},
    # The plan reads run configs and models (parameter sizes from their shapes), and a prepared data dir's manifest
    # (its seq_len, read and range-checked as a run reads it), never a trainer's loop.
    "distaff.train.plan": {"distaff.train.core", "distaff.train.model", "distaff.train.run",
                           "distaff.train.data.manifest"},
    # The launchers read configs and start trainers as processes: never a trainer's loop.
    # A decay branch's config comes from its parent's checkpoint: its file layout and the schedule (distaff decay).
    "distaff.launch": {"distaff.train.core", "distaff.train.run.config", "distaff.train.finetune.config",
                       "distaff.train.plan", "distaff.train.run.checkpoint_files", "distaff.train.run.schedule"},
}
MAX_MODULES = {"kernels": 12, "train": 12, "tests": 20}


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = [FOLDERS[rel.parts[0]], *rel.parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """The most specific package of ``ALLOWED`` that holds ``module``."""
    return max((p for p in ALLOWED if module == p or module.startswith(p + ".")), key=len)


def imported_modules(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module) for every import of a distaff module in ``path`` (or ``source`` as if it were
    that file), relative ones resolved."""
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod when there is one
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name.startswith("distaff.")]


def allows(importer: str, imported: str) -> bool:
    own = package_of(importer)
    if imported == own or imported.startswith(own + "."):
        return True
    return any(imported == a or imported.startswith(a + ".") for a in ALLOWED[own]) or \
        any(a.startswith(imported + ".") for a in ALLOWED[own])   # `from distaff.train.run import config`


def sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (REPO / folder).rglob("*.py"))


def test_every_import_points_down_the_layers():
    checked = 0
    wrong = []
    for path in sources():
        importer = module_name(path)
        for line, imported in imported_modules(path):
            checked += 1
            if not allows(importer, imported):
                wrong.append(f"{path.relative_to(REPO)}:{line} {importer} imports {imported}")
    assert checked > 200, "the import walk found too few imports to be looking at the sources"
    assert wrong == []


def test_every_package_says_what_it_holds_and_may_import():
    packages = {p.parent for p in sources() if p.name == "__init__.py"}
    missing = [str(p.relative_to(REPO)) for p in packages
               if "imports" not in (ast.get_docstring(ast.parse((p / "__init__.py").read_text())) or "").lower()]
    assert len(packages) >= 9 and missing == []


def test_every_package_of_train_is_in_the_layer_table():
    packages = {module_name(p) for p in sources() if p.name == "__init__.py" and p.parent != REPO / "train"}
    assert packages - set(ALLOWED) == set()


@pytest.mark.parametrize("root", sorted(MAX_MODULES))
def test_no_folder_is_one_flat_room(root):
    limit = MAX_MODULES[root]
    crowded = {}
    for folder in [REPO / root, *(p for p in (REPO / root).rglob("*") if p.is_dir())]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > limit:
            crowded[str(folder.relative_to(REPO))] = len(modules)
    assert crowded == {}


def test_a_wrong_import_is_caught():
    """The checker itself: a model module importing the run layer lazily, or relatively, is reported."""
    model = REPO / "train" / "model" / "deberta.py"
    source = "def f():\n    from distaff.train.run.config import RunConfig\n    from ..run import steps\n"
    wrong = [(line, name) for line, name in imported_modules(model, source) if not allows(module_name(model), name)]
    assert wrong == [(2, "distaff.train.run.config.RunConfig"), (3, "distaff.train.run.steps")]


def module_of(name: str, modules: set[str]) -> str | None:
    """The module ``name`` (``pkg.mod`` or ``pkg.mod.attr``) refers to, among ``modules``."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_circles(folder: Path) -> list[list[str]]:
    """Every circle of imports (lazy ones included) among the modules under ``folder``: each as the modules in
    the order they import one another, the first repeated at the end."""
    paths = {module_name(p): p for p in folder.rglob("*.py")}
    graph = {name: sorted({m for _, imported in imported_modules(path)
                           if (m := module_of(imported, set(paths))) not in (None, name)})
             for name, path in paths.items()}
    circles, done = [], set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            circles.append(trail[trail.index(name):] + [name])
            return
        if name in done:
            return
        for target in graph[name]:
            visit(target, trail + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    return circles


CIRCLE_FREE = ("train/plan",)


@pytest.mark.parametrize("folder", CIRCLE_FREE)
def test_no_two_modules_import_each_other(folder):
    assert import_circles(REPO / folder) == []


def test_an_import_circle_is_caught(tmp_path, monkeypatch):
    """The circle finder itself: two plan modules that import each other, one of them lazily, are reported."""
    plan = tmp_path / "train" / "plan"
    plan.mkdir(parents=True)
    (plan / "__init__.py").write_text("")
    (plan / "a.py").write_text("from distaff.train.plan.b import thing\n")
    (plan / "b.py").write_text("def f():\n    from distaff.train.plan import a\n")
    (plan / "c.py").write_text("from distaff.train.plan.a import thing\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert import_circles(plan) == [["distaff.train.plan.a", "distaff.train.plan.b", "distaff.train.plan.a"]]


@pytest.mark.parametrize("package", ["distaff.kernels", "distaff.train.model"])
def test_a_lazy_package_resolves_every_name_it_exports(package):
    """The packages that import their torch modules on first use (so a config is read without torch) still give
    every name of ``__all__``, and refuse a name they do not have."""
    module = importlib.import_module(package)
    assert module.__all__ and all(getattr(module, name) is not None for name in module.__all__)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        module.not_a_name
