"""The profiler: runs real training steps of a model and records them as a :class:`Graph`.

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
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.planner.core.devicespec import DeviceSpec, round_allocation
from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import FixedMemory, Graph, Measured, Op, TensorInfo
from memplan.planner.probe.fake import FakeGuard, fake_call, fake_step_state
from memplan.planner.probe.measure import allocation_highs, max_prefix
from memplan.planner.probe.optime import OpCall, OpTimer, record_call
from memplan.planner.workloads import LossFn, compute_loss, default_optimizer, training_step

_TAG = "memplan_op"
# Metadata queries that reach a dispatch mode only for tensor subclasses (a FakeTensor's ``.device``, which
# autograd asks while it wires up an output): not ops of the program, never recorded.
_METADATA = frozenset({torch.ops.prim.device.default, torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int,
                       torch.ops.aten.sym_numel.default, torch.ops.aten.sym_storage_offset.default})
_NOMINAL_HOST_BANDWIDTH = 12e9  # bytes/s; on CPU offload is a logical move (see docs/model.md)


def model_fingerprint(model: nn.Module) -> str:
    """16 hex chars of sha256 over the parameters' (name, shape, dtype), in registration order. The
    executor compares it with a plan's to refuse a plan made for another model."""
    body = [(name, list(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in model.named_parameters()]
    return hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).hexdigest()[:16]


# ---- what one traced step records ---------------------------------------------------------------------


@dataclass
class _Storage:
    """One storage seen in the step. ``born``/``died`` are (phase, index) clocks: ``("forward", op)``,
    ``("backward", step)``, ``("optimizer", 0)``; ``died`` stays None while it lives."""

    tid: int
    kind: str
    nbytes: int
    dtype: str
    shape: list[int]
    born: tuple[str, int] | None = None
    died: tuple[str, int] | None = None
    producer: int | None = None
    output_index: int = 0
    requires_grad: bool = False
    held: bool = False  # alive after backward


@dataclass
class _OpRecord:
    name: str
    module: str
    time_s: float
    inputs: list[int]
    outputs: list[int]
    writes: list[int]
    random: bool
    scope: int = -1  # the call's number, which keys its allocator high-water mark
    workspace_bytes: int = 0
    has_backward: bool = False
    positions: list[int] = field(default_factory=list)  # each output's position among the call's tensors


@dataclass
class _Trace:
    """Everything one traced training step observed."""

    storages: list[_Storage] = field(default_factory=list)
    n_fixed: int = 0                                                 # storages registered before the step
    ops: list[_OpRecord] = field(default_factory=list)
    saved: dict[int, list[int]] = field(default_factory=dict)       # op -> saved storage ids
    backward_time_s: dict[int, float] = field(default_factory=dict)  # step -> seconds
    # (step, storage id, +bytes born / -bytes died); storage id -1: kernel scratch, -2: a call's scope marker
    backward_events: list[tuple[int, int, int]] = field(default_factory=list)
    backward_order: list[int] = field(default_factory=list)          # steps in the order they ran
    optimizer_events: list[int] = field(default_factory=list)        # +bytes / -bytes
    optimizer_scratch_bytes: int = 0                                 # allocator high-water mark of step()
    optimizer_survivors_bytes: int = 0
    optimizer_time_s: float = 0.0
    # fake steps: (call number, phase, clock, the call's metadata) per ATen call, for op timing
    calls: list[tuple[int, str, int, OpCall]] = field(default_factory=list)
    high: dict[int, int] = field(default_factory=dict)     # call number -> allocator high-water mark
    born_in: dict[int, int] = field(default_factory=dict)  # backward call number -> bytes it created


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    if t.layout != torch.strided or t.device.type == "meta":
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without storage (functional wrappers)
        return None


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results, in pytree order (tuples, lists, dict values). A plain
    walk: ``tree_flatten``'s generality costs more than the ops themselves on small models."""
    out: list[torch.Tensor] = []
    _collect(tree, out)
    return out


def _collect(x: Any, out: list[torch.Tensor]) -> None:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (tuple, list)):
        for y in x:
            _collect(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _collect(y, out)


def map_leaves(fn: Callable[[Any], Any], x: Any) -> Any:
    """``fn`` applied to every leaf of an op's arguments (inside tuples, lists and dict values;
    namedtuples kept): ``tree_map`` for the structures ATen arguments have, without its generality."""
    if isinstance(x, tuple):
        items = [map_leaves(fn, y) for y in x]
        return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
    if isinstance(x, list):
        return [map_leaves(fn, y) for y in x]
    if isinstance(x, dict):
        return {k: map_leaves(fn, y) for k, y in x.items()}
    return fn(x)


storage_of = _storage  # public for the executor: a tensor's storage by the profiler's rules (None: none)
tensors_in = _tensors  # public for the executor: the tensors of an op's arguments or results


def _keys(args: Any, kwargs: Any) -> set[int]:
    """The storages a call reads: an output among them is an in-place result, not a new storage."""
    return {s._cdata for s in map(_storage, _tensors((args, kwargs))) if s is not None}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Tracer(TorchDispatchMode):
    """The dispatch mode behind :func:`profile`. ``phase`` says what the step is doing."""

    def __init__(self, trace: _Trace, modules: list[str], sync: Callable[[], None], memory: str,
                 charge_as: str | None = None):
        super().__init__()
        self.charge_as = charge_as       # device type whose allocator rounding applies (None: the tensor's)
        self.t = trace
        self.modules = modules           # the module stack, kept by forward hooks
        self.model_called = False
        self.sync = sync
        self.memory = memory             # how to read kernel scratch: "off", "cuda" (allocator), "cpu" (scopes),
                                         # "fake" (nothing runs: each call is recorded, timed later)
        self.scope = 0                   # calls so far; a call's number keys its high-water mark
        self.high = trace.high           # call number -> allocator high-water mark above its start
        self.born_in = trace.born_in     # backward call number -> bytes of the storages it created
        self.phase = "idle"
        self.clock = -1                  # forward op / backward step the next events belong to
        self.by_key: dict[int, int] = {}  # live storage _cdata -> storage id
        self.refs: dict[int, weakref.ref] = {}
        self.pending: tuple[int, list[torch.Tensor]] | None = None  # last op's outputs, for their grad_fn
        self.written: dict[Any, list[tuple[int, str]]] = {}

    # -- storages ---------------------------------------------------------------------------------------
    def register(self, t: torch.Tensor, kind: str) -> int | None:
        """The storage id of ``t``, registering its storage (as ``kind``) when new."""
        s = _storage(t)
        if s is None:
            return None
        key = s._cdata
        tid = self.by_key.get(key)
        if tid is not None:
            return tid
        tid = len(self.t.storages)
        born = (self.phase, self.clock) if kind == "activation" else None
        nbytes = round_allocation(s.nbytes(), self.charge_as or t.device.type)
        self.t.storages.append(_Storage(tid, kind, nbytes, _dtype_name(t.dtype), list(t.shape), born,
                                        requires_grad=kind != "activation" and t.requires_grad))
        self.by_key[key] = tid
        self.refs[tid] = weakref.ref(s, lambda _ref, tid=tid, key=key: self._died(tid, key))
        return tid

    def _died(self, tid: int, key: int) -> None:
        st = self.t.storages[tid]
        st.died = (self.phase, self.clock)
        if self.by_key.get(key) == tid:
            del self.by_key[key]
        if self.phase == "backward":
            self.t.backward_events.append((self.clock, tid, -st.nbytes))
        elif self.phase == "optimizer":
            self.t.optimizer_events.append(-st.nbytes)

    # -- the dispatch hook ---------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:  # a fake tensor's metadata query: no op of the program
            return func(*args, **kwargs)
        if self.phase == "forward":
            return self._forward(func, args, kwargs)
        if self.phase == "backward":
            return self._backward(func, args, kwargs)
        if self.phase == "optimizer":
            return self._optimizer(func, args, kwargs)
        return func(*args, **kwargs)

    def _timed(self, func, args, kwargs) -> tuple[Any, float, int]:
        """Run ``func``; return its result, seconds and its call number. With memory on, the allocator's
        high-water mark during the call (above the bytes allocated before it) goes to ``high[number]``:
        read at once on CUDA, and on CPU after the step from the torch profiler's allocation events,
        which land inside the ``memplan:<number>`` range opened here."""
        self.scope += 1
        number = self.scope
        if self.memory == "fake":
            out = self._fake_call(func, args, kwargs)
            if isinstance(func, torch._ops.OpOverload) and func.namespace != "profiler":  # not record_function
                self.t.calls.append((number, self.phase, self.clock, record_call(func, args, kwargs, out)))
            return out, 0.0, number
        if self.memory == "cpu":
            with torch._C._profiler._RecordFunctionFast(f"memplan:{number}"):
                start = time.perf_counter()
                out = func(*args, **kwargs)
                return out, time.perf_counter() - start, number
        self.sync()  # CUDA: let queued kernels finish so that the clock times this op alone
        if self.memory == "cuda":
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = func(*args, **kwargs)
        self.sync()
        seconds = time.perf_counter() - start
        if self.memory == "cuda":
            self.high[number] = torch.cuda.max_memory_allocated() - before
        return out, seconds, number

    def _fake_call(self, func, args, kwargs):
        """``func`` on fake tensors; an op that cannot run so (its output depends on tensor values) is a
        :class:`FakeTraceError` naming it and the module that ran it."""
        if self.phase == "backward" and 0 <= self.clock < len(self.t.ops):
            where = f"the backward of {self.t.ops[self.clock].module or 'the model'}"
        else:
            where = self.modules[-1] if self.modules else ("loss" if self.model_called else "the step")
        return fake_call(func, args, kwargs, where)

    def resolve_pending(self) -> None:
        """Tag the autograd node of the previous op's outputs, then drop them (they must not outlive
        the moment the unprofiled program would free them by more than this)."""
        if self.pending is None:
            return
        k, outs = self.pending
        self.pending = None
        op = self.t.ops[k]
        for out in outs:
            node = out.grad_fn
            if node is not None:
                op.has_backward = True
                meta = node.metadata
                meta.setdefault(_TAG, k)
            tid = self.register(out, "activation")
            if tid is not None and self.t.storages[tid].producer == k and out.requires_grad:
                self.t.storages[tid].requires_grad = True
        del outs

    def _writes(self, func, args, kwargs) -> list[torch.Tensor]:
        spec = self.written.get(func)
        if spec is None:
            spec = [(i, a.name) for i, a in enumerate(func._schema.arguments)
                    if a.alias_info is not None and a.alias_info.is_write]
            self.written[func] = spec
        out: list[torch.Tensor] = []
        for i, name in spec:
            value = args[i] if i < len(args) else kwargs.get(name)
            out += _tensors(value)
        return out

    def _forward(self, func, args, kwargs):
        self.resolve_pending()
        k = len(self.t.ops)
        self.clock = k
        fresh = func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
        inputs = [] if fresh else [self.register(t, "buffer") for t in _tensors((args, kwargs))]
        writes = [self.register(t, "buffer") for t in self._writes(func, args, kwargs)]
        if self.modules:
            module = self.modules[-1]
        else:
            module = "loss" if self.model_called else ""
        rec = _OpRecord(str(func), module, 0.0, list(dict.fromkeys(i for i in inputs if i is not None)), [],
                        [w for w in dict.fromkeys(writes) if w is not None],
                        torch.Tag.nondeterministic_seeded in func.tags)
        self.t.ops.append(rec)
        out, rec.time_s, rec.scope = self._timed(func, args, kwargs)
        outs = _tensors(out)
        for position, t in enumerate(outs):
            s = _storage(t)
            if s is not None and s._cdata not in self.by_key:  # inputs are registered: this one is new
                tid = self.register(t, "activation")
                st = self.t.storages[tid]
                st.producer, st.output_index = k, len(rec.outputs)
                rec.outputs.append(tid)
                rec.positions.append(position)
        self.pending = (k, outs)
        return out

    def _backward(self, func, args, kwargs):
        node = torch._C._current_autograd_node()
        if node is not None:
            step = node.metadata.get(_TAG)
            if step is not None and step != self.clock:
                self.clock = step
                self.t.backward_order.append(step)
        seen = _keys(args, kwargs)
        out, seconds, number = self._timed(func, args, kwargs)
        self.t.backward_time_s[self.clock] = self.t.backward_time_s.get(self.clock, 0.0) + seconds
        born = 0
        for t in _tensors(out):
            s = _storage(t)
            if s is not None and s._cdata not in self.by_key and s._cdata not in seen:
                tid = self.register(t, "activation")
                born += self.t.storages[tid].nbytes
                self.t.backward_events.append((self.clock, tid, self.t.storages[tid].nbytes))
        if self.memory != "off":  # where its kernel scratch goes, once known (see apply_scratch)
            self.born_in[number] = born
            self.t.backward_events.append((self.clock, -2, number))
        return out

    def apply_scratch(self) -> None:
        """Turn the high-water marks into workspace: a forward op's is what it reached beyond its outputs;
        a backward call's becomes a transient (+, -) event pair right after its births."""
        for rec in self.t.ops:
            outputs = sum(self.t.storages[o].nbytes for o in rec.outputs)
            rec.workspace_bytes = max(0, self.high.get(rec.scope, 0) - outputs)
        events = []
        for step, tid, value in self.t.backward_events:
            if tid != -2:
                events.append((step, tid, value))
                continue
            extra = self.high.get(value, 0) - self.born_in.get(value, 0)
            if extra > 0:
                events += [(step, -1, extra), (step, -1, -extra)]
        self.t.backward_events = events

    def _optimizer(self, func, args, kwargs):
        seen = _keys(args, kwargs)
        out = self._timed(func, args, kwargs)[0] if self.memory == "fake" else func(*args, **kwargs)
        for t in _tensors(out):
            s = _storage(t)
            if s is not None and s._cdata not in self.by_key and s._cdata not in seen:
                tid = self.register(t, "activation")
                self.t.optimizer_events.append(self.t.storages[tid].nbytes)
        return out


@contextlib.contextmanager
def _module_stack(model: nn.Module, stack: list[str], tracer_ref: list[_Tracer | None]) -> Iterator[None]:
    """Keep ``stack`` equal to the path of the module running now (forward pre/post hooks)."""
    handles = []

    def pre(name: str):
        def hook(_module, _args):
            stack.append(name)
        return hook

    def post(_module, _args, _out):
        stack.pop()
        if not stack and tracer_ref[0] is not None:
            tracer_ref[0].model_called = True

    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(pre(name)))
        handles.append(module.register_forward_hook(post, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# ---- one traced step ---------------------------------------------------------------------------------------


def _saved_by_node(loss: torch.Tensor, tracer: _Tracer) -> dict[int, list[int]]:
    """Walk the autograd graph from the loss; return forward op -> storage ids its node saved."""
    out: dict[int, list[int]] = {}
    attrs_of: dict[type, list[str]] = {}
    seen: set[int] = set()
    keep: list[Any] = []  # holds the node wrappers during the walk so that id() stays unique
    stack = [loss.grad_fn] if loss.grad_fn is not None else []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        keep.append(node)
        stack.extend(n for n, _ in node.next_functions if n is not None)
        cls = type(node)
        if cls not in attrs_of:
            attrs_of[cls] = [a for a in dir(node) if a.startswith("_saved_")]
        values = []
        for a in attrs_of[cls]:
            try:
                values.append(getattr(node, a))
            except RuntimeError:  # released, or an undefined optional tensor
                continue
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            values.append(node.saved_tensors)
        tids = [tracer.register(t, "buffer") for t in _tensors(values)]
        tids = list(dict.fromkeys(t for t in tids if t is not None))
        del values
        if not tids:
            continue
        op = node.metadata.get(_TAG)
        if op is None:  # untagged node: the latest op that produced one of its saved tensors
            producers = [tracer.t.storages[t].producer for t in tids if tracer.t.storages[t].producer is not None]
            if not producers:
                continue
            op = max(producers)
        out.setdefault(op, []).extend(tids)
    return {op: list(dict.fromkeys(tids)) for op, tids in out.items()}


def _traced_step(model: nn.Module, batch: Any, loss_fn: LossFn, optimizer: torch.optim.Optimizer,
                 fixed_tensors: dict[str, list[torch.Tensor]], sync: Callable[[], None], *,
                 structure: bool, memory: str = "off", tracers: list[_Tracer] | None = None,
                 charge_as: str | None = None) -> _Trace:
    """One training step under the tracer. ``structure``: also record saved tensors (pack hooks and the
    graph walk) and trace the optimizer step; otherwise the optimizer step is only timed, outside the
    mode. ``memory``: how kernel scratch is read ("off", "cuda", "cpu", "fake"; see ``_Tracer._timed``).
    ``tracers`` receives the tracer (a fake step's scratch is applied once its calls are timed).
    ``charge_as``: the device type whose allocator rounding storage sizes get (None: their own)."""
    trace = _Trace()
    stack: list[str] = []
    tracer = _Tracer(trace, stack, sync, memory, charge_as)
    tracer_ref: list[_Tracer | None] = [tracer]
    for kind in ("param", "buffer", "input"):
        for t in fixed_tensors[kind]:
            tracer.register(t, kind)
    trace.n_fixed = len(trace.storages)
    allocator_events = contextlib.nullcontext()
    if memory == "cpu":
        from memplan.planner.probe.measure import allocator_events as quiet_allocator_events
        allocator_events = quiet_allocator_events()

    optimizer.zero_grad(set_to_none=True)
    with allocator_events as prof:
        with _module_stack(model, stack, tracer_ref), tracer:
            tracer.phase = "forward"
            loss = compute_loss(model, batch, loss_fn)
            tracer.resolve_pending()
            tracer.phase = "idle"
            if structure:
                trace.saved = _saved_by_node(loss, tracer)
            tracer.phase, tracer.clock = "backward", len(trace.ops) - 1
            loss.backward()
            tracer.phase = "idle"
            for st in trace.storages:  # alive after backward: held by the caller (the loss, outputs)
                st.held = st.kind == "activation" and st.died is None
            if structure:
                tracer.phase, tracer.clock = "optimizer", 0
                _, _, number = tracer._timed(lambda: optimizer.step(), (), {})
                tracer.phase = "idle"
            del loss
        if not structure:
            sync()
            start = time.perf_counter()
            optimizer.step()
            sync()  # CUDA: the step's kernels are asynchronous
            trace.optimizer_time_s = time.perf_counter() - start
    tracer_ref[0] = None
    if tracers is not None:
        tracers.append(tracer)
    if memory == "cpu":
        for name, high in allocation_highs(prof).items():
            tracer.high[int(name.removeprefix("memplan:"))] = high
    if memory in ("cpu", "cuda"):  # a fake step's marks come from op timing (see _profile_fake)
        tracer.apply_scratch()
    if structure:
        trace.optimizer_scratch_bytes = tracer.high.get(number, 0)
        trace.optimizer_survivors_bytes = sum(
            st.nbytes for st in trace.storages if st.born == ("optimizer", 0) and st.died is None)
    return trace


class _Lifetimes(TorchDispatchMode):
    """Forward ops and, per new storage, the op during which its last reference went (None: it outlived
    the forward). Run with saved-tensor hooks that keep nothing, so that only the program's own
    references (module code, model outputs) keep a storage alive: what a plan that recomputes or offloads
    it leaves behind."""

    def __init__(self, fake: bool = False) -> None:
        super().__init__()
        self.fake = fake                 # calls go through fake_call (fake tensors; real ones run for real)
        self.names: list[str] = []
        self.deaths: list[list[int | None]] = []
        self.known: set[int] = set()
        self.refs: list[weakref.ref] = []

    def _track(self, s: torch.UntypedStorage, row: list[int | None] | None) -> None:
        """Know ``s`` while it lives (as the traced step's ``by_key`` does, so that "new output" means the
        same here); for an output, note in ``row`` when it dies."""
        key = s._cdata
        self.known.add(key)
        j = len(row) if row is not None else -1
        if row is not None:
            row.append(None)

        def died(_ref: weakref.ref) -> None:
            self.known.discard(key)
            if row is not None:
                row[j] = len(self.names) - 1

        self.refs.append(weakref.ref(s, died))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            return func(*args, **kwargs)
        for t in _tensors((args, kwargs)):
            s = _storage(t)
            if s is not None and s._cdata not in self.known:
                self._track(s, None)
        out = fake_call(func, args, kwargs, "the lifetime pass") if self.fake else func(*args, **kwargs)
        self.names.append(str(func))
        row: list[int | None] = []
        self.deaths.append(row)
        for t in _tensors(out):
            s = _storage(t)
            if s is not None and s._cdata not in self.known:
                self._track(s, row)
        return out


def _forward_lifetimes(model: nn.Module, batch: Any, loss_fn: LossFn, names: list[str],
                       fake: bool = False) -> dict[tuple[int, int], int | None] | None:
    """{(forward op, output index): the graph op during which the program itself dropped that storage}
    from one more forward (model and loss, no backward) under saved-tensor hooks that hold nothing.
    ``names`` are the traced step's op names; the ``aten.detach`` autograd runs when it saves an output is
    not dispatched without its own hold, so those are skipped when aligning. None if the ops do not align
    (then the graph keeps what the traced step saw)."""
    mode = _Lifetimes(fake)
    with torch.autograd.graph.saved_tensors_hooks(lambda _t: None, lambda _p: None), mode:
        loss = compute_loss(model, batch, loss_fn)
        del loss
    at: list[int] = []  # lifetime-pass op -> graph op
    g = 0
    for name in mode.names:
        while g < len(names) and names[g] != name and names[g] == "aten.detach.default":
            g += 1
        if g >= len(names) or names[g] != name:
            return None
        at.append(g)
        g += 1
    if any(n != "aten.detach.default" for n in names[g:]):
        return None
    out: dict[tuple[int, int], int | None] = {}
    for k, row in enumerate(mode.deaths):
        for j, died in enumerate(row):
            out[(at[k], j)] = None if died is None else at[died]
    return out


# ---- the graph --------------------------------------------------------------------------------------------


def _backward_figures(trace: _Trace, n_ops: int) -> tuple[list[int], list[int], list[int], dict[int, int]]:
    """Per forward op: (grad alloc, grad free, backward workspace) bytes of its backward step, and, for each
    activation born in forward that died in backward, the step that released it."""
    alloc = [0] * n_ops
    free = [0] * n_ops
    workspace = [0] * n_ops
    born_step: dict[int, int] = {}
    death_step: dict[int, int] = {}
    for step, tid, delta in trace.backward_events:
        if tid < 0:
            continue
        if delta > 0:
            born_step[tid] = step
        else:
            death_step[tid] = step
    for tid, b in born_step.items():
        d = death_step.get(tid)
        # Died in its own step (or, engine order differing from op order, in a step simulated earlier): a
        # transient of its birth step. Otherwise it outlives the step: allocated at b, released at d.
        if d is not None and d >= b:
            continue
        alloc[b] += trace.storages[tid].nbytes
        if d is not None:
            free[d] += trace.storages[tid].nbytes
    # The in-step high-water mark, segment by segment (a step's events are normally one run).
    segment_step, running, high = None, 0, 0
    highs: dict[int, int] = {}
    for step, _tid, delta in trace.backward_events:
        if step != segment_step:
            if segment_step is not None:
                highs[segment_step] = max(highs.get(segment_step, 0), high)
            segment_step, running, high = step, 0, 0
        running += delta
        high = max(high, running)
    if segment_step is not None:
        highs[segment_step] = max(highs.get(segment_step, 0), high)
    for step, high in highs.items():
        workspace[step] = max(0, high - alloc[step])
    released = {tid: step for tid, step in death_step.items()
                if tid not in born_step and trace.storages[tid].kind == "activation"}
    return alloc, free, workspace, released


def _initialisers(trace: _Trace, new_id: dict[int, int], mutated_by: dict[int, list[int]]) -> dict[int, list[int]]:
    """{graph tensor id: the ops that finish it in place} for the mutated activations a replay can rebuild
    by running their producer and then these ops in forward order, under the recorded RNG state: each of
    these ops writes only that storage (through any view of it) and creates none, and the producer has no
    other output (a replay for another output would skip them). Covered: dropout's ``empty_like`` ->
    ``bernoulli_`` -> ``div_`` mask, ``relu_`` after a linear, ``x += residual``, and recurrent cells'
    gates finished by ``add_``/``sigmoid_``/``tanh_``/``mul_`` on chunks that read other activations.

    What the ops read besides the storage is needed by the replay as any input is; that it holds the
    value the op read in forward is checked by :func:`_stale_readers` (the other half of the rule)."""
    out: dict[int, list[int]] = {}
    trace_id = {gid: tid for tid, gid in new_id.items()}
    for gid, ops in mutated_by.items():
        if len(trace.ops[trace.storages[trace_id[gid]].producer].outputs) != 1:
            continue
        if all(not trace.ops[k].outputs and {new_id.get(t) for t in trace.ops[k].writes} == {gid} for k in ops):
            out[gid] = sorted(ops)
    return out


def _stale_readers(trace: _Trace, new_id: dict[int, int], mutated_by: dict[int, list[int]],
                   chains: dict[int, list[int]]) -> set[int]:
    """Ops that read an activation which a later op writes in place, outside a rebuildable chain
    (``chains``, from :func:`_initialisers`): replayed, such an op would read the tensor's final content,
    not what it read in forward. A tensor whose replay runs one of them cannot be rebuilt; its readers
    still can, from the kept tensor. A reader of a chain mid-way (``y = h * 3; h.relu_()``; autograd's
    clone of a GRU chunk before its in-place ``mul_``) is not stale: a replay re-creates the chain up to
    it (:func:`memplan.planner.core.replay.reads_mid_chain`)."""
    last_write = {gid: max(ops) for gid, ops in mutated_by.items() if gid not in chains}
    out = set()
    for k, op in enumerate(trace.ops):
        for t in op.inputs:
            gid = new_id.get(t, -1)
            # an op that writes the tensor itself reads it mid-chain by design: it runs only in a replay
            # that rebuilds that tensor, in forward order with the rest of the chain
            if last_write.get(gid, -1) > k and k not in mutated_by[gid]:
                out.add(k)
    return out


def _build_graph(trace: _Trace, times: list[list[float]], bwd_times: list[dict[int, float]],
                 fixed: FixedMemory, optimizer_time_s: float, name: str, device: torch.device,
                 fingerprint: str, bandwidth: float, meta: dict[str, Any],
                 lifetimes: dict[tuple[int, int], int | None] | None = None) -> Graph:
    n_ops = len(trace.ops)
    # Tensor ids in the graph: the pre-existing storages the step reads or that are fixed, then the
    # activations born in forward, in birth order. Storages born in backward/optimizer are not tensors.
    order = [st for st in trace.storages if st.kind != "activation"] + \
            [st for st in trace.storages if st.kind == "activation" and st.born and st.born[0] == "forward"]
    new_id = {st.tid: i for i, st in enumerate(order)}
    alloc, free, workspace, released = _backward_figures(trace, n_ops)

    saved = {op: [new_id[t] for t in tids if t in new_id] for op, tids in trace.saved.items()}
    in_saved = {t for tids in saved.values() for t in tids}
    inferred = 0
    for tid, step in released.items():  # lived into backward, no node exposed it: saved by its releaser
        if tid in new_id and new_id[tid] not in in_saved and not trace.storages[tid].held:
            saved.setdefault(step, []).append(new_id[tid])
            inferred += 1

    mutated_by: dict[int, list[int]] = {}
    for k, op in enumerate(trace.ops):
        for t in op.writes:
            if t in new_id and trace.storages[t].kind == "activation" and trace.storages[t].producer != k:
                mutated_by.setdefault(new_id[t], []).append(k)

    initialisers = _initialisers(trace, new_id, mutated_by)
    stale = _stale_readers(trace, new_id, mutated_by, initialisers)
    producer_of = {new_id[st.tid]: st.producer for st in trace.storages if st.tid in new_id}
    while True:  # a chain that runs a stale reader is no chain: its own mid-chain readers become stale
        broken = [g for g, ops in initialisers.items() if any(k in stale for k in (producer_of[g], *ops))]
        if not broken:
            break
        for g in broken:
            del initialisers[g]
        stale = _stale_readers(trace, new_id, mutated_by, initialisers)
    tensors = []
    for i, st in enumerate(order):
        act = st.kind == "activation"
        freed_after = None
        if act and st.died is not None and st.died[0] == "forward":
            freed_after = max(st.died[1], st.producer)
        elif act and lifetimes is not None and not st.held and (st.producer, st.output_index) in lifetimes:
            # autograd held it in the traced step; without that hold the program drops it here (after the
            # forward if it outlived it): what a plan that recomputes or offloads it can free at the earliest
            died = lifetimes[(st.producer, st.output_index)]
            freed_after = max(n_ops - 1 if died is None else died, st.producer)
        producer_writes = act and bool(trace.ops[st.producer].writes)
        rebuilt_by = initialisers.get(i, [])
        # rebuilt by re-running its producer and rebuilt_by ops: each must see what it saw in forward
        stale_replay = act and any(k in stale for k in (st.producer, *rebuilt_by))
        tensors.append(TensorInfo(
            id=i, kind=st.kind, producer=st.producer if act else None, output_index=st.output_index if act else 0,
            bytes=st.nbytes, dtype=st.dtype, shape=st.shape, requires_grad=st.requires_grad,
            freed_after=freed_after, held_by_caller=act and st.held,
            recomputable=not ((i in mutated_by and not rebuilt_by) or producer_writes or stale_replay),
            rebuilt_by=rebuilt_by if act and not stale_replay else []))

    ops = []
    for k, rec in enumerate(trace.ops):
        ops.append(Op(
            id=k, name=rec.name, module=rec.module,
            time_s=statistics.median(run[k] for run in times),
            backward_time_s=statistics.median(run.get(k, 0.0) for run in bwd_times),
            inputs=[new_id[t] for t in rec.inputs if t in new_id],
            outputs=[new_id[t] for t in rec.outputs],
            saved=saved.get(k, []), workspace_bytes=rec.workspace_bytes,
            backward_workspace_bytes=workspace[k], backward_grad_alloc_bytes=alloc[k],
            backward_grad_free_bytes=free[k], has_backward=rec.has_backward, random=rec.random))

    # pre-existing storages the step read that are not parameters, buffers or the batch (module attributes)
    other = sum(st.nbytes for st in order if st.kind == "buffer" and st.tid >= trace.n_fixed)
    fixed = fixed.model_copy(update={"other_bytes": other})
    reversed_ok = all(a > b for a, b in itertools.pairwise(trace.backward_order))
    meta.update({
        "saved_inferred": inferred,
        "backward_in_reverse_op_order": reversed_ok,
        "optimizer_step_survivors_bytes": trace.optimizer_survivors_bytes,
        "mutated_by": {str(t): ops_ for t, ops_ in mutated_by.items()},
    })
    return Graph(name=name, device=device.type, model_fingerprint=fingerprint, tensors=tensors, ops=ops,
                 fixed=fixed, optimizer_time_s=optimizer_time_s, host_bandwidth_bytes_per_s=bandwidth, meta=meta)


# ---- the public entry point ---------------------------------------------------------------------------------


def _unique_bytes(tensors: list[torch.Tensor], seen: set[int], charge_as: str | None = None) -> int:
    total = 0
    for t in tensors:
        s = _storage(t)
        if s is not None and s._cdata not in seen:
            seen.add(s._cdata)
            total += round_allocation(s.nbytes(), charge_as or t.device.type)
    return total


def move_batch(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor moved to ``device`` (tensors, dicts, lists, tuples, namedtuples)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return type(batch)({k: move_batch(v, device) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        moved = [move_batch(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def _host_bandwidth(device: torch.device) -> float:
    """Pinned host -> device copy bandwidth (CUDA); a nominal figure elsewhere."""
    if device.type != "cuda":
        return _NOMINAL_HOST_BANDWIDTH
    host = torch.empty(64 * 2**20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=device)
    dev.copy_(host, non_blocking=True)  # warm-up
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(4):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)  # wait for the async copies before reading the clock
    return 4 * host.numel() / (time.perf_counter() - start)


def profile(model: nn.Module, example_batch: Any, loss_fn: LossFn, *,
            optimizer: torch.optim.Optimizer | None = None, warmup: int = 1, repeats: int = 3,
            device: str | torch.device | None = None, progress: bool = True, measure: bool = True,
            name: str = "graph", fake: bool = False, device_spec: DeviceSpec | None = None,
            cache_dir: str | Path | None = None, timer: OpTimer | None = None) -> Graph:
    """Profile real training steps of ``model`` and return their :class:`Graph` (``memplan.graph/1``).

    One step is ``optimizer.zero_grad(set_to_none=True); loss = loss_fn(model, example_batch);
    loss.backward(); optimizer.step()`` (see :mod:`memplan.planner.workloads`): ``loss_fn`` calls the
    model itself and returns a scalar tensor. ``optimizer`` defaults to AdamW (foreach). ``device``:
    ``None`` is CUDA when available, else CPU; the model and batch are moved there. ``warmup`` (>= 1)
    untimed steps create the optimizer state; then ``repeats`` traced steps give the structure (from the
    first) and median times. With ``measure``, :func:`memplan.planner.probe.measure.measure_step` fills
    ``graph.measured`` with an independent measurement of the peak and step time.

    With ``fake`` (implied by ``device_spec``) nothing of the step is allocated: see :func:`_profile_fake`;
    ``warmup``, ``repeats`` and ``measure`` then do not apply. Its ops are timed by ``timer`` when given,
    else by an :class:`OpTimer` for ``device_spec`` (analytic) or this device, caching in ``cache_dir``.

    Raises ``ValueError`` for warmup < 1 or repeats < 1, :class:`WorkloadError` if ``loss_fn`` does not
    return a scalar that requires grad, and :class:`MemplanError` if the op sequence changes between steps
    (:class:`memplan.planner.probe.fake.FakeTraceError` if a fake step cannot run).
    """
    if fake or device_spec is not None:
        return _profile_fake(model, example_batch, loss_fn, optimizer=optimizer, device=device,
                             device_spec=device_spec, cache_dir=cache_dir, progress=progress, name=name,
                             timer=timer)
    if warmup < 1 or repeats < 1:
        raise ValueError(f"profile needs warmup >= 1 (to create the optimizer state) and repeats >= 1, "
                         f"got warmup={warmup}, repeats={repeats}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    model.to(device)
    batch = move_batch(example_batch, device)
    model.train()
    optimizer = optimizer or default_optimizer(model)
    on_cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if on_cuda else (lambda: None)

    with _progress(progress, name, warmup + 1 + repeats + (1 if measure else 0)) as advance:
        for _ in range(warmup):
            training_step(model, batch, loss_fn, optimizer)
            advance()
        params = [p for _, p in model.named_parameters()]
        buffers = [b for _, b in model.named_buffers()]
        inputs = _tensors(batch)
        state = [t for s in optimizer.state.values() for t in _tensors(s)]
        seen: set[int] = set()
        fixed = FixedMemory(params_bytes=_unique_bytes(params, seen), buffers_bytes=_unique_bytes(buffers, seen),
                            inputs_bytes=_unique_bytes(inputs, seen),
                            optimizer_state_bytes=_unique_bytes(state, seen))
        fixed_tensors = {"param": params, "buffer": buffers, "input": inputs}
        # The structure and the memory figures come from one step; its clock is perturbed by the scratch
        # measurement, so the times come from the `repeats` steps after it.
        first = _traced_step(model, batch, loss_fn, optimizer, fixed_tensors, sync, structure=True,
                             memory="cuda" if on_cuda else "cpu")
        lifetimes = _forward_lifetimes(model, batch, loss_fn, [op.name for op in first.ops])
        advance()
        traces = []
        for _ in range(repeats):
            traces.append(_traced_step(model, batch, loss_fn, optimizer, fixed_tensors, sync, structure=False))
            advance()
        measured = Measured()
        if measure:
            from memplan.planner.probe.measure import measure_step
            m = measure_step(model, batch, loss_fn, optimizer, steps=repeats, warmup=0)
            measured = Measured(peak_bytes=m.peak_bytes, step_time_s=m.step_time_s,
                                forward_time_s=m.forward_time_s, backward_time_s=m.backward_time_s)
            advance()

    names = [op.name for op in first.ops]
    for r, tr in enumerate(traces, start=1):
        if [op.name for op in tr.ops] != names:
            raise MemplanError(f"profile of {name}: the forward op sequence of timed step {r} differs from the "
                               f"traced step's ({len(tr.ops)} vs {len(names)} ops); data-dependent control "
                               f"flow cannot be recorded as one graph")
    meta = {
        "profiler": "memplan.planner.probe.profiler", "torch": torch.__version__, "warmup": warmup,
        "repeats": repeats, "optimizer": type(optimizer).__name__,
        "device_name": torch.cuda.get_device_name(device) if on_cuda else "cpu",
        "threads": torch.get_num_threads(),
        "lifetimes_aligned": lifetimes is not None,
    }
    graph = _build_graph(first, [[op.time_s for op in tr.ops] for tr in traces],
                         [tr.backward_time_s for tr in traces], fixed,
                         statistics.median(tr.optimizer_time_s for tr in traces),
                         name, device, model_fingerprint(model), _host_bandwidth(device), meta, lifetimes)
    # the allocator's view includes kernel scratch; the storages' view is the floor
    graph.fixed.optimizer_step_bytes = max(first.optimizer_scratch_bytes, max_prefix(first.optimizer_events))
    graph.measured = measured
    if measured.forward_time_s is not None and measured.backward_time_s is not None and measured.step_time_s:
        plain = (measured.forward_time_s, measured.backward_time_s,
                 max(measured.step_time_s - measured.forward_time_s - measured.backward_time_s, 0.0))
    else:
        plain = plain_step_times(model, batch, loss_fn, optimizer, sync, repeats)
    calibrate_times(graph, *plain)
    graph.replay_op_dispatch_s = REPLAY_OP_DISPATCH_S
    return graph


# What the executor pays per replayed op beyond the op itself: resolving its recipe's tensor references
# to views, the check for arguments written in place, and the replay's own planning (planner/core/replay.py).
# Measured on the benchmark machine (2-core CPU, Python 3.11, torch 2.13) by replaying recorded ops on
# tiny tensors against calling them directly (docs/model.md, "Time").
REPLAY_OP_DISPATCH_S = 15e-6


def plain_step_times(model: nn.Module, batch: Any, loss_fn: LossFn, optimizer: torch.optim.Optimizer,
                     sync: Callable[[], None], repeats: int) -> tuple[float, float, float]:
    """Median seconds of forward (with the loss), backward and ``optimizer.step()`` over ``repeats`` plain
    training steps (no mode, no hooks): what eager training pays."""
    fwd, bwd, opt = [], [], []
    for _ in range(repeats):
        optimizer.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        loss = compute_loss(model, batch, loss_fn)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        optimizer.step()
        sync()
        t3 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
        opt.append(t3 - t2)
    return statistics.median(fwd), statistics.median(bwd), statistics.median(opt)


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
        device = device_spec.device if device_spec else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device_spec is not None and device_spec.device != device.type:
        raise MemplanError(f"device spec {device_spec.name} is a {device_spec.device} device; "
                           f"profiling for --device {device.type} contradicts it")
    if device_spec is None and device.type == "cuda" and not torch.cuda.is_available():
        raise MemplanError("a fake profile for CUDA without a GPU here cannot time its ops: give --device-spec "
                           "(for example h100-80gb)")
    on_cuda = device.type == "cuda" and torch.cuda.is_available()
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    resident = _resident_bytes(model, example_batch, optimizer, device)
    # Autograd cannot wire fake CUDA tensors in a torch built without CUDA: such a build traces the step as
    # on CPU (the CPU kernels' op choices) and charges its storages as CUDA's allocator would.
    traced_on = device if device.type != "cuda" or torch.backends.cuda.is_built() else torch.device("cpu")
    with _progress(progress, name, 4) as advance, \
            fake_step_state(model, example_batch, optimizer, traced_on) as st:
        model.train()
        stack: list[str] = []
        guard = FakeGuard(stack)
        with _module_stack(model, stack, [guard]), guard:  # the warm-up creates the (fake) optimizer state
            training_step(model, st.batch, loss_fn, st.optimizer)
        advance()
        state = [t for s in st.optimizer.state.values() for t in _tensors(s)]
        seen: set[int] = set()
        charge = device.type
        fixed = FixedMemory(params_bytes=_unique_bytes(st.params, seen, charge),
                            buffers_bytes=_unique_bytes(st.buffers, seen, charge),
                            inputs_bytes=_unique_bytes(st.inputs, seen, charge),
                            optimizer_state_bytes=_unique_bytes(state, seen, charge))
        tracers: list[_Tracer] = []
        first = _traced_step(model, st.batch, loss_fn, st.optimizer,
                             {"param": st.params, "buffer": st.buffers, "input": st.inputs}, lambda: None,
                             structure=True, memory="fake", tracers=tracers, charge_as=charge)
        advance()
        lifetimes = _forward_lifetimes(model, st.batch, loss_fn, [op.name for op in first.ops], fake=True)
        optimizer_name = type(st.optimizer).__name__
        advance()
    timer = timer or OpTimer(device, spec=device_spec, cache_dir=cache_dir)
    timings = timer.time([call for *_, call in first.calls])
    forward = {rec.scope: k for k, rec in enumerate(first.ops)}
    analytic: set[int] = set()
    optimizer_time_s = 0.0
    for (number, phase, clock, _call), timing in zip(first.calls, timings, strict=True):
        first.high[number] = timing.high_bytes
        if phase == "forward" and number in forward:
            rec = first.ops[forward[number]]
            rec.time_s = timing.time_s
            for tid, position in zip(rec.outputs, rec.positions, strict=True):
                # a kernel may return a view of a larger buffer than its meta function says (CPU mse_loss):
                # what the allocator holds is the real storage, seen when the call ran alone
                if position < len(timing.output_bytes):
                    st = first.storages[tid]
                    st.nbytes = max(st.nbytes, round_allocation(timing.output_bytes[position], device.type))
        elif phase == "backward":
            first.backward_time_s[clock] = first.backward_time_s.get(clock, 0.0) + timing.time_s
        elif phase == "optimizer":
            optimizer_time_s += timing.time_s
        if timing.source == "analytic" and phase in ("forward", "backward"):
            analytic.add(clock)
    tracers[0].apply_scratch()
    advance()
    stats = timer.stats
    meta = {
        "profiler": "memplan.planner.probe.profiler", "fake": True, "torch": torch.__version__,
        "optimizer": optimizer_name, "threads": torch.get_num_threads(),
        "device_name": device_spec.name if device_spec else (
            torch.cuda.get_device_name(device) if on_cuda else "cpu"),
        "device_spec": device_spec.name if device_spec else None,
        "traced_on": traced_on.type,
        "lifetimes_aligned": lifetimes is not None,
        "op_timing": {"calls": stats.calls, "distinct": stats.distinct, "cache_hits": stats.cache_hits,
                      "isolated_runs": stats.isolated_runs, "analytic": stats.analytic,
                      "cache_dir": str(timer.cache_dir)},
        "profile_peak_bytes": (torch.cuda.max_memory_allocated(device) if on_cuda
                               else resident + stats.peak_bytes),
    }
    bandwidth = device_spec.host_bandwidth_bytes_per_s if device_spec else _host_bandwidth(device)
    graph = _build_graph(first, [[op.time_s for op in first.ops]], [first.backward_time_s], fixed,
                         optimizer_time_s, name, device, model_fingerprint(model), bandwidth, meta, lifetimes)
    for op in graph.ops:
        op.time_source = "analytic" if op.id in analytic else "isolated"
    # the storages' view (the allocator's is not there to read)
    graph.fixed.optimizer_step_bytes = max_prefix(first.optimizer_events)
    # the plan runs on the same executor whichever way the graph was profiled (isolated op times need no
    # calibration: no tracing instrumentation was on while they ran)
    graph.replay_op_dispatch_s = REPLAY_OP_DISPATCH_S
    return graph


def _resident_bytes(model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer | None,
                    device: torch.device) -> int:
    """Bytes of the real tensors on ``device`` a fake profile's caller already holds (model, batch,
    optimizer state): what the allocator has in use before the profile allocates anything."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) if torch.cuda.is_available() else 0
    tensors = [t for t in itertools.chain(model.parameters(), model.buffers(), _tensors(batch))
               if t.device == device]
    if optimizer is not None:
        tensors += [t for s in optimizer.state.values() for t in _tensors(s) if t.device == device]
    return _unique_bytes(tensors, set())
