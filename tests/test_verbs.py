"""The verbs where a user looks (issue #21.6): ``import memplan.api as memplan`` gives ``profile``,
``solve``, ``simulate``, ``apply``, ``run_plan``, ``maxbatch`` (and ``profile_family``, ``materialize``),
each the very function of its deep path with its signature; importing ``memplan.api`` loads no torch (the
CLI and service stay fast); and the README's Python section runs as written."""

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import memplan.api as memplan
from memplan.executor.apply import apply
from memplan.executor.session import run_plan
from memplan.planner.core.simulator import simulate
from memplan.planner.probe.family import profile_family
from memplan.planner.probe.materialize import materialize
from memplan.planner.probe.profiler import profile
from memplan.solvers import solve
from memplan.solvers.maxbatch import max_dim

README = Path(__file__).resolve().parent.parent / "README.md"

DEEP = {"profile": profile, "solve": solve, "simulate": simulate, "apply": apply, "run_plan": run_plan,
        "maxbatch": max_dim, "profile_family": profile_family, "materialize": materialize}
# the leading parameters a caller passes by position
LEADING = {"profile": ["model", "example_batch", "loss_fn"], "solve": ["graph", "budget_bytes", "method"],
           "simulate": ["graph", "plan"], "apply": ["model", "plan"],
           "run_plan": ["model", "batch", "loss_fn", "optimizer", "plan", "graph"],
           "maxbatch": ["graph", "budget_bytes"], "profile_family": ["model", "batches", "loss_fn"],
           "materialize": ["model", "device"]}


@pytest.mark.parametrize("name", sorted(DEEP))
def test_each_verb_is_its_deep_function_with_its_signature(name):
    verb = getattr(memplan, name)
    assert verb is DEEP[name] and callable(verb)
    params = [p.name for p in inspect.signature(verb).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert params[: len(LEADING[name])] == LEADING[name]
    assert name in memplan.__all__ and name in dir(memplan)


def test_an_unknown_verb_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'optimise'"):
        memplan.optimise  # noqa: B018


def test_importing_the_verbs_loads_no_torch():
    code = "import sys, memplan.api, memplan.api.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _readme_python_section() -> str:
    text = README.read_text()
    section = text[text.index("## Use from Python"):text.index("### Shapes that vary")]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_python_section_runs_as_written(tmp_path, monkeypatch):
    code = _readme_python_section()
    assert code.startswith("import memplan.api as memplan")
    monkeypatch.chdir(tmp_path)  # it writes plan.json
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    batch = (torch.randn(32, 16), torch.randint(0, 4, (32,)))

    def loss_fn(m, b):
        return nn.functional.cross_entropy(m(b[0]), b[1])

    opt = torch.optim.AdamW(model.parameters())
    scope = {"model": model, "batch": batch, "loss_fn": loss_fn, "opt": opt, "data": [batch, batch]}
    exec(compile(code, "README.md", "exec"), scope)
    assert (tmp_path / "plan.json").is_file()
    assert len(scope["report"].losses) == 1 + 1 + 5  # warm-up, memory step, timed steps: it trained
