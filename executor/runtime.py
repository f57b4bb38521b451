"""The run-time half of the executor: one training step's forward is watched op by op, every saved tensor
is mapped to its graph tensor id, and backward gets what the plan says it should.

How a step runs (see docs/model.md for the model it reproduces):

* **Ops.** A ``TorchDispatchMode`` counts forward ATen ops with the profiler's rules (the same helpers:
  a tensor is its storage; an output storage not seen before is a new tensor; ``lift_fresh`` reads
  nothing). Op *k* must carry the name of the graph's op *k*, and create as many new storages, or the
  step stops with :class:`PlanMismatch` naming the first divergent op. One difference is expected and
  skipped: with ``saved_tensors_hooks`` installed, autograd no longer dispatches the ``aten.detach`` it
  runs when it saves an op's output, and those detaches (no new storage, nothing saved) are in the graph.
* **Fast path.** The first step runs every op through the full handler above and learns each op's
  overload and its new storages' positions; later steps (``Step.fast``) compare an op's overload by
  identity and run it, and only the ops ``planner/core/watch.py`` says the plan needs (producers of tracked
  tensors, replayed ops) take the full handler, which maps just the tracked tensors to their ids.
* **Saved tensors** go through ``saved_tensors_hooks``. A *kept* one (and every parameter, buffer, input,
  or view of one: they are not activations) is returned as is. A *recomputed* one is packed as a handle
  (tensor id and view geometry), and autograd no longer holds its storage, which dies at its last forward
  use. An *offloaded* one is copied to its slot of the host pool as it is packed (one written in place
  later, a recurrent cell's gates, when its last writer has run) and packed as a handle.
* **Recompute** is the simulator's lazy replay, decided by the same function
  (:func:`memplan.planner.core.replay.replay`): when backward unpacks a missing tensor, its producer (and its
  in-place initialisers) are replayed from recipes recorded in forward (the ATen op, its non-tensor
  arguments, and references to its input storages by tensor id with their view geometry), recursively
  through missing inputs, in forward order. Replayed tensors that other saved-tensor handles still wait for stay until their last unpack
  (unless the plan says ``recompute_each``: rebuilt again for their own backward); the others die after
  their last use in the replay. A tensor an op reads before its in-place chain ends gets a scratch copy
  re-created up to that op (the replay's ``scratch``), dropped right after it. Only the ops the schedule's replays run are
  recorded. A replay is planned once per availability state and compiled on its first run
  (:class:`Segment`): later steps reuse the plan while they answer ``replay()``'s questions alike, and
  repeat the traced decisions on their own recipes while those keep their signatures
  (:func:`recipe_signature`), tracing afresh otherwise (``Executor.segment_stats`` counts which). Random ops replay under the RNG state captured before they ran (inside
  ``torch.random.fork_rng``, which restores the loop's stream), so dropout masks are identical. Arguments an op writes in place (batch norm's running
  statistics) are cloned for the replay, so a replay changes nothing but what it returns.
* **Pinning**: an activation that cannot be rebuilt (mutated in place later) but that a replay reads
  is held from its production until backward has passed the lowest step whose replay reads it, as the
  simulator charges it (its first pass finds these tensors; node pre-hooks tell how far backward is).
* **Events.** Each step logs what it performs (forward ops, copies both ways, replays with their ops) as
  :class:`memplan.planner.core.schedule.ScheduleEvent` in ``events``; prefetch points and pins come from the
  plan's schedule (``Executor.schedule``), so a test compares the two event for event.
* **Offload** uses one pinned host pool, allocated once from the plan and reused every step. On CUDA the
  device -> host copy runs on a dedicated copy stream after an event recorded on the compute stream;
  the device storage is held until the copy's event has completed (polled at each op boundary) and then
  released (no ``record_stream``). Prefetches start when backward reaches the op the plan names (a
  pre-hook on each op's autograd node); the buffer is allocated on the compute stream, filled on the copy
  stream, and compute waits on the copy's event before use. On CPU the same code copies synchronously.
"""

from __future__ import annotations

import bisect
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.planner.core.errors import MemplanError, PlanError, PlanMismatch
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action
from memplan.planner.core.replay import Replay, kept_by_replays, replay
from memplan.planner.core.schedule import ScheduleEvent
from memplan.planner.core.shapes import ShapeMatcher
from memplan.planner.core.simulator import static_facts
from memplan.planner.probe.storage import map_leaves, storage_of, tensors_in

if TYPE_CHECKING:
    from memplan.executor.apply import Executor

_DETACH = "aten.detach.default"
_FRESH = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
_NODE_TAG = "memplan_executor_op"


@dataclass(frozen=True)
class _Ref:
    """A tensor argument of a recorded op that lives in an activation storage: its tensor id and view."""

    tid: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class Recipe:
    """How to replay forward op ``k``: the ATen op, arguments with activations as :class:`_Ref`, the
    positions (in its flattened outputs) of its new storages and their tensor ids, and the RNG state.
    ``slots``: where the activations are when all of them are top-level arguments (positional index or
    keyword name, and the reference), so a replay fills them in without walking the arguments; None
    when one is nested (a list of tensors), and the replay maps the arguments' leaves."""

    func: Any
    args: Any
    kwargs: Any
    new: list[tuple[int, int]]
    rng: tuple[bytearray, bytearray | None] | None   # generator states (CPU, CUDA) as host bytes
    slots: list[tuple[int | str, _Ref]] | None = None


def _slots(args: tuple, kwargs: dict) -> list[tuple[int | str, _Ref]] | None:
    """The top-level positions of a recorded op's activation arguments, or None if one is nested."""
    out: list[tuple[int | str, _Ref]] = [(i, a) for i, a in enumerate(args) if type(a) is _Ref]
    out += [(k, a) for k, a in kwargs.items() if type(a) is _Ref]
    nested = [a for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple, dict))]
    return None if nested and any(type(x) is _Ref for x in _leaves(nested)) else out


