"""The profiler: runs real training steps of a model and records them as a :class:`Graph`.

:func:`profile` orchestrates; the work is in the layers below it. Each step is
:func:`memplan.planner.workloads.training_step`; :func:`memplan.planner.probe.tracing.traced_step` runs it
under the tracing mode and returns a :class:`memplan.planner.core.build.Trace` (plain records);
:func:`memplan.planner.core.build.build_graph` (torch-free) makes the graph of it;
:mod:`memplan.planner.probe.measure` measures the plain step's peak and phase times;
:mod:`memplan.planner.probe.storage` says how a tensor's storage is seen.

What it observes, and how (torch >= 2.4):

* **Ops.** A ``TorchDispatchMode`` sees every ATen operator below autograd, in execution order, forward
  and backward. Composite ops (``linear``) appear as their parts (``t``, ``addmm``); a kernel's own calls
  do not appear (the mode is off while its handler runs).
* **Storages.** A tensor is identified by its storage (``untyped_storage()._cdata``): a view or an
  in-place result is not a new tensor. A ``weakref`` on each new storage fires the moment it dies, which
  gives ``freed_after`` (forward), the gradient figures (backward) and ``held_by_caller`` (alive after
  backward). The handler never holds a tensor past the next op, so lifetimes are the unprofiled ones.
* **Autograd nodes.** When op *k+1* starts, op *k*'s outputs carry their ``grad_fn`` (autograd sets it
  after the dispatch returns); the node is tagged ``node.metadata["memplan_op"] = k``. A custom autograd
  Function runs its ops with grad off, so its node lands on the last op that produced its output.
* **Saved tensors.** After forward the autograd graph is walked from the loss and every ``_saved_*``
  attribute of every node (``saved_tensors`` of a custom Function) is unpacked: node -> storages ->
  ``Op.saved``. No ``saved_tensors_hooks`` are installed: they would change the program (autograd then
  skips the ``detach`` it dispatches when saving an output). Saved tensors that no node exposes (the
  inner node of ``CopySlices``) are found by their death: an activation that lives into backward, is in
  no ``saved`` list and is not held by the caller is counted as saved by the op whose backward step
  released it (``meta["saved_inferred"]`` counts them).
* **Backward.** ``torch._C._current_autograd_node()`` names the node running each backward ATen op; its
  tag gives the forward op whose backward step it is. Ops under untagged nodes (``AccumulateGrad``) count
  toward the most recent tagged step. Storages born in step *i* that outlive it are
  ``backward_grad_alloc_bytes``; those that die within it make ``backward_workspace_bytes`` (the in-step
  high-water mark beyond the step's allocations); those born earlier that die in it are
  ``backward_grad_free_bytes``.
* **Workspace.** Scratch memory inside a kernel (oneDNN's reorders in a convolution's backward) is no
  storage the mode sees, but the allocator sees it. On CUDA the allocator's peak is read around each op;
  on CPU the traced step runs under ``torch.profiler`` with ``profile_memory=True``, each op inside a
  ``memplan:<n>`` range, and the highest running sum of the allocation events inside the range is the op's
  high-water mark. Beyond its outputs, that is ``workspace_bytes``; in backward it joins the step's
  events (``backward_workspace_bytes``); for ``optimizer.step()`` it is ``optimizer_step_bytes``.
* **Time.** ``time.perf_counter`` around each op (CUDA: synchronised) in ``repeats`` further steps (the
  traced step's clock is perturbed by the memory reading), median per op.

Profiling runs real training steps (``warmup + 1 + repeats`` of them, plus those of the measurement):
the model's parameters and the optimizer's state are updated as in training.

**Fake profiles** (``fake=True``, or a ``device_spec``) run the same steps through the same tracer with
the model's tensors swapped for fake ones (:mod:`memplan.planner.probe.fake`): nothing of the step is allocated,
the model is left untouched and may live on the meta device. The tracer then records each ATen call's
metadata instead of timing it, and :mod:`memplan.planner.probe.optime` times the calls afterwards (alone on the
device, cached, or analytically for a device spec), giving also each call's allocator high-water mark.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memplan.planner.core.build import build_graph, share_fused_step_bytes
from memplan.planner.core.devicespec import DeviceSpec, round_allocation
from memplan.planner.core.errors import MemplanError, MemplanWarning, WorkloadError
from memplan.planner.core.graph import FUSE_MODES, FixedMemory, Graph, Measured
from memplan.planner.core.schedule import overlapped_s
from memplan.planner.probe import hostheap
from memplan.planner.probe.checkpointing import own_checkpointing
from memplan.planner.probe.device import (
    Device,
    current_gpus,
    default_device_type,
    device_here,
    device_of,
    fake_trace_device,
)
from memplan.planner.probe.draws import ADVICE as DRAW_ADVICE
from memplan.planner.probe.eager import eager_charge_s
from memplan.planner.probe.fake import FakeGuard, fake_step_state
from memplan.planner.probe.kernels import cuda_kernel_choices
from memplan.planner.probe.measure import fused_extra_s, max_prefix, measure_step, time_steps, untracked_bytes
from memplan.planner.probe.optime import OpCall, OpTimer, kernel_scratch, record_call
from memplan.planner.probe.restore import restored
from memplan.planner.probe.states import host_optimizer_rate, state_units
from memplan.planner.probe.storage import move_batch, tensors_in, unique_bytes
from memplan.planner.probe.tracing import forward_lifetimes, module_stack, traced_step
from memplan.planner.workloads import LossFn, default_optimizer, refuse_compiled, training_step


def model_fingerprint(model: nn.Module) -> str:
    """16 hex chars of sha256 over the parameters' (name, shape, dtype), in registration order. The
    executor compares it with a plan's to refuse a plan made for another model."""
    body = [(name, list(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in model.named_parameters()]
    return hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).hexdigest()[:16]


# ---- the public entry point ---------------------------------------------------------------------------------


def profile(model: nn.Module, example_batch: Any, loss_fn: LossFn, *,
            optimizer: torch.optim.Optimizer | None = None, warmup: int = 1, repeats: int = 3,
            device: str | torch.device | None = None, progress: bool = True, measure: bool = True,
            name: str = "graph", fake: bool = False, device_spec: DeviceSpec | None = None,
            cache_dir: str | Path | None = None, timer: OpTimer | None = None,
            fuse: str | Sequence[str] | None = None, restore: bool = True) -> Graph:
    """Profile real training steps of ``model`` and return their :class:`Graph` (``memplan.graph/1``).

    One step is ``optimizer.zero_grad(set_to_none=True); loss = loss_fn(model, example_batch);
    loss.backward(); optimizer.step()`` (see :mod:`memplan.planner.workloads`): ``loss_fn`` calls the
    model itself and returns a scalar tensor. ``optimizer`` defaults to AdamW (foreach). ``device``:
    ``None`` is CUDA when available, else CPU; the model and batch are moved there. ``warmup`` (>= 1)
    untimed steps create the optimizer state; then ``repeats`` traced steps give the structure (from the
    first) and median times. With ``measure``, :func:`memplan.planner.probe.measure.measure_step` fills
    ``graph.measured`` with an independent measurement of the peak and step time. ``fuse`` ("backward",
    "forward" or both): also time steps with the optimizer's updates fused so (``repeats`` of them, at
    least :data:`FUSED_ROUNDS`), interleaved with as many plain ones
    (:func:`memplan.planner.probe.measure.fused_extra_s`), into ``graph.fused_extra_s``: what the
    simulator charges a fused step (a fake profile runs no real step: it leaves them unmeasured).

    Those steps train the model. With ``restore`` (the default) its parameters, buffers and gradients, the
    ``optimizer``'s state and the random streams are put back afterwards, bit for bit, from copies in host
    memory (:func:`memplan.planner.probe.restore.restored`): training after a profile is training without
    one. ``restore=False`` skips the copies (host memory of the model's size) and leaves the model trained.
    A fake profile trains nothing; with ``restore`` it leaves the random streams as they were too (its
    isolated timings draw from them).

    With ``fake`` (implied by ``device_spec``) nothing of the step is allocated: see :func:`_profile_fake`;
    ``warmup``, ``repeats`` and ``measure`` then do not apply. Its ops are timed by ``timer`` when given,
    else by an :class:`OpTimer` for ``device_spec`` (analytic) or this device, caching in ``cache_dir``.

    Raises ``ValueError`` for warmup < 1 or repeats < 1, :class:`WorkloadError` if ``loss_fn`` does not
    return a scalar that requires grad, and :class:`MemplanError` if the op sequence changes between steps
    (:class:`memplan.planner.probe.fake.FakeTraceError` if a fake step cannot run).
    """
    modes = _fuse_modes(fuse)  # a typo is refused before any step runs
    refuse_compiled(model)
    if fake or device_spec is not None:
        # nothing real is trained, but the isolated timings draw random arguments and replay random ops
        with _random_streams_kept() if restore else contextlib.nullcontext():
            graph = _profile_fake(model, example_batch, loss_fn, optimizer=optimizer, device=device,
                                  device_spec=device_spec, cache_dir=cache_dir, progress=progress, name=name,
                                  timer=timer)
        if modes:  # asked for, and said why it is not there (the simulator then charges no fusion cost)
            graph.meta["fused_extra_s"] = "not measured: a fake profile runs no real step"
        return graph
    if warmup < 1 or repeats < 1:
        raise ValueError(f"profile needs warmup >= 1 (to create the optimizer state) and repeats >= 1, "
                         f"got warmup={warmup}, repeats={repeats}")
    meta = next((n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta), None)
    if meta is not None:
        raise WorkloadError(f"the model is on the meta device ({meta} has no data): a real profile trains it; "
                            f"profile it with fake=True (--fake), then materialize it under the plan")
    layer = device_of(device)
    model.to(layer.torch_device)  # where the tensors live (an emulated GPU's on the CPU)
    with restored(model, optimizer) if restore else contextlib.nullcontext():
        graph = _profile_real(model, example_batch, loss_fn, layer, optimizer=optimizer, warmup=warmup,
                              repeats=repeats, progress=progress, measure=measure, name=name, modes=modes)
    own = own_checkpointing(model)
    if own is not None:  # planner/probe/checkpointing.py
        graph.meta["own_checkpointing"] = own.line()
        warnings.warn(f"{own.line()}: the graph saves only what that checkpointing keeps, so a plan can keep no "
                      f"more ('100%' still recomputes them); call model.{own.switch}() before profiling to let "
                      f"memplan plan every activation", MemplanWarning, stacklevel=2)
    branches = graph.meta.get("draw_branches")
    if branches:  # planner/probe/draws.py
        warnings.warn(f"{', '.join(branches[:3])}{' ...' if len(branches) > 3 else ''} branched on a random draw "
                      f"in the profiled step: if that decides which ops run, {DRAW_ADVICE}", MemplanWarning,
                      stacklevel=2)
    return graph


def _random_streams_kept() -> contextlib.AbstractContextManager:
    """The CPU random stream, and the current GPU's where a real one is here, put back after the block."""
    return torch.random.fork_rng(devices=current_gpus())


def _profile_real(model: nn.Module, example_batch: Any, loss_fn: LossFn, layer: Device, *,
                  optimizer: torch.optim.Optimizer | None, warmup: int, repeats: int, progress: bool,
                  measure: bool, name: str, modes: list[str]) -> Graph:
    """:func:`profile`'s real steps on ``layer``'s device (the model already there)."""
    device = layer.torch_device
    batch = move_batch(example_batch, device)
    model.train()
    optimizer = optimizer or default_optimizer(model)
    sync = layer.synchronize
    charge = layer.type  # storages are charged as this device's allocator charges them

    with _progress(progress, name, warmup + 1 + repeats + (1 if measure else 0)) as advance:
        for _ in range(warmup):
            training_step(model, batch, loss_fn, optimizer)
            advance()
        params = [p for _, p in model.named_parameters()]
        buffers = [b for _, b in model.named_buffers()]
        inputs = tensors_in(batch)
        state = [t for s in optimizer.state.values() for t in tensors_in(s)]
        seen: set[int] = set()
        fixed = FixedMemory(params_bytes=unique_bytes(params, seen, charge),
                            buffers_bytes=unique_bytes(buffers, seen, charge),
                            inputs_bytes=unique_bytes(inputs, seen, charge),
                            optimizer_state_bytes=unique_bytes(state, seen, charge))
        units = state_units(model, optimizer, charge)
        host_rate = host_optimizer_rate(optimizer)
        # what the device holds beyond those storages (cuBLAS workspaces), after the warm-up created it: a
        # later step's peak includes it
        untracked = untracked_bytes(model, batch, optimizer)
        fixed_tensors = {"param": params, "buffer": buffers, "input": inputs}
        # The structure and the memory figures come from one step; its clock is perturbed by the scratch
        # measurement, so the times come from the `repeats` steps after it.
        first = traced_step(model, batch, loss_fn, optimizer, fixed_tensors, sync, structure=True,
                            memory="cuda" if layer.has_allocator_counters else "cpu", charge_as=charge,
                            device=layer).trace
        lifetimes = forward_lifetimes(model, batch, loss_fn, [op.name for op in first.ops])
        advance()
        traces = []
        for _ in range(repeats):
            traces.append(traced_step(model, batch, loss_fn, optimizer, fixed_tensors, sync, structure=False,
                                      charge_as=charge, device=layer).trace)
            advance()
        measured = Measured()
        if measure:
            m = measure_step(model, batch, loss_fn, optimizer, steps=repeats, warmup=0)
            measured = Measured(peak_bytes=m.peak_bytes, step_time_s=m.step_time_s,
                                forward_time_s=m.forward_time_s, backward_time_s=m.backward_time_s)
            advance()

    names = [op.name for op in first.ops]
    for r, tr in enumerate(traces, start=1):
        if [op.name for op in tr.ops] != names:
            k = next((k for k, (a, b) in enumerate(zip(tr.ops, first.ops, strict=False)) if a.name != b.name),
                     min(len(tr.ops), len(names)))
            ran = f"{tr.ops[k].name} in {tr.ops[k].module or 'the model'}" if k < len(tr.ops) else "nothing"
            draws = list(dict.fromkeys(first.draw_branches + tr.draw_branches))
            why = (f"{', '.join(draws)} branched on a random draw: {DRAW_ADVICE}" if draws else
                   "data-dependent control flow cannot be recorded as one graph")
            raise MemplanError(f"profile of {name}: the forward op sequence of timed step {r} differs from the "
                               f"traced step's at op {k} ({ran}, where the traced step ran "
                               f"{names[k] if k < len(names) else 'nothing'}); {why}")
    meta = {
        "profiler": "memplan.planner.probe.profiler", "torch": torch.__version__, "warmup": warmup,
        "repeats": repeats, "optimizer": type(optimizer).__name__,
        "device_name": layer.name(),
        "threads": torch.get_num_threads(),
        "lifetimes_aligned": lifetimes is not None,
    }
    if layer.emulated:
        meta["emulated"] = True
    graph = build_graph(first, name=name, device=layer.type, fixed=fixed,
                        times=[[op.time_s for op in tr.ops] for tr in traces],
                        backward_times=[tr.backward_time_s for tr in traces],
                        optimizer_time_s=statistics.median(tr.optimizer_time_s for tr in traces),
                        fingerprint=model_fingerprint(model),
                        host_bandwidth_bytes_per_s=layer.host_bandwidth_bytes_per_s(), meta=meta,
                        lifetimes=lifetimes)
    # Memory no plan changes beyond the parameters, buffers, batch and optimizer state: module attributes the
    # step read (the trace's ``other_bytes``) and what the device holds that no tensor owns. With allocator
    # counters the measured figure already covers the attributes (it is everything beyond those storages).
    attributes = graph.fixed.other_bytes
    graph.fixed.other_bytes = (max(attributes, untracked) if layer.has_allocator_counters
                               else attributes + untracked)
    # the allocator's view includes kernel scratch; the storages' view is the floor
    graph.fixed.optimizer_step_bytes = max(first.optimizer_scratch_bytes, max_prefix(first.optimizer_events))
    share_fused_step_bytes(graph, max_prefix(first.optimizer_events))
    graph.state_units = units
    graph.host_optimizer_bytes_per_s, graph.host_optimizer_call_s = host_rate or (None, 0.0)
    graph.measured = measured
    clock = layer.clock()
    if (measured.forward_time_s is not None and measured.backward_time_s is not None and measured.step_time_s
            and clock is time.perf_counter):  # else the ops' clock: op times and the plain step in one unit
        plain = (measured.forward_time_s, measured.backward_time_s,
                 max(measured.step_time_s - measured.forward_time_s - measured.backward_time_s, 0.0))
    else:
        t = time_steps(model, batch, loss_fn, optimizer, steps=repeats, device=device, clock=clock)
        plain = (t.forward_s, t.backward_s, t.optimizer_s)
    calibrate_times(graph, *plain)
    for mode in modes:
        graph.fused_extra_s[mode] = fused_extra_s(model, batch, loss_fn, optimizer, mode,
                                                  rounds=max(repeats, FUSED_ROUNDS), device=device, clock=clock)
    graph.replay_op_dispatch_s = REPLAY_OP_DISPATCH_S
    graph.watch_op_dispatch_s = WATCH_OP_DISPATCH_S
    return graph


def _fuse_modes(fuse: str | Sequence[str] | None) -> list[str]:
    """The fusion modes to measure: ``fuse`` as a list, each checked."""
    modes = [] if fuse is None else [fuse] if isinstance(fuse, str) else list(fuse)
    for mode in modes:
        if mode not in FUSE_MODES:
            raise MemplanError(f"fuse={mode!r}: expected {' or '.join(FUSE_MODES)}")
    return modes


# What the executor pays per replayed op beyond the op itself (its compiled replay's argument views and
# call, the reuse checks; executor/recipes.py Segment) and per forward op it watches under a plan (its
# dispatch mode and recipe recording; the saved-tensor and module hooks spread over them). Measured by
# benchmarks/dispatch.py on the benchmark machine (2-core CPU, Python 3.11, torch 2.13), in CPU time
# (docs/model.md, "Time"): watched, tiny GPT-2 and BERT steps planned against plain; replayed, the median
# of the extra backward time per extra replayed op between two plans of those, and of the backward time
# beyond the replayed ops' own on 16-step GRU and LSTM cells under multi-level plans, in steps after the
# first (a first step plans and traces every replay: 1.4-1.9x that, once).
REPLAY_OP_DISPATCH_S = 37e-6
FUSED_ROUNDS = 5  # rounds of (plain, fused) steps timing what fusion adds, at least (measure.fused_extra_s)
WATCH_OP_DISPATCH_S = 30e-6


def calibrate_times(graph: Graph, forward_s: float, backward_s: float, optimizer_s: float) -> None:
    """Scale the traced op times so that they sum to a plain step's: each op's ``time_s`` by
    ``forward_s / sum(time_s)``, each ``backward_time_s`` by ``backward_s / sum(backward_time_s)``, and set
    ``optimizer_time_s`` to ``optimizer_s``. Traced times carry the dispatch mode's instrumentation (a
    Python call and a clock read per op) and miss the time between ops (module calls, autograd's own
    work); plain eager training pays the second and not the first. The factors go to
    ``graph.meta["time_calibration"]``. In place; a sum of zero leaves its times as they are."""
    fwd_sum = sum(op.time_s for op in graph.ops)
    bwd_sum = sum(op.backward_time_s for op in graph.ops)
    f = forward_s / fwd_sum if fwd_sum > 0 else 1.0
    b = backward_s / bwd_sum if bwd_sum > 0 else 1.0
    for op in graph.ops:
        op.time_s *= f
        op.backward_time_s *= b
    graph.optimizer_time_s = optimizer_s
    graph.meta["time_calibration"] = {"forward": f, "backward": b, "plain_forward_s": forward_s,
                                      "plain_backward_s": backward_s, "plain_optimizer_s": optimizer_s}


@contextlib.contextmanager
def _progress(enabled: bool, name: str, total: int) -> Iterator[Callable[[], None]]:
    """A transient rich progress bar over the profiled steps (on stderr), or nothing."""
    if not enabled:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("profiling {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(name, total=total)
        yield lambda: bar.advance(task)


# ---- fake profiling ---------------------------------------------------------------------------------------


def _profile_fake(model: nn.Module, example_batch: Any, loss_fn: LossFn, *,
                  optimizer: torch.optim.Optimizer | None, device: str | torch.device | None,
                  device_spec: DeviceSpec | None, cache_dir: str | Path | None, progress: bool,
                  name: str, timer: OpTimer | None = None) -> Graph:
    """The graph of one training step traced under ``FakeTensorMode`` (:mod:`memplan.planner.probe.fake`):
    parameters, buffers, optimizer state and batch are fake, so no activation, gradient or optimizer
    state is allocated and ``model`` may live on the meta device; ``model`` and ``optimizer`` are left
    untouched. The steps are those of a real profile (a warm-up that creates the optimizer state, the
    traced step, the lifetime pass), through the same tracer; only the times differ: each recorded ATen
    call is timed by :class:`memplan.planner.probe.optime.OpTimer`, alone on ``device`` (cached), or for
    ``device_spec``'s device analytically. ``device``: None is ``device_spec``'s device type, else CUDA
    when available, else CPU. ``graph.meta["profile_peak_bytes"]`` is the allocator's peak while
    profiling (the real tensors the caller already had on the device, plus one op's working set).
    """
    if device is None:
        device = device_spec.device if device_spec else default_device_type()
    device = torch.device(device)
    if device_spec is not None and device_spec.device != device.type:
        raise MemplanError(f"device spec {device_spec.name} is a {device_spec.device} device; "
                           f"profiling for --device {device.type} contradicts it")
    # the device the profile runs on: None for a spec's GPU that is not here (nothing runs on it)
    layer = device_here(device)
    if device_spec is None and layer is None:
        raise MemplanError("a fake profile for CUDA without a GPU here cannot time its ops: give --device-spec "
                           "(for example h100-80gb)")
    counters = layer is not None and layer.has_allocator_counters
    if counters:
        layer.reset_peak()
    resident = _resident_bytes(model, example_batch, optimizer, layer)
    traced_on = fake_trace_device(device, layer)
    kind = layer.type if layer is not None else device.type  # the graph's device (emulated: cuda)
    # a GPU that is not here, traced on the CPU: the step takes the GPU's kernels where the CPU's would
    # keep other tensors (attention, dropout: planner/probe/kernels.py); the emulation's step runs on the
    # CPU for real, with the CPU's kernels, and is traced with them
    gpu_kernels = kind == "cuda" and traced_on.type == "cpu" and layer is None
    # a step on this CPU takes page faults where its allocator maps memory afresh: the fake steps give
    # each storage a shadow block of the allocator's (planner/probe/hostheap.py)
    shadow, no_shadow = _shadow(layer, device_spec)
    with _progress(progress, name, 4) as advance, \
            (cuda_kernel_choices() if gpu_kernels else contextlib.nullcontext()), \
            fake_step_state(model, example_batch, optimizer, traced_on) as st, \
            contextlib.closing(shadow) if shadow is not None else contextlib.nullcontext():
        model.train()
        stack: list[str] = []
        guard = FakeGuard(stack)
        # the warm-up creates the (fake) optimizer state; shadowed, it also brings the allocator to the
        # state of steady training, and its last steps are counted
        warmups = hostheap.WARMUP_STEPS if shadow is not None else 1
        for i in range(warmups):
            guard.model_called = guard.backward_seen = False  # each step names its loss and optimizer anew
            seen_calls: list[OpCall] = []
            with module_stack(model, stack, [guard]), guard, \
                    hostheap.ShadowMode(shadow, record_call, seen_calls) if shadow is not None \
                    else contextlib.nullcontext(), \
                    shadow.step() if shadow is not None and i > 0 else contextlib.nullcontext():
                training_step(model, st.batch, loss_fn, st.optimizer)
            if shadow is not None:  # the kernels' own scratch, found once per call, for the counted steps
                new = [c for c in seen_calls if c.key not in shadow.scratch]
                shadow.scratch.update(kernel_scratch(new, layer.torch_device))
        advance()
        state = [t for s in st.optimizer.state.values() for t in tensors_in(s)]
        seen: set[int] = set()
        charge = kind
        fixed = FixedMemory(params_bytes=unique_bytes(st.params, seen, charge),
                            buffers_bytes=unique_bytes(st.buffers, seen, charge),
                            inputs_bytes=unique_bytes(st.inputs, seen, charge),
                            optimizer_state_bytes=unique_bytes(state, seen, charge))
        units = state_units(model, st.optimizer, charge)
        host_rate = host_optimizer_rate(st.optimizer)
        tracer = traced_step(model, st.batch, loss_fn, st.optimizer,
                             {"param": st.params, "buffer": st.buffers, "input": st.inputs}, lambda: None,
                             structure=True, memory="fake", charge_as=charge, shadow=shadow)
        first = tracer.trace
        if shadow is not None:
            shadow.close()
        advance()
        lifetimes = forward_lifetimes(model, st.batch, loss_fn, [op.name for op in first.ops], fake=True)
        optimizer_name = type(st.optimizer).__name__
        advance()
    if timer is not None and timer.spec is None and layer is not None and (
            type(timer.layer) is not type(layer) or timer.layer.emulated != layer.emulated):
        # the timer reads kernel scratch with its own device layer's rounding: a CPU's timer under the CUDA
        # emulation charged unrounded bytes, silently
        raise MemplanError(f"the op timer runs on {timer.layer!r} and this profile on {layer!r}: make the OpTimer "
                           f"where the profile runs (inside emulate_cuda, if the profile is), or pass none")
    timer = timer or OpTimer(layer.torch_device if layer is not None else device, spec=device_spec,
                             cache_dir=cache_dir)
    timings = timer.time([call for *_, call in tracer.calls])
    # what eager training pays per call beyond the call alone (autograd's recording and engine, the
    # dispatch among other ops' code): a real step has it, an isolated call does not. It is host work: on
    # CUDA it overlaps the device's run of the kernels issued before (overlapped_s)
    eager_forward_s, eager_backward_s = eager_charge_s(timer)
    forward = {rec.scope: k for k, rec in enumerate(first.ops)}
    analytic: set[int] = set()
    optimizer_time_s = 0.0
    for (number, phase, clock, _call), timing in zip(tracer.calls, timings, strict=True):
        tracer.high[number] = timing.high_bytes
        if phase == "forward" and number in forward:
            rec = first.ops[forward[number]]
            rec.time_s = overlapped_s(kind, timing.time_s, eager_forward_s)
            for tid, position in zip(rec.outputs, rec.positions, strict=True):
                # a kernel may return a view of a larger buffer than its meta function says (CPU mse_loss):
                # what the allocator holds is the real storage, seen when the call ran alone
                if position < len(timing.output_bytes):
                    st = first.storages[tid]
                    st.nbytes = max(st.nbytes, round_allocation(timing.output_bytes[position], kind))
        elif phase == "backward":
            first.backward_time_s[clock] = (first.backward_time_s.get(clock, 0.0)
                                            + overlapped_s(kind, timing.time_s, eager_backward_s))
        elif phase == "optimizer":
            optimizer_time_s += timing.time_s
        if timing.source == "analytic" and phase in ("forward", "backward"):
            analytic.add(clock)
    tracer.apply_scratch()
    optimizer_time_s += _charge_fresh_pages(first, shadow)
    advance()
    stats = timer.stats
    meta = {
        "profiler": "memplan.planner.probe.profiler", "fake": True, "torch": torch.__version__,
        "optimizer": optimizer_name, "threads": torch.get_num_threads(),
        "device_name": device_spec.name if device_spec else layer.name(),
        "device_spec": device_spec.name if device_spec else None,
        "traced_on": traced_on.type,
        "kernel_choices": "cuda" if gpu_kernels else traced_on.type,
        "lifetimes_aligned": lifetimes is not None,
        "op_timing": {"calls": stats.calls, "distinct": stats.distinct, "cache_hits": stats.cache_hits,
                      "isolated_runs": stats.isolated_runs, "analytic": stats.analytic,
                      "cache_dir": str(timer.cache_dir), "eager_forward_s": eager_forward_s,
                      "eager_backward_s": eager_backward_s},
        "profile_peak_bytes": layer.max_memory_allocated() if counters else resident + stats.peak_bytes,
    }
    if layer is not None and layer.emulated:
        meta["emulated"] = True
    if layer is not None and layer.returns_pages and device_spec is None:
        meta["fresh_pages"] = _fresh_pages_meta(shadow, no_shadow)
    bandwidth = device_spec.host_bandwidth_bytes_per_s if device_spec else layer.host_bandwidth_bytes_per_s()
    graph = build_graph(first, name=name, device=kind, fixed=fixed, optimizer_time_s=optimizer_time_s,
                        fingerprint=model_fingerprint(model), host_bandwidth_bytes_per_s=bandwidth, meta=meta,
                        lifetimes=lifetimes)
    for op in graph.ops:
        op.time_source = "analytic" if op.id in analytic else "isolated"
    # the storages' view (the allocator's is not there to read)
    graph.fixed.optimizer_step_bytes = max_prefix(first.optimizer_events)
    share_fused_step_bytes(graph)
    graph.state_units = units
    # the host's optimizer rate: the spec's machine's where it gives one (with its source), else this one's
    graph.host_optimizer_bytes_per_s, graph.host_optimizer_call_s = host_rate or (None, 0.0)
    if device_spec is not None and device_spec.host_optimizer_bytes_per_s:
        graph.host_optimizer_bytes_per_s, graph.host_optimizer_call_s = device_spec.host_optimizer_bytes_per_s, 0.0
    if device_spec is not None:
        graph.meta["host_optimizer_source"] = device_spec.host_source or "measured on the profiling machine"
    # what the device's libraries hold that no tensor owns (cuBLAS workspaces): the spec's figure, or what
    # this device creates for the step's two threads (forward's and autograd's)
    graph.fixed.other_bytes += device_spec.workspace_bytes if device_spec else layer.step_workspace_bytes()
    # the plan runs on the same executor whichever way the graph was profiled (isolated op times need no
    # calibration: no tracing instrumentation was on while they ran)
    graph.replay_op_dispatch_s = REPLAY_OP_DISPATCH_S
    graph.watch_op_dispatch_s = WATCH_OP_DISPATCH_S
    return graph


def _shadow(layer: Device | None, device_spec: DeviceSpec | None) -> tuple[hostheap.Shadow | None, str | None]:
    """The shadow of a fake profile's steps (planner/probe/hostheap.py), or None and why there is none: only
    a CPU's allocator returns pages within a step, and only glibc's is shadowed."""
    if device_spec is not None or layer is None or not layer.returns_pages:
        return None, "the device's allocator keeps its blocks"
    why = hostheap.unsupported()
    if why is not None:
        return None, why
    return hostheap.Shadow(), None


def _charge_fresh_pages(trace: Any, shadow: hostheap.Shadow | None) -> float:
    """Add what the step's fresh pages cost to the ops whose allocations take them: the mean of the counted
    steps' pages, in the traced step's proportions, at this machine's cost of a fresh page. Returns the
    optimizer step's share (forward ops and backward steps are charged in ``trace``)."""
    if shadow is None or shadow.failed is not None or not shadow.step_totals:
        return 0.0
    traced = {where: n for where, n in shadow.pages.items() if where[0] in ("forward", "backward", "optimizer")}
    total = sum(traced.values())
    counted = shadow.step_totals[-hostheap.COUNTED_STEPS:]
    if total == 0:
        return 0.0
    seconds_per_page = _page_cycle_s() * statistics.mean(counted) / total
    optimizer_s = 0.0
    for (phase, clock), n in traced.items():
        seconds = n * seconds_per_page
        if phase == "forward" and 0 <= clock < len(trace.ops):
            trace.ops[clock].time_s += seconds
        elif phase == "backward":
            trace.backward_time_s[clock] = trace.backward_time_s.get(clock, 0.0) + seconds
        elif phase == "optimizer":
            optimizer_s += seconds
    return optimizer_s


def _fresh_pages_meta(shadow: hostheap.Shadow | None, no_shadow: str | None) -> dict[str, Any]:
    """``meta["fresh_pages"]``: what the profile charged for the step's fresh pages, or why nothing."""
    if shadow is None:
        return {"charged": False, "why": no_shadow}
    if shadow.failed is not None:
        return {"charged": False, "why": shadow.failed}
    counted = shadow.step_totals[-hostheap.COUNTED_STEPS:]
    cost = _page_cycle_s()
    pages = statistics.mean(counted) if counted else 0.0
    return {"charged": True, "pages_per_step": pages, "steps_counted": counted,
            "seconds_per_page": cost, "fault_s": hostheap.fresh_page_cost_s(),
            "release_s": hostheap.page_release_cost_s(), "seconds_per_step": pages * cost,
            "page_bytes": hostheap.PAGE}


def _page_cycle_s() -> float:
    """What a step's fresh page costs it: its fault and, as a steady step gives back what it faults in,
    its release."""
    return hostheap.fresh_page_cost_s() + hostheap.page_release_cost_s()


def _resident_bytes(model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer | None,
                    layer: Device | None) -> int:
    """Bytes of the real tensors on ``layer``'s device a fake profile's caller already holds (model, batch,
    optimizer state): what the allocator has in use before the profile allocates anything (0 for a device
    that is not here)."""
    if layer is None:
        return 0
    if layer.has_allocator_counters:
        return layer.memory_allocated()
    device = layer.torch_device
    tensors = [t for t in itertools.chain(model.parameters(), model.buffers(), tensors_in(batch))
               if t.device == device]
    if optimizer is not None:
        tensors += [t for s in optimizer.state.values() for t in tensors_in(s) if t.device == device]
    return unique_bytes(tensors, set(), layer.type) + layer.untracked_bytes()
