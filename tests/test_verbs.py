"""The verbs where a user looks (issue #21.6): ``import memplan.api as memplan`` gives ``profile``,
``solve``, ``simulate``, ``apply``, ``run_plan``, ``maxbatch`` (and ``profile_family``, ``materialize``),
each the very function of its deep path with its signature; importing ``memplan.api`` loads no torch (the
CLI and service stay fast); the README's Python example and docs/python.md's run as written (issue 40.5: the
reference moved to docs/), and every ``memplan`` command and option the README and docs/ write exists."""

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

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

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


def _python_block(path: Path, heading: str, end: str | None = None) -> str:
    """The first ``python`` block after ``heading`` in ``path`` (before ``end`` when given)."""
    text = path.read_text()
    section = text[text.index(heading):text.index(end) if end else None]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _scope():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    batch = (torch.randn(32, 16), torch.randint(0, 4, (32,)))

    def loss_fn(m, b):
        return nn.functional.cross_entropy(m(b[0]), b[1])

    opt = torch.optim.AdamW(model.parameters())
    return {"model": model, "batch": batch, "loss_fn": loss_fn, "opt": opt, "data": [batch, batch]}


def test_the_python_section_of_docs_runs_as_written(tmp_path, monkeypatch):
    code = _python_block(ROOT / "docs" / "python.md", "## Use from Python", "## Shapes that vary")
    assert code.startswith("import memplan.api as memplan")
    monkeypatch.chdir(tmp_path)  # it writes plan.json
    scope = _scope()
    exec(compile(code, "docs/python.md", "exec"), scope)
    assert (tmp_path / "plan.json").is_file()
    assert len(scope["report"].losses) == 1 + 1 + 5  # warm-up, memory step, timed steps: it trained


def test_the_readme_training_script_example_runs_as_written(tmp_path, monkeypatch):
    code = _python_block(README, "**Inside your training script")
    monkeypatch.chdir(tmp_path)  # it writes plan.json and graph.json
    scope = _scope()
    before = [p.detach().clone() for p in scope["model"].parameters()]
    exec(compile(code, "README.md", "exec"), scope)
    assert (tmp_path / "plan.json").is_file() and (tmp_path / "graph.json").is_file()
    assert scope["plan"].budget_bytes == 4 * 2**30
    assert any(not torch.equal(a, b) for a, b in zip(before, scope["model"].parameters(), strict=True))  # trained


def _memplan_lines(path: Path) -> list[str]:
    """Command lines starting with ``memplan`` in the bash blocks of ``path`` (comments dropped)."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
        for line in block.splitlines():
            line = line.split(" #")[0].strip().removeprefix(".venv/bin/")
            if line.startswith("memplan "):
                lines.append(line.rstrip("&").strip())
    return lines


def test_every_command_and_option_the_docs_write_exists():
    from typer.main import get_command

    from memplan.api.cli import app

    cli = get_command(app)
    checked = 0
    for path in [README, *DOCS]:
        for line in _memplan_lines(path):
            words = line.split()
            command = cli.commands.get(words[1])
            assert command is not None, f"{path.name}: `{line}`: no command {words[1]!r}"
            names = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)}
            for word in words[2:]:
                if word.startswith("-") and not word[1:2].isdigit():
                    assert word.split("=")[0] in names, f"{path.name}: `{line}`: {words[1]} has no option {word}"
            checked += 1
    assert checked >= 30  # the reference's examples, not a handful