def _leaves(x: Any) -> list[Any]:
    """Every leaf of nested arguments (lists, tuples, dict values)."""
    out: list[Any] = []
    map_leaves(out.append, x)
    return out


# ---- compiled replays -----------------------------------------------------------------------------
# A replay is planned by ``replay()`` from the step's answers to its questions about tensors (available?
# fetchable? retained?), and those are the same at the same point of every step: a Segment keeps the
# plan with the questions it asked and is reused when a later step answers them alike. Its first run is
# traced into CompiledOps: for each op where each activation argument comes from (the tensor an earlier
# op of the replay returned, a view of a storage it re-created, a view of a resident one), which written
# arguments are cloned, and what becomes of each new output; a later run repeats those decisions on that
# step's recipes as long as their signatures (recipe_signature) are the traced ones.
SEGMENTS_PER_TARGET = 4       # availability states remembered per target
COMPILED_PER_SEGMENT = 4      # recipe signatures (batch shapes of a shape family...) per segment
SIGNATURES_PER_OP = 8         # signatures remembered per recorded op
_AVAILABLE, _FETCHABLE, _RETAINED = 0, 1, 2   # replay()'s questions
_DIRECT, _MADE_VIEW, _RESIDENT = 0, 1, 2      # where an activation argument comes from
_DROP, _SCRATCH, _REBUILT = 0, 1, 2           # what becomes of a new output


@dataclass(frozen=True)
class CompiledOp:
    """One op of a compiled replay. ``op``: its id; ``signature``: the id of its recipe's signature when it
    was traced; ``fills``: (argument position or keyword, tensor id, source, view geometry (dtype, size,
    stride, offset) or None for a direct read) per activation argument, None when one is nested (the op is
    then run by ``Step._run``, argument leaf by leaf); ``clones``: written arguments cloned; ``roles``: per
    new output (the recipe's ``new`` order) dropped, kept as a scratch copy, or rebuilt; ``frees``: the
    re-created tensors freed after it."""

    op: int
    signature: int
    fills: tuple[tuple[int | str, int, int, tuple | None], ...] | None
    clones: tuple[int | str, ...]
    roles: tuple[int, ...]
    frees: tuple[int, ...]


@dataclass
class Segment:
    """A planned replay (``replay``), the questions ``replay()`` asked to plan it with their answers
    ((question, tensor id, answer)), and its compilations, newest first."""

    replay: Replay
    questions: tuple[tuple[int, int, bool], ...]
    compiled: list[tuple[CompiledOp, ...]] = field(default_factory=list)


_PLAIN = frozenset((type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.layout,
                    torch.memory_format, _Ref))


def recipe_signature(rec: Recipe) -> tuple | None:
    """What a compiled op depends on in a recipe: the ATen op, its new outputs' positions, and its
    arguments with every tensor replaced by its geometry (dtype, device, size, stride, offset), lists as
    tuples, and constants as they are. Two recipes with equal signatures are replayed with the same
    decisions. None when an argument is of a kind that cannot be compared safely (the op then always runs
    traced)."""
    try:
        return (rec.func, tuple(rec.new), tuple(_leaf_signature(a) for a in rec.args),
                tuple(sorted((k, _leaf_signature(v)) for k, v in rec.kwargs.items())))
    except TypeError:
        return None


def _leaf_signature(x: Any) -> Any:
    if type(x) in _PLAIN:
        return x
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, x.device, tuple(x.size()), tuple(x.stride()), x.storage_offset())
    if isinstance(x, (list, tuple)):
        return tuple(_leaf_signature(y) for y in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _leaf_signature(v)) for k, v in x.items()))
    raise TypeError(f"{type(x).__name__} in a recipe's arguments")

class Packed:
    """What autograd holds instead of a recomputed or offloaded tensor."""

    __slots__ = ("step", "tid", "dtype", "size", "stride", "offset")

    def __init__(self, step: Step, tid: int, t: torch.Tensor):
        self.step = step
        self.tid = tid
        self.dtype = t.dtype
        self.size = tuple(t.size())
        self.stride = tuple(t.stride())
        self.offset = t.storage_offset()


def _view(storage: torch.UntypedStorage, dtype: torch.dtype, size, stride, offset: int,
          device: torch.device | None = None) -> torch.Tensor:
    """A tensor over ``storage`` with this geometry (``device``: the storage's, when the caller knows it:
    reading ``storage.device`` costs as much as building the view)."""
    return torch.empty(0, dtype=dtype, device=device or storage.device).set_(storage, offset, size, stride)


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return _view(storage, torch.uint8, (storage.nbytes(),), (1,), 0)


