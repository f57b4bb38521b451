"""Bounds every strategy and the entry share: what keep-everything costs, what "100%" of a percentage
budget means, and a sound lower bound on any plan's peak (a budget below it is refused at once).

Achievable peaks (the least peak memplan can find) are in :mod:`memplan.solvers.min_memory`.
"""

from __future__ import annotations

from memplan.planner.core.graph import Graph
from memplan.planner.core.simulator import Report, simulate_actions


def keep_all_report(graph: Graph) -> Report:
    """The simulator's report of the plan that keeps every activation (no timeline)."""
    return simulate_actions(graph, {})


def activation_bytes(graph: Graph) -> int:
    """Keep-everything peak minus fixed memory: what '100%' of a percentage budget means."""
    return keep_all_report(graph).peak_bytes - graph.fixed.resident_bytes


def memory_lower_bound(graph: Graph) -> int:
    """A sound lower bound on any plan's peak under the cost model: at each forward op its inputs and
    outputs are resident; at each backward step its saved tensors, the gradients live then (which no plan
    changes) and its workspace are. A budget below it is refused at once."""
    fixed = graph.fixed.resident_bytes
    tensors = graph.tensors
    bound = fixed + graph.fixed.optimizer_step_bytes
    held = 0
    for op in graph.ops:
        acts = {t for t in (*op.inputs, *op.outputs) if tensors[t].kind == "activation"}
        bound = max(bound, fixed + held + sum(tensors[t].bytes for t in acts) + op.workspace_bytes)
        held += sum(tensors[t].bytes for t in op.outputs if tensors[t].held_by_caller)
    grads = 0
    for op in reversed(graph.ops):
        acts = {t for t in op.saved if tensors[t].kind == "activation" and not tensors[t].held_by_caller}
        need = fixed + held + grads + op.backward_grad_alloc_bytes + op.backward_workspace_bytes
        bound = max(bound, need + sum(tensors[t].bytes for t in acts))
        grads += op.backward_grad_alloc_bytes - op.backward_grad_free_bytes
    return bound
