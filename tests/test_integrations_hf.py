"""Hugging Face ``Trainer`` with ``MemplanCallback``: a small GPT-2 trains a few steps on CPU bitwise like
the same Trainer without the callback (losses, gradient norms, parameters), with gradient accumulation,
``max_grad_norm`` and bf16 mixed precision; the plan actually recomputes; the measured peak of a step under
the plan is the predicted one; a budget below every plan fails in the first forward, before any
parameter changes, with the line ``memplan solve`` prints."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers, accelerate) is not installed")
pytest.importorskip("accelerate", reason="the hf extra (transformers, accelerate) is not installed")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from memplan.api.integrations.huggingface import MemplanCallback  # noqa: E402
from memplan.planner.core.errors import Infeasible, MemplanError  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

#: the solve's time limit (the default is 60 s): the plan is not what these tests are about, the callback,
#: bitwise training and the peaks are
LIMIT_S = 6.0


@functools.cache
def _base() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64, bos_token_id=0,
                        eos_token_id=0)
    return GPT2LMHeadModel(config)


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _train(callback: MemplanCallback | None, tmp_path, **args):
    model = copy.deepcopy(_base())
    targs = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, use_cpu=True,
                              report_to=[], logging_steps=1, save_strategy="no", seed=0,
                              disable_tqdm=True, **args)
    trainer = Trainer(model=model, args=targs, train_dataset=_Tokens(), callbacks=[callback] if callback else [])
    trainer.train()
    return model, trainer.state.log_history


def _same_training(tmp_path, budget: str = "50%", **args) -> tuple[MemplanCallback, list[dict]]:
    callback = MemplanCallback(budget=budget, time_limit_s=LIMIT_S)
    planned, planned_logs = _train(callback, tmp_path, **args)
    plain, plain_logs = _train(None, tmp_path, **args)
    for key in ("loss", "grad_norm"):
        assert [h.get(key) for h in planned_logs] == [h.get(key) for h in plain_logs]
    assert all(torch.equal(a, b) for a, b in zip(planned.parameters(), plain.parameters(), strict=True))
    assert callback.plan.count("recompute") > 0
    assert callback.planner.executor is None  # removed at the end of training
    return callback, planned_logs


def test_trainer_bitwise_with_predicted_and_measured_peak_in_the_logs(tmp_path):
    callback, logs = _same_training(tmp_path)
    predicted = logs[0]["memplan_predicted_peak_bytes"]
    measured = next(h["memplan_measured_peak_bytes"] for h in logs if "memplan_measured_peak_bytes" in h)
    assert predicted <= logs[0]["memplan_budget_bytes"] < logs[0]["memplan_keep_all_peak_bytes"]
    # the allocator agrees with the simulator to within a few scalars
    assert abs(measured - predicted) <= 0.005 * predicted, (measured, predicted)


def test_trainer_with_accumulation_clipping_and_bf16_is_bitwise(tmp_path):
    # 80%: the gradients accumulated over micro-batches take part of the budget
    callback, logs = _same_training(tmp_path, "80%", gradient_accumulation_steps=2, max_grad_norm=1.0, bf16=True)
    measured = callback.measured_peak_bytes
    predicted = callback.summary.predicted_peak_bytes  # the accumulated gradients included
    assert predicted <= callback.summary.budget_bytes
    assert abs(measured - predicted) <= 0.005 * predicted, (measured, predicted)


def test_trainer_with_backward_fusion_trains_bitwise(tmp_path):
    """``fuse="backward"`` steps each module inside backward. The Trainer takes a gradient norm for its logs
    with ``clip_grad_norm_(params, inf)`` after every backward, which clips nothing: memplan's guard against
    clipping after a fused backward lets it pass (it refused every step before)."""
    callback = MemplanCallback(budget="50%", time_limit_s=LIMIT_S, fuse="backward")
    planned, logs = _train(callback, tmp_path, max_grad_norm=0)
    plain, plain_logs = _train(None, tmp_path, max_grad_norm=0)
    assert [h.get("loss") for h in logs] == [h.get("loss") for h in plain_logs]
    assert all(torch.equal(a, b) for a, b in zip(planned.parameters(), plain.parameters(), strict=True))
    assert callback.plan.count("recompute") > 0 and callback.planner.executor is None


def test_a_budget_below_every_plan_stops_training_before_any_update(tmp_path):
    model = copy.deepcopy(_base())
    before = [p.detach().clone() for p in model.parameters()]
    targs = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, use_cpu=True,
                              report_to=[], save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=targs, train_dataset=_Tokens(), callbacks=[MemplanCallback(budget="1MiB")])
    with pytest.raises(Infeasible) as err:
        trainer.train()
    assert str(err.value).startswith("no plan fits budget 1.00 MiB (1048576 B) for graph 'GPT2LMHeadModel'; "
                                     "the minimum feasible budget memplan knows is ")
    assert err.value.min_feasible_bytes > 2**20
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_bad_options_fail_at_construction():
    with pytest.raises(MemplanError, match="cannot read size '12 apples'"):
        MemplanCallback(budget="12 apples")
    with pytest.raises(MemplanError, match="fuse=None or 'backward'"):
        MemplanCallback(fuse="forward")


class _Ragged(torch.utils.data.Dataset):
    """Token sequences of random lengths 4..32: the collator pads each batch to its longest."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        n = int(torch.randint(4, 33, (1,), generator=g))
        return {"input_ids": torch.randint(1, 256, (n,), generator=g)}


