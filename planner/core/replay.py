"""What a replay runs: the one definition of rebuilding a missing activation, shared by the simulator,
the executor, the FSDP2 unit check and the solvers (torch-free).

A *replay* of ``target`` re-creates it from what is at hand. Starting from ``target`` (missing by
definition: a replay is asked for only then), every tensor the replay needs is classified:

* **available**: a parameter, buffer or input (always), or an activation for which ``available(u)`` is
  true (resident on the device; a kept, pinned or held tensor). It is *read*, never re-created.
* **fetched**: an activation for which ``fetchable(u)`` is true (an offloaded tensor whose host copy
  exists): it is copied back to the device before the replay runs its first op, not rebuilt.
* **rebuilt**: a recomputable activation: its producer op runs again, then its ``rebuilt_by`` ops (the
  in-place initialisers that finished its content in forward: dropout's ``bernoulli_`` and ``div_`` into
  an ``empty_like``, an in-place ReLU). Every tensor those ops read is needed in turn.
* **blocked**: an activation that is none of the above (not recomputable, or past ``max_depth``): the
  replay cannot run unless it is made available; the caller refuses the plan or (a solver's model)
  constrains it.

The replay runs the ops of every rebuilt tensor once each, in forward (op id) order. After each op it
frees the tensors it re-created that no later op of the replay reads, unless the tensor is the target or
``retain(u)`` says backward still needs it (a saved tensor whose own backward step is still to come stays
resident, as checkpointing keeps it), unless the plan recomputes it with ``recompute_each``
(:func:`kept_by_replays`: a multi-level replay, which re-runs it for its own backward instead of holding
it); those, with the target, are ``kept`` when it ends. An output of a
replayed op that was already available is not re-created (the new copy is dropped at once).

Which tensors are needed is decided once, from the state when the replay starts: a fetch or a rebuild
during the replay does not change what else it needs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from memplan.planner.core.errors import PlanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action

Predicate = Callable[[int], bool]


@dataclass(frozen=True)
class Replay:
    """One replay of ``target`` (see the module docstring for the rules).

    ``ops``: op ids to run, in forward order (producers and their ``rebuilt_by`` initialisers).
    ``rebuilds``: activations it re-creates (outputs of ``ops`` that were not available), ascending.
    ``fetches``: offloaded activations copied back before it starts, ascending.
    ``reads``: available activations it reads (they must stay resident until it has run), ascending.
    ``frees_after``: parallel to ``ops``: the re-created tensors freed right after each op.
    ``kept``: re-created tensors still resident when it ends (the target first).
    ``missing``: every needed activation within ``max_depth`` that was not available, breadth-first
    from the target (target first): the rebuilt, fetched and blocked ones (not the frontier).
    ``blocked``: needed activations that can be neither read, fetched nor rebuilt (ascending).
    ``frontier``: needed activations past ``max_depth`` (a subset of ``blocked``).
    ``scratch``: available or fetched tensors that a replayed op reads mid-chain (:func:`reads_mid_chain`),
    re-created as private copies by their producer and the chain's ops before that reader, and freed
    after it (``frees_after`` lists them; they are in neither ``rebuilds`` nor ``kept``; the resident
    copy, if any, is untouched).
    """

    target: int
    ops: tuple[int, ...]
    rebuilds: tuple[int, ...]
    fetches: tuple[int, ...]
    reads: tuple[int, ...]
    frees_after: tuple[tuple[int, ...], ...]
    kept: tuple[int, ...]
    missing: tuple[int, ...]
    blocked: tuple[int, ...]
    frontier: tuple[int, ...]
    scratch: tuple[int, ...] = ()

    def check(self, graph: Graph, step: int | None = None) -> None:
        """Raise :class:`PlanError` naming the first blocked tensor, if any (``step``: the backward step
        that needs the target, for the message)."""
        if not self.blocked:
            return
        u = self.blocked[0]
        info = graph.tensors[u]
        who = f"backward of op {step}" if step is not None else "a replay"
        raise PlanError(f"{who} needs tensor {self.target}, whose recomputation needs tensor {u} (output of "
                        f"op {info.producer} {graph.ops[info.producer].name}), which is neither kept nor "
                        f"recomputable")


def _as_predicate(x: Predicate | Collection[int] | None) -> Predicate:
    if x is None:
        return lambda _u: False
    if callable(x):
        return x
    return x.__contains__


@dataclass(frozen=True)
class _Facts:
    """Per-graph facts a replay reads, computed once per graph: ``rebuild[t]`` (:func:`rebuild_ops`),
    ``reads[p]``: op ``p``'s activation inputs, each with whether ``p`` reads it mid-chain."""

    rebuild: dict[int, tuple[int, ...]]
    reads: list[tuple[tuple[int, bool], ...]]


