"""The dependency direction of STYLE.md, checked by reading imports (no import-linter run needed):
solvers never import torch or the layers above them; the planner never imports solvers/executor/api."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

RULES = {
    "solvers": ("torch", "memplan.executor", "memplan.api", "memplan.planner.probe", "memplan.planner.workloads"),
    "planner": ("memplan.solvers", "memplan.executor", "memplan.api"),
    "executor": ("memplan.solvers", "memplan.api"),
}



def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _violations(folder: str, forbidden: tuple[str, ...], files=None) -> list[str]:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        if files and path.name not in files:
            continue
        for name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


@pytest.mark.parametrize("folder", sorted(RULES))
def test_dependency_direction(folder):
    assert _violations(folder, RULES[folder]) == []


def test_planner_core_is_torch_free():
    """planner/core is the torch-free layer: it never imports torch, transformers or the probe above it."""
    assert _violations("planner/core", ("torch", "transformers", "memplan.planner.probe",
                                        "memplan.planner.workloads")) == []
    top = [p.name for p in (ROOT / "planner").glob("*.py")]
    assert sorted(top) == ["__init__.py", "workloads.py"], "planner/ holds core/, probe/ and workloads.py only"


PROBE_LAYERS = {
    # the probe reads bottom-up: storage helpers <- measurement <- the tracing mode <- the profiler
    "storage.py": ("memplan.planner.probe", "memplan.planner.workloads"),
    "measure.py": ("memplan.planner.probe.tracing", "memplan.planner.probe.profiler",
                   "memplan.planner.probe.optime", "memplan.planner.probe.fake"),
    "tracing.py": ("memplan.planner.probe.profiler",),
}


@pytest.mark.parametrize("name", sorted(PROBE_LAYERS))
def test_probe_layers(name):
    assert (ROOT / "planner" / "probe" / name).is_file()
    assert _violations("planner/probe", PROBE_LAYERS[name], files={name}) == []


def test_no_bare_package_imports():
    bare = ("planner", "solvers", "api", "executor")
    bad = [f"{p.relative_to(ROOT)} imports {n}" for folder in (*bare, "tests", "benchmarks")
           for p in (ROOT / folder).rglob("*.py") for n in _imports(p) if n.split(".")[0] in bare]
    assert bad == []


# Imports of private names still waiting for their owner: (importing file, module, name). Each entry is a
# debt with a name on it, not a permission.
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str, str]] = set()  # none left: keep it that way


def _private_imports(path: Path) -> list[tuple[str, str, str]]:
    """(file, module, name) for every private name ``path`` takes from another memplan module: ``from
    memplan.x import _name``, and ``x._name`` where ``x`` is a memplan module it imported."""
    rel = str(path.relative_to(ROOT))
    tree = ast.parse(path.read_text())
    found: list[tuple[str, str, str]] = []
    modules: dict[str, str] = {}  # local name -> memplan module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("memplan."):
            for a in node.names:
                if a.name.startswith("_"):
                    found.append((rel, node.module, a.name))
                if (ROOT / Path(*node.module.split(".")[1:]) / f"{a.name}.py").is_file():
                    modules[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("memplan.") and a.asname:
                    modules[a.asname] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append((rel, modules[node.value.id], node.attr))
    return found


@pytest.mark.parametrize("folder", ["planner", "solvers", "api", "executor"])
def test_no_module_imports_another_modules_private_names(folder):
    """STYLE.md: if two modules need a function, it is public somewhere. Once broken by plan.py taking
    graph.py's ``_first_error``, the executor taking the profiler's storage helpers and the rank measurement
    taking measure.py's ``_leaves``."""
    found = [f for path in sorted((ROOT / folder).rglob("*.py")) for f in _private_imports(path)]
    assert [f for f in found if f not in KNOWN_PRIVATE_IMPORTS] == []


def test_the_private_import_check_sees_both_forms(tmp_path, monkeypatch):
    """The check above finds ``from memplan.x import _y`` and ``module._y`` on an imported memplan module."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "planner" / "probe").mkdir(parents=True)
    (tmp_path / "planner" / "probe" / "measure.py").write_text("")
    user = tmp_path / "planner" / "user.py"
    user.write_text("from memplan.planner.core.graph import _check_graph, Graph\n"
                    "from memplan.planner.probe import measure\n"
                    "measure._without_kineto_chatter()\nmeasure.max_prefix([])\n")
    assert _private_imports(user) == [("planner/user.py", "memplan.planner.core.graph", "_check_graph"),
                                      ("planner/user.py", "memplan.planner.probe.measure", "_without_kineto_chatter")]
