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


# ---- import cycles -------------------------------------------------------------------------------------


def _modules(root: Path) -> dict[str, Path]:
    """Every module of the project by its dotted name, through pyproject's package-dir mapping
    (``memplan.planner`` -> ``planner/`` ...); a package's ``__init__.py`` is the package itself."""
    import tomllib

    package_dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found: dict[str, Path] = {}
    for package, folder in package_dirs.items():
        for path in (root / folder).rglob("*.py"):
            parts = path.relative_to(root / folder).with_suffix("").parts
            found[".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
    return found


def _module_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports anywhere in its file (function-level imports included):
    ``from pkg import mod`` names the module ``pkg.mod``, ``from mod import x`` the module ``mod``;
    relative imports are resolved against ``name``'s package."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
            for a in node.names:
                if f"{base}.{a.name}" in modules:
                    out.add(f"{base}.{a.name}")
                elif base in modules:
                    out.add(base)
    out.discard(name)
    return out


def import_cycles(root: Path) -> list[list[str]]:
    """The import cycles among the project's modules: each strongly connected component of more than one
    module of the import graph (Tarjan's algorithm), its modules sorted, the components sorted."""
    modules = _modules(root)
    graph = {m: sorted(_module_imports(m, p, modules)) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_no_import_cycles():
    """Each folder reads from its entry point down: no module imports one that imports it back, directly or
    through others, at module or function level (once broken by solvers/core -> min_memory -> dp ->
    hierarchical -> core, and executor/apply <-> runtime before the executor was taken apart). The assertion
    lists every cycle found."""
    assert import_cycles(ROOT) == []


def test_the_cycle_check_sees_function_level_and_relative_imports(tmp_path):
    """The check above finds a cycle closed by an import inside a function, through a relative import and
    a ``from package import module``, across the package-dir mapping; a one-way import from another folder
(api -> solvers) is no cycle; and none is left once the function-level import points down."""
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools]\npackage-dir = { "memplan.solvers" = "solvers", '
                                             '"memplan.api" = "api" }\n')
    (tmp_path / "solvers").mkdir()
    (tmp_path / "api").mkdir()
    (tmp_path / "solvers" / "__init__.py").write_text("")
    (tmp_path / "api" / "__init__.py").write_text("")
    (tmp_path / "solvers" / "registry.py").write_text("")
    (tmp_path / "solvers" / "core.py").write_text("from memplan.solvers import low\n")
    (tmp_path / "solvers" / "low.py").write_text("from .mid import x\n")
    (tmp_path / "solvers" / "mid.py").write_text("def x():\n    from memplan.solvers.core import solve\n")
    (tmp_path / "api" / "cli.py").write_text("from memplan.solvers.core import solve\n")
    assert import_cycles(tmp_path) == [["memplan.solvers.core", "memplan.solvers.low", "memplan.solvers.mid"]]
    (tmp_path / "solvers" / "mid.py").write_text("def x():\n    from memplan.solvers import registry\n")
    assert import_cycles(tmp_path) == []


def test_cuda_lives_behind_the_device_layer():
    """Everything that differs between a CPU and a GPU is planner/probe/device.py's: the executor and the
    probe ask it, so that CUDA's rules emulated on a CPU (tests/test_cuda_emulation.py) reach every path.
    No ``torch.cuda`` call, ``is_cuda`` test or ``device.type == "cuda"`` branch elsewhere there (code only:
    docstrings and comments may name them)."""
    bad = []
    for folder in ("executor", "planner/probe"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "device.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and (
                        node.attr == "is_cuda" or (node.attr == "cuda" and isinstance(node.value, ast.Name)
                                                   and node.value.id == "torch")):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {ast.unparse(node)}")
                if isinstance(node, ast.Compare) and any(
                        isinstance(c, ast.Constant) and c.value == "cuda" for c in node.comparators) and \
                        "type" in ast.unparse(node.left):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} branches on {ast.unparse(node)}")
    assert bad == []