def _facts(graph: Graph) -> _Facts:
    cached = graph.__dict__.get("_memplan_replay_facts")
    if cached is None:
        tensors = graph.tensors
        rebuild = {t.id: rebuild_ops(graph, t.id) for t in tensors if t.kind == "activation"}
        reads = [tuple((v, reads_mid_chain(graph, op.id, v)) for v in op.inputs if tensors[v].kind == "activation")
                 for op in graph.ops]
        cached = _Facts(rebuild, reads)
        graph.__dict__["_memplan_replay_facts"] = cached
    return cached


def kept_by_replays(action: Action) -> bool:
    """Whether a replay that re-creates a saved tensor planned ``action`` for another target keeps it
    until its own backward (``recompute``: a checkpoint left behind) or frees it after its last use in
    the replay (``recompute_each``: rebuilt again when its own backward needs it). The simulator and the
    executor both build their ``retain`` predicate from it."""
    return action != Action.RECOMPUTE_EACH


def rebuild_ops(graph: Graph, tensor: int) -> tuple[int, ...]:
    """The ops that re-create ``tensor`` in a replay: its producer, then its ``rebuilt_by`` ops."""
    info = graph.tensors[tensor]
    if info.producer is None:
        return ()
    return (info.producer, *info.rebuilt_by)


def reads_mid_chain(graph: Graph, op: int, tensor: int) -> bool:
    """Whether forward op ``op`` reads ``tensor`` before its in-place chain is finished: one of the
    tensor's ``rebuilt_by`` ops comes after ``op``, and ``op`` is neither its producer nor one of those
    (``y = h * 3; h.relu_()``; autograd's clone of a GRU chunk before its in-place ``mul_``). Replayed,
    such an op must read a copy of the tensor at that point of its chain, not the finished tensor."""
    info = graph.tensors[tensor]
    chain = info.rebuilt_by
    return bool(chain) and chain[-1] > op and op != info.producer and op not in chain


