"""One training step under a plan: its forward is watched op by op, every saved tensor is mapped to its
graph tensor id, and backward gets what the plan says it should.

How a step runs (see docs/model.md for the model it reproduces):

* **Ops.** A ``TorchDispatchMode`` (:class:`StepMode`) counts forward ATen ops with the profiler's rules
  (the same helpers: a tensor is its storage; an output storage not seen before is a new tensor;
  ``lift_fresh`` reads nothing). Op *k* must carry the name of the graph's op *k*, and create as many new
  storages, of the graph's bytes as the device's allocator charges them. Where the ops differ (another
  op, another number of new storages) the step runs the model's ops as they are up to the next module
  boundary and re-synchronises there, and stops with :class:`PlanMismatch` only where the plan decides
  something in what differed, naming the module and the tensor (:mod:`memplan.executor.resync`); a
  tensor of another shape is refused naming the op. One difference is expected and skipped: with
  ``saved_tensors_hooks`` installed, autograd no longer dispatches the ``aten.detach`` it runs when it
  saves an op's output, and those detaches (no new storage, nothing saved) are in the graph.
* **Fast path.** The first step runs every op through the full handler above and learns each op's
  overload and its new storages' positions; later steps (``Step.fast``) compare an op's overload by
  identity and run it, and only the ops ``planner/core/watch.py`` says the plan needs (producers of
  tracked tensors, replayed ops) take the full handler, which maps just the tracked tensors to their ids.
* **Saved tensors** go through ``saved_tensors_hooks``. A *kept* one (and every parameter, buffer, input,
  or view of one: they are not activations) is returned as is. A *recomputed* one is packed as a handle
  (:class:`Packed`: tensor id and view geometry), and autograd no longer holds its storage, which dies at
  its last forward use. An *offloaded* one is copied to its slot of the host pool as it is packed (one
  written in place later, a recurrent cell's gates, when its last writer has run) and packed as a handle
  (:mod:`memplan.executor.transfers`).
* **Recompute** is the simulator's lazy replay (:mod:`memplan.executor.replaying`).
* **Pinning**: an activation that cannot be rebuilt (mutated in place later) but that a replay reads
  is held from its production until backward has passed the lowest step whose replay reads it, as the
  simulator charges it (its first pass finds these tensors; node pre-hooks tell how far backward is).
* **Events.** Each step logs what it performs (forward ops, copies both ways, replays with their ops) as
  :class:`memplan.planner.core.schedule.ScheduleEvent` in ``events``; prefetch points and pins come from the
  plan's schedule (``Executor.schedule``), so a test compares the two event for event.

Everything that differs between a CPU and a GPU (bytes charged, copy streams, generator states) is the
executor's device layer's (``Executor.device``, :mod:`memplan.planner.probe.device`).
"""

from __future__ import annotations

import bisect
import weakref
from collections import Counter
from typing import Any, NoReturn

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.executor.recipes import (
    FRESH_OPS,
    HostConstant,
    Recipe,
    Ref,
    activation_slots,
    storage_key,
    storage_view,
)
from memplan.executor.replaying import Replaying
from memplan.executor.resync import Resync
from memplan.executor.transfers import Offloading
from memplan.planner.core.errors import MemplanError, PlanMismatch
from memplan.planner.core.graph import DETACH
from memplan.planner.core.plan import Action
from memplan.planner.core.schedule import ScheduleEvent
from memplan.planner.core.shapes import ShapeMatcher
from memplan.planner.core.simulator import static_facts
from memplan.planner.probe.device import Transfer
from memplan.planner.probe.draws import ADVICE as DRAW_ADVICE
from memplan.planner.probe.storage import map_leaves, storage_of, tensors_in

_NODE_TAG = "memplan_executor_op"


class Packed:
    """What autograd holds instead of a recomputed or offloaded tensor. It reaches its step through a weak
    reference: autograd's graph holding the step (and through it the executor and the model) would keep
    them alive for good when backward never runs (a reference cycle through C++ that ``gc`` cannot see)."""

    __slots__ = ("step", "tid", "dtype", "size", "stride", "offset")

    def __init__(self, step: Step, tid: int, t: torch.Tensor):
        self.step = weakref.ref(step)
        self.tid = tid
        self.dtype = t.dtype
        self.size = tuple(t.size())
        self.stride = tuple(t.stride())
        self.offset = t.storage_offset()


