"""The ILP's driver: warm start, build, solve, decode, confirm in the simulator, cut and re-solve."""

from __future__ import annotations

import math
import time

from memplan.planner.core.errors import MemplanError, PlanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action
from memplan.planner.core.simulator import Report, default_prefetch_at, simulate_actions, static_facts
from memplan.solvers.capuchin import solve_capuchin
from memplan.solvers.greedy import solve_greedy
from memplan.solvers.ilp.backends import run_backend
from memplan.solvers.ilp.blocks import solve_blocks
from memplan.solvers.ilp.config import Config
from memplan.solvers.ilp.formulation import Builder, Built
from memplan.solvers.ilp.intervals import solve_intervals
from memplan.solvers.ilp.linear import BuildOutOfTime, ConstantlyViolated, no_good
from memplan.solvers.registry import ALL_PLANS, Proposal, plan_space, register

MAX_SAVED = 20_000        # the blocks formulation's reach (recompute only)
REPLAY_MAX_SAVED = 400    # the replay and interval models' (offload included)
DEFAULT = Config()


def decode(built: Built, values: list[int], graph: Graph) -> tuple[dict[int, Action], dict[int, int]]:
    actions: dict[int, Action] = {}
    prefetch: dict[int, int] = {}
    st = static_facts(graph)
    for u in graph.saved_activations:  # ascending ids: the simulator's FIFO order among equal prefetch points
        if u in built.r and values[built.r[u]]:
            actions[u] = Action.RECOMPUTE
        elif u in built.each and values[built.each[u]]:
            actions[u] = Action.RECOMPUTE_EACH
        elif u in built.o and values[built.o[u]]:
            actions[u] = Action.OFFLOAD
            fired = [sl for sl in built.slots[u] if values[sl.var]]
            if built.default_prefetch:
                continue  # the simulator's default point (a replay may fetch it earlier, as it would)
            if fired and fired[0].start:
                prefetch[u] = fired[0].step
            else:  # fetched by a replay before any scheduled point: the earliest legal point is a no-op
                prefetch[u] = st.first_bwd_use[u]
    return actions, prefetch


def hint_for(built: Built, graph: Graph, actions: dict[int, Action], prefetch: dict[int, int],
              bandwidth: float) -> dict[int, int]:
    hint: dict[int, int] = {}
    for u, v in built.r.items():
        hint[v] = int(actions.get(u) == Action.RECOMPUTE)
    for u, v in built.each.items():
        hint[v] = int(actions.get(u) == Action.RECOMPUTE_EACH)
    for u, v in built.o.items():
        off = actions.get(u) == Action.OFFLOAD
        hint[v] = int(off)
        q = prefetch.get(u, default_prefetch_at(graph, u, bandwidth)) if off else None
        for sl in built.slots[u]:
            if sl.start:
                hint[sl.var] = int(off and sl.step == q)
    return hint


@register("ilp", description="Checkmate-style MILP over keep / recompute / offload and prefetch points, "
                             "exact under the simulator's lazy replay (CP-SAT, CBC or HiGHS)",
          graphs="dag", exact=True, offload=True, max_ops=MAX_SAVED, config=Config)
