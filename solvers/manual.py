"""``manual``: the plan a user names (modules to checkpoint, or tensors to keep), scored like any other."""

from __future__ import annotations

import difflib

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass

from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action
from memplan.solvers.registry import Proposal, register


@dataclass(frozen=True, kw_only=True, config=ConfigDict(extra="forbid"))  # lists from JSON or tuples
class Config:
    """Options of ``manual`` (at least one of them)."""

    # module prefixes whose saved activations are recomputed, as torch.utils.checkpoint around each would
    checkpoint: str | list[str] | None = None
    # saved activations to keep (every other one is recomputed)
    tensors: list[int] | None = None

    def __post_init__(self) -> None:
        if self.checkpoint is None and self.tensors is None:
            raise MemplanError("manual: give checkpoint=[module prefixes] and/or tensors=[tensor ids]")


def _module_matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _unknown_module(graph: Graph, name: str) -> MemplanError:
    prefixes: dict[str, None] = {}
    for op in graph.ops:
        parts = [p for p in op.module.split(".") if p]
        for d in range(1, len(parts) + 1):
            prefixes[".".join(parts[:d])] = None
    known = list(prefixes)
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
    shown = list(dict.fromkeys(close + sorted(known, key=lambda p: (p.count("."), p))))[:6]
    return MemplanError(
        f"manual: no op of graph {graph.name!r} ran in module {name!r}; known module prefixes include "
        f"{', '.join(repr(p) for p in shown) or '(none: the graph has no module names)'}"
        f"{f' ({len(known)} in all)' if len(known) > len(shown) else ''}")




@register("manual", description="a user's plan: checkpoint=[module prefixes] to recompute, or "
                                "tensors=[ids] to keep (everything else recomputed)",
          graphs="dag", exact=False, offload=False, config=Config)
def solve_manual(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
                 host_budget_bytes: int | None = None, config: Config) -> Proposal:
    """The plan a user writes by hand, scored like any other.

    ``checkpoint=["transformer.h.0", ...]``: recompute the saved activations produced inside those
    modules, as ``torch.utils.checkpoint`` around each would. ``tensors=[ids]``: keep those saved
    activations and recompute every other one (Paddle's RecomputeOptimizer checkpoints); with both, the
    listed tensors are kept inside the checkpointed modules. Activations that cannot be recomputed are
    kept (counted in ``stats['kept_not_recomputable']``). The budget only decides whether it fits.
    """
    checkpoint, tensors = config.checkpoint, config.tensors
    saved = graph.saved_activations
    saved_set = set(saved)
    keep: set[int] = set()
    if tensors is not None:
        for t in tensors:
            if not isinstance(t, int) or isinstance(t, bool) or t not in saved_set:
                shown = ", ".join(map(str, saved[:8])) + (f", ... ({len(saved)} in all)" if len(saved) > 8 else "")
                raise MemplanError(f"manual: tensors lists {t!r}, which is not a saved activation of graph "
                                   f"{graph.name!r}; saved activations: {shown or '(none)'}")
            keep.add(t)
    if checkpoint is not None:
        prefixes = [checkpoint] if isinstance(checkpoint, str) else list(checkpoint)
        for p in prefixes:
            if not isinstance(p, str) or not any(_module_matches(op.module, p) for op in graph.ops):
                raise _unknown_module(graph, str(p))
        ops = graph.ops
        chosen = [t for t in saved
                  if any(_module_matches(ops[graph.tensors[t].producer].module, p) for p in prefixes)]
    else:
        chosen = list(saved)
    chosen = [t for t in chosen if t not in keep]
    actions = {t: Action.RECOMPUTE for t in chosen if graph.tensors[t].recomputable}
    return Proposal(actions, status="feasible",
                    stats={"recomputed": len(actions), "kept_not_recomputable": len(chosen) - len(actions)})

