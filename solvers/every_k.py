"""``every-k``: 'checkpoint every k-th block' on the coarsened chain, as users do by hand
(``torch.utils.checkpoint.checkpoint_sequential``; Chen et al. 2016 with k = sqrt(n)). No optimality claim.
"""

from __future__ import annotations

import time

from pydantic import Field
from pydantic.dataclasses import dataclass

from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import Graph, coarsen
from memplan.planner.core.plan import Action
from memplan.planner.core.simulator import Report, simulate_actions
from memplan.solvers.registry import CONFIG, Proposal, register

Actions = dict[int, Action]


@dataclass(frozen=True, kw_only=True, config=CONFIG)
class Config:
    """Options of ``every-k``."""

    k: int | None = Field(default=None, ge=1)      # checkpoint every k-th stage; None: the fastest k that fits
    depth: int | None = Field(default=None, ge=0)  # module depth of the chain's stages; None: coarsen's default


DEFAULT = Config()


def _simulate(graph: Graph, actions: Actions) -> Report:
    return simulate_actions(graph, actions)


def _chain_for(graph: Graph, depth: int | None):
    """The coarsened chain whose stages are the 'blocks': ``coarsen``'s default, or, when that leaves
    fewer than 4 stages (a flat module tree), the shallowest module depth that gives at least 4."""
    if depth is not None:
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise MemplanError(f"every-k: depth must be a non-negative integer, got {depth!r}")
        return coarsen(graph, depth)
    chain = coarsen(graph)
    if len(chain) >= 4 or not graph.ops:
        return chain
    max_depth = max(len([p for p in op.module.split(".") if p]) for op in graph.ops)
    for d in range(1, max_depth + 1):
        finer = coarsen(graph, d)
        if len(finer) >= 4:
            return finer
    return chain


