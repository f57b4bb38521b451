"""Workload specs: every built-in builds and gives a scalar loss; bad specs fail with one clear line."""

import pytest
import torch

from memplan.planner.core.errors import MemplanError, WorkloadError
from memplan.planner.workloads import BUILTINS, SIZES, compute_loss, load_workload


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_gives_a_scalar_loss(name):
    w = load_workload(name)
    assert w.name == name and isinstance(w.model, torch.nn.Module)
    loss = compute_loss(w.model, w.batch, w.loss_fn)
    assert loss.shape == () and loss.requires_grad and torch.isfinite(loss)


def test_builtins_are_reproducible():
    a, b = load_workload("mlp", depth=2), load_workload("mlp", depth=2)
    assert torch.equal(a.model[0].weight, b.model[0].weight) and torch.equal(a.batch[0], b.batch[0])


def test_overrides_reach_the_builder():
    w = load_workload("gpt2", n_layer=2, seq_len=16, batch_size=1)
    assert w.model.config.n_layer == 2 and w.batch["input_ids"].shape == (1, 16)
    assert len(load_workload("mlp", depth=3).model) == 6


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(WorkloadError, match=r"unknown workload 'gpt3': expected one of mlp, resnet, gpt2, unet, bert"):
        load_workload("gpt3")


def test_unknown_override_and_size():
    with pytest.raises(WorkloadError, match=r"workload 'mlp' has no option layers; it takes depth, width, "
                                            r"batch_size, seed, size"):
        load_workload("mlp", layers=3)
    with pytest.raises(WorkloadError, match=r"workload 'gpt2' has no size 'xl'; sizes: small, base"):
        load_workload("gpt2", size="xl")


@pytest.mark.parametrize(("name", "size"), [(n, s) for n, sizes in SIZES.items() for s in sizes])
def test_size_presets_build(name, size):
    # every preset names only options its builder takes (building the large models is skipped: slow)
    import inspect
    assert set(SIZES[name][size]) <= set(inspect.signature(BUILTINS[name]).parameters)


def test_file_spec(tmp_path):
    f = tmp_path / "wl.py"
    f.write_text(
        "import torch\n"
        "def make(width=4):\n"
        "    m = torch.nn.Linear(width, 1)\n"
        "    return m, torch.randn(2, width), lambda model, x: model(x).sum()\n"
        "def bad_tuple():\n"
        "    return 1, 2\n"
        "def bad_model():\n"
        "    return 'model', torch.randn(2), lambda m, x: x\n"
        "VALUE = 3\n")
    w = load_workload(f"{f}:make", width=6)
    assert w.name == "wl:make" and w.model.in_features == 6
    assert compute_loss(w.model, w.batch, w.loss_fn).shape == ()
    with pytest.raises(WorkloadError, match=r"must return \(model, example_batch, loss_fn\), got tuple"):
        load_workload(f"{f}:bad_tuple")
    with pytest.raises(WorkloadError, match="returned a str as the model; expected a torch.nn.Module"):
        load_workload(f"{f}:bad_model")
    with pytest.raises(WorkloadError, match=r"has no function 'missing'"):
        load_workload(f"{f}:missing")
    with pytest.raises(WorkloadError, match=r"has no function 'VALUE'"):
        load_workload(f"{f}:VALUE")


def test_missing_file_and_broken_file(tmp_path):
    with pytest.raises(WorkloadError, match=r"workload file .*nope.py not found"):
        load_workload(str(tmp_path / "nope.py") + ":make")
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('no such dependency')\n")
    with pytest.raises(WorkloadError, match="importing workload file .* failed: ImportError: no such dependency"):
        load_workload(f"{broken}:make")


def test_loss_must_be_a_scalar_that_requires_grad():
    w = load_workload("mlp", depth=1)
    with pytest.raises(WorkloadError, match="got a tensor of shape \\[1024, 256\\]"):
        compute_loss(w.model, w.batch, lambda m, b: m(b[0]))
    with pytest.raises(WorkloadError, match="got a float"):
        compute_loss(w.model, w.batch, lambda m, b: 1.0)
    with pytest.raises(WorkloadError, match="that does not require grad"):
        compute_loss(w.model, w.batch, lambda m, b: m(b[0]).sum().detach())


# ---- whose bug: the user's (one line, exit 2) or memplan's (propagates as it is) ------------------------------
def _user_shape_bug(model, batch):
    return model(batch[0][:, :3]).sum()  # the model's first Linear takes 16 features


def _user_raises(model, batch):
    raise ValueError("my loss is broken")


def test_a_user_bug_in_loss_fn_is_one_line_naming_the_loss_fn_and_the_exception():
    """Raised by the user's code, or by an op of the user's model: directly, and through the profiler's
    dispatch mode (memplan's frames are then on the stack, between the op and the user's code)."""
    from memplan.planner.probe.profiler import profile

    w = load_workload("mlp", depth=2, width=16, batch_size=8)
    line = _user_shape_bug.__code__.co_firstlineno
    for run in (lambda fn: compute_loss(w.model, w.batch, fn),
                lambda fn: profile(w.model, w.batch, fn, repeats=1, progress=False)):
        with pytest.raises(WorkloadError) as e:
            run(_user_shape_bug)
        assert str(e.value).startswith("loss_fn(model, batch) raised RuntimeError: mat1 and mat2 shapes cannot be "
                                       "multiplied")
        assert str(e.value).endswith(f"(loss_fn is _user_shape_bug, test_workloads.py:{line})")
        assert "\n" not in str(e.value)
        with pytest.raises(WorkloadError, match=r"raised ValueError: my loss is broken \(loss_fn is _user_raises, "):
            run(_user_raises)


def test_a_bug_of_memplans_inside_the_step_is_not_disguised_as_the_users(monkeypatch):
    """The profiler's dispatch mode failing at a statement of its own (here a lookup of a missing key,
    compiled at the tracing mode's file as a bug there would be) propagates as it is: not a WorkloadError."""
    from memplan.planner.probe import profiler, tracing
    from memplan.planner.workloads import raised_by_memplan

    w = load_workload("mlp", depth=2, width=16, batch_size=8)
    scope: dict = {}
    exec(compile("def _forward(self, func, args, kwargs):\n    return self.by_op_name['aten.addmm']\n",
                 tracing.__file__, "exec"), scope)
    monkeypatch.setattr(tracing.Tracer, "by_op_name", {}, raising=False)
    monkeypatch.setattr(tracing.Tracer, "_forward", scope["_forward"])
    with pytest.raises(KeyError, match="aten.addmm") as e:
        profiler.profile(w.model, w.batch, w.loss_fn, repeats=1, progress=False)
    assert raised_by_memplan(e.value)
    # the CLI's mapping: a MemplanError is the user's to fix (exit 2); this one is a bug (exit 1)
    assert not isinstance(e.value, MemplanError)
