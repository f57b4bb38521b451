"""What the profiler records of the model states a plan may place (planner/core/states.py): per unit of the
optimizer's parameters, as optimizer fusion buckets them (a module's own parameters that the optimizer steps,
:func:`memplan.planner.probe.fusion.buckets`), its parameters' and its optimizer state's device bytes."""

from __future__ import annotations

import contextlib
import inspect
import time

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._python_dispatch import _disable_current_modes

from memplan.planner.core.graph import StateUnit
from memplan.planner.probe.fusion import bucket_modules, buckets
from memplan.planner.probe.storage import tensors_in, unique_bytes


def unit_state_tensors(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[tuple[nn.Parameter, str]]:
    """The optimizer state entries of ``params`` that live on their parameter's device (a GPU's Adam keeps its
    step counters on the host already), as (parameter, key)."""
    out = []
    for p in params:
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.device == p.device:
                out.append((p, key))
    return out


def state_units(model: nn.Module, optimizer: torch.optim.Optimizer, charge_as: str) -> list[StateUnit]:
    """One :class:`StateUnit` per bucket, after a step has created the optimizer's state; storages charged as
    ``charge_as``'s allocator charges them, each counted once (a storage shared by two units: the first)."""
    groups, _, module_buckets = buckets(model, optimizer)
    names = bucket_modules(model, module_buckets, len(groups))
    seen_params: set[int] = set()
    seen_state: set[int] = set()
    units = []
    for name, params in zip(names, groups, strict=True):
        entries = unit_state_tensors(optimizer, params)
        state = [t for p, k in entries for t in tensors_in(optimizer.state[p][k])]
        units.append(StateUnit(module=name, params=len(params),
                               param_bytes=unique_bytes(list(params), seen_params, charge_as),
                               state_bytes=unique_bytes(state, seen_state, charge_as),
                               state_tensors=len(entries)))
    return units


HOST_SAMPLE_NUMEL = 1 << 21  # at most, the parameters the host's optimizer rate is timed on (8 MiB in float32)
HOST_SAMPLE_MIN_NUMEL = 1 << 14  # at least (a call's fixed cost would dominate below)
HOST_SAMPLE_STEPS = 5


def host_optimizer_rate(optimizer: torch.optim.Optimizer, dtype: torch.dtype | None = None
                        ) -> tuple[float, float] | None:
    """What this host's CPU takes to step with ``optimizer``'s class and its first group's hyper-parameters
    (what a host-stepped unit runs: the same optimizer on CPU tensors): ``(parameter bytes per second, seconds
    per call)``, a line through two timings, on a parameter of ``dtype`` (the optimizer's first parameter's by
    default) of :data:`HOST_SAMPLE_MIN_NUMEL` and of the model's largest parameter's size (at most
    :data:`HOST_SAMPLE_NUMEL`: a small model's updates run in the cache, a large one's fault fresh pages for
    their temporaries), each the least of :data:`HOST_SAMPLE_STEPS` steps after one that creates the state (a
    machine's other load aside).
    The optimizers memplan plans work per parameter element, so the time is a call's fixed cost plus the
    bytes at the rate. None where that optimizer cannot be built on a CPU tensor (its constructor wants more
    than a group's options, or a GPU)."""
    groups = optimizer.param_groups
    if not groups or not groups[0]["params"]:
        return None
    dtype = dtype or groups[0]["params"][0].dtype
    try:
        accepted = inspect.signature(type(optimizer).__init__).parameters
    except (TypeError, ValueError):
        return None
    # the group's options the constructor takes (a group also carries derived keys: AdamW's
    # decoupled_weight_decay, a scheduler's initial_lr)
    options = {k: v for k, v in groups[0].items() if k in accepted and k != "params"}
    largest = max(p.numel() for g in groups for p in g["params"])
    sizes = [HOST_SAMPLE_MIN_NUMEL, min(max(largest, 4 * HOST_SAMPLE_MIN_NUMEL), HOST_SAMPLE_NUMEL)]
    points = []
    try:
        with _plain_tensors(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            for n in sizes:
                p = torch.nn.Parameter(torch.randn(n, dtype=dtype))
                p.grad = torch.randn_like(p)
                opt = type(optimizer)([p], **options)
                opt.step()
                times = []
                for _ in range(HOST_SAMPLE_STEPS):
                    start = time.perf_counter()
                    opt.step()
                    times.append(time.perf_counter() - start)
                points.append((n * p.element_size(), min(times)))  # the least: others' load aside
    except Exception:  # noqa: BLE001 -- any optimizer that cannot run here: not measured, said in the graph
        return None
    (b0, t0), (b1, t1) = points
    per_byte = (t1 - t0) / (b1 - b0) if t1 > t0 else t1 / b1  # noisy timings: all of it per byte
    call = max(0.0, t0 - per_byte * b0)
    return (1.0 / per_byte, call) if per_byte > 0 else None


def _plain_tensors() -> contextlib.AbstractContextManager:
    """Real CPU tensors inside a fake profile: no fake mode, no dispatch mode (the profile's own)."""
    stack = contextlib.ExitStack()
    stack.enter_context(unset_fake_temporarily())
    stack.enter_context(_disable_current_modes())
    return stack
