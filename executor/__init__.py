"""memplan.executor: runs a plan in real training (recompute, offload with prefetch, fused optimizer steps).

``memplan.executor.apply(model, plan, graph=..., optimizer=..., fuse=None | "backward" | "forward")``;
see :mod:`memplan.executor.apply` (the loop's hooks), :mod:`memplan.executor.step` (one step: ops, saved tensors),
:mod:`memplan.executor.replaying` (recompute), :mod:`memplan.executor.transfers` (offload) and
:mod:`memplan.executor.recipes` (what forward records for replays).
"""

from memplan.executor.apply import Executor, apply
from memplan.planner.core.errors import PlanMismatch

__all__ = ["Executor", "PlanMismatch", "apply"]
