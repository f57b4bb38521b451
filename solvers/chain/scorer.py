"""Candidate plans scored in the simulator, memoised, for methods that generate many and return the
fastest that fits (``dp`` on DAGs and with offload, the chain baselines)."""

from __future__ import annotations

from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action
from memplan.planner.core.simulator import Report, simulate_actions

Actions = dict[int, Action]


class Scorer:
    """Simulated candidate plans, memoised; picks the fastest that fits a budget."""

    def __init__(self, graph: Graph, host_budget_bytes: int | None = None):
        self.graph = graph
        self.host = host_budget_bytes
        self.seen: dict[frozenset, tuple[Report, Actions, dict[int, int], str]] = {}

    def add(self, actions: Actions, source: str, prefetch_at: dict[int, int] | None = None) -> Report:
        key = frozenset((*actions.items(), *((t, -k - 1) for t, k in (prefetch_at or {}).items())))
        if key not in self.seen:
            r = simulate_actions(self.graph, actions, prefetch_at=prefetch_at)
            self.seen[key] = (r, actions, dict(prefetch_at or {}), source)
        return self.seen[key][0]

    def best(self, budget: int):
        fits = [v for v in self.seen.values() if v[0].peak_bytes <= budget
                and (self.host is None or v[0].host_peak_bytes <= self.host)]
        if not fits:
            return None
        return min(fits, key=lambda v: (v[0].time_s, v[0].peak_bytes, len(v[1])))
