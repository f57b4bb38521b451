"""What eager training pays per ATen call beyond the call itself, for fake profiles' isolated op times.

An isolated call (:mod:`memplan.planner.probe.optime`) runs alone in a loop: its code and the
dispatcher's path are hot and no autograd graph is recorded. In a training step each call also pays the
autograd layer (recording a node in forward, saving its inputs, setting its outputs' ``grad_fn``; the
engine's scheduling of each node in backward) and runs among other ops' code. For large kernels this is
noise; for tiny ones it is most of their time (a GRU cell unrolled 64 steps: 1,349 forward calls).

:func:`eager_overhead_s` measures it on the device, once per device and torch version (cached as JSON
beside the op-time cache, and per process): a small recurrent model of tiny tensors (a ``GRUCell`` of
width 8 unrolled 32 steps, a ``Linear``-``LayerNorm``-``GELU`` head) is trained eagerly and its forward
and backward timed with the device's clock; the same step's ATen calls are timed alone by the given
warm timer; the difference, per call, is the figure (never below zero). Medians over repeats, so a burst
of load on a shared machine moves it little. It runs with one torch thread whatever the caller's (the
per-call work is single-threaded; with two threads on a busy 2-core machine OpenMP's barriers made each
tiny call of the probe take milliseconds).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.planner.probe.device import device_of
from memplan.planner.probe.optime import OpCall, OpTimer, device_identity, record_call

_STEPS, _REPEATS, _TIMED = 32, 3, 10  # cell steps; eager medians taken (their median is used); steps each
_MEASURED: dict[str, tuple[float, float]] = {}  # identity -> (forward, backward): measured once per process


class _Recorder(TorchDispatchMode):
    """Records each ATen call of the block as (phase, OpCall); runs it as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.calls: list[tuple[str, OpCall]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((self.phase, record_call(func, args, kwargs, out)))
        return out


def _tiny_step(device: torch.device) -> Callable[[], torch.Tensor]:
    """The forward of the probe model: many tiny calls, as in an unrolled recurrent cell."""
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cell = nn.GRUCell(8, 8).to(device)
        head = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 1)).to(device)
    x = torch.randn(_STEPS, 4, 8, generator=gen).to(device)

    def forward() -> torch.Tensor:
        h = torch.zeros(4, 8, device=device)
        for t in range(_STEPS):
            h = cell(x[t], h)
        return head(h).square().mean()

    return forward


def measure_eager_overhead_s(device: torch.device,
                             time_calls: Callable[[list[OpCall]], list[float]]) -> tuple[float, float]:
    """``(forward, backward)`` seconds per ATen call that eager training pays beyond the call alone on
    ``device``, ``time_calls`` timing calls alone (a warm :class:`OpTimer`'s times). Measured now."""
    layer = device_of(device)
    forward = _tiny_step(layer.torch_device)
    for _ in range(3):  # warm-up: kernels chosen, allocator blocks cached
        forward().backward()
    recorder = _Recorder()
    with recorder:
        loss = forward()
    recorder.phase = "backward"
    with recorder:
        loss.backward()
    calls = [c for _, c in recorder.calls]
    n_forward = sum(1 for phase, _ in recorder.calls if phase == "forward")
    n_backward = len(calls) - n_forward
    clock = layer.clock()
    alone = time_calls(calls)  # each a median over the timer's sweeps
    alone_f = sum(t for (phase, _), t in zip(recorder.calls, alone, strict=True) if phase == "forward")
    per_forward, per_backward = [], []
    for _ in range(_REPEATS):
        f, b = [], []
        for _ in range(_TIMED):
            layer.synchronize()
            start = clock()
            loss = forward()
            layer.synchronize()
            mid = clock()
            loss.backward()
            layer.synchronize()
            f.append(mid - start)
            b.append(clock() - mid)
        per_forward.append((statistics.median(f) - alone_f) / n_forward)
        per_backward.append((statistics.median(b) - (sum(alone) - alone_f)) / max(n_backward, 1))
    return max(0.0, statistics.median(per_forward)), max(0.0, statistics.median(per_backward))


def eager_overhead_s(device: torch.device, cache_dir: str | Path,
                     time_calls: Callable[[list[OpCall]], list[float]], timing: str = "") -> tuple[float, float]:
    """:func:`measure_eager_overhead_s`, measured once per device identity (device model, threads, torch
    version) and ``timing`` (how ``time_calls`` times: the charge is the gap to *its* figures), cached in
    ``cache_dir`` as ``eager-<hash>.json`` and for this process."""
    import hashlib

    identity = f"{device_identity(torch.device(device))}|{timing}"
    if identity in _MEASURED:
        return _MEASURED[identity]
    path = Path(cache_dir) / f"eager-{hashlib.sha256(identity.encode()).hexdigest()[:16]}.json"
    with contextlib.suppress(Exception):  # a missing or damaged file is measured again
        data: Any = json.loads(path.read_text())
        _MEASURED[identity] = (float(data["forward_s"]), float(data["backward_s"]))
        return _MEASURED[identity]
    threads = torch.get_num_threads()
    try:  # the per-call work is single-threaded; two threads' barriers on a busy machine drown it
        torch.set_num_threads(1)
        forward_s, backward_s = measure_eager_overhead_s(device, time_calls)
    finally:
        torch.set_num_threads(threads)
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"forward_s": forward_s, "backward_s": backward_s, "measured_on": identity}))
    tmp.replace(path)
    _MEASURED[identity] = (forward_s, backward_s)
    return forward_s, backward_s


def eager_charge_s(timer: OpTimer) -> tuple[float, float]:
    """``(forward, backward)`` seconds a fake profile timed by ``timer`` adds to each forward and backward
    call of its step: :func:`eager_overhead_s` against calls timed as ``timer`` times them (warm, its
    runs and sweeps). ``(0, 0)`` for an analytic timer (a spec's ``op_overhead_s`` is its per-call
    charge) and for one made with ``eager=False``."""
    if timer.spec is not None or not timer.eager:
        return 0.0, 0.0

    def alone(calls: list[OpCall]) -> list[float]:
        with tempfile.TemporaryDirectory() as scratch:  # fresh figures, none kept
            timed = OpTimer(timer.device, cache_dir=scratch, min_runs=timer.min_runs, target_s=timer.target_s,
                            cold=False, sweeps=timer.sweeps)
            return [t.time_s for t in timed.time(calls)]

    timing = f"runs={timer.min_runs},{timer.target_s},sweeps={timer.sweeps}|laps=queued"  # as the timer times
    return eager_overhead_s(timer.device, timer.cache_dir, alone, timing)
