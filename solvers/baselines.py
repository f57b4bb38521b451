"""The published chain schedules as baselines, each on the coarsened chain (op-level stages for a chain
graph), translated into keep / recompute actions and scored by the simulator like every other method.

Baselines, each on the coarsened chain (op-level stages for a chain graph): ``rotor`` (Beaumont,
Eyraud-Dubois, Herrmann, Joly, Shilova 2019: nested recomputation DP, ``Opt[s][t][m]``), ``chen`` (Chen
et al. 2016: sqrt(n) segments), ``revolve`` (Griewank & Walther 2000: binomial checkpoint positions).
memplan's plans recompute each tensor at most once, so a nested schedule is translated into the
activations it keeps in its first forward sweep; each baseline is tried over its own parameter and the
fastest simulated plan that fits is returned.
"""

from __future__ import annotations

import math
import time

import numpy as np

from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action
from memplan.solvers.chain.scorer import Scorer
from memplan.solvers.chain.stages import Stages, stage_actions, stage_chain
from memplan.solvers.registry import Proposal, register

Actions = dict[int, Action]


def chen_candidates(graph: Graph, stages: Stages, scorer: Scorer, segments: int | None = None) -> None:
    """Chen et al. 2016: cut the chain into about sqrt(n) segments of equal length; keep what the last
    stage of each segment produces (the next segment's input) and the whole last segment."""
    n = len(stages)
    k = segments if segments is not None else max(1, math.isqrt(n - 1) + 1 if n > 1 else 1)
    length = max(1, -(-n // k))
    bounds = list(range(length - 1, n, length))
    last_start = (bounds[-1] + 1) if bounds and bounds[-1] + 1 < n else (bounds[-2] + 1 if len(bounds) > 1 else 0)
    keep = set(bounds) | set(range(last_start, n))
    scorer.add(stage_actions(graph, stages, keep), "chen")


def _run_baseline(graph: Graph, budget: int, name: str, fill) -> Proposal:
    scorer = Scorer(graph)
    scorer.add({}, "keep-all")
    fill(scorer)
    best = scorer.best(budget)
    if best is None:
        return Proposal(status="infeasible", stats={"plans_scored": len(scorer.seen), "lowest_peak_bytes":
                                                    min(r.peak_bytes for r, *_ in scorer.seen.values())})
    report, actions, _, source = best
    return Proposal(actions, status="feasible", stats={"plans_scored": len(scorer.seen), "source": source})


@register("chen", description="Chen et al. 2016: sqrt(n) equal segments of the coarsened chain "
                              "(keep-everything when it fits)", graphs="chain")
def solve_chen(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
               host_budget_bytes: int | None = None, segments: int | None = None, **options: object) -> Proposal:
    """Keep-everything if it fits, else Chen's sqrt(n)-segment plan (``segments=`` to choose the count)."""
    if options:
        raise MemplanError(f"chen: unknown option(s) {', '.join(sorted(options))}")
    stages = stage_chain(graph)
    if segments is not None and (not isinstance(segments, int) or isinstance(segments, bool)
                                 or not 1 <= segments <= max(1, len(stages))):
        raise MemplanError(f"chen: segments must be an integer from 1 to {len(stages)} (the stages), got {segments!r}")
    return _run_baseline(graph, budget_bytes, "chen",
                         lambda sc: len(stages) and chen_candidates(graph, stages, sc, segments))


def revolve_checkpoints(steps: int, snaps: int) -> list[int]:
    """Griewank & Walther's binomial schedule: the positions (0 .. steps-1) at which the first forward
    sweep stores a checkpoint, for a homogeneous chain of ``steps`` steps and ``snaps`` checkpoint slots
    (position 0, the input, included). With ``r`` the least number of repetitions such that
    ``C(snaps + r, snaps) >= steps``, each advance is ``C(s + r - 1, s)`` steps (``s`` slots left) and
    the rest is covered with one slot fewer."""
    if steps <= 0:
        return []
    snaps = max(1, snaps)
    pos, left, s, out = 0, steps, snaps, [0]
    while left > 1 and s > 1:
        r = 0
        while math.comb(s + r, s) < left:
            r += 1
        if r == 0:
            break
        advance = max(1, min(left - 1, math.comb(s + r - 1, s)))
        pos += advance
        left -= advance
        s -= 1
        out.append(pos)
    return out


@register("revolve", description="REVOLVE (Griewank & Walther 2000): binomial checkpoint positions on the "
                                 "coarsened chain, over the number of checkpoints", graphs="chain")
def solve_revolve(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
                  host_budget_bytes: int | None = None, snaps: int | None = None, **options: object) -> Proposal:
    """The binomial schedule's first-sweep checkpoints as kept stage boundaries (the last stage kept),
    for ``snaps`` slots or, by default, the count whose simulated plan is fastest within the budget."""
    if options:
        raise MemplanError(f"revolve: unknown option(s) {', '.join(sorted(options))}")
    stages = stage_chain(graph)
    n = len(stages)
    deadline = time.perf_counter() + time_limit_s

    def fill(sc: Scorer) -> None:
        for c in ([snaps] if snaps is not None else range(1, n + 1)):
            checkpoints = revolve_checkpoints(n, c)
            sc.add(stage_actions(graph, stages, {n - 1}, [p for p in checkpoints if p > 0]), f"revolve({c})")
            if time.perf_counter() > deadline:
                break

    return _run_baseline(graph, budget_bytes, "revolve", fill if n else (lambda sc: None))


# ---- rotor -----------------------------------------------------------------------------------------------
_ROTOR_STAGES = 64
_ROTOR_UNITS = 160


def _rotor_table(uf, ub, x, xbar, M):
    """Beaumont et al. 2019's ``Opt[s][t][m]``: least time to run forward and backward of stages
    ``s .. t`` given their input stored, with ``m`` memory units for everything else; either store all of
    stage ``s`` (x-bar) and continue, or store the input of a later stage ``s'`` as a checkpoint, run on,
    and redo ``s .. s'-1`` afterwards with the memory given back. ``choice[s][t][m]`` = -1 (all) or s'."""
    L = len(uf)
    inf = np.inf
    opt = [[None] * L for _ in range(L)]
    choice = [[None] * L for _ in range(L)]
    ar = np.arange(M + 1)

    def shift(a, d):
        out = np.full(M + 1, inf)
        if d <= M:
            out[d:] = a[: M + 1 - d]
        return out

    pre = np.concatenate([[0.0], np.cumsum(uf)])
    for s in range(L):
        opt[s][s] = np.where(ar >= xbar[s], uf[s] + ub[s], inf)
        choice[s][s] = np.full(M + 1, -1, dtype=np.int64)
    for length in range(1, L):
        for s in range(L - length):
            t = s + length
            best = uf[s] + ub[s] + shift(opt[s + 1][t], xbar[s])
            ch = np.full(M + 1, -1, dtype=np.int64)
            for sp in range(s + 1, t + 1):
                cand = (pre[sp] - pre[s]) + shift(opt[sp][t], x[sp]) + opt[s][sp - 1]
                better = cand < best
                best = np.where(better, cand, best)
                ch = np.where(better, sp, ch)
            opt[s][t], choice[s][t] = best, ch
    return opt, choice


@register("rotor", description="Beaumont et al. 2019: nested-recomputation DP on the coarsened "
                               "(heterogeneous) chain, translated into memplan actions", graphs="chain")
def solve_rotor(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
                host_budget_bytes: int | None = None, **options: object) -> Proposal:
    """Rotor's optimal schedule for each memory level (one table), translated into the activations it
    keeps in its first forward sweep (stages stored whole, and checkpointed stage inputs); the fastest
    simulated translation that fits is returned."""
    if options:
        raise MemplanError(f"rotor: unknown option(s) {', '.join(sorted(options))}")
    stages = stage_chain(graph, _ROTOR_STAGES)
    L = len(stages)
    if not L:
        return _run_baseline(graph, budget_bytes, "rotor", lambda sc: None)
    total = sum(stages.produced_bytes) + max(stages.input_bytes)
    unit = max(1, -(-total // _ROTOR_UNITS))
    x = [-(-b // unit) for b in stages.input_bytes]
    xbar = [-(-b // unit) for b in stages.produced_bytes]
    M = -(-total // unit)
    opt, choice = _rotor_table(list(stages.time_s), list(stages.backward_time_s), x, xbar, M)

    def translate(m: int) -> Actions | None:
        if not np.isfinite(opt[0][L - 1][m]):
            return None
        keep_stages, keep_inputs = set(), set()
        s, t = 0, L - 1
        while True:
            c = int(choice[s][t][m])
            if s == t:
                keep_stages.add(s)
                break
            if c < 0:
                keep_stages.add(s)
                m -= xbar[s]
                s += 1
            else:
                keep_inputs.add(c)
                m -= x[c]
                s = c
        return stage_actions(graph, stages, keep_stages, keep_inputs)

    def fill(sc: Scorer) -> None:
        for m in range(M + 1):
            a = translate(m)
            if a is not None:
                sc.add(a, f"rotor(m={m * unit})")

    return _run_baseline(graph, budget_bytes, "rotor", fill)
