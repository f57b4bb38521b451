"""memplan.planner: the graph and plan schema, the profiler and the simulator (the cost model).

The torch-free parts (graph, plan, replay, schedule, simulator, units, errors) import without torch; the profiler,
the measurement harness and the built-in workloads import torch lazily, in their own modules. The functions ``replay`` and ``schedule`` are not re-exported
here (they would shadow their modules): import them from ``memplan.planner.replay`` / ``.schedule``.
"""

from memplan.planner.errors import (
    GraphError,
    Infeasible,
    MemplanError,
    PlanError,
    PlanMismatch,
    WorkloadError,
)
from memplan.planner.graph import Chain, ChainStage, FixedMemory, Graph, Op, TensorInfo, coarsen
from memplan.planner.plan import Action, Decision, Plan, Prediction, SolverInfo
from memplan.planner.replay import Replay
from memplan.planner.schedule import Schedule, ScheduleEvent
from memplan.planner.simulator import Report, simulate
from memplan.planner.units import format_bytes, parse_budget

__all__ = [
    "Action", "Chain", "ChainStage", "Decision", "FixedMemory", "Graph", "GraphError", "Infeasible",
    "MemplanError", "Op", "Plan", "PlanError", "PlanMismatch", "Prediction", "Replay", "Report", "Schedule",
    "ScheduleEvent", "SolverInfo", "TensorInfo", "WorkloadError", "coarsen", "format_bytes", "parse_budget",
    "simulate",
]
