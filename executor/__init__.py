"""memplan.executor: runs a plan in real training (recompute, offload with prefetch, fused optimizer steps).

``memplan.executor.apply(model, plan, graph=..., optimizer=..., fuse=None | "backward" | "forward")``;
see :mod:`memplan.executor.apply` and :mod:`memplan.executor.runtime`.
"""

from memplan.executor.apply import Executor, apply
from memplan.planner.core.errors import PlanMismatch

__all__ = ["Executor", "PlanMismatch", "apply"]
