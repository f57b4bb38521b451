"""The largest batch (or sequence length) whose best plan fits a budget, from one shape-family graph.

    answer = max_dim(graph, budget_bytes=24 * 2**30, dim="batch", max_overhead=0.2)
    answer.value, answer.result.plan, answer.graph      # the plan is for ``answer.graph`` (that shape)

No trial runs: each candidate value is the family evaluated at that shape
(:func:`memplan.planner.core.shapes.at_shape`, extrapolating past the profiled shapes) and solved with
:func:`memplan.solvers.solve`. A value *fits* when a plan's predicted peak is within the budget and, with
``max_overhead``, its step time is at most ``1 + max_overhead`` times keeping everything at that shape.
Fitting is taken to be monotone in the value (a larger batch never needs less memory): the search doubles
from 1 until a value does not fit, then bisects between the last that fits and the first that does not.
A value below the smallest memory bound (:func:`memplan.solvers.memory_lower_bound`) is rejected without
solving.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from memplan.planner.core.errors import GraphError, Infeasible, MemplanError
from memplan.planner.core.graph import FUSE_MODES, Graph
from memplan.planner.core.shapes import at_shape, family_of
from memplan.planner.core.simulator import simulate
from memplan.planner.core.units import format_bytes
from memplan.solvers import (
    SolveResult,
    keep_all_report,
    memory_lower_bound,
    smallest_known_peak,
    solve,
)

MAX_VALUE = 1 << 24  # the search's default cap


@dataclass(frozen=True)
class Probe:
    """One candidate value: fits or not, and why not (``reason``); ``min_feasible_bytes`` is the smallest
    peak memplan knows at that shape; ``overhead`` the best plan's, when one fits the budget."""

    value: int
    fits: bool
    reason: str
    min_feasible_bytes: int | None = None
    overhead: float | None = None


@dataclass(frozen=True)
class MaxDim:
    """The answer: ``value`` is the largest that fits; ``graph`` is the family at it, ``result`` its best
    plan (apply it with that graph); ``next`` the probe of ``value + 1`` (why one more does not fit)."""

    dim: str
    value: int
    graph: Graph
    result: SolveResult
    overhead: float
    next: Probe
    probes: tuple[Probe, ...]


def max_dim(graph: Graph, budget_bytes: int, *, dim: str = "batch", max_overhead: float | None = None,
            method: str = "auto", time_limit_s: float = 10.0, offload: bool = False,
            max_value: int = MAX_VALUE, fuse: str | None = None, host_budget_bytes: int | None = None,
            states: bool | str | None = None) -> MaxDim:
    """The largest value of dimension ``dim`` (the family's other dimensions at the graph's own values)
    whose best plan fits ``budget_bytes`` within ``max_overhead`` (a fraction: 0.2 is 20%; None: any).

    ``method``, ``time_limit_s`` (per candidate), ``offload``, ``host_budget_bytes``, ``states`` (optimizer
    state streamed through the host, with ``offload`` by default) and ``fuse`` go to :func:`memplan.solvers.solve`
    (``fuse="backward"`` or ``"forward"``: the step with the optimizer fused there, its peak and its overhead
    against keeping everything in that step).
    Raises :class:`GraphError` when the graph has no shape family over ``dim``, :class:`Infeasible`
    (naming the minimum feasible budget at ``dim = 1``) when not even 1 fits, and :class:`MemplanError`
    for a negative budget or overhead. ``max_value`` caps the search (a model's maximum sequence length):
    when it fits, it is the answer and ``next`` says so.
    """
    fam = family_of(graph)
    if fam is None:
        raise GraphError(f"graph {graph.name} was profiled at one shape: maxbatch needs a shape family "
                         f"(memplan maxbatch WORKLOAD profiles one)")
    if dim not in fam.dims:
        raise GraphError(f"graph {graph.name}'s shape family varies {', '.join(fam.dims)}, not {dim!r}")
    if not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise MemplanError(f"budget must be a non-negative number of bytes, got {budget_bytes!r}")
    if max_overhead is not None and not max_overhead >= 0:
        raise MemplanError(f"max overhead must be a non-negative fraction, got {max_overhead!r}")
    if fuse is not None and fuse not in FUSE_MODES:
        raise MemplanError(f"fuse={fuse!r}: expected {' or '.join(FUSE_MODES)} (or None: not fused)")
    fused = fuse is not None and bool(graph.fused_backward)
    fixed = dict(fam.at)
    found: dict[int, tuple[Graph, SolveResult, float]] = {}
    probes: dict[int, Probe] = {}

    def probe(v: int) -> Probe:
        if v in probes:
            return probes[v]
        g = at_shape(graph, {**fixed, dim: v}, extrapolate=True)
        # (the unfused step's bound is no bound on the fused one: solve refuses that, quoting its least peak)
        # (nor is the activations' bound one on a step whose model states may leave the device)
        moves_states = bool(g.state_units) and (offload if states is None else bool(states))
        if not fused and not moves_states and memory_lower_bound(g) > budget_bytes:
            least = smallest_known_peak(g, offload=offload, deadline=time.perf_counter() + time_limit_s)
            p = Probe(v, False, "no plan fits the budget", least)
        else:
            try:
                result = solve(g, budget_bytes, method, time_limit_s=time_limit_s, offload=offload, fuse=fuse,
                               host_budget_bytes=host_budget_bytes, states=states)
            except Infeasible as e:
                p = Probe(v, False, "no plan fits the budget", e.min_feasible_bytes)
            else:
                # keeping everything in the step solve planned
                base = (simulate(g, None, timeline=False, fuse=fuse) if fused else keep_all_report(g)).time_s
                overhead = result.report.time_s / base - 1.0 if base > 0 else 0.0
                if max_overhead is not None and overhead > max_overhead + 1e-12:
                    p = Probe(v, False, f"the best plan found costs {overhead:.1%} over keeping everything",
                              None, overhead)
                else:
                    p = Probe(v, True, "fits", None, overhead)
                    found[v] = (g, result, overhead)
        probes[v] = p
        return p

    first = probe(1)
    if not first.fits:
        if first.min_feasible_bytes is None:
            raise MemplanError(f"not even {dim}=1 fits: {first.reason}")
        least = first.min_feasible_bytes
        raise Infeasible(f"not even {dim}=1 fits budget {format_bytes(budget_bytes)} ({budget_bytes} B): the "
                         f"minimum feasible budget memplan knows at {dim}=1 is {format_bytes(least)} ({least} B)",
                         budget_bytes=budget_bytes, min_feasible_bytes=first.min_feasible_bytes)
    lo, hi = 1, min(2, max_value + 1)
    while hi <= max_value and probe(hi).fits:  # double until a value does not fit
        lo = hi
        hi = min(2 * hi, max_value + 1)
    if hi > max_value:  # everything up to the cap fits
        probes[hi] = Probe(hi, False, f"above the largest value asked for ({max_value})")
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        if probe(mid).fits:
            lo = mid
        else:
            hi = mid
    g, result, overhead = found[lo]
    return MaxDim(dim=dim, value=lo, graph=g, result=result, overhead=overhead, next=probe(lo + 1),
                  probes=tuple(probes[v] for v in sorted(probes)))