def _pad_to_longest(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        ids[i, :len(f["input_ids"])] = f["input_ids"]
        mask[i, :len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_trainer_with_dynamic_padding_runs_every_length_under_one_plan(tmp_path):
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64, bos_token_id=0,
                        eos_token_id=0)
    config._attn_implementation = "eager"  # sdpa skips the mask for unpadded batches: another op sequence
    base = GPT2LMHeadModel(config)
    lengths: list[int] = []

    def train(callback):
        model = copy.deepcopy(base)
        model.register_forward_pre_hook(lambda m, a, kw: lengths.append(kw["input_ids"].shape[1]) if m.training
                                        and torch.is_grad_enabled() else None, with_kwargs=True)
        targs = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=5,
                                  use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", seed=0,
                                  disable_tqdm=True)
        trainer = Trainer(model=model, args=targs, train_dataset=_Ragged(), data_collator=_pad_to_longest,
                          callbacks=[callback] if callback else [])
        trainer.train()
        return model, trainer.state.log_history

    callback = MemplanCallback(budget="50%", max_seq_len=32, time_limit_s=LIMIT_S)
    planned, planned_logs = train(callback)
    plain, plain_logs = train(None)
    assert len(set(lengths)) > 2  # the lengths really varied (the profile's own calls included)
    assert [h.get("loss") for h in planned_logs] == [h.get("loss") for h in plain_logs]
    assert all(torch.equal(a, b) for a, b in zip(planned.parameters(), plain.parameters(), strict=True))
    assert callback.graph.meta["shape_family"]["limit"] == {"seq": 32} and callback.plan.count("recompute") > 0
    assert callback.measured_peak_bytes <= callback.summary.predicted_peak_bytes


class _Stop(Exception):
    pass


def _hook_counts(model: torch.nn.Module) -> list[tuple[int, int]]:
    return [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]


@pytest.mark.parametrize("late", [False, True], ids=["given-at-init", "added-later"])
def test_an_exception_out_of_train_leaves_the_model_plain(tmp_path, late):
    # the second step's forward (the first to start under the plan) raises: train() must give the model
    # and optimizer back without the plan's hooks, as on_train_end does after a normal end
    model = copy.deepcopy(_base())
    callback = MemplanCallback(budget="50%", time_limit_s=LIMIT_S)

    def fail_under_the_plan(module, args, kwargs):
        if callback.planner.executor is not None and module.training and torch.is_grad_enabled():
            raise _Stop("the user's model fails in step 2")

    model.register_forward_pre_hook(fail_under_the_plan, with_kwargs=True)
    plain_hooks = _hook_counts(model)
    targs = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, use_cpu=True,
                              report_to=[], save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=targs, train_dataset=_Tokens(), callbacks=[] if late else [callback])
    if late:
        trainer.add_callback(callback)
    with pytest.raises(_Stop):
        trainer.train()
    assert callback.plan is not None and callback.plan.count("recompute") > 0  # it was planned and applied
    assert callback.planner.executor is None
    assert _hook_counts(model) == plain_hooks
    optimizer = trainer.optimizer.optimizer  # accelerate's wrapper around the torch optimizer
    assert "step" not in optimizer.__dict__ or "Executor" not in optimizer.step.__qualname__
