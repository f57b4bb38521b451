"""Module boundaries of the profiled forward: where a step under a plan can re-synchronise with the graph.

A boundary is one side of one module call, keyed ``(path, n, side)``: the module's path as
``named_modules`` names it (``""``: the root), its call number in the step (0 for the first call) and
``BEGIN`` or ``END`` (its forward pre- or post-hook). Its position is the number of forward ops the
profiled step had run there. A step whose ops differ from the graph's (another way of building a mask, a
branch on the batch) meets the same boundaries at runtime: once it reaches one, it is back at that
position of the graph (``executor/step.py``).

Graphs record their module calls (``Graph.module_calls``). For a graph from before they were recorded the
calls are derived from each op's innermost module path: a call is a maximal run of ops inside the
module's path, so back-to-back calls of one module read as one call and a module that ran no op is not
seen. Such a boundary is still safe to re-synchronise at: the ops after it are matched against the
graph's, and a planned tensor of another shape is refused.
"""

from __future__ import annotations

from memplan.planner.core.graph import Graph, ModuleCall

BEGIN, END = 0, 1

Boundary = tuple[str, int, int]  # (module path, call number, BEGIN or END)


def module_calls(graph: Graph) -> list[ModuleCall]:
    """The graph's module calls in the order they began: recorded, or derived (module docstring)."""
    if graph.module_calls:
        return list(graph.module_calls)
    calls: list[ModuleCall] = []
    open_: dict[str, ModuleCall] = {}  # path -> its call running at the previous op
    for op in graph.ops:
        parts = op.module.split(".") if op.module and op.module != "loss" else []
        paths = ["", *(".".join(parts[:i]) for i in range(1, len(parts) + 1))] if op.module != "loss" else []
        for path in [p for p in open_ if p not in paths]:
            del open_[path]
        for path in paths:
            call = open_.get(path)
            if call is None:
                call = open_[path] = ModuleCall(path=path, start=op.id, end=op.id + 1)
                calls.append(call)
            call.end = op.id + 1
    return calls


def boundary_positions(graph: Graph) -> dict[Boundary, int]:
    """Every boundary of the profiled forward -> the op position there (module docstring)."""
    out: dict[Boundary, int] = {}
    count: dict[str, int] = {}
    for call in module_calls(graph):
        n = count.get(call.path, 0)
        count[call.path] = n + 1
        out[(call.path, n, BEGIN)] = call.start
        out[(call.path, n, END)] = call.end
    return out
