"""memplan.api: the ``memplan`` CLI, the REST service, the framework callbacks, and the Python verbs in
one place:

    import memplan.api as memplan

    graph = memplan.profile(model, batch, loss_fn)                  # or fake=True: nothing allocated
    result = memplan.solve(graph, budget_bytes=4 * 2**30)           # .plan, .report, .status
    memplan.simulate(graph, result.plan).peak_bytes                 # the simulator's score of any plan
    with memplan.apply(model, result.plan, graph=graph, optimizer=opt):
        ...                                                         # train under the plan
    memplan.run_plan(model, batch, loss_fn, opt, result.plan, graph)   # a few steps, measured
    memplan.maxbatch(memplan.profile_family(...), 24 * 2**30)       # the largest batch that fits
    memplan.materialize(model, "cuda")                              # a meta-device model, built for real

Each verb is the function of its own module (``memplan.planner.probe.profiler.profile``,
``memplan.solvers.solve``, ...; those paths keep working), imported when first used: ``import
memplan.api`` itself loads neither torch nor the solvers, so the CLI and the service start fast.
"""

from __future__ import annotations

import importlib
from typing import Any

# verb -> (module, function)
VERBS: dict[str, tuple[str, str]] = {
    "profile": ("memplan.planner.probe.profiler", "profile"),
    "profile_family": ("memplan.planner.probe.family", "profile_family"),
    "solve": ("memplan.solvers.core", "solve"),
    "simulate": ("memplan.planner.core.simulator", "simulate"),
    "apply": ("memplan.executor.apply", "apply"),
    "run_plan": ("memplan.executor.session", "run_plan"),
    "maxbatch": ("memplan.solvers.maxbatch", "max_dim"),
    "materialize": ("memplan.planner.probe.materialize", "materialize"),
}

__all__ = sorted(VERBS)


def __getattr__(name: str) -> Any:
    if name not in VERBS:
        raise AttributeError(f"module 'memplan.api' has no attribute {name!r}")
    module, function = VERBS[name]
    if module == "memplan.solvers.core":
        importlib.import_module("memplan.solvers")  # the strategies register themselves on import
    value = getattr(importlib.import_module(module), function)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(VERBS))
