"""Options of the ILP (``solve(graph, budget, "ilp", **options)``), validated once at the entry."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic.dataclasses import dataclass

from memplan.solvers.registry import CONFIG

BACKENDS = ("cpsat", "cbc", "highs")


@dataclass(frozen=True, kw_only=True, config=CONFIG)
class Config:
    """Options of :func:`memplan.solvers.ilp.driver.solve_ilp`."""

    backend: Literal["cpsat", "cbc", "highs"] = "cpsat"
    # replay: the exact model of the simulator's lazy replays (windowed past small_saved); intervals: the
    # full-graph retention-interval relaxation with simulated plans (recompute only); auto: replay on
    # small graphs and with offload, otherwise intervals (its bound decides the status) and, unless that
    # proves its plan optimal, the windowed replay model in the last 40% of the time
    # blocks: the staircase relaxation (bound) and block-uniform plans (ilp/blocks.py), recompute only,
    # any size; auto picks it past 400 saved activations
    formulation: Literal["auto", "replay", "intervals", "blocks"] = "auto"
    # also recompute_each (per-use re-creation) for every rebuildable tensor; off: the model, its bound
    # and its "optimal" cover keep / recompute (/ offload) only, and the result's space says so. None: on
    # graphs of at most per_use_saved saved activations (the model grows ~75% and its LP bound weakens:
    # random 30-op DAGs proved optimal in 2 s without, not within 30 s with)
    per_use: bool | None = None
    per_use_saved: int = Field(default=20, ge=0)

    def model_per_use(self, saved: int) -> bool:
        """Whether the replay model includes recompute_each for a graph of ``saved`` saved activations."""
        return self.per_use if self.per_use is not None else saved <= self.per_use_saved
    # choose: the ILP picks prefetch points; default: the simulator's
    prefetch: Literal["choose", "default"] = "choose"
    # producers a replay may go back; None: unlimited on small graphs
    max_replay_depth: int | None = Field(default=None, ge=0)
    # ops after last forward use within which a D2H copy must end; None: unlimited on small graphs (a copy
    # may then run into backward)
    copy_window_ops: int | None = Field(default=None, ge=0)
    # candidate prefetch points after the first backward use
    prefetch_window_ops: int | None = Field(default=None, ge=0)
    workers: int = Field(default=2, ge=1)        # CP-SAT search workers
    max_rounds: int = Field(default=20, ge=0)    # lazy-constraint rounds (re-solves after a cut)
    warm_start: bool = True                      # hint the faster of the greedy and Capuchin plans
    small_saved: int = Field(default=40, ge=0)   # graphs with at most this many saved activations get no windows
    # memory rows are kept below this many units: past it, sizes are rounded down to a coarser unit (a
    # relaxation whose plans the simulator confirms); byte-exact coefficients of GPU tensors break solvers
    max_memory_units: int = Field(default=2**20, ge=1)
