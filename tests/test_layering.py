"""The tree is the architecture: each package imports only the layers below it (docs/architecture.md).

Every import is checked, including those inside functions, so a lazy import cannot hide a dependency
that points upwards or sideways."""

from __future__ import annotations

import ast
import importlib
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
    # An ablation averages checkpoints and scores them as a run does (average, checkpoint_eval).
    "distaff.train.tools.ablate": {"distaff.kernels", "distaff.train.core", "distaff.train.data", "distaff.train.model",
                                   "distaff.train.run", "distaff.train.pretrain", "distaff.train.finetune",
                                   "distaff.train.plan", "distaff.train.tools"},
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
# Folders whose modules may not import each other in a circle (lazy imports included: a circle hidden in a
# function still ties the two modules into one).
NO_CIRCLES = ("launch", "train", "kernels")


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


def module_graph(paths: list[Path], source_of=lambda path: None) -> dict[str, set[str]]:
    """Module -> the modules among ``paths`` it imports (``from pkg import name`` counted as importing ``pkg``
    when ``pkg.name`` is not a module of its own); ``source_of(path)`` may stand in for a file's text."""
    names = {module_name(path): path for path in paths}
    graph: dict[str, set[str]] = {name: set() for name in names}
    for name, path in names.items():
        for _, imported in imported_modules(path, source_of(path)):
            target = imported if imported in names else imported.rsplit(".", 1)[0]
            if target in names and target != name:
                graph[name].add(target)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every module that can reach itself through the graph, with one circle it is on (depth-first search)."""
    circles = []
    for start in sorted(graph):
        path, seen, stack = {start: [start]}, {start}, [start]
        while stack:
            here = stack.pop()
            for nxt in sorted(graph[here]):
                if nxt == start:
                    circles.append(path[here] + [start])
                    stack = []
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    path[nxt] = path[here] + [nxt]
                    stack.append(nxt)
    return circles


@pytest.mark.parametrize("folder", NO_CIRCLES)
def test_no_import_circles(folder):
    paths = sorted((REPO / folder).rglob("*.py"))
    graph = module_graph(paths)
    assert sum(len(edges) for edges in graph.values()) >= 10, "too few imports found to be looking at the folder"
    assert import_circles(graph) == []


def test_an_import_circle_is_caught():
    """The checker itself: eval_jobs importing slurm (which imports eval_jobs) lazily, inside a function."""
    eval_jobs = REPO / "launch" / "eval_jobs.py"
    extra = "\ndef f():\n    from distaff.launch.slurm import submit\n"
    graph = module_graph(sorted((REPO / "launch").rglob("*.py")),
                         lambda path: path.read_text() + extra if path == eval_jobs else None)
    assert ["distaff.launch.eval_jobs", "distaff.launch.slurm", "distaff.launch.eval_jobs"] in import_circles(graph)


@pytest.mark.parametrize("package", ["distaff.kernels", "distaff.train.model"])
def test_a_lazy_package_resolves_every_name_it_exports(package):
    """The packages that import their torch modules on first use (so a config is read without torch) still give
    every name of ``__all__``, and refuse a name they do not have."""
    module = importlib.import_module(package)
    assert module.__all__ and all(getattr(module, name) is not None for name in module.__all__)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        module.not_a_name
