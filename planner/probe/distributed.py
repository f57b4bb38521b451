"""One rank's memory under DDP and FSDP2, as adjustments of a graph profiled on the bare module.

The graph of a distributed step is the bare module's with one rank's batch: the ops, activations and
their lifetimes are the same on every rank. What differs is what the engine keeps per rank; these
functions return a copy of the graph whose figures say so (docs/model.md, "Distributed"), so that the
unchanged simulator predicts a rank's peak:

* :func:`for_ddp`: DDP keeps its gradient buckets (flat buffers, one copy of every gradient) for the
  whole of training: ``fixed.other_bytes`` grows by the bytes of the parameters that require grad.
* :func:`for_fsdp`: ``fully_shard`` keeps 1/N of each parameter (dim 0 padded to a multiple of N) and of
  the optimizer state; the root unit's parameters stay unsharded from forward to the end of backward; a
  unit's unsharded parameters and its flat all-gather output exist while its ops run (forward; backward
  with the previous unit prefetched and the next unit's reduce-scatter input still kept); a unit's full
  gradients are copied into its reduce-scatter input and freed when its backward ends, leaving 1/N; gloo
  copies each collective's full flat buffer once.

:func:`cross_unit_recomputes` and :func:`keep_within_units` keep a plan's replays inside FSDP units (a
replay in one unit's backward cannot read another unit's resharded parameters). A rank's peak is measured
by :func:`memplan.planner.probe.measure.measure_rank_step`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action, Plan
from memplan.planner.core.replay import replay

ENGINES = ("ddp", "fsdp")


class DistributedPlanError(MemplanError):
    """A plan or a distributed set-up that a rank cannot run as stated (named in the message)."""


# ---- FSDP units ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FSDPUnit:
    """One ``fully_shard`` unit: module path (``""`` is the root), its parameters' bytes unsharded and
    per rank (sharded along dim 0, padded to a multiple of the world size)."""

    prefix: str
    unsharded_bytes: int
    shard_bytes: int


def unit_of(module: str, prefixes: Iterable[str]) -> str:
    """The innermost unit prefix that ``module`` (a module path) lies in; ``""`` (the root) if none."""
    best = ""
    for p in prefixes:
        if p and (module == p or module.startswith(p + ".")) and len(p) > len(best):
            best = p
    return best


def shard_bytes(shape: list[int] | tuple[int, ...], element_bytes: int, world_size: int) -> int:
    """Bytes of one rank's shard of a parameter: dim 0 split into ``world_size`` padded chunks."""
    if not shape:
        return element_bytes  # a scalar is replicated
    rest = math.prod(shape[1:])
    return math.ceil(shape[0] / world_size) * rest * element_bytes


def check_unit_prefixes(model: Any, prefixes: list[str]) -> None:
    """Refuse, naming it, the first of ``prefixes`` (FSDP units) that is not a module of ``model``."""
    names = dict(model.named_modules())
    missing = [p for p in prefixes if p not in names]
    if missing:
        raise DistributedPlanError(f"FSDP unit {missing[0]!r} is not a module of {type(model).__name__}")


def fsdp_units(model: Any, prefixes: list[str], world_size: int) -> list[FSDPUnit]:
    """The units that ``fully_shard`` on each of ``prefixes`` (then on the root) makes of the bare
    ``model``, with their bytes. A parameter belongs to the innermost unit its module lies in; a tied
    parameter is counted once (where it first appears)."""
    if world_size < 1:
        raise DistributedPlanError(f"world_size must be >= 1, got {world_size}")
    check_unit_prefixes(model, prefixes)
    full = {p: 0 for p in ["", *prefixes]}
    shard = dict(full)
    for name, p in model.named_parameters():  # deduplicated: tied parameters appear once
        u = unit_of(name.rpartition(".")[0], prefixes)
        full[u] += p.numel() * p.element_size()
        shard[u] += shard_bytes(list(p.shape), p.element_size(), world_size)
    return [FSDPUnit(u, full[u], shard[u]) for u in ["", *prefixes]]


# ---- adjusted graphs --------------------------------------------------------------------------------------


def _copy(graph: Graph) -> Graph:
    return Graph.model_validate(graph.model_dump())