def replay(graph: Graph, target: int, *, available: Predicate | Collection[int],
           fetchable: Predicate | Collection[int] | None = None, retain: Predicate | Collection[int] | None = None,
           max_depth: int | None = None) -> Replay:
    """What a replay of ``target`` runs, given what is at hand (module docstring).

    ``available(u)``: activation ``u`` is on the device and may be read (non-activations always are).
    ``fetchable(u)``: ``u`` is not on the device but has a host copy to fetch. ``retain(u)``: a tensor this
    replay re-creates must stay resident after it (backward still reads it). ``max_depth``: needed
    tensors more than this many producer hops from the target are not expanded (``frontier``, blocked).
    Each argument may be a predicate or a collection of tensor ids. Raises nothing: blocked tensors are
    reported (:meth:`Replay.check` raises).
    """
    is_available = _as_predicate(available)
    is_fetchable = _as_predicate(fetchable)
    is_retained = _as_predicate(retain)
    tensors, ops = graph.tensors, graph.ops
    depth = {target: 0}
    order = [target]   # the breadth-first queue: tensors to rebuild, scratch copies to re-create
    missing = [target]
    to_run: set[int] = set()
    reads: set[int] = set()
    fetches: list[int] = []
    blocked: list[int] = []
    frontier: list[int] = []
    full: set[int] = {target}  # rebuilt in full by this replay (producer and whole chain)
    # scratch copies: a tensor that a replayed op reads mid-chain, not rebuilt in full here, is
    # re-created privately up to that op (its producer and the chain's ops before the last such reader)
    scratch_upto: dict[int, int] = {}
    expanded: dict[int, set[int]] = {}

    def need_full(v: int, hops: int) -> None:
        """``v`` is read finished by a replayed op: read it, fetch it, or rebuild it in full."""
        if v in full or v in reads or v in fetches or v in blocked or v in frontier:
            return
        if is_available(v):
            reads.add(v)
            return
        if v not in scratch_upto and max_depth is not None and hops > max_depth:
            frontier.append(v)
            return
        if is_fetchable(v):
            fetches.append(v)
            missing.append(v)
            return
        if not tensors[v].recomputable or tensors[v].producer is None:
            blocked.append(v)
            missing.append(v)
            return
        full.add(v)
        scratch_upto.pop(v, None)  # the whole chain runs: mid-chain readers see it in forward order
        depth.setdefault(v, hops)
        missing.append(v)
        order.append(v)

    def need_scratch(v: int, reader: int, hops: int) -> None:
        """``v`` is read mid-chain by replayed op ``reader``."""
        if v in full or reader <= scratch_upto.get(v, -1):
            return
        if not tensors[v].recomputable or tensors[v].producer is None:
            if v not in blocked:
                blocked.append(v)
            return
        scratch_upto[v] = reader
        depth.setdefault(v, hops)
        order.append(v)  # (again, if it grew: the chain's further ops are expanded)

    facts = _facts(graph)
    i = 0
    while i < len(order):  # breadth first: the depth limit counts hops from the target
        u = order[i]
        i += 1
        if u in full:
            run = facts.rebuild[u]
        elif u in scratch_upto:
            run = tuple(p for p in facts.rebuild[u] if p < scratch_upto[u])
        else:
            continue
        done = expanded.setdefault(u, set())
        run = tuple(p for p in run if p not in done)
        done.update(run)
        to_run.update(run)
        for p in run:
            for v, mid in facts.reads[p]:
                if v == u:
                    continue
                if mid:
                    need_scratch(v, p, depth[u] + 1)
                else:
                    need_full(v, depth[u] + 1)
    scratch_upto = {v: q for v, q in scratch_upto.items() if v not in full}
    run_order = sorted(to_run)
    last_use: dict[int, int] = {}
    for p in run_order:
        for v in ops[p].inputs:
            if v in scratch_upto and p > scratch_upto[v]:
                continue  # a reader of the finished tensor reads the resident (or fetched) copy
            last_use[v] = p
    have = set(reads) | set(fetches)
    made: list[int] = []
    kept: list[int] = []
    dies_after: dict[int, list[int]] = {}  # op -> re-created tensors freed right after it, in creation order
    frees_after: list[tuple[int, ...]] = []
    for p in run_order:
        for o in ops[p].outputs:
            if o not in scratch_upto:
                if o in have or (o != target and is_available(o)):
                    continue
                have.add(o)
                made.append(o)
                if o == target or is_retained(o):
                    kept.append(o)
                    continue
            dies_after.setdefault(max(p, last_use.get(o, -1)), []).append(o)
        frees_after.append(tuple(dies_after.pop(p, ())))
    kept.sort(key=lambda u: (u != target, u))
    return Replay(
        target=target, ops=tuple(run_order), rebuilds=tuple(sorted(made)), fetches=tuple(sorted(fetches)),
        reads=tuple(sorted(reads)), frees_after=tuple(frees_after), kept=tuple(kept), missing=tuple(missing),
        blocked=tuple(sorted(blocked + frontier)), frontier=tuple(sorted(frontier)),
        scratch=tuple(sorted(scratch_upto)))
