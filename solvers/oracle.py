"""The exhaustive oracle: every keep / recompute (/ offload, at every legal prefetch point; / recompute_each
with ``per_use``) assignment of every saved activation, each scored by the simulator. Exact by construction, exponential in size: for
graphs of up to about 12 saved activations, as the reference the other solvers are proved against.

With offload the plan space includes the prefetch point of each offloaded tensor (``prefetch_at``, any
op from its first backward reader up to the last op): a later prefetch holds less device memory, an
earlier one hides more of the copy, and a solver that chooses them (the ILP) can only be checked against
an oracle that chooses them too. ``prefetch="default"`` restricts the oracle to the simulator's default
points (smaller, for the methods that only use those).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from typing import Literal

from pydantic.dataclasses import dataclass

from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action
from memplan.planner.core.simulator import simulate_actions, static_facts
from memplan.solvers.registry import CONFIG, Proposal, plan_space, register

MAX_SAVED = 14
PREFETCH_MODES = ("choose", "default")



@dataclass(frozen=True, kw_only=True, config=CONFIG)
class Config:
    """Options of ``oracle``."""

    # choose: every legal prefetch point of each offloaded tensor; default: the simulator's only
    prefetch: Literal["choose", "default"] = "choose"
    # also recompute_each for every rebuildable tensor (multi-level replays; 3^n plans rather than 2^n);
    # off: keep / recompute (/ offload), and the result's space says so
    per_use: bool = False


DEFAULT = Config()


Choice = tuple[Action, int | None]  # an action and, for offload, its prefetch point (None: the default)


def _choices(graph: Graph, offload: bool, prefetch: str, per_use: bool = False) -> list[list[Choice]]:
    """Per saved activation, every (action, prefetch point) the plan space allows (``per_use``: with
    ``recompute_each`` beside ``recompute``)."""
    if prefetch not in PREFETCH_MODES:
        raise MemplanError(f"oracle: prefetch must be one of {', '.join(PREFETCH_MODES)}, got {prefetch!r}")
    st = static_facts(graph)
    n = len(graph.ops)
    out = []
    for t in graph.saved_activations:
        opts: list[Choice] = [(Action.KEEP, None)]
        if graph.tensors[t].recomputable:
            opts.append((Action.RECOMPUTE, None))
            if per_use:
                opts.append((Action.RECOMPUTE_EACH, None))
        if offload:
            if prefetch == "default":
                opts.append((Action.OFFLOAD, None))
            else:
                opts += [(Action.OFFLOAD, q) for q in range(st.first_bwd_use[t], n)]
        out.append(opts)
    return out


def plan_count(graph: Graph, *, offload: bool = False, prefetch: str = "choose", per_use: bool = False) -> int:
    """How many plans the oracle enumerates for ``graph`` (to decide whether it is affordable)."""
    return math.prod(len(c) for c in _choices(graph, offload, prefetch, per_use))


def _plans(graph: Graph, offload: bool, prefetch: str,
           per_use: bool = False) -> Iterator[tuple[dict[int, Action], dict[int, int]]]:
    saved = graph.saved_activations
    for combo in itertools.product(*_choices(graph, offload, prefetch, per_use)):
        actions = {t: a for t, (a, _) in zip(saved, combo, strict=True) if a != Action.KEEP}
        points = {t: q for t, (_, q) in zip(saved, combo, strict=True) if q is not None}
        yield actions, points


@register("oracle", description="exhaustive search over keep / recompute (/ offload at every prefetch point; "
                                "recompute_each with per_use) (tiny graphs only; the reference)",
          exact=True, offload=True, max_ops=MAX_SAVED, config=Config)
def solve_oracle(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
                 host_budget_bytes: int | None = None, config: Config = DEFAULT) -> Proposal:
    """Minimise simulated step time subject to simulated peak <= budget (and host peak <= host budget);
    ties: lower peak, then fewer non-keep actions, then fewer recompute_each, then fewer explicit prefetch
    points. ``prefetch``: ``choose`` enumerates every legal prefetch point of each offloaded tensor,
    ``default`` only the simulator's default; ``per_use`` adds recompute_each. ``status`` is ``optimal`` when the enumeration finished, ``timeout`` otherwise."""
    prefetch = config.prefetch
    space = plan_space(per_use=config.per_use, offload=offload, prefetch=prefetch)
    best: tuple[float, int, int, int, int] | None = None
    best_plan: tuple[dict[int, Action], dict[int, int]] = ({}, {})
    deadline = time.perf_counter() + time_limit_s
    tried = 0
    for actions, points in _plans(graph, offload, prefetch, config.per_use):
        r = simulate_actions(graph, actions, prefetch_at=points)
        tried += 1
        if r.peak_bytes <= budget_bytes and (host_budget_bytes is None or r.host_peak_bytes <= host_budget_bytes):
            per_use = sum(a == Action.RECOMPUTE_EACH for a in actions.values())
            key = (r.time_s, r.peak_bytes, len(actions), per_use, len(points))
            if best is None or key < best:
                best, best_plan = key, (actions, points)
        if time.perf_counter() > deadline:
            if best is None:  # not a proof: the plans not tried may fit
                return Proposal(status="infeasible", stats={"plans_tried": tried, "stopped": "time limit"},
                                space=space)
            return Proposal(*best_plan, status="timeout", stats={"plans_tried": tried}, space=space)
    if best is None:
        return Proposal(status="infeasible", stats={"plans_tried": tried}, space=space)
    return Proposal(*best_plan, status="optimal", lower_bound_s=best[0], stats={"plans_tried": tried}, space=space)


def oracle_min_peak(graph: Graph, *, offload: bool = False, prefetch: str = "choose", per_use: bool = False) -> int:
    """The exact smallest simulated peak over all plans (tiny graphs only; with offload, over every
    prefetch point unless ``prefetch="default"``; with ``per_use``, recompute_each included)."""
    return min(simulate_actions(graph, a, prefetch_at=p).peak_bytes
               for a, p in _plans(graph, offload, prefetch, per_use))
