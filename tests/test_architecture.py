"""The dependency direction of STYLE.md, checked by reading imports (no import-linter run needed):
solvers never import torch or the layers above them; the planner never imports solvers/executor/api."""

import ast
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


def test_no_bare_package_imports():
    bare = ("planner", "solvers", "api", "executor")
    bad = [f"{p.relative_to(ROOT)} imports {n}" for folder in (*bare, "tests", "benchmarks")
           for p in (ROOT / folder).rglob("*.py") for n in _imports(p) if n.split(".")[0] in bare]
    assert bad == []


def test_the_executor_imports_no_private_names_of_other_modules():
    """The executor reaches the planner through public names only (it once ran the simulator's private
    probe and the profiler's private storage helpers)."""
    bad = []
    for path in sorted((ROOT / "executor").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("memplan."):
                if not node.module.startswith("memplan.executor"):
                    bad += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert bad == []
