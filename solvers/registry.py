"""The registry of solver strategies, and the contract each follows. Imports no strategy.

A strategy is one module (``solvers/<name>.py``, or a package such as ``solvers/ilp/``) holding a
function ``fn(graph, budget_bytes, *, time_limit_s, offload, host_budget_bytes, config) -> Proposal``
and, when it takes options, a frozen ``Config`` (a pydantic dataclass: typed fields, documented, with
checks in ``__post_init__``). It registers itself with :func:`register` when its module is imported;
``memplan.solvers`` imports every built-in strategy module once, so :func:`solvers` lists them all.
:func:`SolverSpec.config_for` validates a caller's options against the ``Config`` once, at the entry
(:func:`memplan.solvers.core.solve`), so a strategy receives a checked, typed object.

Strategies registered without a ``Config`` receive the caller's options as keyword arguments instead
(the chain DP family in ``dp.py`` and ``baselines.py`` still does its own checking).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

from pydantic import ConfigDict, ValidationError
from pydantic.dataclasses import dataclass as config_dataclass

from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action

STATUSES = ("optimal", "feasible", "timeout", "infeasible")

#: ``Proposal.space`` when a result's status and bound hold over every plan memplan could execute for the
#: request: keep, recompute and recompute_each, and offload at any legal prefetch point when it is allowed
ALL_PLANS = "all"


def plan_space(*, per_use: bool, offload: bool, prefetch: str = "choose") -> str:
    """The ``Proposal.space`` of a search over keep and recompute, plus recompute_each when ``per_use``
    and offload when ``offload`` (at every legal prefetch point, or only the simulator's default ones with
    ``prefetch="default"``): ``all`` when that is every plan the request allows, else its actions joined
    by '/' (``keep/recompute``, ``keep/recompute/offload at default prefetch points``...)."""
    if per_use and (not offload or prefetch == "choose"):
        return ALL_PLANS
    actions = ["keep", "recompute"] + (["recompute_each"] if per_use else [])
    if offload:
        actions.append("offload" if prefetch == "choose" else "offload at default prefetch points")
    return "/".join(actions)

#: What every strategy's ``Config`` is declared with: frozen, keyword-only, unknown fields refused,
#: no silent coercion (``"3"`` is not an int, ``True`` is not a number).
CONFIG = ConfigDict(extra="forbid", strict=True)


class FrontierPoint(NamedTuple):
    """One budget of a frontier: the predicted overhead (step time over keep-everything's, minus one; None
    where no plan fits), and what the solve at that budget claims: its ``status`` (``optimal``,
    ``feasible``, ``timeout`` or ``infeasible``) and the ``space`` of plans the claim holds over (None where
    no plan fits)."""

    budget_bytes: int
    overhead: float | None
    status: str
    space: str | None


@dataclass
class Proposal:
    """What a strategy returns: its choice and what it knows about its quality.

    ``status``: ``optimal`` (proved optimal for the exact problem), ``feasible`` (a plan, no proof),
    ``timeout`` (best plan found before the time limit), ``infeasible`` (no plan within the budget).
    ``lower_bound_s``: a proven lower bound on the step time of every plan within the budget, where the
    strategy has one. ``method``: the strategy that made the plan when it is not the one called (``auto``
    delegates), else None. ``space``: the plans over which ``optimal``, ``infeasible`` and
    ``lower_bound_s`` hold (:data:`ALL_PLANS`, or a narrower space named by :func:`plan_space`: a method
    that searches keep / recompute only says so).
    """

    actions: dict[int, Action] = field(default_factory=dict)
    prefetch_at: dict[int, int] = field(default_factory=dict)
    status: str = "feasible"
    lower_bound_s: float | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    method: str | None = None
    space: str = ALL_PLANS


SolverFn = Callable[..., Proposal]


@config_dataclass(frozen=True, kw_only=True, config=CONFIG)
class NoOptions:
    """The ``Config`` of a strategy that takes no options."""


NO_OPTIONS = NoOptions()


@dataclass(frozen=True)
class SolverSpec:
    name: str
    fn: SolverFn
    description: str
    graphs: str           # "chain" (uses the coarsened chain; any graph) or "dag"
    exact: bool           # optimal under its model when it finishes
    offload: bool         # can choose offload
    max_ops: int | None   # refuses graphs with more saved activations (exhaustive methods)
    config: type | None = None  # the strategy's Config (None: options passed as keywords)

    def config_for(self, options: dict[str, Any]) -> Any:
        """The strategy's ``Config`` built from ``options`` (validated once); raises
        :class:`MemplanError` naming the solver, the option and what it accepts."""
        if self.config is None:
            raise MemplanError(f"solver {self.name!r} takes options as keywords, not a Config")
        known = [f.name for f in fields(self.config)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            offer = f"its options: {', '.join(known)}" if known else "it takes no options"
            raise MemplanError(f"solver {self.name!r} has no option {', '.join(map(repr, unknown))}; {offer}")
        try:
            return self.config(**options)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "options"
            got = err.get("input")
            raise MemplanError(f"solver {self.name!r}: option {where}={got!r}: {err['msg']}") from None

    def default_config(self) -> Any:
        """The strategy's ``Config`` with every option at its default ({} for keyword strategies)."""
        return {} if self.config is None else self.config_for({})

    def check(self, graph: Graph, offload: bool) -> None:
        """Refuse a request this strategy cannot take: offload it does not plan, a graph too large."""
        if offload and not self.offload:
            able = sorted(n for n, s in _REGISTRY.items() if s.offload)
            raise MemplanError(f"solver {self.name!r} does not plan offload; use one of {', '.join(able)}")
        n = len(graph.saved_activations)
        if self.max_ops is not None and n > self.max_ops:
            raise MemplanError(f"solver {self.name!r} handles at most {self.max_ops} saved activations; this "
                               f"graph has {n}")

    def call(self, graph: Graph, budget_bytes: int, *, time_limit_s: float, offload: bool,
             host_budget_bytes: int | None, config: Any) -> Proposal:
        """Run the strategy with a validated ``config`` (from :meth:`config_for`; for a keyword strategy,
        the options dict)."""
        common = dict(time_limit_s=time_limit_s, offload=offload, host_budget_bytes=host_budget_bytes)
        if self.config is None:
            return self.fn(graph, budget_bytes, **common, **config)
        return self.fn(graph, budget_bytes, **common, config=config)


_REGISTRY: dict[str, SolverSpec] = {}


def register(name: str, *, description: str, graphs: str = "dag", exact: bool = False, offload: bool = False,
             max_ops: int | None = None, config: type | None = None) -> Callable[[SolverFn], SolverFn]:
    """Register ``fn`` under ``name`` (see the module docstring for its signature). ``config``: the
    strategy's ``Config`` dataclass; without one, options reach ``fn`` as keyword arguments."""

    def deco(fn: SolverFn) -> SolverFn:
        _REGISTRY[name] = SolverSpec(name, fn, description, graphs, exact, offload, max_ops, config)
        return fn

    return deco


def solvers() -> dict[str, SolverSpec]:
    """Every registered strategy by name (a copy)."""
    return dict(_REGISTRY)


def get(name: str) -> SolverSpec:
    """The strategy called ``name``; :class:`MemplanError` listing the known ones otherwise."""
    if name not in _REGISTRY:
        raise MemplanError(f"unknown solver {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]
