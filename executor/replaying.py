"""Recompute: the replays of a step under a plan (the part of :class:`memplan.executor.step.Step` that
re-creates tensors backward needs).

The replay is the simulator's lazy replay, decided by the same function
(:func:`memplan.planner.core.replay.replay`): when backward unpacks a missing tensor, its producer (and
its in-place initialisers) are replayed from the recipes forward recorded
(:class:`memplan.executor.recipes.Recipe`), recursively through missing inputs, in forward order.
Replayed tensors that other saved-tensor handles still wait for stay until their last unpack (unless the
plan says ``recompute_each``: rebuilt again for their own backward); the others die after their last use
in the replay. A tensor an op reads before its in-place chain ends gets a scratch copy re-created up to
that op (the replay's ``scratch``), dropped right after it. A replay is planned once per availability
state and compiled on its first run (:class:`memplan.executor.recipes.Segment`): later steps reuse the plan
while they answer ``replay()``'s questions alike, and repeat the traced decisions on their own recipes
while those keep their signatures (:func:`memplan.executor.recipes.recipe_signature`), tracing afresh
otherwise (``Executor.segment_stats`` counts which). Random ops replay under the RNG states captured
before they ran. Arguments an op writes in place (batch norm's running statistics) are cloned, so a
replay changes nothing but what it returns.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from memplan.executor.recipes import (
    AVAILABLE,
    COMPILED_PER_SEGMENT,
    DIRECT,
    DROP,
    FETCHABLE,
    FRESH_OPS,
    MADE_VIEW,
    REBUILT,
    RESIDENT,
    RETAINED,
    SCRATCH,
    SEGMENTS_PER_TARGET,
    CompiledOp,
    HostConstant,
    Recipe,
    Ref,
    Segment,
    clone_at,
    recipe_signature,
    storage_view,
    written_arguments,
)
from memplan.planner.core.errors import MemplanError, PlanError
from memplan.planner.core.plan import Action
from memplan.planner.core.replay import Replay, kept_by_replays, replay
from memplan.planner.core.schedule import ScheduleEvent
from memplan.planner.probe.storage import map_leaves, tensors_in


class Replaying:
    """Replay methods of a step. They read the step's ``ex`` (the executor: graph, actions, segment cache),
    ``recipes``, ``cache``, ``storages``, ``host``, ``pending_unpacks``, ``log`` and ``replays``, and its
    offload methods (``_prefetch``, ``_wait_ready``, ``available``)."""

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
        try:
            # grad mode on, as in the forward the ops were recorded in (oneDNN's LSTM makes the workspace its
            # backward reads only then: under no_grad, backward's own mode, it returns none), and below
            # autograd, so that the replayed ops build no graph on the parameters they read
            with torch.enable_grad(), torch._C._AutoDispatchBelowAutograd():
                compiled = self._compiled(seg) if ex.reuse_replays else None
                if compiled is not None:
                    stats["compiled reused"] += 1
                    self._run_compiled(compiled, made, made_tensors)
                else:
                    stats["recompiled" if seg.compiled else "compiled"] += 1
                    seg.compiled.insert(0, self._run_traced(r, made, made_tensors))
                    del seg.compiled[COMPILED_PER_SEGMENT:]
        finally:
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

        r = replay(self.g, target, available=recorded(AVAILABLE), fetchable=recorded(FETCHABLE),
                   retain=recorded(RETAINED))
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
        if kind == AVAILABLE:
            return self.available(u) is not None
        if kind == FETCHABLE:
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
                    roles.append(SCRATCH)
                elif tid in rebuilds and tid not in made:
                    made[tid] = s
                    made_tensors[tid] = t
                    # Remember the rebuilt storage itself: after its last unpack autograd still holds
                    # it while the node runs, and a replay for another saved tensor of the same node
                    # (layer norm's mean after its input) must find it, not rebuild it a second time;
                    # the simulator keeps it resident through that backward step.
                    self.storages[tid] = weakref.ref(s)
                    roles.append(REBUILT)
                else:
                    roles.append(DROP)
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
                    if source == DIRECT:
                        v = made_tensors[tid]
                    elif source == MADE_VIEW:  # same dtype as the tensor its op returned: a strided view
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
                        v = storage_view(s, *geometry)
                    if type(at) is int:
                        args[at] = v
                    else:
                        kwargs = {**kwargs, at: v}
                if op.clones:
                    args, kwargs = clone_at(args, kwargs, op.clones)
                out = self._call(rec, args, kwargs)
                outs = (out,) if isinstance(out, torch.Tensor) else tensors_in(out)
                results = [(tid, outs[pos]) for pos, tid in rec.new]
            for (tid, t), role in zip(results, op.roles, strict=True):
                if role != DROP:
                    s = made[tid] = t.untyped_storage()
                    made_tensors[tid] = t
                    if role == REBUILT:
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
            if not isinstance(x, Ref):
                return x
            geometry = (x.dtype, x.size, x.stride, x.offset)
            t = made_tensors.get(x.tid)
            if (t is not None and t.dtype == x.dtype and t.storage_offset() == x.offset and t.size() == x.size
                    and t.stride() == x.stride):
                if fills is not None:
                    fills.append((at, x.tid, DIRECT, None))
                return t  # read with the geometry its op made it with: no view to build
            s = made.get(x.tid)
            source = MADE_VIEW if t is not None and t.dtype == x.dtype else RESIDENT
            if s is None:
                s = self.available(x.tid)
                self._wait_ready(x.tid)  # an offloaded input fetched for this replay: its copy must be in
            if s is None:
                raise MemplanError(f"executor: replaying op {p} needs tensor {x.tid}, which is gone (a bug)")
            if fills is not None:
                fills.append((at, x.tid, source, (*geometry, s.device)))
            return storage_view(s, *geometry)

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
        written = written_arguments(rec, made)
        if written:
            args, kwargs = clone_at(args, kwargs, written)
            if clones is not None:
                clones.extend(written)
        out = self._call(rec, args, kwargs)
        outs = (out,) if isinstance(out, torch.Tensor) else tensors_in(out)
        return [(tid, outs[pos].untyped_storage(), outs[pos]) for pos, tid in rec.new]

    def _call(self, rec: Recipe, args: Any, kwargs: Any) -> Any:
        """Call a recorded op; a random one from the generator states it ran from in forward (the device
        layer forks the generators, which restores the training loop's streams afterwards, as
        ``torch.utils.checkpoint`` does). A ``lift_fresh`` runs on a new copy of its constant."""
        if rec.func in FRESH_OPS:
            args = tuple(a.tensor() if type(a) is HostConstant else a for a in args)
        if rec.rng is None:
            return rec.func(*args, **kwargs)
        with self.ex.device.forked_rng(*rec.rng):
            return rec.func(*args, **kwargs)
