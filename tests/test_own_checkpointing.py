"""A model that checkpoints itself (issue 40.4): transformers' ``activation_checkpointing_enable`` (5.24 on;
``gradient_checkpointing_enable`` before, and its alias since), ``every_n_layers`` and ``offload=True`` are
found and said in one line; ``profile`` warns that its graph already recomputes; the Trainer callback
switches it off by default (memplan plans every activation, "100%" keeps everything), trains bitwise like
the plain Trainer with its checkpointing on, and gives the model back with it on; ``own_checkpointing="keep"``
plans over the checkpointed step."""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers, accelerate) is not installed")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from memplan.api.integrations.common import StepPlanner  # noqa: E402
from memplan.planner.core.errors import MemplanError, MemplanWarning  # noqa: E402
from memplan.planner.probe.checkpointing import checkpointing_off, own_checkpointing  # noqa: E402
from memplan.planner.probe.profiler import profile  # noqa: E402
from memplan.solvers import activation_bytes  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def gpt2(n_layer: int = 2) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                      bos_token_id=0, eos_token_id=0))


def loss_fn(model, batch):
    return model(input_ids=batch, labels=batch).loss


def test_both_method_names_every_n_layers_and_offload_are_found():
    model = gpt2(4)
    assert own_checkpointing(model) is None
    model.activation_checkpointing_enable()
    found = own_checkpointing(model)
    assert (found.layers, found.of, found.offload) == (4, 4, False)
    assert found.switch == "activation_checkpointing_disable"
    assert found.line() == "the model checkpoints every layer itself: profiled so, its step already recomputes them"
    model.activation_checkpointing_disable()
    assert own_checkpointing(model) is None
    model.activation_checkpointing_enable(every_n_layers=2, offload=True)
    found = own_checkpointing(model)
    assert (found.layers, found.of, found.offload) == (2, 4, True)
    assert "2 of its 4 layers" in found.line() and "offload=True" in found.line()
    with checkpointing_off(model) as off:
        assert off == found and own_checkpointing(model) is None and not model.is_activation_checkpointing
    assert own_checkpointing(model) == found  # every flag as it was
    model.activation_checkpointing_disable()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old name, an alias in transformers 5.24
        model.gradient_checkpointing_enable()
    assert own_checkpointing(model).layers == 4


def test_profile_says_its_step_already_recomputes_and_keeps_less():
    batch = torch.randint(0, 64, (2, 32))
    model = gpt2()
    plain = profile(model, batch, loss_fn, warmup=1, repeats=1, progress=False, measure=False)
    model.activation_checkpointing_enable()
    with pytest.warns(MemplanWarning) as caught:
        checkpointed = profile(model, batch, loss_fn, warmup=1, repeats=1, progress=False, measure=False)
    lines = [str(w.message) for w in caught if "checkpoints every layer itself" in str(w.message)]
    assert len(lines) == 1 and "\n" not in lines[0] and "activation_checkpointing_disable()" in lines[0]
    assert checkpointed.meta["own_checkpointing"].startswith("the model checkpoints every layer")
    # "100%" of the checkpointed step is well under keeping every activation
    assert activation_bytes(checkpointed) < 0.8 * activation_bytes(plain)
    assert "own_checkpointing" not in plain.meta


def test_a_bad_choice_is_one_line():
    from memplan.api.cli.graphs import model_checkpointing

    with pytest.raises(MemplanError, match="own_checkpointing must be 'off' .* or 'keep'"):
        StepPlanner("50%", own_checkpointing="on")
    with pytest.raises(MemplanError, match=r"^--own-checkpointing 'maybe': choose off or keep$"):
        model_checkpointing(gpt2(), "maybe")


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def _train(tmp_path, callback=None):
    from memplan.api.integrations.huggingface import MemplanCallback

    model = copy.deepcopy(gpt2())
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, use_cpu=True,
                             report_to=[], logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True,
                             activation_checkpointing=True)  # the Trainer switches it on itself
    cb = MemplanCallback(**callback) if callback is not None else None
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[cb] if cb else [])
    trainer.train()
    return model, trainer.state.log_history, cb


@pytest.mark.slow
def test_the_trainer_callback_plans_every_activation_and_gives_the_checkpointing_back(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="memplan"):
        planned, logs, cb = _train(tmp_path, {"budget": "100%", "time_limit_s": 5.0})
    said = [r.getMessage() for r in caplog.records if "checkpoints every layer itself" in r.getMessage()]
    assert len(said) == 1 and "switched off" in said[0] and "own_checkpointing='keep'" in said[0]
    plain, plain_logs, _ = _train(tmp_path)
    assert [h.get("loss") for h in logs] == [h.get("loss") for h in plain_logs]
    assert all(torch.equal(a, b) for a, b in zip(planned.parameters(), plain.parameters(), strict=True))
    assert planned.is_activation_checkpointing  # given back as it was
    # "100%" under the default keeps every activation: the plan recomputes nothing
    assert cb.plan.count("recompute") == 0 and cb.planner.checkpointing.layers == 2
    kept, _, cb_keep = _train(tmp_path, {"budget": "100%", "time_limit_s": 5.0, "own_checkpointing": "keep"})
    assert activation_bytes(cb_keep.graph) < 0.8 * activation_bytes(cb.graph)  # planned over the checkpointed step
    assert all(torch.equal(a, b) for a, b in zip(kept.parameters(), plain.parameters(), strict=True))


WORKLOAD = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    model.activation_checkpointing_enable()
    batch = torch.randint(0, 64, (2, 32))
    return model, batch, lambda m, b: m(input_ids=b, labels=b).loss
'''


@pytest.mark.slow
def test_the_command_line_switches_it_off_by_default_and_keeps_it_when_asked(tmp_path):
    import json
    import os
    import subprocess
    import sys

    (tmp_path / "ckpt.py").write_text(WORKLOAD)
    env = {k: v for k, v in os.environ.items() if k != "MEMPLAN_DEBUG"}

    def profile_cli(*extra):
        return subprocess.run([sys.executable, "-m", "memplan.api.cli", "profile", "ckpt.py:build", "--repeats", "1",
                               "--json", *extra], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)

    off = profile_cli("-o", "off.json")
    assert off.returncode == 0, off.stderr
    said = [line for line in off.stderr.splitlines() if "checkpoints every layer itself" in line]
    assert len(said) == 1 and "switched off" in said[0] and "--own-checkpointing keep" in said[0]
    keep = profile_cli("-o", "keep.json", "--own-checkpointing", "keep")
    assert keep.returncode == 0, keep.stderr
    assert any("activation_checkpointing_disable()" in line for line in keep.stderr.splitlines())
    # switched off, every activation is the plan's to choose; kept, only the layers' inputs are saved
    assert json.loads(keep.stdout)["saved_activations"] < json.loads(off.stdout)["saved_activations"] / 2