class HostPool:
    """One host buffer (pinned on CUDA) with a fixed slot per offloaded tensor id, allocated once."""

    ALIGN = 512

    def __init__(self, graph: Graph, tids: list[int], pin: bool):
        self.slots: dict[int, tuple[int, int]] = {}
        at = 0
        for t in tids:
            n = graph.tensors[t].bytes
            self.slots[t] = (at, n)
            at += -(-n // self.ALIGN) * self.ALIGN
        self.bytes = at
        self.buffer = torch.empty(at, dtype=torch.uint8, pin_memory=pin) if at else None

    def slot(self, tid: int, nbytes: int) -> torch.Tensor:
        start, n = self.slots[tid]
        if nbytes > n:
            raise PlanMismatch(f"offloaded tensor {tid} has {nbytes} bytes at run time, {n} in the graph")
        return self.buffer[start:start + nbytes]


class StepMode(TorchDispatchMode):
    """Counts forward ops for the executor's current step; passes everything else through."""

    def __init__(self, ex: Executor):
        super().__init__()
        self.ex = ex

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # runs eagerly only; the dynamo-disable wrapper costs more than the handler itself

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        ex = self.ex
        step = ex.step_state
        if (step is None or step.forward_done or ex.busy
                or torch._C._current_autograd_node() is not None):
            return func(*args, **kwargs)
        if step.fast:
            # the fast path: an op the plan decides nothing about, the graph's op at this position (its
            # overload learned by the first step): count it and run it
            k = step.cursor
            if k < step.n_fast and func is ex.funcs[k] and not ex.needed[k]:
                step.cursor = k + 1
                step.log.append(k)
                return func(*args, **kwargs)
        return step.forward_op(func, args, kwargs)


class Step:
    """One forward and its backward under the plan."""

    def __init__(self, ex: Executor):
        self.ex = ex
        self.g = ex.graph
        self.cursor = 0
        self.forward_done = False
        self.backward_started = False
        self.by_key: dict[int, tuple[int, weakref.ref]] = {}   # live storage -> (tensor id or -1, its weakref)
        self.storages: dict[int, weakref.ref] = {}              # tensor id -> weakref to its storage
        self.recipes: dict[int, Recipe] = {}
        self.pending_unpacks: Counter[int] = Counter()          # tensor id -> handles not yet unpacked
        self.cache: dict[int, torch.UntypedStorage] = {}        # rebuilt / fetched, awaiting unpacks
        self.host: dict[int, tuple[torch.Tensor, torch.device, int]] = {}  # offloaded: slot, device, bytes
        self.d2h_pending: list[tuple[Any, torch.Tensor]] = []   # (copy done event, device bytes held)
        self.ready: dict[int, tuple[Any, torch.device]] = {}    # prefetched id -> (copy done event, device)
        self.pending_outs: tuple[int, list[torch.Tensor]] | None = None
        self.pinned: dict[int, torch.UntypedStorage] = {}        # held for a replay that reads them
        self.prefetch_queue = list(ex.prefetch_order)          # (-prefetch_at, tid), ascending
        self.replays = 0
        self.signature_ids: dict[int, int] = {}                # recorded op -> its recipe's signature id
        # what it performed, in the schedule's terms (``events``): an int k >= 0 is forward op k computed,
        # -1 - k autograd's detach k passed undispatched, a range forward ops run without the mode,
        # anything else a ScheduleEvent
        self.log: list[Any] = []
        # after the first step: ops the plan decides nothing about take the mode's fast path, and only
        # tracked tensors (planner/core/watch.py) are mapped to the graph
        self.fast = ex.learned
        self.n_fast = ex.last_real_op + 1
        self.boundary = 0                                      # module boundaries passed (fast steps)
        self.failed = False
        self.rng_device = None
        self.shapes = ShapeMatcher(ex.family, self.g) if ex.family is not None else None
        # offloaded tensors written in place after their first saver: copied when the last writer has run,
        # as the simulator does (static_facts.d2h_after); op -> {tensor id: its storage}
        self.d2h_after = static_facts(self.g).d2h_after
        self.deferred: dict[int, dict[int, torch.UntypedStorage]] = {}
        self.unwatched_from: int | None = None                 # forward op from which the step ran unwatched
        if ex.watch and not self.fast:
            for p in ex.fixed_tensors:
                self._see(p, -1)

    @property
    def events(self) -> list[ScheduleEvent]:
        """What the step performed, in the schedule's terms (:class:`ScheduleEvent`), in order."""
        ops = self.g.ops
        out: list[ScheduleEvent] = []
        for e in self.log:
            if isinstance(e, int) and e < 0:
                out.append(ScheduleEvent("compute", "forward", -1 - e, reason=f"{_DETACH} (autograd's, not "
                                                                              f"dispatched under saved-tensor hooks)"))
            elif isinstance(e, int):
                out.append(ScheduleEvent("compute", "forward", e, reason=ops[e].name))
            elif isinstance(e, range):
                out.extend(ScheduleEvent("compute", "forward", k, reason=f"{ops[k].name} (not watched: outside "
                                                                          f"the plan's decisions)") for k in e)
            else:
                out.append(e)
        return out

    # ---- storages ----------------------------------------------------------------------------
    def _see(self, t: torch.Tensor, tid: int) -> int | None:
        """Register ``t``'s storage (as tensor ``tid``, -1 for a non-activation) unless known; return
        its tensor id (-1 for non-activations), None for tensors without storage."""
        s = storage_of(t)
        if s is None:
            return None
        key = s._cdata
        known = self.by_key.get(key)
        if known is not None:
            return known[0]
        by_key = self.by_key

        def died(ref: weakref.ref, key: int = key) -> None:
            entry = by_key.get(key)
            if entry is not None and entry[1] is ref:
                del by_key[key]

        ref = weakref.ref(s, died)
        by_key[key] = (tid, ref)
        if tid >= 0:
            self.storages[tid] = ref
        return tid

    def available(self, tid: int) -> torch.UntypedStorage | None:
        s = self.cache.get(tid)
        if s is not None:
            return s
        ref = self.storages.get(tid)
        return ref() if ref is not None else None

    # ---- forward -----------------------------------------------------------------------------
    def _match(self, name: str) -> int:
        ops = self.g.ops
        while self.cursor < len(ops) and ops[self.cursor].name != name and ops[self.cursor].name == _DETACH:
            self._passed_detach()  # the detach autograd runs when saving an output is gone under hooks
        k = self.cursor
        if k >= len(ops):
            self._fail(f"the model ran more forward ops than the profiled graph's {len(ops)}: "
                       f"{name} has no counterpart; re-profile and re-solve for this model and batch")
        if ops[k].name != name:
            self._fail(f"forward op {k} differs from the profiled graph: the plan expects "
                       f"{ops[k].name} (module {ops[k].module or '?'}), the model ran {name}; "
                       f"re-profile and re-solve for this model and batch")
        self.cursor += 1
        return k

    def _passed_detach(self) -> None:
        """Step over a graph detach that autograd no longer dispatches under saved-tensor hooks (it
        creates nothing and saves nothing): the step has reached that position all the same."""
        self.log.append(-1 - self.cursor)  # (``events`` spells it out)
        self.cursor += 1

    def forward_op(self, func, args, kwargs):
        """The full handler: a needed op (planner/core/watch.py), or any op of the first watched step,
        which also learns what later steps' fast path uses (the op's overload, its new storages'
        positions)."""
        if self.pending_outs is not None:
            self.resolve_pending()
        if self.d2h_pending:
            self.poll_d2h()
        if self.cursor > self.ex.last_real_op:
            # every op of the graph has run: what follows (backward's seed ``ones_like``, metrics) is
            # not the model's step
            self.forward_done = True
            if not self.fast and not self.failed:
                self.ex.learn()
            return func(*args, **kwargs)
        ex = self.ex
        k = self.cursor
        if self.fast and k < self.n_fast and func is ex.funcs[k]:
            self.cursor = k + 1
        else:
            name = _NAMES.get(func)
            if name is None:
                name = _NAMES[func] = str(func)
            k = self._match(name)
        self.log.append(k)
        op = self.g.ops[k]
        positions = ex.new_positions[k] if self.fast else None
        learn = positions is None
        record = k in ex.recorded_ops  # only the ops a replay of the schedule runs
        fused = ex.fused is not None and ex.fused.pending_keys
        inputs = [] if func in _FRESH or not (learn or fused or record) else tensors_in((args, kwargs))
        if learn:  # every storage is seen, so that a new one is known as new
            for t in inputs:
                self._see(t, -1)
        if fused:
            ex.fused.check_not_pending(inputs, op)
        rng = None
        if record:
            args_r = self._refs(args)
            kwargs_r = {key: self._refs(v) for key, v in kwargs.items()} if kwargs else kwargs
            if k in ex.rng_ops:
                rng = self._capture_rng(inputs)
        out = func(*args, **kwargs)
        for tid, s in self.deferred.pop(k, {}).items():  # its last in-place writer has run
            self._offload(tid, s)
        outs = tensors_in(out)
        if learn:
            new = self._new_outputs(k, op, outs)
            if not self.fast:
                ex.funcs[k] = func
                ex.new_positions[k] = tuple(pos for pos, _ in new)
        else:
            new = list(zip(positions, op.outputs, strict=True))
            for pos, tid in new:
                t = outs[pos]
                s = t.untyped_storage()
                self._check_output(k, op, t, s, tid)
                self._see(t, tid)
                if tid in ex.pins:
                    self.pinned[tid] = s
        if record:
            self.recipes[k] = Recipe(func, args_r, kwargs_r, new, rng, _slots(args_r, kwargs_r))
        if ex.tag_nodes:
            self.pending_outs = (k, outs)
        return out

    def _new_outputs(self, k: int, op, outs: list[torch.Tensor]) -> list[tuple[int, int]]:
        """Map op ``k``'s new output storages (not seen before) to its graph outputs, in order; checked
        against the graph (count, bytes, shape, dtype). Returns (position in ``outs``, tensor id) pairs."""
        ex = self.ex
        new: list[tuple[int, int]] = []
        for pos, t in enumerate(outs):
            s = storage_of(t)
            if s is None or s._cdata in self.by_key:
                continue
            if len(new) >= len(op.outputs):
                self._fail(f"forward op {k} ({op.name}, module {op.module or '?'}) created more new "
                           f"tensors than the profiled graph's {len(op.outputs)}; re-profile")
            tid = op.outputs[len(new)]
            self._check_output(k, op, t, s, tid)
            self._see(t, tid)
            new.append((pos, tid))
            if tid in ex.pins:  # cannot be rebuilt, and a replay reads it: hold it (docs/model.md, pinning)
                self.pinned[tid] = s
        if len(new) != len(op.outputs):
            self._fail(f"forward op {k} ({op.name}, module {op.module or '?'}) created {len(new)} new "
                       f"tensors, the profiled graph {len(op.outputs)}; re-profile")
        return new

    def _check_output(self, k: int, op, t: torch.Tensor, s: torch.UntypedStorage, tid: int) -> None:
        """Same op names are not the same step: a different batch or width runs the same ops on other
        shapes, and the plan's bytes (and the host pool's slots) would be wrong. Compare what the graph
        recorded for the storage: its bytes, and the shape and dtype of the tensor that created it."""
        expected = self.ex.expected_outputs.get(tid)
        if expected is not None and t.dtype is expected[0] and s.nbytes() == expected[1] and t.shape == expected[2]:
            return  # as the graph has it (the common case, compared on torch's own types)
        info = self.g.tensors[tid]
        dtype = str(t.dtype).removeprefix("torch.")
        if s.nbytes() == info.bytes and list(t.shape) == info.shape and dtype == info.dtype:
            self.ex.expected_outputs[tid] = (t.dtype, info.bytes, t.shape)
        else:
            if self.shapes is not None:  # a graph with a shape family: any shape of it up to the graph's
                problem = self.shapes.check(tid, dtype, list(t.shape), s.nbytes())
                if problem is None:
                    return
                self._fail(f"forward op {k} ({op.name}, module {op.module or '?'}): {problem}; re-profile "
                           f"the family up to this shape and re-solve")
            self._fail(f"forward op {k} ({op.name}, module {op.module or '?'}) made tensor {tid} as "
                       f"{dtype}{list(t.shape)} ({s.nbytes()} B); the profiled graph has "
                       f"{info.dtype}{info.shape} ({info.bytes} B): the batch or the model differs from the "
                       f"profiled one; re-profile and re-solve for this model and batch")

    def _fail(self, message: str) -> NoReturn:
        """Abandon the step, then raise: the dispatch mode and the saved-tensor hooks stay entered until
        the next forward, ``optimizer.step()`` or ``remove()`` (they cannot be left from inside a dispatch),
        and an abandoned step lets every op through instead of raising again."""
        self.forward_done = True
        self.failed = True
        raise PlanMismatch(message)

    def _refs(self, x: Any) -> Any:
        """``x`` (an op's argument or its argument tuple) with activations as :class:`_Ref`: what
        ``map_leaves(self._ref, x)`` returns, without walking lists of numbers (sizes, dims) leaf by leaf."""
        if isinstance(x, torch.Tensor):
            return self._ref(x)
        if type(x) is tuple or type(x) is list:
            if not any(isinstance(y, (torch.Tensor, list, tuple, dict)) for y in x):
                return x
            out = [self._refs(y) for y in x]
            return out if type(x) is list else tuple(out)
        if isinstance(x, (tuple, list, dict)):  # namedtuples and dicts: the general walk
            return map_leaves(self._ref, x)
        return x

    def _ref(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        entry = self.by_key.get(_storage_key(x))
        if entry is None or entry[0] < 0:
            return x  # a parameter, buffer, input or constant: alive anyway, held as is
        return _Ref(entry[0], x.dtype, tuple(x.size()), tuple(x.stride()), x.storage_offset())

    def _capture_rng(self, inputs: list[torch.Tensor]) -> tuple[bytearray, bytearray | None]:
        """The generator states before a random op, kept as host bytes: they are bookkeeping, not
        activations (on CUDA the generator state is host memory anyway), and as tensors on CPU each
        5 KiB mt19937 state would sit in the allocator that the measured peak reads, all step long."""
        cuda = next((t.device for t in inputs if t.device.type == "cuda"), None)
        self.rng_device = cuda
        cpu_state = bytearray(torch.get_rng_state().numpy().tobytes())
        return cpu_state, (bytearray(torch.cuda.get_rng_state(cuda).numpy().tobytes()) if cuda is not None
                           else None)

    def resolve_pending(self) -> None:
        """Hook the autograd node of the previous op's outputs (set once its dispatch returned), so that
        backward reaching it starts the prefetches scheduled there."""
        if self.pending_outs is None:
            return
        k, outs = self.pending_outs
        self.pending_outs = None
        for t in outs:
            node = t.grad_fn
            if node is not None and _NODE_TAG not in node.metadata:
                node.metadata[_NODE_TAG] = k
                step = weakref.ref(self)
                node.register_prehook(lambda _grads, k=k, step=step: _reached(step, k))

    # ---- saved tensors -----------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        entry = self.by_key.get(_storage_key(t))
        if entry is None or entry[0] < 0:
            return t  # not an activation of this step: parameters and their views are never moved
        tid = entry[0]
        action = self.ex.actions.get(tid, Action.KEEP)
        if action == Action.KEEP:
            return t
        if action == Action.OFFLOAD:
            s = t.untyped_storage()
            writer = self.d2h_after.get(tid)
            if writer is not None and writer >= self.cursor:  # written in place later: copied after it
                self.deferred.setdefault(writer, {})[tid] = s
            else:
                self._offload(tid, s)
        self.pending_unpacks[tid] += 1
        return Packed(self, tid, t)

    def unpack(self, p: Packed) -> torch.Tensor:
        self.begin_backward()
        tid = p.tid
        s = self.available(tid)
        if s is None:
            if tid in self.host:
                s = self._prefetch(tid, "late: needed by its backward step")
            else:
                self._replay(tid)
                s = self.cache[tid]
        self._wait_ready(tid)  # compute waits for the prefetch's copy (exposed transfer time)
        view = _view(s, p.dtype, p.size, p.stride, p.offset)
        self.pending_unpacks[tid] -= 1
        if self.pending_unpacks[tid] <= 0:
            self.cache.pop(tid, None)  # the last handle: autograd's use of `view` is the last reference
        return view

    def begin_backward(self) -> None:
        if self.backward_started:
            return
        self.backward_started = True
        if self.unwatched_from is not None:
            # the ops after the plan's last decision ran without the mode (the executor left it at a
            # module boundary): in the schedule's terms, they were computed all the same
            self.log.append(range(self.unwatched_from, len(self.g.ops)))
        # Called from inside the engine (an unpack or a node pre-hook), so the callback runs when this
        # backward pass ends: what the step still holds is released there, not when the next step
        # replaces it (``Executor.last_step`` keeps the step for inspection).
        if torch._C._current_graph_task_id() != -1:  # not when a saved tensor is read outside backward
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
        self.end_forward()

    def end_backward(self) -> None:
        """Backward is over: drop pinned tensors, rebuilt or fetched tensors no handle asked for, and the
        device sources of finished copies (docs/model.md releases every activation by the end of
        backward; only the caller's own references, the loss and outputs, outlive it)."""
        self.pinned.clear()
        self.cache.clear()
        for tid in list(self.ready):  # fetched, never read: its copy must end before the buffer is freed
            self._wait_ready(tid)
        for ev, src in self.d2h_pending:  # never free a source its copy may still read
            torch.cuda.current_stream(src.device).wait_event(ev)
        self.d2h_pending = []

    def _wait_ready(self, tid: int) -> None:
        """Make the compute stream wait for tensor ``tid``'s prefetch copy (exposed transfer time), once."""
        entry = self.ready.pop(tid, None)
        if entry is not None:
            ev, device = entry
            torch.cuda.current_stream(device).wait_event(ev)

    def enter(self, cursor: int) -> None:
        """The mode is entered at a module boundary where the first watched step had run ``cursor`` ops:
        those ran unwatched (nothing of the plan happens before its first decision)."""
        self.log.append(range(self.cursor, cursor))
        self.cursor = cursor

    def end_forward(self) -> None:
        if self.forward_done:
            return
        self.resolve_pending()
        self.forward_done = True
        ops = self.g.ops
        rest = [k for k in range(self.cursor, len(ops)) if ops[k].name != _DETACH]
        while not rest and self.cursor < len(ops):
            self._passed_detach()
        if rest:
            k = rest[0]
            raise PlanMismatch(f"the forward ended after {self.cursor} ops, but the profiled graph has "
                               f"{len(ops)}: op {k} ({ops[k].name}, module {ops[k].module or '?'}) never ran; "
                               f"re-profile and re-solve for this model and batch")
        if not self.fast and not self.failed and self.ex.watch:
            self.ex.learn()

    # ---- offload -----------------------------------------------------------------------------
    def _offload(self, tid: int, s: torch.UntypedStorage) -> None:
        if tid in self.host:
            return
        ex = self.ex
        with ex.internal():
            src = _byte_view(s)
            dst = ex.pool.slot(tid, s.nbytes())
            if s.device.type == "cuda":
                produced = torch.cuda.Event()
                produced.record(torch.cuda.current_stream(s.device))
                with torch.cuda.stream(ex.copy_stream):
                    ex.copy_stream.wait_event(produced)  # the copy starts after the producing op
                    dst.copy_(src, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(ex.copy_stream)
                # hold the device storage until the copy has read it; released at an op boundary after
                self.d2h_pending.append((done, src))
            else:
                dst.copy_(src)  # CPU fallback: synchronous, the device memory is free to go at once
        self.host[tid] = (dst, s.device, s.nbytes())
        self.log.append(ScheduleEvent("d2h", "forward", self.cursor - 1, tid, reason="offloaded"))

    def poll_d2h(self) -> None:
        if self.d2h_pending:
            self.d2h_pending = [(e, t) for e, t in self.d2h_pending if not e.query()]

    def _prefetch(self, tid: int, why: str, at: int | None = None) -> torch.UntypedStorage:
        """Start the copy back of an offloaded tensor (its device buffer counts from now)."""
        s = self.available(tid)
        if s is not None:
            return s  # never released (its copy ran late, or the caller holds it): nothing moves
        self.log.append(ScheduleEvent("h2d", "backward", at, tid, reason=why))
        src, device, nbytes = self.host[tid]
        ex = self.ex
        with ex.internal():
            dst = torch.empty(nbytes, dtype=torch.uint8, device=device)  # allocated on the compute stream
            if device.type == "cuda":
                allocated = torch.cuda.Event()
                allocated.record(torch.cuda.current_stream(device))
                with torch.cuda.stream(ex.copy_stream):
                    ex.copy_stream.wait_event(allocated)
                    dst.copy_(src, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(ex.copy_stream)
                self.ready[tid] = (done, device)
            else:
                dst.copy_(src)
        s = dst.untyped_storage()
        self.cache[tid] = s
        self.storages[tid] = weakref.ref(s)  # found while anyone holds it (see _replay)
        return s

    def reached(self, k: int) -> None:
        """Backward is about to run op ``k``'s step: start the prefetches scheduled at or above it."""
        self.begin_backward()
        self.poll_d2h()
        if self.pinned:  # steps above k are done: release what only their replays read
            pins = self.ex.pins
            for tid in [t for t in self.pinned if pins[t] > k]:
                del self.pinned[tid]
        q = self.prefetch_queue
        while q and -q[0][0] >= k:
            _, tid = q.pop(0)
            if tid in self.host and self.pending_unpacks[tid] > 0:
                self._prefetch(tid, f"scheduled at op {k}", k)

    # ---- recompute -----------------------------------------------------------------------------
    def _replay(self, target: int) -> None:
        """Rebuild ``target`` by the replay :func:`memplan.planner.core.replay.replay` defines (the one the
        simulator charges): fetch what it needs from the host, run its ops in forward order, drop what it
        made after its last use unless a handle still waits for it; leaves the target in ``self.cache``.

        The replay is planned once per availability state and compiled on its first run
        (:class:`Segment`, :meth:`_segment`); later replays of the same target in the same state (the same
        point of a later step) run the compiled ops while this step's recipes have the signatures they
        were compiled from, and are traced afresh otherwise."""
        g = self.g
        seg = self._segment(target)
        r = seg.replay
        recipes = self.recipes
        lost = next((p for p in r.ops if p not in recipes), None)
        if lost is not None:
            raise PlanError(f"backward needs tensor {target}, whose recomputation runs op {lost} "
                            f"({g.ops[lost].name}), which forward did not record")
        for u in r.fetches:
            self._prefetch(u, f"needed to recompute tensor {target}")
        self.log.append(ScheduleEvent("replay", "backward", None, target, r.ops))
        made: dict[int, torch.UntypedStorage] = {}
        made_tensors: dict[int, torch.Tensor] = {}  # the op's own output: a reader with its view takes it as is
        ex = self.ex
        stats = ex.segment_stats
        busy, ex.busy = ex.busy, True  # the executor's own ops (Executor.internal, without its generator)
        grad = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        try:
            compiled = self._compiled(seg) if ex.reuse_replays else None
            if compiled is not None:
                stats["compiled reused"] += 1
                self._run_compiled(compiled, made, made_tensors)
            else:
                stats["recompiled" if seg.compiled else "compiled"] += 1
                seg.compiled.insert(0, self._run_traced(r, made, made_tensors))
                del seg.compiled[COMPILED_PER_SEGMENT:]
        finally:
            torch.set_grad_enabled(grad)
            ex.busy = busy
        for u in r.kept:
            self.cache[u] = made[u]

    def _segment(self, target: int) -> Segment:
        """The replay of ``target`` from this step's state: a cached :class:`Segment` whose recorded
        questions this step answers the same (``replay()`` is a function of those answers), else a new
        one planned by :func:`memplan.planner.core.replay.replay` (refused if blocked) and cached."""
        ex = self.ex
        candidates = ex.segments.get(target) if ex.reuse_replays else None
        if candidates:
            answer = self._answer
            for seg in candidates:
                if all(answer(kind, u) is a for kind, u, a in seg.questions):
                    ex.segment_stats["plan reused"] += 1
                    return seg
        asked: dict[tuple[int, int], bool] = {}

        def recorded(kind: int) -> Any:
            def predicate(u: int) -> bool:
                a = asked[kind, u] = self._answer(kind, u)
                return a
            return predicate

        r = replay(self.g, target, available=recorded(_AVAILABLE), fetchable=recorded(_FETCHABLE),
                   retain=recorded(_RETAINED))
        r.check(self.g)
        seg = Segment(r, tuple((kind, u, a) for (kind, u), a in asked.items()))
        if candidates is None:
            candidates = ex.segments[target] = []
        candidates.insert(0, seg)
        del candidates[SEGMENTS_PER_TARGET:]
        ex.segment_stats["planned"] += 1
        return seg

    def _answer(self, kind: int, u: int) -> bool:
        """The step's answer to one of ``replay()``'s questions about tensor ``u``."""
        if kind == _AVAILABLE:
            return self.available(u) is not None
        if kind == _FETCHABLE:
            return u in self.host
        return self.pending_unpacks[u] > 0 and kept_by_replays(self.ex.actions.get(u, Action.KEEP))

    def _signature_id(self, p: int) -> int:
        """The id of recorded op ``p``'s recipe signature (:func:`recipe_signature`) among those the
        executor has seen for ``p`` (computed once per step); -1 when it has none (the op is never run
        compiled)."""
        i = self.signature_ids.get(p)
        if i is None:
            sig = recipe_signature(self.recipes[p])
            i = -1 if sig is None else self.ex.signature_id(p, sig)
            self.signature_ids[p] = i
        return i

    def _compiled(self, seg: Segment) -> tuple[CompiledOp, ...] | None:
        """A compilation of ``seg`` whose ops' recipe signatures equal this step's, if any."""
        sig = self._signature_id
        for ops in seg.compiled:
            if all(op.signature == sig(op.op) and op.signature >= 0 for op in ops):
                return ops
        return None

    def _run_traced(self, r: Replay, made: dict[int, torch.UntypedStorage],
                    made_tensors: dict[int, torch.Tensor]) -> tuple[CompiledOp, ...]:
        """Run replay ``r`` op by op, deciding every argument and output as it goes, and return those
        decisions as compiled ops (:meth:`_run_compiled` repeats them)."""
        rebuilds = set(r.rebuilds)
        scratch = set(r.scratch)
        compiled: list[CompiledOp] = []
        for p, freed in zip(r.ops, r.frees_after, strict=True):
            fills: list[tuple[int | str, int, int, tuple | None]] = []
            clones: list[int | str] = []
            roles: list[int] = []
            for tid, s, t in self._run(p, made, made_tensors, fills, clones):
                if tid in scratch:  # a private copy read mid-chain: shadows the resident one, not found
                    made[tid] = s
                    made_tensors[tid] = t
                    roles.append(_SCRATCH)
                elif tid in rebuilds and tid not in made:
                    made[tid] = s
                    made_tensors[tid] = t
                    # Remember the rebuilt storage itself: after its last unpack autograd still holds
                    # it while the node runs, and a replay for another saved tensor of the same node
                    # (layer norm's mean after its input) must find it, not rebuild it a second time;
                    # the simulator keeps it resident through that backward step.
                    self.storages[tid] = weakref.ref(s)
                    roles.append(_REBUILT)
                else:
                    roles.append(_DROP)
            self.replays += 1
            for u in freed:
                del made[u], made_tensors[u]
            nested = self.recipes[p].slots is None
            compiled.append(CompiledOp(p, self._signature_id(p), None if nested else tuple(fills), tuple(clones),
                                       tuple(roles), freed))
        return tuple(compiled)

    def _run_compiled(self, ops: tuple[CompiledOp, ...], made: dict[int, torch.UntypedStorage],
                      made_tensors: dict[int, torch.Tensor]) -> None:
        """Run a compiled replay: the traced decisions, on this step's recipes (their constants, tensors
        and RNG states; their signatures are the traced ones)."""
        recipes = self.recipes
        storages = self.storages
        for op in ops:
            p = op.op
            if op.fills is None:  # nested activation arguments: mapped leaf by leaf
                results = [(tid, t) for tid, _, t in self._run(p, made, made_tensors)]
            else:
                rec = recipes[p]
                args, kwargs = list(rec.args), rec.kwargs
                for at, tid, source, geometry in op.fills:
                    if source == _DIRECT:
                        v = made_tensors[tid]
                    elif source == _MADE_VIEW:  # same dtype as the tensor its op returned: a strided view
                        v = torch.as_strided(made_tensors[tid], geometry[1], geometry[2], geometry[3])
                    else:  # a storage re-created here read with another dtype, or a resident one
                        s = made.get(tid)
                        if s is None:
                            s = self.available(tid)
                            if s is None:
                                raise MemplanError(f"executor: replaying op {p} needs tensor {tid}, which is "
                                                   f"gone (a bug)")
                            if self.ready:
                                self._wait_ready(tid)
                        v = _view(s, *geometry)
                    if type(at) is int:
                        args[at] = v
                    else:
                        kwargs = {**kwargs, at: v}
                if op.clones:
                    args, kwargs = _clone_at(args, kwargs, op.clones)
                out = self._call(rec, args, kwargs)
                outs = (out,) if isinstance(out, torch.Tensor) else tensors_in(out)
                results = [(tid, outs[pos]) for pos, tid in rec.new]
            for (tid, t), role in zip(results, op.roles, strict=True):
                if role != _DROP:
                    s = made[tid] = t.untyped_storage()
                    made_tensors[tid] = t
                    if role == _REBUILT:
                        storages[tid] = weakref.ref(s)
            self.replays += 1
            for u in op.frees:
                del made[u], made_tensors[u]

    def _run(self, p: int, made: dict[int, torch.UntypedStorage], made_tensors: dict[int, torch.Tensor],
             fills: list | None = None, clones: list | None = None,
             ) -> list[tuple[int, torch.UntypedStorage, torch.Tensor]]:
        """Run recorded op ``p`` on its arguments' current storages (``made``: re-created by this replay,
        ``made_tensors`` their tensors as their ops returned them). Returns its new storages: (tensor id,
        storage, the output tensor). ``fills`` and ``clones``, when given, receive where each activation
        argument was taken from (:class:`CompiledOp`) and which written arguments were cloned."""
        rec = self.recipes[p]

        def value(x: Any, at: int | str | None = None) -> Any:
            if not isinstance(x, _Ref):
                return x
            geometry = (x.dtype, x.size, x.stride, x.offset)
            t = made_tensors.get(x.tid)
            if (t is not None and t.dtype == x.dtype and t.storage_offset() == x.offset and t.size() == x.size
                    and t.stride() == x.stride):
                if fills is not None:
                    fills.append((at, x.tid, _DIRECT, None))
                return t  # read with the geometry its op made it with: no view to build
            s = made.get(x.tid)
            source = _MADE_VIEW if t is not None and t.dtype == x.dtype else _RESIDENT
            if s is None:
                s = self.available(x.tid)
                self._wait_ready(x.tid)  # an offloaded input fetched for this replay: its copy must be in
            if s is None:
                raise MemplanError(f"executor: replaying op {p} needs tensor {x.tid}, which is gone (a bug)")
            if fills is not None:
                fills.append((at, x.tid, source, (*geometry, s.device)))
            return _view(s, *geometry)

        if rec.slots is not None:
            args, kwargs = list(rec.args), rec.kwargs
            for at, ref in rec.slots:
                if type(at) is int:
                    args[at] = value(ref, at)
                else:
                    kwargs = {**kwargs, at: value(ref, at)}
        else:
            args, kwargs = map_leaves(value, (rec.args, rec.kwargs))
        # an in-place initialiser must write the storage this replay rebuilds; anything else it writes
        # (batch norm's running statistics) is cloned so that the replay changes nothing else
        written = _written(rec, made)
        if written:
            args, kwargs = _clone_at(args, kwargs, written)
            if clones is not None:
                clones.extend(written)
        out = self._call(rec, args, kwargs)
        outs = (out,) if isinstance(out, torch.Tensor) else tensors_in(out)
        return [(tid, outs[pos].untyped_storage(), outs[pos]) for pos, tid in rec.new]

    def _call(self, rec: Recipe, args: Any, kwargs: Any) -> Any:
        """Call a recorded op; a random one from the generator state it ran from in forward."""
        if rec.rng is None:
            return rec.func(*args, **kwargs)
        # fork_rng restores the training loop's stream afterwards (as torch.utils.checkpoint does)
        cpu_state, cuda_state = rec.rng
        device = self.rng_device
        with torch.random.fork_rng(devices=[device] if cuda_state is not None else []):
            torch.set_rng_state(torch.frombuffer(cpu_state, dtype=torch.uint8))
            if cuda_state is not None:
                torch.cuda.set_rng_state(torch.frombuffer(cuda_state, dtype=torch.uint8), device)
            return rec.func(*args, **kwargs)


def _storage_key(t: torch.Tensor) -> int | None:
    """The key ``Step.by_key`` knows ``t``'s storage by, or None if it has none (a tensor whose storage
    ``storage_of`` does not count is never registered, so looking its key up finds nothing either)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _reached(step_ref: weakref.ref, k: int) -> None:
    step = step_ref()
    if step is not None:
        step.reached(k)


_WRITES: dict[Any, list[tuple[int, str]]] = {}
_NAMES: dict[Any, str] = {}  # ATen op -> its name as the graph spells it (str(op), computed once)


def _written(rec: Recipe, made: dict[int, torch.UntypedStorage]) -> list[int | str]:
    """The arguments (positions, or keyword names) ``rec.func`` writes in place that a replay must clone
    (a replay must not mutate state): all of them except storages the running replay rebuilds
    (``made``): an in-place initialiser writes the tensor it is replayed for."""
    func = rec.func
    spec = _WRITES.get(func)
    if spec is None:
        spec = [(i, a.name) for i, a in enumerate(func._schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write]
        _WRITES[func] = spec
    if not spec:
        return []
    keep = {i for i, a in enumerate(rec.args) if isinstance(a, _Ref) and a.tid in made}
    keep |= {k for k, a in rec.kwargs.items() if isinstance(a, _Ref) and a.tid in made}
    out: list[int | str] = []
    for i, name in spec:
        if i in keep or name in keep:
            continue
        if i < len(rec.args):
            out.append(i)
        elif name in rec.kwargs:
            out.append(name)
    return out


def _clone_at(args, kwargs, at: list[int | str] | tuple[int | str, ...]):
    """``args`` and ``kwargs`` with the tensors at positions or keyword names ``at`` cloned."""
    args = list(args)
    kwargs = dict(kwargs)
    for i in at:
        if type(i) is int:
            args[i] = map_leaves(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, args[i])
        else:
            kwargs[i] = map_leaves(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, kwargs[i])
    return tuple(args), kwargs


def prefetch_order(prefetch_at: dict[int, int]) -> list[tuple[int, int]]:
    """(−prefetch op, tensor id) ascending: the order in which backward reaches the prefetch points."""
    out: list[tuple[int, int]] = []
    for tid, at in prefetch_at.items():
        bisect.insort(out, (-at, tid))
    return out
