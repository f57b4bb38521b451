"""memplan.planner: from a training step to a scored plan, in two layers.

- ``core/`` (no torch): a trace turned into a graph (``build``), the graph and plan schema, the replay of
  one tensor, the schedule a plan lowers to (every timing decision), and the simulator that scores it
  (``score`` sums a schedule's events; ``simulate(graph, plan)`` is ``score(graph, schedule(graph, plan))``). Solvers and the service
  import only this layer.
- ``probe/`` (torch): the tracing mode that records a step (really or under FakeTensorMode) and the
  profiler around it, op timing, and the allocator measurements that check predictions.
- ``workloads.py``: the built-in models and the one training-step convention everything runs.

The names below are the core's; ``replay`` and ``schedule`` are functions in modules of the same name
(import them from ``memplan.planner.core.replay`` / ``.schedule``).
"""

from memplan.planner.core.errors import (
    GraphError,
    Infeasible,
    MemplanError,
    PlanError,
    PlanMismatch,
    WorkloadError,
)
from memplan.planner.core.graph import Chain, ChainStage, FixedMemory, Graph, Op, TensorInfo, coarsen
from memplan.planner.core.plan import Action, Decision, Plan, Prediction, SolverInfo
from memplan.planner.core.replay import Replay
from memplan.planner.core.schedule import Schedule, ScheduleEvent
from memplan.planner.core.simulator import Report, score, simulate
from memplan.planner.core.units import format_bytes, parse_budget

__all__ = [
    "Action", "Chain", "ChainStage", "Decision", "FixedMemory", "Graph", "GraphError", "Infeasible",
    "MemplanError", "Op", "Plan", "PlanError", "PlanMismatch", "Prediction", "Replay", "Report", "Schedule",
    "ScheduleEvent", "SolverInfo", "TensorInfo", "WorkloadError", "coarsen", "format_bytes", "parse_budget",
    "score", "simulate",
]
