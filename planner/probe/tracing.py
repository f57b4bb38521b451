"""The tracing mode: what one real (or fake) training step does, recorded as a :class:`Trace`.

:func:`traced_step` runs :func:`memplan.planner.workloads.training_step` under :class:`Tracer`, a
``TorchDispatchMode`` that sees every ATen call below autograd (see :mod:`memplan.planner.probe.profiler`
for what it observes and how), with forward hooks keeping the module stack (:func:`module_stack`) and, after
forward, a walk of the autograd graph for the tensors each node saved (:func:`saved_by_node`).
:func:`forward_lifetimes` runs one more forward under saved-tensor hooks that hold nothing
(:class:`LifetimeMode`): when the program itself drops each storage. The trace is plain data; turning it
into a graph is :func:`memplan.planner.core.build.build_graph`'s job (torch-free).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.planner.core.build import Trace, TraceOp, TraceStorage
from memplan.planner.core.devicespec import round_allocation
from memplan.planner.core.errors import WorkloadError
from memplan.planner.core.graph import DETACH
from memplan.planner.probe.device import Device
from memplan.planner.probe.draws import Draws
from memplan.planner.probe.draws import refusal as draw_refusal
from memplan.planner.probe.fake import FakeTensor, FakeTraceError, ViewReplays, fake_call, written_tensors
from memplan.planner.probe.fusion import buckets
from memplan.planner.probe.hostheap import Shadow
from memplan.planner.probe.measure import allocation_highs, allocator_events
from memplan.planner.probe.optime import OpCall, record_call
from memplan.planner.probe.storage import dtype_name, storage_keys, storage_of, tensors_in
from memplan.planner.workloads import LossFn, compute_loss, training_step

TAG = "memplan_op"  # key of the forward op's number in an autograd node's metadata
# Metadata queries that reach a dispatch mode only for tensor subclasses (a FakeTensor's ``.device``, which
# autograd asks while it wires up an output): not ops of the program, never recorded.
METADATA = frozenset({torch.ops.prim.device.default, torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int,
                      torch.ops.aten.sym_numel.default, torch.ops.aten.sym_storage_offset.default})


# An autograd pass inside the step's forward: the ops of a backward node run before the loss is returned
AUTOGRAD_IN_FORWARD = (
    "loss_fn runs autograd inside the step's forward (in {where}: torch.autograd.grad or a backward before the "
    "loss is returned, as a gradient penalty, a second-order method or a physics-informed loss do); memplan "
    "plans a step whose forward builds the graph and whose one backward consumes it: train this loss without "
    "a plan")


class Tracer(TorchDispatchMode):
    """The dispatch mode behind :func:`traced_step`: records into ``trace`` what each ATen call of the step
    does. ``phase`` says what the step is doing ("forward", "backward", "optimizer"; "idle" records
    nothing); ``clock`` is the forward op or backward step the next events belong to."""

    def __init__(self, trace: Trace, modules: list[str], memory: str,
                 charge_as: str | None = None, device: Device | None = None):
        super().__init__()
        self.charge_as = charge_as       # device type whose allocator rounding applies (None: the tensor's)
        self.device = device or Device()  # whose allocator counters ("cuda") and clock are read
        self.trace = trace
        self.modules = modules           # the module stack, kept by forward hooks
        self.model_called = False
        self.memory = memory             # how to read kernel scratch: "off", "cuda" (the allocator's counters),
                                         # "cpu" (the allocator's reports in scopes),
                                         # "fake" (nothing runs: each call is recorded, timed later)
        self.scope = 0                   # calls so far; a call's number keys its high-water mark
        self.high: dict[int, int] = {}    # call number -> allocator high-water mark above its start
        self.born_in: dict[int, int] = {}  # backward call number -> bytes of the storages it created
        # fake steps: (call number, phase, clock, the call's metadata) per ATen call, for op timing
        self.calls: list[tuple[int, str, int, OpCall]] = []
        self.phase = "idle"
        self.clock = -1                  # forward op / backward step the next events belong to
        self.by_key: dict[int, int] = {}  # live storage _cdata -> storage id
        self.refs: dict[int, weakref.ref] = {}
        self.pending: tuple[int, list[torch.Tensor]] | None = None  # last op's outputs, for their grad_fn
        self.replays = ViewReplays()      # autograd's replays of fake views: not ops of the program
        self.draws = Draws()              # tensors whose values are a random draw's (branches on them)
        self.shadow: Shadow | None = None  # fake CPU steps: each new storage's shadow block (hostheap.py)
        self.scratch_due: tuple[str, Any] | None = None  # the last call's key and place: its kernel scratch
        self.stopwatch = self.device.stopwatch()  # times the calls as the device runs them
        self.laps: list[tuple[str, int, int]] = []  # (phase, forward op or backward step, lap) to settle

    # -- storages ---------------------------------------------------------------------------------------
    def charged(self, s: torch.UntypedStorage, t: torch.Tensor) -> int:
        """Bytes of ``t``'s storage ``s`` as the allocator of the graph's device charges them."""
        return round_allocation(s.nbytes(), self.charge_as or t.device.type)

    def register(self, t: torch.Tensor, kind: str) -> int | None:
        """The storage id of ``t``, registering its storage (as ``kind``) when new."""
        s = storage_of(t)
        if s is None:
            return None
        key = s._cdata
        tid = self.by_key.get(key)
        if tid is not None:
            return tid
        tid = len(self.trace.storages)
        born = (self.phase, self.clock) if kind == "activation" else None
        nbytes = self.charged(s, t)
        self.trace.storages.append(TraceStorage(tid, kind, nbytes, dtype_name(t.dtype), list(t.shape), born,
                                                requires_grad=kind != "activation" and t.requires_grad))
        self.by_key[key] = tid
        self.refs[tid] = weakref.ref(s, lambda _ref, tid=tid, key=key: self._died(tid, key))
        if self.shadow is not None and kind == "activation":
            self.shadow.born(s, (self.phase, self.clock))
        return tid

    def _died(self, tid: int, key: int) -> None:
        st = self.trace.storages[tid]
        st.died = (self.phase, self.clock)
        if self.by_key.get(key) == tid:
            del self.by_key[key]
        if self.phase == "backward":
            self.trace.backward_events.append((self.clock, tid, -st.nbytes))
        elif self.phase == "optimizer":
            self.trace.optimizer_events.append(-st.nbytes)

    # -- the dispatch hook ---------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in METADATA:  # a fake tensor's metadata query: no op of the program
            return func(*args, **kwargs)
        if self.phase == "forward":
            return self._forward(func, args, kwargs)
        if self.phase == "backward":
            return self._backward(func, args, kwargs)
        if self.phase == "optimizer":
            return self._optimizer(func, args, kwargs)
        return func(*args, **kwargs)

    def run_call(self, func, args, kwargs, done: tuple | None = None) -> tuple[Any, float, int]:
        """Run ``func``; return its result, seconds and its call number. With memory on, the allocator's
        high-water mark during the call (above the bytes allocated before it) goes to ``high[number]``:
        read at once on CUDA, and on CPU after the step from the torch profiler's allocation events,
        which land inside the ``memplan:<number>`` range opened here. ``done`` (fake steps only): the call
        ran already, its output inside. Timed on the device layer's :class:`Stopwatch` (CUDA: an event pair,
        no synchronisation: the step's kernels queue as they do untraced): the seconds returned are 0
        there, and :meth:`settle_times` gives the forward op or backward step its lap after the step."""
        self.scope += 1
        number = self.scope
        if self.memory == "fake":
            out = self._fake_call(func, args, kwargs) if done is None else done[0]
            if isinstance(func, torch._ops.OpOverload) and func.namespace != "profiler":  # not record_function
                self.calls.append((number, self.phase, self.clock, record_call(func, args, kwargs, out)))
                if self.shadow is not None:  # its kernel's scratch, after its outputs' blocks
                    self.scratch_due = (self.calls[-1][3].key, (self.phase, self.clock))
            return out, 0.0, number
        if self.memory == "cpu":
            with torch._C._profiler._RecordFunctionFast(f"memplan:{number}"):
                start = time.perf_counter()
                out = func(*args, **kwargs)
                return out, time.perf_counter() - start, number
        if self.memory == "cuda":  # the allocator's counters move as the host issues: no wait needed
            before = self.device.memory_allocated()
            self.device.reset_peak()
        mark = self.stopwatch.begin()
        out = func(*args, **kwargs)
        lap = self.stopwatch.end(mark)
        if self.phase in ("forward", "backward"):
            self.laps.append((self.phase, len(self.trace.ops) - 1 if self.phase == "forward" else self.clock, lap))
        if self.memory == "cuda":
            self.high[number] = self.device.max_memory_allocated() - before
        return out, 0.0, number

    def settle_times(self) -> None:
        """Give each forward op and backward step the laps of its calls (read after the step)."""
        if not self.laps:
            return
        seconds = self.stopwatch.seconds()
        for phase, k, lap in self.laps:
            if phase == "forward":
                self.trace.ops[k].time_s += seconds[lap]
            else:
                self.trace.backward_time_s[k] = self.trace.backward_time_s.get(k, 0.0) + seconds[lap]
        self.laps.clear()

    def _fake_call(self, func, args, kwargs):
        """``func`` on fake tensors; an op that cannot run so (its output depends on tensor values) is a
        :class:`FakeTraceError` naming it and the module that ran it."""
        if self.phase == "backward" and 0 <= self.clock < len(self.trace.ops):
            where = f"the backward of {self.trace.ops[self.clock].module or 'the model'}"
        elif self.phase == "optimizer":
            where = "the optimizer step"
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
        op = self.trace.ops[k]
        for out in outs:
            node = out.grad_fn
            if node is not None:
                op.has_backward = True
                meta = node.metadata
                meta.setdefault(TAG, k)
            tid = self.register(out, "activation")
            if tid is not None and self.trace.storages[tid].producer == k and out.requires_grad:
                self.trace.storages[tid].requires_grad = True
        del outs

    def _forward(self, func, args, kwargs):
        if self.replays.replaying(func, args):
            # autograd rebuilding a fake view's grad_fn (ViewReplays): not an op of the program, and the
            # pending outputs' grad_fn must not be read now (that view's mutex is held)
            out = self._fake_call(func, args, kwargs) if self.memory == "fake" else func(*args, **kwargs)
            self.replays.replayed(out)
            return out
        if self.memory == "fake":
            # perhaps autograd rebuilding a stale fake view before the op that reads it: held until that
            # op shows (ViewReplays), the pending outputs' grad_fn unread meanwhile
            return self.replays.route(func, args, kwargs, self.where(), self._record, self._fake_call)
        return self._record(func, args, kwargs)

    def settle_replays(self, args: tuple = (), kwargs: dict | None = None) -> None:
        """Record the held view calls that were the program's own (ViewReplays.settle), in order, before
        the call with ``args`` / ``kwargs`` (none given: the forward has ended)."""
        self.replays.flush(args, kwargs, self._record)

    def _record(self, func, args, kwargs, done: tuple | None = None, module: str | None = None):
        """Record forward call ``func`` as op k and run it (``done``: it ran already, its output inside)."""
        if done is None and torch._C._current_graph_task_id() != -1:
            raise WorkloadError(AUTOGRAD_IN_FORWARD.format(where=self.modules[-1] if self.modules else
                                                           ("loss" if self.model_called else "the step")))
        self.resolve_pending()
        k = len(self.trace.ops)
        self.clock = k
        fresh = func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
        inputs = [] if fresh else [self.register(t, "buffer") for t in tensors_in((args, kwargs))]
        writes = [self.register(t, "buffer") for t in written_tensors(func, args, kwargs)]
        if module is None:
            module = self.where()
        rec = TraceOp(str(func), module, 0.0, list(dict.fromkeys(i for i in inputs if i is not None)), [],
                        [w for w in dict.fromkeys(writes) if w is not None],
                        torch.Tag.nondeterministic_seeded in func.tags)
        self.trace.ops.append(rec)
        # a fake step runs a branch on a draw only where every value answers alike (fake.py): not one
        branch = self.draws.is_branch(func, args) and (self.memory != "fake" or isinstance(args[0], FakeTensor))
        try:
            out, rec.time_s, rec.scope = self.run_call(func, args, kwargs, done)
        except FakeTraceError as e:
            if not branch:
                raise
            raise FakeTraceError(draw_refusal(e.args[0], module)) from None
        if branch:
            self.trace.draw_branches.append(module or "the model")
        self.draws.note(func, args, kwargs, out)
        outs = tensors_in(out)
        for position, t in enumerate(outs):
            s = storage_of(t)
            if s is not None and s._cdata not in self.by_key:  # inputs are registered: this one is new
                tid = self.register(t, "activation")
                st = self.trace.storages[tid]
                st.producer, st.output_index = k, len(rec.outputs)
                rec.outputs.append(tid)
                rec.positions.append(position)
        self.pending = (k, outs)
        self.replay_scratch()
        self.replays.after_write(func, args, kwargs)
        if self.memory == "fake":
            self.replays.made(func, args, kwargs, out)
        return out

    def where(self) -> str:
        """The module a forward call now runs in (``loss`` after the model's call, ``""`` before it)."""
        if self.modules:
            return self.modules[-1]
        return "loss" if self.model_called else ""

    def _backward(self, func, args, kwargs):
        node = torch._C._current_autograd_node()
        if node is not None:
            step = node.metadata.get(TAG)
            if step is not None and step != self.clock:
                self.clock = step
                self.trace.backward_order.append(step)
        seen = storage_keys(args, kwargs)
        out, seconds, number = self.run_call(func, args, kwargs)
        self.trace.backward_time_s[self.clock] = self.trace.backward_time_s.get(self.clock, 0.0) + seconds
        born = 0
        for t in tensors_in(out):
            s = storage_of(t)
            if s is not None and s._cdata not in self.by_key and s._cdata not in seen:
                tid = self.register(t, "activation")
                born += self.trace.storages[tid].nbytes
                self.trace.backward_events.append((self.clock, tid, self.trace.storages[tid].nbytes))
        self.replay_scratch()
        if self.memory != "off":  # where its kernel scratch goes, once known (see apply_scratch)
            self.born_in[number] = born
            self.trace.backward_events.append((self.clock, -2, number))
        return out

    def apply_scratch(self) -> None:
        """Turn the high-water marks into workspace: a forward op's is what it reached beyond its outputs;
        a backward call's becomes a transient (+, -) event pair right after its births."""
        for rec in self.trace.ops:
            outputs = sum(self.trace.storages[o].nbytes for o in rec.outputs)
            rec.workspace_bytes = max(0, self.high.get(rec.scope, 0) - outputs)
        events = []
        for step, tid, value in self.trace.backward_events:
            if tid != -2:
                events.append((step, tid, value))
                continue
            extra = self.high.get(value, 0) - self.born_in.get(value, 0)
            if extra > 0:
                events += [(step, -1, extra), (step, -1, -extra)]
        self.trace.backward_events = events

    def _optimizer(self, func, args, kwargs):
        seen = storage_keys(args, kwargs)
        out = self.run_call(func, args, kwargs)[0] if self.memory == "fake" else func(*args, **kwargs)
        for t in tensors_in(out):
            s = storage_of(t)
            if s is not None and s._cdata not in self.by_key and s._cdata not in seen:
                tid = self.register(t, "activation")
                self.trace.optimizer_events.append(self.trace.storages[tid].nbytes)
        self.replay_scratch()
        return out

    def replay_scratch(self) -> None:
        """The shadow's replay of the last call's kernel scratch (hostheap.Shadow.kernel_scratch), once its
        outputs have their blocks: where it allocated them in a real step."""
        if self.scratch_due is not None and self.shadow is not None:
            key, where = self.scratch_due
            self.scratch_due = None
            self.shadow.kernel_scratch(key, where)


@contextlib.contextmanager
def module_stack(model: nn.Module, stack: list[str], tracer_ref: list[Tracer | None]) -> Iterator[None]:
    """Keep ``stack`` equal to the path of the module running now (forward pre/post hooks), and record each
    module call of a traced forward (its path and the ops it ran) in the tracer's ``trace.module_calls``."""
    handles = []
    opened: list[list | None] = []  # per module on the stack: its trace.module_calls entry, if recorded

    def pre(name: str):
        def hook(_module, _args):
            stack.append(name)
            tracer = tracer_ref[0]
            call = None
            if isinstance(tracer, Tracer) and tracer.phase == "forward":
                call = [name, len(tracer.trace.ops), -1]
                tracer.trace.module_calls.append(call)
            opened.append(call)
        return hook

    def post(_module, _args, _out):
        stack.pop()
        call = opened.pop() if opened else None
        tracer = tracer_ref[0]
        if call is not None and isinstance(tracer, Tracer):
            call[2] = len(tracer.trace.ops)
        if not stack and tracer is not None:
            tracer.model_called = True

    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(pre(name)))
        handles.append(module.register_forward_hook(post, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# ---- one traced step ---------------------------------------------------------------------------------------


def saved_by_node(loss: torch.Tensor, tracer: Tracer) -> dict[int, list[int]]:
    """Walk the autograd graph from the loss; return forward op -> storage ids its node saved.

    A saved tensor packed by saved-tensor hooks the program installed (``torch.utils.checkpoint``'s
    non-reentrant hooks, ``save_on_cpu``) is read packed, never unpacked: what its pack hook kept is what
    the step holds (checkpoint's holder: nothing; save_on_cpu: the host copy). Unpacking it here ran
    checkpoint's recomputation during the walk: the recomputed activations became every checkpointed node's
    "saved" tensors (a 4-block model checkpointed per block predicted 17.3 MB where it measured 6.8 MB).

    Such a checkpointed region's inputs, which its frame keeps for the recomputation, are read when backward
    reaches the region's last op (the first unpack recomputes the whole region) and held with the frame
    until the region's first op's backward: they are saved by those two ops. A plan that recomputed the
    input of GPT-2's first checkpointed block predicted it rebuilt at that block's first op's backward, and
    measured 32 KiB over its prediction."""
    out: dict[int, list[int]] = {}
    frames: dict[int, tuple[Any, list[int]]] = {}  # checkpoint frame -> the forward ops of its nodes
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
        hooked: list[Any] = []  # the node's SavedTensors that the program's own hooks packed
        for a in attrs_of[cls]:
            # a tensor attribute has a raw SavedTensor (``_raw_saved_self``): read packed where hooks packed
            # it, never unpacked; without hooks through the node (an output saved is only unpacked whole)
            raw = getattr(node, "_raw" + a, None)
            try:
                values.append(getattr(node, a) if raw is None or not _hooked(raw) else _packed(raw))
            except RuntimeError:  # released, or an undefined optional tensor
                continue
            if raw is not None:
                hooked.extend(r for r in (raw if isinstance(raw, (tuple, list)) else [raw]) if _hooked(r))
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            raw = node._raw_saved_tensors
            values.append(_packed(raw) if _hooked(raw) else node.saved_tensors)
            hooked.extend(r for r in raw if _hooked(r))
        tids = [tracer.register(t, "buffer") for t in tensors_in(values)]
        tids = list(dict.fromkeys(t for t in tids if t is not None))
        del values
        tag = node.metadata.get(TAG)
        if tag is not None:
            for frame in _checkpoint_frames(hooked):
                frames.setdefault(id(frame), (frame, []))[1].append(tag)
        if not tids:
            continue
        op = tag
        if op is None:  # untagged node: the latest op that produced one of its saved tensors
            storages = tracer.trace.storages
            producers = [storages[t].producer for t in tids if storages[t].producer is not None]
            if not producers:
                continue
            op = max(producers)
        out.setdefault(op, []).extend(tids)
    for frame, ops in frames.values():
        tids = [tracer.register(t, "buffer") for t in tensors_in(_frame_inputs(frame))]
        tids = [t for t in tids if t is not None]
        if tids and ops:  # read from the region's last op's backward until its first op's (the frame's life)
            for op in (max(ops), min(ops)):
                out.setdefault(op, []).extend(tids)
    return {op: list(dict.fromkeys(tids)) for op, tids in out.items()}


def _checkpoint_frames(hooked: list[Any]) -> list[Any]:
    """The ``torch.utils.checkpoint`` frames (non-reentrant) whose hooks packed the saved tensors ``hooked``:
    found in their unpack hooks' closures."""
    found: list[Any] = []
    for raw in hooked:
        for cell in getattr(raw.unpack_hook, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if type(value).__name__ == "_CheckpointFrame" and all(value is not f for f in found):
                found.append(value)
    return found


def _frame_inputs(frame: Any) -> list[Any]:
    """The inputs a checkpoint frame keeps for its recomputation: ``saved_args`` (SavedTensors, torch 2.12
    and later) or its input saver's saved tensors (earlier), unpacked (no hook of the program's packs them:
    they are saved outside the region)."""
    saved = getattr(frame, "saved_args", None)
    if saved:
        out = []
        for arg in saved:
            if hasattr(arg, "unpack") and getattr(arg, "unpack_hook", None) is None:
                try:
                    out.append(arg.unpack())
                except RuntimeError:
                    continue
        return out
    saver = getattr(getattr(frame, "input_saver", None), "grad_fn", None)
    if saver is not None:
        try:
            return list(saver.saved_tensors)
        except RuntimeError:
            return []
    return []


def _hooked(raw: Any) -> bool:
    if isinstance(raw, (tuple, list)):
        return any(_hooked(r) for r in raw)
    return getattr(raw, "unpack_hook", None) is not None


def _packed(raw: Any) -> Any:
    """Saved tensors as the step holds them: what the pack hook returned for one the program packed with
    hooks of its own (read, not unpacked), else the tensor."""
    if isinstance(raw, (tuple, list)):
        return [_packed(r) for r in raw]
    if raw.unpack_hook is not None:
        return raw.data
    try:
        return raw.unpack()
    except RuntimeError:  # a saved output cannot be unpacked alone: it is among the graph's tensors anyway
        return None


@contextlib.contextmanager
def _fusion_buckets(model: nn.Module, optimizer: torch.optim.Optimizer, tracer: Tracer) -> Iterator[None]:
    """Record in ``tracer.trace.fused_steps`` where backward makes each fusion bucket's gradients final
    (planner/probe/fusion.py: a bucket is stepped when the last of its parameters' gradients is), as the
    backward step running then, the bucket's owner and its gradients' bytes (charged as the step's storages
    are). A bucket some parameter of which gets no gradient is never stepped in backward: not recorded."""
    groups, bucket_of, module_buckets = buckets(model, optimizer)
    owner: dict[int, str] = {}
    for name, module in model.named_modules():
        for b in module_buckets.get(module, ()):
            owner.setdefault(b, name)
    ready = [0] * len(groups)
    grad_bytes = [0] * len(groups)

    def final(p: torch.Tensor) -> None:
        b = bucket_of[p]
        ready[b] += 1
        grad = p.grad
        storage = storage_of(grad) if grad is not None else None  # none counted for a sparse one, as elsewhere
        if storage is not None:
            grad_bytes[b] += tracer.charged(storage, grad)
        if ready[b] == len(groups[b]):
            tracer.trace.fused_steps.append((tracer.clock, owner.get(b, ""), grad_bytes[b]))

    handles = [p.register_post_accumulate_grad_hook(final) for p in bucket_of]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def traced_step(model: nn.Module, batch: Any, loss_fn: LossFn, optimizer: torch.optim.Optimizer,
                fixed_tensors: dict[str, list[torch.Tensor]], sync: Callable[[], None], *,
                structure: bool, memory: str = "off", charge_as: str | None = None,
                device: Device | None = None, shadow: Shadow | None = None) -> Tracer:
    """One :func:`memplan.planner.workloads.training_step` under a :class:`Tracer`; returns the tracer, whose
    ``trace`` is what the step did. ``fixed_tensors``: the ``"param"``, ``"buffer"`` and ``"input"``
    tensors, registered before the step. ``structure``: also record saved tensors (the graph walk) and
    trace the optimizer step; otherwise the optimizer step is only timed, outside the mode. ``memory``: how
    kernel scratch is read ("off", "cuda", "cpu", "fake"; see ``Tracer.run_call``); a fake step's marks
    are applied (``Tracer.apply_scratch``) by the caller once its calls are timed. ``charge_as``: the
    device type whose allocator rounding storage sizes get (None: their own); ``device``: the device layer
    whose counters and clock are read (None: a CPU's). ``shadow``: gives each storage the step creates its
    shadow block and counts the step's fresh pages by ``(phase, op)`` (a fake step on a CPU:
    :mod:`memplan.planner.probe.hostheap`)."""
    trace = Trace()
    stack: list[str] = []
    tracer = Tracer(trace, stack, memory, charge_as, device)
    tracer.shadow = shadow
    tracer_ref: list[Tracer | None] = [tracer]
    for kind in ("param", "buffer", "input"):
        for t in fixed_tensors[kind]:
            tracer.register(t, kind)
    trace.n_fixed = len(trace.storages)
    number = -1  # the optimizer step's call number (structure steps)

    def run_phase(phase: str, fn: Callable[[], Any]) -> Any:
        nonlocal number
        if phase == "forward":
            with module_stack(model, stack, tracer_ref), tracer:
                tracer.phase = "forward"
                loss = fn()
                tracer.settle_replays()
                tracer.resolve_pending()
                tracer.phase = "idle"
                if structure:
                    trace.saved = saved_by_node(loss, tracer)
            return loss
        if phase == "backward":
            with module_stack(model, stack, tracer_ref), tracer, \
                    _fusion_buckets(model, optimizer, tracer) if structure else contextlib.nullcontext():
                tracer.phase, tracer.clock = "backward", len(trace.ops) - 1
                fn()
                tracer.phase = "idle"
            for st in trace.storages:  # alive after backward: held by the caller (the loss, outputs)
                st.held = st.kind == "activation" and st.died is None
            return None
        if structure:
            with tracer:
                tracer.phase, tracer.clock = "optimizer", 0
                out, _, number = tracer.run_call(fn, (), {})
                tracer.phase = "idle"
            return out
        sync()
        start = time.perf_counter()
        out = fn()
        sync()  # CUDA: the step's kernels are asynchronous
        trace.optimizer_time_s = time.perf_counter() - start
        return out

    optimizer.zero_grad(set_to_none=True)  # the previous step's gradients go before anything is watched
    with allocator_events() if memory == "cpu" else contextlib.nullcontext() as prof, \
            shadow.step() if shadow is not None else contextlib.nullcontext():
        training_step(model, batch, loss_fn, optimizer, run_phase=run_phase)
    tracer_ref[0] = None
    tracer.settle_times()
    if memory == "cpu":
        charge = tracer.device.charged_bytes if tracer.device.emulated else None
        for name, high in allocation_highs(prof, charge).items():
            tracer.high[int(name.removeprefix("memplan:"))] = high
    if memory in ("cpu", "cuda"):  # a fake step's marks come from op timing (see the profiler's fake path)
        tracer.apply_scratch()
    if structure:
        trace.optimizer_scratch_bytes = tracer.high.get(number, 0)
        trace.optimizer_survivors_bytes = sum(
            st.nbytes for st in trace.storages if st.born == ("optimizer", 0) and st.died is None)
    return tracer


class LifetimeMode(TorchDispatchMode):
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
        self.replays = ViewReplays()     # autograd's replays of fake views: not ops of the program

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
        if func in METADATA:
            return func(*args, **kwargs)
        if self.replays.replaying(func, args):
            out = fake_call(func, args, kwargs, "the lifetime pass") if self.fake else func(*args, **kwargs)
            self.replays.replayed(out)
            return out
        if not self.fake:
            return self._record(func, args, kwargs)
        return self.replays.route(func, args, kwargs, "", self._record,  # held as the traced step holds it
                                  lambda f, a, kw: fake_call(f, a, kw, "the lifetime pass"))

    def settle(self, args: tuple = (), kwargs: dict | None = None) -> None:
        """Record the held view calls that were the program's own (as :meth:`Tracer.settle_replays`)."""
        self.replays.flush(args, kwargs, self._record)

    def _record(self, func, args, kwargs, done: tuple | None = None, module: str = ""):  # module: unused here
        for t in tensors_in((args, kwargs)):
            s = storage_of(t)
            if s is not None and s._cdata not in self.known:
                self._track(s, None)
        if done is not None:
            out = done[0]
        else:
            out = fake_call(func, args, kwargs, "the lifetime pass") if self.fake else func(*args, **kwargs)
        self.replays.after_write(func, args, kwargs)
        self.names.append(str(func))
        row: list[int | None] = []
        self.deaths.append(row)
        for t in tensors_in(out):
            s = storage_of(t)
            if s is not None and s._cdata not in self.known:
                self._track(s, row)
        if self.fake:
            self.replays.made(func, args, kwargs, out)
        return out


def forward_lifetimes(model: nn.Module, batch: Any, loss_fn: LossFn, names: list[str],
                       fake: bool = False) -> dict[tuple[int, int], int | None] | None:
    """{(forward op, output index): the graph op during which the program itself dropped that storage}
    from one more forward (model and loss, no backward) under saved-tensor hooks that hold nothing.
    ``names`` are the traced step's op names; the ``aten.detach`` autograd runs when it saves an output is
    not dispatched without its own hold, so those are skipped when aligning. None if the ops do not align
    (then the graph keeps what the traced step saw)."""
    mode = LifetimeMode(fake)
    with torch.autograd.graph.saved_tensors_hooks(lambda _t: None, lambda _p: None), mode:
        loss = compute_loss(model, batch, loss_fn)
        mode.settle()
        del loss
    at: list[int] = []  # lifetime-pass op -> graph op
    g = 0
    for name in mode.names:
        while g < len(names) and names[g] != name and names[g] == DETACH:
            g += 1
        if g >= len(names) or names[g] != name:
            return None
        at.append(g)
        g += 1
    if any(n != DETACH for n in names[g:]):
        return None
    out: dict[tuple[int, int], int | None] = {}
    for k, row in enumerate(mode.deaths):
        for j, died in enumerate(row):
            out[(at[k], j)] = None if died is None else at[died]
    return out
