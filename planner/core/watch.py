"""Which forward ops the executor watches under a plan: one definition for the executor, which enters its
op-counting dispatch mode for them, and the simulator, which charges that mode's dispatch (torch-free).

The executor needs to see an ATen call in forward only where the plan decides something there:

* the producer of every *tracked* tensor: a recomputed or offloaded one (its saved-tensor handles name
  it), a pinned one (held for a replay), and every activation a replay reads or re-creates (a replay's
  recipe refers to it by tensor id, and the replay must find it resident);
* every op a replay runs (its recipe: the ATen op and its arguments, recorded as it runs);
* the last in-place writer of an offloaded tensor copied after it.

These are the *needed* ops. The mode is on from ``first`` (the lowest needed op) to ``last`` (the
highest): ops in between that are not needed pass through its fast path, which only checks that the op
is the graph's. Outside the window the step dispatches plainly (saved-tensor hooks stay on: a packed
tensor is found by its storage, whichever op saves it).

Offloading or pinning makes the executor tag every op's autograd node (backward's position drives the
prefetches and the pins' releases), so such a plan is watched from op 0 to its last decision, the savers
of moved tensors, the prefetch points and the forward ops before which an offloaded tensor's device copy
is released (its copy to host has ended: the executor releases it exactly there) included, and every op
in it is needed (``full``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action


@dataclass(frozen=True)
class Watch:
    """The forward ops a step under a plan watches (module docstring).

    ``first``..``last``: the window (inclusive; empty when ``last < first``: a plan that moves nothing).
    ``needed``: op ids handed to the executor's full per-op handler (recipes, tracked outputs).
    ``tracked``: tensor ids whose storages the executor maps to the graph.
    ``full``: every op of the window is needed (offload or pins).
    """

    first: int
    last: int
    needed: frozenset[int]
    tracked: frozenset[int]
    full: bool

    @property
    def ops(self) -> int:
        """How many forward ops the mode sees."""
        return max(self.last - self.first + 1, 0)


def forward_watch(graph: Graph, actions: Mapping[int, Action], replayed_ops: Collection[int],
                  pins: Collection[int] = (), prefetch_ops: Collection[int] = (),
                  d2h_after: Mapping[int, int] | None = None, release_ops: Collection[int] = ()) -> Watch:
    """The :class:`Watch` of a plan: ``actions`` (tensor id -> action; KEEP may be left out),
    ``replayed_ops`` (every op a replay of its schedule runs), ``pins`` (tensors held for a replay),
    ``prefetch_ops`` (backward steps whose autograd nodes the executor tags: where prefetches start and
    where offloaded tensors' device copies are released in backward), ``d2h_after`` (saved activation written in
    place after its first saver -> its last writer; the simulator's ``static_facts``), ``release_ops``
    (forward ops at whose boundary an offloaded tensor's device copy is released: ``Schedule.released``)."""
    moved = {t: a for t, a in actions.items() if a != Action.KEEP}
    if not moved:
        return Watch(0, -1, frozenset(), frozenset(), False)
    tensors, ops = graph.tensors, graph.ops
    tracked = set(moved) | set(pins)
    for p in replayed_ops:
        tracked.update(v for v in ops[p].inputs if tensors[v].kind == "activation")
        tracked.update(ops[p].outputs)
    needed = {tensors[t].producer for t in tracked if tensors[t].producer is not None}
    needed.update(replayed_ops)
    offloaded = [t for t, a in moved.items() if a == Action.OFFLOAD]
    d2h_after = d2h_after or {}
    needed.update(d2h_after[t] for t in offloaded if t in d2h_after)
    full = bool(offloaded) or bool(pins)
    if not full:
        return Watch(min(needed), max(needed), frozenset(needed), frozenset(tracked), False)
    savers = graph.savers
    last = max([*needed, *prefetch_ops, *release_ops, *(max(savers.get(t, [-1])) for t in moved)])
    return Watch(0, last, frozenset(range(last + 1)), frozenset(tracked), True)


def fused_forward_watch(graph: Graph, watch: Watch) -> Watch:
    """``watch`` under forward-fused optimizer steps (memplan.planner.probe.fusion): each module's parameters
    are updated in its forward pre-hook, so an op that reads a parameter still pending (one used outside the
    module that owns it) must be caught. The ops that read a parameter are needed (the full handler checks
    their inputs) and the window reaches from the first of them to the last; the others in it pass through
    the mode's fast path, which checks only that the op is the graph's (an op that is not takes the full
    handler too). Past the last reader no parameter is read: the mode leaves there, before backward."""
    readers = {op.id for op in graph.ops if any(graph.tensors[t].kind == "param" for t in op.inputs)}
    if not readers:
        return watch
    if watch.ops:
        first, last = min(watch.first, min(readers)), max(watch.last, max(readers))
    else:
        first, last = min(readers), max(readers)
    return Watch(first, last, watch.needed | readers, watch.tracked, watch.full)