def for_ddp(graph: Graph, world_size: int) -> Graph:
    """A copy of ``graph`` (the bare module, one rank's batch) as one DDP rank holds it: DDP's gradient
    buckets (``gradient_as_bucket_view=False``, the default: one flat copy of every gradient, allocated at
    construction and kept) join the fixed memory. ``meta["distributed"]`` records the adjustment."""
    if world_size < 1:
        raise DistributedPlanError(f"world_size must be >= 1, got {world_size}")
    g = _copy(graph)
    g.fused_backward = []  # backward fusion under DDP steps after the reduction: predicted unfused (an upper bound)
    bucket_bytes = sum(t.bytes for t in g.tensors if t.kind == "param" and t.requires_grad)
    g.fixed.other_bytes += bucket_bytes
    g.meta["distributed"] = {"engine": "ddp", "world_size": world_size, "bucket_bytes": bucket_bytes}
    return g.invalidate()


def for_fsdp(graph: Graph, units: list[FSDPUnit], world_size: int, *, backend: str = "gloo") -> Graph:
    """A copy of ``graph`` as one FSDP2 rank holds it (``reshard_after_forward=True`` for every unit but
    the root, one unit prefetched in backward, one reduce-scatter input kept), ``units`` from
    :func:`fsdp_units`; docs/model.md ("Distributed") states every term. ``backend``: the process group's;
    under ``"nccl"`` the collectives allocate nothing through the allocator, under any other (gloo) each
    all-gather and reduce-scatter allocates one temporary copy of its full flat buffer. Raises
    :class:`DistributedPlanError` if the units' bytes do not add up to the graph's parameters (another
    model) or the root unit is missing."""
    by_prefix = {u.prefix: u for u in units}
    if "" not in by_prefix:
        raise DistributedPlanError("for_fsdp needs the root unit (prefix '') among the units")
    if world_size < 1:
        raise DistributedPlanError(f"world_size must be >= 1, got {world_size}")
    full_bytes = sum(u.unsharded_bytes for u in units)
    if full_bytes != graph.fixed.params_bytes:
        raise DistributedPlanError(f"the FSDP units hold {full_bytes} parameter bytes, the graph "
                                   f"{graph.fixed.params_bytes}: units of another model")
    g = _copy(graph)
    g.fused_backward = []  # the shards' gradients under backward fusion: not modelled, predicted unfused
    shard_total = sum(u.shard_bytes for u in units)
    ratio = shard_total / full_bytes if full_bytes else 1.0
    # F: one unit's flat all-gather output = its unsharded parameters (padded) = its reduce-scatter input
    flat = {u.prefix: world_size * u.shard_bytes for u in units}
    temp = {u: (0 if backend == "nccl" else b) for u, b in flat.items()}  # gloo's copy inside a collective
    grads = {u.prefix: u.unsharded_bytes for u in units}  # the full gradients autograd makes
    shard = {u.prefix: u.shard_bytes for u in units}
    g.fixed.params_bytes = shard_total
    g.fixed.optimizer_state_bytes = round(graph.fixed.optimizer_state_bytes * ratio)
    g.fixed.optimizer_step_bytes = round(graph.fixed.optimizer_step_bytes * ratio)
    g.fixed.other_bytes += flat[""]  # the root's unsharded parameters: gathered once, freed after backward
    prefixes = [u.prefix for u in units if u.prefix]
    n = len(g.ops)
    model_end = max((op.id for op in g.ops if op.module != "loss"), default=-1)  # later ops: the loss's
    op_unit = [unit_of(op.module, prefixes) if op.id <= model_end else None for op in g.ops]
    order = list(dict.fromkeys(u for u in op_unit if u))  # non-root units in forward order
    first = {u: op_unit.index(u) for u in order}
    last = {u: n - 1 - op_unit[::-1].index(u) for u in order}
    pos = {u: j for j, u in enumerate(order)}

    def F(j: int) -> int:  # noqa: N802 - the doc's name; 0 outside the units
        return flat[order[j]] if 0 <= j < len(order) else 0

    fwd = [0] * n
    bwd = [0] * n
    gathered = ""  # the unit whose flat all-gather output FSDP2 holds in forward (all_gather_state)
    for k, u in enumerate(op_unit):
        if u is None:
            continue  # the loss: FSDP2's forward is over, its backward not begun
        if u:
            j = pos[u]
            # forward: unsharded parameters + their flat all-gather output; backward: unsharded parameters
            # + the previous unit prefetched + the next unit's reduce-scatter input, still kept
            compute = flat[u] + F(j - 1) + F(j + 1)
            fwd[k] = max(2 * flat[u], compute)  # a replay in backward runs with the forward figure
            bwd[k] = compute
            if k == first[u]:  # its all-gather: the held output of the one before + its own + gloo's copy
                fwd[k] = max(fwd[k], flat[gathered] + flat[u] + temp[u])
                gathered = u
                # post-backward: reshard, drop the next unit's reduce-scatter input, copy the full gradients
                # into this unit's (padded) reduce-scatter input, free them, the shards + gloo's copy
                bwd[k] = max(bwd[k], F(j - 1) + flat[u] + max(0, shard[u] + temp[u] - grads[u]))
            if k == last[u]:  # pre-backward: copy-out beside the prefetched flat output, then prefetch
                prev = order[j - 1] if j > 0 else None
                ahead = flat[prev] + temp[prev] if prev is not None else 0
                bwd[k] = max(bwd[k], F(j + 1) + flat[u] + max(flat[u], ahead))
        else:
            # a root op between non-root units: forward holds the last all-gather's output; backward the
            # next unit's reduce-scatter input and the previous unit prefetched
            after = next((j for j, v in enumerate(order) if first[v] > k), len(order))
            bwd[k] = F(after) + F(after - 1)
            fwd[k] = max(flat[gathered], bwd[k])
    if 0 <= model_end and order and op_unit[model_end] == "":
        # the root's pre-backward, at the model's output: prefetch of the last unit (+ gloo's copy)
        bwd[model_end] = max(bwd[model_end], flat[order[-1]] + temp[order[-1]])
    # the root's post-backward, after every backward step: its full gradients -> reduce-scatter input (its
    # unsharded parameters, charged in other_bytes, are freed first) -> shards + gloo's copy
    bwd[0] = max(bwd[0], max(0, shard[""] + temp[""] - grads[""]))
    for op in g.ops:
        op.workspace_bytes += fwd[op.id]
        op.backward_workspace_bytes += bwd[op.id]
    for u in ["", *order]:  # a unit's backward ends at its first op: full gradients -> shards
        k = first[u] if u else 0
        g.ops[k].backward_grad_free_bytes += grads[u] - shard[u]
    g.meta["distributed"] = {"engine": "fsdp", "world_size": world_size, "backend": backend,
                             "units": [asdict(u) for u in units]}
    return g.invalidate()


