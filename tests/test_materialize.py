"""A model planned on the meta device is built for real (issue #21.3): :func:`materialize` allocates its
tensors in place (the same objects: ties and optimizers hold), initialises them with the model's own code
(each module's ``reset_parameters``; transformers' ``init_weights``), refuses what nothing initialised, and
``memplan run --fake`` trains a meta-device workload instead of crashing on ``Cannot copy out of meta
tensor``."""

import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from memplan.api.cli import app
from memplan.planner.core.errors import MemplanError
from memplan.planner.probe.materialize import materialize


def _plain():
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4), nn.BatchNorm1d(4))


def test_reset_parameters_initialise_as_the_constructor_does():
    torch.manual_seed(0)
    real = _plain()
    with torch.device("meta"):
        model = _plain()
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(0)
    assert materialize(model, "cpu") is model
    # the same draws in the same order: the values a real build gives, on the same Parameter objects
    assert all(torch.equal(a, b) for a, b in zip(real.state_dict().values(), model.state_dict().values(), strict=True))
    assert list(model.parameters()) == params and opt.param_groups[0]["params"] == params
    assert all(p.device.type == "cpu" for p in params)


class Scaled(nn.Module):
    """A parameter of its own and no reset_parameters: nothing can initialise ``scale`` but the caller."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        return self.lin(x) * self.scale


def test_what_nothing_initialises_is_refused_by_name_and_init_does_it():
    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(MemplanError, match=r"^materialize: scale, steps came from the meta device and the "
                                           r"modules' reset_parameters\(\) did not initialise them; pass init="):
        materialize(model, "cpu")

    def init(m):
        m.lin.reset_parameters()
        nn.init.ones_(m.scale)
        m.steps.zero_()

    with torch.device("meta"):
        model = Scaled()
    materialize(model, "cpu", init=init)
    assert torch.equal(model.scale, torch.ones(4)) and model.steps.item() == 0


def test_tensors_that_have_values_keep_them():
    model = Scaled()
    with torch.no_grad():
        model.scale.fill_(3.0)
    with torch.device("meta"):
        model.lin = nn.Linear(4, 4)
    materialize(model, "cpu")
    assert torch.equal(model.scale, torch.full((4,), 3.0)) and not model.lin.weight.isnan().any()
    with pytest.raises(MemplanError, match="target device is the meta device"):
        materialize(model, "meta")


def test_a_transformers_model_gets_its_own_init_and_ties():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      tie_word_embeddings=True)
    real = transformers.LlamaForCausalLM(config)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    materialize(model, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    # buffers computed in constructors (rotary frequencies) are recomputed by _init_weights
    assert all(torch.equal(a, b) for a, b in zip(real.buffers(), model.buffers(), strict=True))
    assert torch.equal(model.model.norm.weight, torch.ones(32))
    std = model.model.layers[0].mlp.up_proj.weight.std().item()
    assert abs(std - config.initializer_range) < 0.2 * config.initializer_range


META_WORKLOAD = '''
import torch
from torch import nn


def build(width: int = 64, depth: int = 6, batch_size: int = 512):
    with torch.device("meta"):
        model = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())],
                              nn.Linear(width, 10))
    batch = (torch.randn(batch_size, width), torch.randint(0, 10, (batch_size,)))
    return model, batch, lambda model, b: nn.functional.cross_entropy(model(b[0]), b[1])
'''


@pytest.mark.slow
def test_memplan_run_fake_trains_a_model_built_on_the_meta_device(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))
    (tmp_path / "meta_mlp.py").write_text(META_WORKLOAD)
    r = CliRunner().invoke(app, ["run", f"{tmp_path / 'meta_mlp.py'}:build", "--fake", "--budget", "60%",
                                 "--steps", "1", "--time-limit", "3", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["replays_per_step"] > 0  # the plan recomputes: the budget is below keeping everything
    assert all(loss == loss and loss < 10 for loss in doc["losses"])  # finite: the model was initialised
    assert doc["measured_peak_bytes"] <= doc["budget_bytes"]