def _every_k_actions(graph: Graph, chain, k: int) -> Actions:
    """Keep the activations crossing into every k-th stage (0, k, 2k, ...) and everything the last
    segment makes (like ``torch.utils.checkpoint.checkpoint_sequential``, which runs its last segment
    normally); recompute every other saved activation that can be. ``k >= len(chain)`` keeps all."""
    n = len(chain)
    last = ((n - 1) // k) * k if n else 0
    keep: set[int] = set()
    for stage in chain.stages:
        if stage.index % k == 0:
            keep.update(stage.input_tensors)
        if stage.index >= last:
            keep.update(t for o in stage.ops for t in graph.ops[o].outputs)
    tensors = graph.tensors
    return {t: Action.RECOMPUTE for t in graph.saved_activations
            if t not in keep and tensors[t].recomputable and tensors[t].bytes > 0}


class _KSearch:
    """Simulated every-k plans, memoised by k."""

    def __init__(self, graph: Graph, chain):
        self.graph, self.chain = graph, chain
        self.seen: dict[int, tuple[Report, Actions]] = {}

    def __call__(self, k: int) -> Report:
        if k not in self.seen:
            actions = _every_k_actions(self.graph, self.chain, k)
            self.seen[k] = (_simulate(self.graph, actions), actions)
        return self.seen[k][0]

    def lowest(self, grid: list[int], deadline: float | None = None) -> int:
        """The k of least peak: the grid's best, then a ternary search between its neighbours (the peak
        is about n/k boundaries plus k stages: unimodal but for noise). Past ``deadline`` (a
        ``time.perf_counter()`` value) no further k is simulated: the best k simulated by then."""
        def in_time() -> bool:
            return deadline is None or time.perf_counter() < deadline

        tried = []
        for k in grid:  # in order, simulating each, while time is left (the first k at least)
            if tried and not in_time():
                break
            self(k)
            tried.append(k)
        best = min(tried, key=lambda k: (self(k).peak_bytes, k))
        i = grid.index(best)
        lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
        while hi - lo > 2 and in_time():
            m1, m2 = lo + (hi - lo) // 3, hi - (hi - lo) // 3
            if self(m1).peak_bytes <= self(m2).peak_bytes:
                hi = m2
            else:
                lo = m1
        near = [k for k in range(lo, hi + 1) if in_time() or k in self.seen] or [best]
        return min(near, key=lambda k: (self(k).peak_bytes, k))


def _k_grid(n: int) -> list[int]:
    if n <= 24:
        return list(range(1, n + 1))
    grid, k = [], 1
    while k < n:
        grid.append(k)
        k = max(k + 1, int(k * 1.5))
    return grid + [n]


def every_k_search(graph: Graph, budget: int | None, depth: int | None = None, *,
                   deadline: float | None = None) -> tuple[int, Actions, Report, int]:
    """The every-k plan for ``budget``: the fastest that fits among the k tried (k = len(chain) keeps
    everything), or, with ``budget=None`` or when none fits, the one of least peak. Returns (k, actions,
    report, stages). ``deadline`` (a ``time.perf_counter()`` value) bounds the whole search: past it no
    further k is simulated (the first grid k always is) and the answer is the best among those simulated."""
    chain = _chain_for(graph, depth)
    n = len(chain)
    if n == 0:
        return 0, {}, _simulate(graph, {}), 0
    search = _KSearch(graph, chain)
    grid = _k_grid(n)

    def in_time() -> bool:
        return deadline is None or time.perf_counter() < deadline

    if budget is not None:
        fitting = []
        for k in grid:  # from the most recomputed (least peak, mostly) up, while time is left
            if k != grid[0] and not in_time():
                break
            if search(k).peak_bytes <= budget:
                fitting.append(k)
        if fitting:
            # time falls as k grows (less is recomputed); look between the largest fitting grid k and
            # the next grid point for a larger one that still fits
            lo = max(fitting)
            hi = next((k for k in grid if k > lo), lo)
            while hi - lo > 1 and in_time():
                mid = (lo + hi) // 2
                if search(mid).peak_bytes <= budget:
                    lo = mid
                else:
                    hi = mid
    k = search.lowest(grid, deadline)
    fits = [k for k, (r, _) in search.seen.items() if budget is not None and r.peak_bytes <= budget]
    if fits:
        k = min(fits, key=lambda k: (search.seen[k][0].time_s, search.seen[k][0].peak_bytes, -k))
    report, actions = search.seen[k]
    return k, actions, report, n




@register("every-k", description="checkpoint every k-th block of the coarsened chain (what users do by "
                                 "hand); option k=, default: the fastest k that fits",
          graphs="chain", exact=False, offload=False, config=Config)
def solve_every_k(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
                  host_budget_bytes: int | None = None, config: Config = DEFAULT) -> Proposal:
    """Keep the activations at the boundary of every k-th stage of ``coarsen(graph)`` (``depth`` picks
    the module depth) and everything of the last segment; recompute the rest, as
    ``checkpoint_sequential`` does (Chen et al. 2016 with k = sqrt(n)). With ``k`` given, that plan; by
    default the k (1..stages) whose plan is fastest within the budget, searched for ``time_limit_s`` at
    most (beyond it by one plan's simulation at most): the fastest that fits among the k tried by then,
    with status ``timeout`` (``infeasible`` with ``stats["stopped"] = "time limit"`` if none fits)."""
    k, depth = config.k, config.depth
    if k is not None:
        chain = _chain_for(graph, depth)
        if k > max(len(chain), 1):
            raise MemplanError(f"every-k: k must be an integer from 1 to the number of stages "
                               f"({len(chain)} at module depth {chain.depth}), got {k!r}")
        actions = _every_k_actions(graph, chain, k)
        return Proposal(actions, status="feasible", stats={"k": k, "stages": len(chain), "depth": chain.depth})
    deadline = time.perf_counter() + time_limit_s
    best_k, actions, report, n = every_k_search(graph, budget_bytes, depth, deadline=deadline)
    stats: dict = {"k": best_k, "stages": n}
    cut = time.perf_counter() >= deadline  # the search may have stopped before trying every k
    if cut:
        stats["stopped"] = "time limit"
    if report.peak_bytes > budget_bytes:  # the least-peak k's plan
        return Proposal(actions, status="infeasible", stats={**stats, "lowest_peak_bytes": report.peak_bytes})
    return Proposal(actions, status="timeout" if cut else "feasible", stats=stats)