def solve_ilp(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
              host_budget_bytes: int | None = None, config: Config = DEFAULT) -> Proposal:
    """Minimise the simulated step time subject to the simulated peak <= ``budget_bytes`` (and the host
    bytes <= ``host_budget_bytes``), by the MILP described in the package docstring, solved by
    ``backend`` (see :class:`Config` for the options). Warm-started from the faster of the greedy and
    Capuchin heuristics; every solution is simulated, and one over budget is cut off and the model
    re-solved. Returns the best simulated plan with the solver's bound; ``optimal`` only when proved (and
    confirmed by the simulator) on a model that admits every plan (on large graphs the model is limited,
    and its bound and status go to ``stats['model_bound_s']`` / ``stats['model_status']`` instead),
    ``timeout`` when the limit stopped the search, ``infeasible`` when the model has no plan."""
    cfg = config
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    bw = graph.host_bandwidth_bytes_per_s
    per_use = cfg.model_per_use(len(graph.saved_activations))
    stats: dict[str, object] = {"backend": cfg.backend}

    def fits(r: Report) -> bool:
        return r.peak_bytes <= budget_bytes and (not offload or host_budget_bytes is None
                                                 or r.host_peak_bytes <= host_budget_bytes)

    # Warm start: the faster of the greedy and Capuchin heuristics' plans that fit. It is also the answer
    # when the model (depth- or window-limited on large graphs) admits nothing better.
    best: tuple[float, dict[int, Action], dict[int, int]] | None = None
    warm: tuple[dict[int, Action], dict[int, int]] | None = None
    if cfg.warm_start:
        for name, heuristic in (("greedy", solve_greedy), ("capuchin", solve_capuchin)):
            try:
                prop = heuristic(graph, budget_bytes, time_limit_s=min(5.0, 0.1 * time_limit_s), offload=offload,
                                 host_budget_bytes=host_budget_bytes)
            except MemplanError:
                continue
            if prop.status == "infeasible" or (not per_use and Action.RECOMPUTE_EACH in prop.actions.values()):
                continue  # none, or outside the model's space
            rep = simulate_actions(graph, prop.actions, prefetch_at=prop.prefetch_at)
            if fits(rep) and (best is None or rep.time_s < best[0]):
                warm = (prop.actions, prop.prefetch_at)
                best = (rep.time_s, dict(prop.actions), dict(prop.prefetch_at))
                stats["warm_start"] = name
        stats["warm_start_s"] = None if best is None else best[0]
    formulation = cfg.formulation
    n_saved = len(graph.saved_activations)
    if formulation == "auto":
        formulation = ("replay" if offload or n_saved <= cfg.small_saved
                       else "blocks" if n_saved > REPLAY_MAX_SAVED else "both")
    if formulation in ("intervals", "blocks") and offload:
        raise MemplanError(f"ilp: formulation {formulation!r} plans recompute only; use formulation='replay' "
                           "(or 'auto') with offload")
    if formulation in ("replay", "both") and n_saved > REPLAY_MAX_SAVED:
        raise MemplanError(f"ilp: the replay model handles at most {REPLAY_MAX_SAVED} saved activations "
                           f"(offload included); this graph has {n_saved}: plan it without offload")
    if formulation == "blocks":
        # past the replay model's size: the staircase relaxation's bound, block-uniform plans (blocks.py)
        incumbent = None if best is None else (best[0], best[1])
        status_b, bound_b, found, more = solve_blocks(graph, budget_bytes, cfg, deadline, incumbent, fits)
        stats.update(more, solve_s=time.perf_counter() - t0)
        if found is None:
            stats["stopped"] = "model infeasible" if status_b == "infeasible" else "time limit"
            return Proposal(status="infeasible", stats=stats)
        return Proposal(found[1], {}, status_b, bound_b, stats)
    outer_bound: float | None = None  # the interval model's bound, when the replay model runs after it
    if formulation in ("intervals", "both"):
        # the full-graph relaxation first: a bound valid for the exact problem, and often the best plan;
        # "both" leaves 40% of the time to the (windowed) replay model when that is not proved optimal
        until = deadline if formulation == "intervals" else t0 + 0.6 * time_limit_s
        incumbent = None if best is None else (best[0], best[1])
        status_i, bound_i, found, more = solve_intervals(graph, budget_bytes, cfg, until, incumbent, fits)
        stats["intervals"] = more
        if found is not None and (best is None or found[0] < best[0]):
            best, warm = (found[0], found[1], {}), (found[1], {})
        if formulation == "intervals" or status_i in ("optimal", "infeasible"):
            stats["solve_s"] = time.perf_counter() - t0
            if best is None:
                stats["stopped"] = "model infeasible" if status_i == "infeasible" else "time limit"
                return Proposal(status="infeasible", stats=stats)
            # the interval relaxation bounds recompute_each plans too (module docstring of .intervals)
            return Proposal(best[1], best[2], status_i, bound_i, stats, space=ALL_PLANS)
        outer_bound = bound_i
    # the replay model's claims cover recompute_each with per_use, offload at every prefetch point with
    # prefetch="choose"; behind the interval model, its bound decides (and covers every plan)
    # (a plan it finds; "infeasible" is the replay model's alone: the interval bound is on time, and a
    # recompute_each plan it leaves out may fit, as on a U-Net below every keep / recompute plan's peak)
    model_space = plan_space(per_use=per_use, offload=offload, prefetch=cfg.prefetch)
    space = ALL_PLANS if outer_bound is not None else model_space
    try:
        built = Builder(graph, budget_bytes, offload=offload, host_budget=host_budget_bytes, cfg=cfg,
                        deadline=deadline).build()
    except ConstantlyViolated:
        return Proposal(status="infeasible", stats={**stats, "reason": "a memory row no plan can change is over budget"})
    except BuildOutOfTime:
        # the time limit ended while the model was being built: the best plan so far (the warm start) is
        # the answer, a timeout, within the caller's deadline
        stats.update(stopped="time limit while building the model", solve_s=time.perf_counter() - t0)
        if best is None:
            return Proposal(status="infeasible", stats=stats, space=model_space)
        return Proposal(best[1], best[2], "timeout", None, stats, space=space)
    model = built.model
    stats.update(variables=len(model.lb), rows=len(model.rows), build_s=time.perf_counter() - t0)
    hint = hint_for(built, graph, *warm, bw) if warm else {}
    bound_s: float | None = None
    status = "timeout"
    cuts = mismatches = time_cuts = 0
    rounds = 0

    def tol(time_s: float) -> float:
        # what separates "equal" from "faster": float noise, the rounded-down replay ticks of one plan,
        # and (with offload) the model's timing error
        return 1e-9 * time_s + built.tick_s * (2 * len(graph.ops) + 2) + 2 * built.time_err_s

    for _ in range(cfg.max_rounds):
        rounds += 1
        left = deadline - time.perf_counter()
        if left <= 0.05:
            break
        ans = run_backend(cfg, model, hint, left)
        if ans.bound is not None and math.isfinite(ans.bound):
            # The model is a relaxation of the exact problem (memory rounded down, replays rounded down,
            # offload timing within time_err_s), and cuts only remove plans the simulator refused or plans
            # recorded in `best`: so the optimum is at least min(best, this bound), in every round.
            round_bound = built.time_s(ans.bound) - built.time_err_s
            bound_s = round_bound if bound_s is None else max(bound_s, round_bound)
        if ans.status == "infeasible":
            # nothing left in the relaxation: every plan it admitted was refused by the simulator or is
            # recorded, so `best` is the optimum, or no plan fits -- when the model leaves no plan out
            status = "infeasible" if best is None else ("optimal" if built.exact else "feasible")
            break
        if ans.values is None:
            break  # no solution within the time left
        actions, prefetch = decode(built, ans.values, graph)
        try:
            rep = simulate_actions(graph, actions, prefetch_at=prefetch)
        except PlanError:
            rep = None  # a replay the model let through needs a tensor that can be neither read nor rebuilt
        model_s = built.time_s(ans.objective or 0.0)
        if rep is None or not fits(rep):
            cuts += 1  # over budget in bytes (the relaxation rounds sizes down): cut it, solve again
            no_good(model, built.decision_vars, ans.values)
            continue
        if abs(rep.time_s - model_s) > tol(rep.time_s):
            mismatches += 1
        if best is None or rep.time_s < best[0]:
            best = (rep.time_s, actions, prefetch)
        if bound_s is not None and best[0] <= bound_s + tol(best[0]):
            status = "optimal"  # a plan the simulator confirmed meets a bound valid for the exact problem
            break
        if ans.status == "optimal" and rep.time_s > model_s + tol(rep.time_s):
            # the model under-priced this plan (a rounding tie): it is recorded in `best` at its simulated
            # time; cut it and ask again for the next best
            cuts += 1
            no_good(model, built.decision_vars, ans.values)
            time_cuts += 1
            continue
        hint = {v: ans.values[v] for v in built.decision_vars}
        break
    stats.update(cuts=cuts, time_cuts=time_cuts, rounds=rounds, model_mismatches=mismatches,
                 memory_unit_bytes=built.unit_bytes, memory_exact=built.memory_exact,
                 solve_s=time.perf_counter() - t0)
    if best is None:
        stats["stopped"] = "model infeasible" if status == "infeasible" else "time limit"
        return Proposal(status="infeasible", stats=stats, space=model_space)
    if bound_s is not None:
        bound_s = min(bound_s, best[0])
    if status == "optimal":
        bound_s = best[0] if bound_s is None else bound_s
    if not built.exact:
        # the model left plans out (replay depth, prefetch window): its bound and its "optimal" hold over
        # the plans it admits only, and a heuristic can beat them, so neither is reported as the method's
        stats["model_bound_s"] = bound_s
        stats["model_status"] = status
        bound_s = None
        status = "feasible" if status == "optimal" else status
    if outer_bound is not None:
        # the interval relaxation's bound holds for every plan: it decides the status
        bound_s = min(outer_bound, best[0])
        if best[0] <= outer_bound + tol(best[0]):
            status = "optimal"
    return Proposal(best[1], best[2], status, bound_s, stats, space=space)

