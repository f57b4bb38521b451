"""The eager per-call charge of fake profiles (planner/probe/eager.py): what eager training pays per ATen
call beyond the call timed alone is measured once per device and timing method (cached on disk and per
process), and a fake profile adds it to every forward and backward call of its step, not to the
optimizer's. A tiny MLP and the probe's own tiny GRU: about a second in all."""

import pytest
import torch
from torch import nn

from memplan.planner.probe import eager, profiler
from memplan.planner.probe.optime import OpTimer
from memplan.planner.probe.profiler import profile

CPU = torch.device("cpu")


def test_the_charge_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(eager, "_MEASURED", {})
    asked = []

    def alone(calls):  # every call free when alone: the whole eager time is the charge
        asked.append(len(calls))
        return [0.0] * len(calls)

    forward_s, backward_s = eager.eager_overhead_s(CPU, tmp_path, alone, "test")
    assert len(asked) == 1 and asked[0] > 100  # the probe's calls, timed once
    assert forward_s > 0 and backward_s > 0
    assert list(tmp_path.glob("eager-*.json"))
    assert eager.eager_overhead_s(CPU, tmp_path, alone, "test") == (forward_s, backward_s)  # this process
    monkeypatch.setattr(eager, "_MEASURED", {})
    assert eager.eager_overhead_s(CPU, tmp_path, alone, "test") == (forward_s, backward_s)  # the file
    assert len(asked) == 1
    monkeypatch.setattr(eager, "_MEASURED", {})
    eager.eager_overhead_s(CPU, tmp_path, alone, "other timing")  # another timing method: measured again
    assert len(asked) == 2


def test_a_fake_profile_charges_every_forward_and_backward_call(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    batch = torch.randn(8, 16)
    # the step's fresh pages (planner/probe/hostheap.py) vary between two profiles: not charged here
    monkeypatch.setattr(profiler, "_shadow", lambda *_: (None, "not charged in this test"))

    def fake(charge):
        timer = OpTimer(CPU, cache_dir=tmp_path, min_runs=1, target_s=0.0)  # one cache: the same isolated times
        monkeypatch.setattr(profiler, "eager_charge_s", lambda t: charge if t is timer else None)
        return profile(model, batch, lambda m, x: m(x).sum(), device="cpu", progress=False, fake=True,
                       timer=timer)

    plain, charged = fake((0.0, 0.0)), fake((1e-3, 2e-3))
    assert charged.meta["op_timing"]["eager_forward_s"] == 1e-3
    for a, b in zip(plain.ops, charged.ops, strict=True):
        assert b.time_s - a.time_s == pytest.approx(1e-3)  # one forward call per op
    backward_calls = (sum(op.backward_time_s for op in charged.ops) - sum(op.backward_time_s for op in plain.ops)) / 2e-3
    assert backward_calls == pytest.approx(round(backward_calls)) and round(backward_calls) >= len(plain.ops) // 2
    assert charged.optimizer_time_s == pytest.approx(plain.optimizer_time_s)  # optimizer calls: no charge


def test_on_cuda_the_charge_overlaps_the_calls_own_time(tmp_path, monkeypatch):
    """The charge is host work: on CUDA the host does it while the device runs earlier kernels, so a call
    costs the larger of the two, not their sum (emulated GPU; a charge far above every call's own time)."""
    from memplan.planner.probe.device import emulate_cuda

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    batch = torch.randn(8, 16)
    with emulate_cuda():
        timer = OpTimer(torch.device("cuda"), cache_dir=tmp_path, min_runs=1, target_s=0.0)
        monkeypatch.setattr(profiler, "eager_charge_s", lambda t: (1.0, 2.0))
        g = profile(model, batch, lambda m, x: m(x).sum(), device="cuda", progress=False, fake=True,
                    timer=timer)
    assert g.device == "cuda"
    assert [op.time_s for op in g.ops] == [1.0] * len(g.ops)  # max(call, 1 s), not 1 s + the call
    assert all(op.backward_time_s % 2.0 == 0.0 for op in g.ops)  # 2 s per backward call, nothing more


def test_an_analytic_or_plain_timer_charges_nothing(tmp_path):
    from memplan.planner.core.devicespec import load_device_spec

    analytic = OpTimer(torch.device("cuda"), spec=load_device_spec("h100-80gb"), cache_dir=tmp_path)
    assert eager.eager_charge_s(analytic) == (0.0, 0.0)
    assert eager.eager_charge_s(OpTimer(CPU, cache_dir=tmp_path, eager=False)) == (0.0, 0.0)
    assert not list(tmp_path.glob("eager-*.json"))  # nothing measured