class StepMode(TorchDispatchMode):
    """Counts forward ops for the executor's current step; passes everything else through."""

    def __init__(self, ex: Any):
        super().__init__()
        self.ex = weakref.proxy(ex)  # the Executor (memplan.executor.apply), which owns this mode

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
                if step.release_queue and step.release_queue[0][1] <= k:  # offloaded tensors whose copy
                    step.release_copied(k)  # to host has ended on the schedule's clock leave here
                step.cursor = k + 1
                step.log.append(k)
                return func(*args, **kwargs)
        return step.forward_op(func, args, kwargs)


class Step(Offloading, Replaying, Resync):
    """One forward and its backward under the plan. Offload is :class:`Offloading`'s, recompute
    :class:`Replaying`'s, re-synchronising after ops that differ from the graph's :class:`Resync`'s; this
    class matches forward ops to the graph and packs and unpacks saved tensors."""

    def __init__(self, ex: Any):
        self.ex = weakref.proxy(ex)  # the Executor, which owns this step
        self.g = ex.graph
        self.cursor = 0
        self.forward_done = False
        self.backward_started = False
        self.model_calls = 1  # the model's forward calls in this step so far
        self.by_key: dict[int, tuple[int, weakref.ref]] = {}   # live storage -> (tensor id or -1, its weakref)
        self.storages: dict[int, weakref.ref] = {}              # tensor id -> weakref to its storage
        self.recipes: dict[int, Recipe] = {}
        self.pending_unpacks: Counter[int] = Counter()          # tensor id -> handles not yet unpacked
        self.cache: dict[int, torch.UntypedStorage] = {}        # rebuilt / fetched, awaiting unpacks
        self.host: dict[int, tuple[torch.Tensor, torch.device, int]] = {}  # offloaded: slot, device, bytes
        self.d2h_pending: dict[int, tuple[Transfer, torch.Tensor]] = {}  # id -> copy to host, bytes it reads
        self.release_queue = list(ex.release_order)            # (in backward, op, tid): Schedule.released
        self.ready: dict[int, Transfer] = {}                    # prefetched id -> its copy, not waited for
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
        self.begun: dict[str, int] = {}                        # module path -> calls begun (boundaries)
        self.ended: dict[str, int] = {}                        # module path -> calls ended
        self.diverged = None                                   # (position, why) while ops differ (resync.py)
        self.unbound: dict[int, str] = {}
        self.resyncs = 0
        self.stray_saves: list[int] = []
        self.pending_saves: list[int] = []
        self.moved_packs: list[tuple[int, int]] = []
        self.failed = False
        self.released = False                                  # release() ran: the step is over
        self.shapes = ShapeMatcher(ex.family, self.g) if ex.family is not None else None
        # offloaded tensors written in place after their first saver: copied when the last writer has run,
        # as the simulator does (static_facts.d2h_after); op -> {tensor id: its storage}
        facts = static_facts(self.g)
        self.d2h_after = facts.d2h_after
        self.saved_at = facts.saved_at  # op -> activations first saved by it (an input: copied as it starts)
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
                out.append(ScheduleEvent("compute", "forward", -1 - e, reason=f"{DETACH} (autograd's, not "
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
    def _match(self, name: str) -> int | None:
        """The graph position of the op the model runs now (named ``name``), or None when it is not the
        graph's op there: the step has diverged (:meth:`Resync.diverge`)."""
        ops = self.g.ops
        while self.cursor < len(ops) and ops[self.cursor].name != name and ops[self.cursor].name == DETACH:
            self._passed_detach()  # the detach autograd runs when saving an output is gone under hooks
        k = self.cursor
        if k >= len(ops):
            self._fail(f"the model ran more forward ops than the profiled graph's {len(ops)}: "
                       f"{name} has no counterpart; re-profile and re-solve for this model and batch")
        if ops[k].name != name:
            self.diverge(k, f"forward op {k} differs from the profiled graph: the plan expects "
                            f"{ops[k].name} (module {ops[k].module or '?'}), the model ran {name}")
            return None
        self.cursor += 1
        return k

    def _passed_detach(self) -> None:
        """Step over a graph detach that autograd no longer dispatches under saved-tensor hooks (it
        creates nothing and saves nothing): the step has reached that position all the same."""
        # releases at the boundaries before and after it, as the schedule orders them
        if self.release_queue and not self.backward_started:
            self.release_copied(self.cursor)
        self.log.append(-1 - self.cursor)  # (``events`` spells it out)
        self.cursor += 1
        if self.release_queue and not self.backward_started:
            self.release_copied(self.cursor)

    def forward_op(self, func, args, kwargs):
        """The full handler: a needed op (planner/core/watch.py), or any op of the first watched step,
        which also learns what later steps' fast path uses (the op's overload, its new storages'
        positions)."""
        if self.release_queue:  # at the boundary before op ``cursor``, first, as the schedule releases
            self.release_copied(self.cursor)
        if self.pending_outs is not None:
            self.resolve_pending()
        if self.cursor > self.ex.last_real_op:
            # every op of the graph has run: what follows (backward's seed ``ones_like``, metrics) is
            # not the model's step
            self.forward_done = True
            if not self.failed:
                self.check_bound()
            if not self.fast and not self.failed:
                self.ex.learn()
            return func(*args, **kwargs)
        if self.diverged is not None and not self.resync_at_op(func):
            return self.stray(func, args, kwargs)
        ex = self.ex
        k = self.cursor
        if self.fast and k < self.n_fast and func is ex.funcs[k]:
            self.cursor = k + 1
        else:
            name = _NAMES.get(func)
            if name is None:
                name = _NAMES[func] = str(func)
            k = self._match(name)
            if k is None and not self.resync_at_op(func):
                return self.stray(func, args, kwargs)
            if k is None:  # the graph's op a little further on
                k = self._match(name)
        self.log.append(k)
        op = self.g.ops[k]
        positions = ex.new_positions[k] if self.fast else None
        if positions is None and self.fast and not ex.needed[k]:
            # an op the first step did not run (its ops differed there) and the plan decides nothing about
            return func(*args, **kwargs)
        if self.unbound:
            self.bind_inputs(k, op, args, kwargs)
        learn = positions is None
        record = k in ex.recorded_ops  # only the ops a replay of the schedule runs
        fused = ex.fused is not None and ex.fused.pending_keys
        inputs = [] if func in FRESH_OPS or not (learn or fused or record) else tensors_in((args, kwargs))
        if learn:  # every storage is seen, so that a new one is known as new
            for t in inputs:
                self._see(t, -1)
        if fused:
            ex.fused.check_not_pending(inputs, op)
        rng = None
        if record and func in FRESH_OPS:  # a constant from Python data: its value, not the tensor
            args_r = map_leaves(lambda x: HostConstant.of(x) if isinstance(x, torch.Tensor) else x, args)
            kwargs_r = kwargs
        elif record:
            args_r = self._refs(args)
            kwargs_r = {key: self._refs(v) for key, v in kwargs.items()} if kwargs else kwargs
            if k in ex.rng_ops:
                rng = self._capture_rng()
        out = func(*args, **kwargs)
        for tid, s in self.deferred.pop(k, {}).items():  # its last in-place writer has run
            self._offload(tid, s)
        outs = tensors_in(out)
        if learn:
            new = self._new_outputs(k, op, outs)
            if new is None:  # not the graph's op after all: the step diverged at it
                return out
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
            self.recipes[k] = Recipe(func, args_r, kwargs_r, new, rng, activation_slots(args_r, kwargs_r))
        if ex.tag_nodes:
            self.pending_outs = (k, outs)
        return out

    def _new_outputs(self, k: int, op, outs: list[torch.Tensor]) -> list[tuple[int, int]] | None:
        """Map op ``k``'s new output storages (not seen before) to its graph outputs, in order; checked
        against the graph (count, bytes, shape, dtype). Returns (position in ``outs``, tensor id) pairs,
        or None when it created another number of them than the graph's op: the step diverged there."""
        ex = self.ex
        fresh: dict[int, tuple[int, torch.Tensor, torch.UntypedStorage]] = {}
        for pos, t in enumerate(outs):
            s = storage_of(t)
            if s is not None and s._cdata not in self.by_key and s._cdata not in fresh:
                fresh[s._cdata] = (pos, t, s)
        if len(fresh) != len(op.outputs):
            for _, t, _s in fresh.values():
                self._see(t, -1)
            self.diverge(k, f"forward op {k} ({op.name}, module {op.module or '?'}) created {len(fresh)} new "
                            f"tensors, the profiled graph {len(op.outputs)}")
            return None
        new: list[tuple[int, int]] = []
        for (pos, t, s), tid in zip(fresh.values(), op.outputs, strict=True):
            self._check_output(k, op, t, s, tid)
            self._see(t, tid)
            new.append((pos, tid))
            if tid in ex.pins:  # cannot be rebuilt, and a replay reads it: hold it (docs/model.md, pinning)
                self.pinned[tid] = s
        return new

    def _check_output(self, k: int, op, t: torch.Tensor, s: torch.UntypedStorage, tid: int) -> None:
        """Same op names are not the same step: a different batch or width runs the same ops on other
        shapes, and the plan's bytes (and the host pool's slots) would be wrong. Compare what the graph
        recorded for the storage: its bytes as the device's allocator charges them (CUDA rounds every block
        up to 512 bytes, and so does a CUDA profile), and the shape and dtype of the tensor that created it."""
        raw = s.nbytes()
        nbytes = self.ex.device.charged_bytes(raw)
        expected = self.ex.expected_outputs.get(tid)
        if expected is not None and t.dtype is expected[0] and nbytes == expected[1] and t.shape == expected[2]:
            return  # as the graph has it (the common case, compared on torch's own types)
        info = self.g.tensors[tid]
        dtype = str(t.dtype).removeprefix("torch.")
        if nbytes == info.bytes and list(t.shape) == info.shape and dtype == info.dtype:
            self.ex.expected_outputs[tid] = (t.dtype, info.bytes, t.shape)
        else:
            if self.shapes is not None:  # a graph with a shape family: any shape of it up to the graph's
                problem = self.shapes.check(tid, dtype, list(t.shape), raw)
                if problem is None:
                    return
                self._fail(f"forward op {k} ({op.name}, module {op.module or '?'}): {problem}; re-profile "
                           f"the family up to this shape and re-solve")
            charged = f", {nbytes} B as the {self.ex.device.type} allocator charges it" if nbytes != raw else ""
            smaller = (dtype == info.dtype and len(t.shape) == len(info.shape)
                       and all(a <= b for a, b in zip(t.shape, info.shape, strict=True)))
            advice = ("a smaller batch than the profiled one (the last, partial batch of a DataLoader?): profile a "
                      "shape family (profile_family; README, 'Shapes that vary') or drop it (drop_last=True)"
                      if smaller else "re-profile and re-solve for this model and batch")
            self._fail(f"forward op {k} ({op.name}, module {op.module or '?'}) made tensor {tid} as "
                       f"{dtype}{list(t.shape)} ({raw} B{charged}); the profiled graph has "
                       f"{info.dtype}{info.shape} ({info.bytes} B): the batch or the model differs from the "
                       f"profiled one; {advice}")

    def _fail(self, message: str) -> NoReturn:
        """Abandon the step, then raise: the dispatch mode and the saved-tensor hooks stay entered until
        the next forward, ``optimizer.step()`` or ``remove()`` (they cannot be left from inside a dispatch),
        and an abandoned step lets every op through instead of raising again."""
        self.forward_done = True
        self.failed = True
        branches = self.ex.graph.meta.get("draw_branches")
        if branches:  # planner/probe/draws.py: the likely cause
            message += (f" (the profiled step branched on a random draw in {', '.join(branches[:3])}: "
                        f"{DRAW_ADVICE})")
        raise PlanMismatch(message)

    def _refs(self, x: Any) -> Any:
        """``x`` (an op's argument or its argument tuple) with activations as :class:`Ref`: what
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
        entry = self.by_key.get(storage_key(x))
        if entry is None or entry[0] < 0:
            return x  # a parameter, buffer or input: alive anyway, held as is
        return Ref(entry[0], x.dtype, tuple(x.size()), tuple(x.stride()), x.storage_offset())

    def _capture_rng(self) -> tuple[bytearray, bytearray | None]:
        """The generator states (the CPU's, the device's) before a random op, kept as host bytes: they are
        bookkeeping, not activations (on CUDA the generator state is host memory anyway), and as tensors on
        CPU each 5 KiB mt19937 state would sit in the allocator that the measured peak reads, all step long."""
        return bytearray(torch.get_rng_state().numpy().tobytes()), self.ex.device.rng_state()

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
        entry = self.by_key.get(storage_key(t))
        if entry is None or entry[0] < 0:
            return held(t, self.ex)  # not an activation of this step: parameters and their views never move
        tid = entry[0]
        action = self.ex.actions.get(tid, Action.KEEP)
        if action == Action.KEEP:
            return held(t, self.ex)
        if self.diverged is not None:  # judged at the next op (resync.py): the graph's saver, or refused
            self.pending_saves.append(tid)
        else:
            self.moved_packs.append((tid, len(self.log)))
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
        if self.released and p.tid not in self.cache and self.available(p.tid) is None:
            raise MemplanError(f"executor: backward reads tensor {p.tid} of a step that has ended (a new step "
                               f"began, zero_grad() or remove() ran): under a plan, run a step's backward before "
                               f"the next step starts")
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
        view = storage_view(s, p.dtype, p.size, p.stride, p.offset)
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

    def release(self) -> None:
        """The step is over, however it ended (its backward finished, failed or never came; its forward
        raised): drop everything it still holds for a backward (rebuilt, fetched and pinned tensors, copies
        in flight, the recorded recipes), so that memory plain training would free is freed. A later
        backward through this step's saved tensors is refused (:meth:`unpack`)."""
        self.forward_done = True
        self.released = True
        self.pending_outs = None
        self.deferred.clear()
        self.pinned.clear()
        self.cache.clear()
        self.recipes.clear()
        self.finish_transfers()

    def end_backward(self) -> None:
        """Backward is over: drop pinned tensors, rebuilt or fetched tensors no handle asked for, and the
        device sources of finished copies (docs/model.md releases every activation by the end of
        backward; only the caller's own references, the loss and outputs, outlive it)."""
        self.pinned.clear()
        self.cache.clear()
        self.finish_transfers()  # never free a buffer or a source a copy may still use

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
        if self.diverged is not None:
            start, why = self.diverged
        else:
            start = self.cursor
            rest = [k for k in range(start, len(ops)) if ops[k].name != DETACH]
            while not rest and self.cursor < len(ops):
                self._passed_detach()
            why = (f"the forward ended after {start} ops, the profiled graph has {len(ops)}: op {rest[0]} "
                   f"({ops[rest[0]].name}, module {ops[rest[0]].module or '?'}) never ran") if rest else ""
        if self.diverged is not None or self.cursor < len(ops):
            self.skip(start, len(ops), None, why)
        if not self.failed:
            self.check_bound()
        if not self.fast and not self.failed and self.ex.watch:
            self.ex.learn()

    # ---- backward ----------------------------------------------------------------------------
    def reached(self, k: int) -> None:
        """Backward is about to run op ``k``'s step: start the prefetches scheduled at or above it."""
        self.begin_backward()
        if self.release_queue:
            self.release_copied(k, backward=True)
        if self.pinned:  # steps above k are done: release what only their replays read
            pins = self.ex.pins
            for tid in [t for t in self.pinned if pins[t] > k]:
                del self.pinned[tid]
        q = self.prefetch_queue
        while q and -q[0][0] >= k:
            _, tid = q.pop(0)
            if tid in self.host and self.pending_unpacks[tid] > 0:
                self._prefetch(tid, f"scheduled at op {k}", k)


def held(t: torch.Tensor, ex: Any) -> torch.Tensor:
    """What a saved-tensor hook gives autograd for a tensor it keeps as it is: the tensor itself when it has
    no ``grad_fn`` (a parameter, the batch), else an alias without one (``detach``: the same storage, so the
    same bytes and lifetime). Returning a tensor with its ``grad_fn`` makes the node that saves its own
    output hold it, and it the node: a reference cycle through C++ that ``gc`` cannot free, so a forward
    whose backward never runs would leak its activations (PyTorch's saved-tensor hooks caveat)."""
    if t.grad_fn is None:
        return t
    with ex.internal():  # the executor's op, not the model's
        return t.detach()


def _reached(step_ref: weakref.ref, k: int) -> None:
    step = step_ref()
    if step is not None:
        step.reached(k)

_NAMES: dict[Any, str] = {}  # ATen op -> its name as the graph spells it (str(op), computed once)

def release_order(released: dict[int, tuple[str, int]]) -> list[tuple[bool, int, int]]:
    """``Schedule.released`` as ``(in backward, op, tensor id)``, in the order the schedule releases them
    (the order a step reaches them: forward positions ascending, then backward ones descending)."""
    return [(phase != "forward", at, t) for t, (phase, at) in released.items()]


def prefetch_order(prefetch_at: dict[int, int]) -> list[tuple[int, int]]:
    """(−prefetch op, tensor id) ascending: the order in which backward reaches the prefetch points."""
    out: list[tuple[int, int]] = []
    for tid, at in prefetch_at.items():
        bisect.insort(out, (-at, tid))
    return out