# ---- plans that stay inside FSDP units -----------------------------------------------------------------------


def _replay_ops(graph: Graph, actions: dict[int, Action], target: int) -> set[int]:
    """Ops a replay of ``target`` may run (:func:`memplan.planner.core.replay.replay`), counting as missing
    every activation the plan does not keep for backward (an over-approximation of the simulator's
    replay: a tensor rebuilt earlier and still cached is counted as missing). Kept, caller-held and
    offloaded (fetched, not rebuilt) tensors are read; one that cannot be rebuilt is pinned (read)."""
    savers = graph.savers

    def available(u: int) -> bool:
        info = graph.tensors[u]
        kept = u in savers and actions.get(u, Action.KEEP) == Action.KEEP
        return kept or info.held_by_caller or not info.recomputable

    offloaded = {t for t, a in actions.items() if a == Action.OFFLOAD}
    return set(replay(graph, target, available=available, fetchable=offloaded).ops)


def cross_unit_recomputes(graph: Graph, plan: Plan, prefixes: list[str]) -> list[tuple[int, str, str]]:
    """(tensor, unit whose backward first reads it, other unit) for every recomputed tensor whose replay
    may run an op that reads parameters of another non-root unit: under FSDP2 those parameters are
    resharded then. Empty when the plan is safe."""
    actions = plan.actions()
    op_unit = [unit_of(op.module, prefixes) for op in graph.ops]
    params = {t.id for t in graph.tensors if t.kind == "param"}
    bad = []
    for t, a in actions.items():
        if a != Action.RECOMPUTE:
            continue
        home = op_unit[max(graph.savers[t])]  # backward reaches the highest saver first
        for k in sorted(_replay_ops(graph, actions, t)):
            u = op_unit[k]
            if u and u != home and params.intersection(graph.ops[k].inputs):
                bad.append((t, home, u))
                break
    return bad


def keep_within_units(graph: Graph, plan: Plan, prefixes: list[str]) -> tuple[Plan, list[int]]:
    """``plan`` with every recompute that crosses FSDP units (:func:`cross_unit_recomputes`) turned into
    keep (its prediction dropped: simulate it again), and the tensors changed."""
    changed: list[int] = []
    while True:
        bad = cross_unit_recomputes(graph, plan, prefixes)
        if not bad:
            return plan, changed
        demote = {t for t, _, _ in bad}
        changed += sorted(demote)
        decisions = [d.model_copy(update={"action": Action.KEEP, "prefetch_at": None}) if d.tensor in demote else d
                     for d in plan.decisions]
        plan = plan.model_copy(update={"decisions": decisions, "predicted": None})
