"""The ILP's backends: a :class:`LinearModel` solved by OR-Tools CP-SAT, PuLP's CBC, or HiGHS (in a
child process when highspy cannot load beside OR-Tools' own HiGHS library), each answering an
:class:`Answer` in the model's units.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from memplan.planner.core.errors import MemplanError, SolverUnavailable
from memplan.solvers.ilp.config import Config
from memplan.solvers.ilp.linear import LinearModel


@dataclass
class Answer:
    status: str                        # optimal | feasible | infeasible | unknown
    values: list[int] | None           # one per variable, when a solution was found
    objective: float | None            # in ticks
    bound: float | None                # best bound, in ticks
    stats: dict = field(default_factory=dict)


def _left(t0: float, time_limit_s: float) -> float:
    """What is left of ``time_limit_s`` since ``t0``: building a backend's model from ours takes seconds on
    large graphs (a 755-op GPT-2 with offload: about one), and a solver limited to the whole of it
    overran its caller's deadline by that much."""
    return time_limit_s - (time.perf_counter() - t0)


def solve_cpsat(model: LinearModel, hint: dict[int, int], time_limit_s: float, workers: int) -> Answer:
    t0 = time.perf_counter()
    try:
        from ortools.sat.python import cp_model
    except ImportError as e:  # not installed, or a conflicting HiGHS library loaded first
        if "undefined symbol" in str(e):
            return solve_child(model, hint, time_limit_s, "cpsat", workers)
        raise SolverUnavailable("ilp backend 'cpsat' needs OR-Tools: pip install ortools") from None
    cm = cp_model.CpModel()
    xs = [cm.new_bool_var(nm) if bi else cm.new_int_var(lo, hi, nm)
          for lo, hi, bi, nm in zip(model.lb, model.ub, model.binary, model.names, strict=True)]
    lo_inf, hi_inf = cp_model.INT_MIN, cp_model.INT_MAX
    for terms, lo, hi in model.rows:
        expr = cp_model.LinearExpr.weighted_sum([xs[v] for v in terms], list(terms.values()))
        cm.add_linear_constraint(expr, lo_inf if lo is None else lo, hi_inf if hi is None else hi)
    cm.minimize(cp_model.LinearExpr.weighted_sum([xs[v] for v in model.objective], list(model.objective.values())))
    for v, val in hint.items():
        cm.add_hint(xs[v], val)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, _left(t0, time_limit_s))
    solver.parameters.num_workers = max(1, workers)
    # CP-SAT 9.15's inclusion presolve (ProcessAtMostOneAndLinear) can certify a wrong optimum on linear
    # models (google/or-tools#5293): on a 5-op offload graph it proved 9.600 s "optimal" where the model
    # admits 8.975 s (CBC, HiGHS, CP-SAT without presolve and the exhaustive oracle agree). Off, the rest
    # of presolve stays on; tests/test_solvers_common.py pins the case.
    solver.parameters.presolve_inclusion_work_limit = 0
    code = solver.solve(cm)
    stats = {"wall_s": solver.wall_time, "branches": solver.num_branches}
    if code == cp_model.INFEASIBLE:
        return Answer("infeasible", None, None, None, stats)
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Answer("unknown", None, None, None, stats)
    values = [int(solver.value(x)) for x in xs]
    return Answer("optimal" if code == cp_model.OPTIMAL else "feasible", values, solver.objective_value,
                   solver.best_objective_bound, stats)


def pulp_problem(model: LinearModel):
    import pulp

    prob = pulp.LpProblem("memplan_ilp", pulp.LpMinimize)
    # variables are made by the problem (PuLP 3.3.1+; 4.0 removes constructing LpVariable directly)
    xs = [prob.add_variable(f"x{i}", lowBound=lo, upBound=hi, cat=pulp.LpBinary if bi else pulp.LpContinuous)
          for i, (lo, hi, bi) in enumerate(zip(model.lb, model.ub, model.binary, strict=True))]
    prob += pulp.LpAffineExpression([(xs[v], c) for v, c in model.objective.items()])
    for j, (terms, lo, hi) in enumerate(model.rows):
        expr = pulp.LpAffineExpression([(xs[v], c) for v, c in terms.items()])
        if lo is not None and hi is not None and lo == hi:
            prob += pulp.LpConstraint(expr, pulp.LpConstraintEQ, f"r{j}", hi)
            continue
        if lo is not None:
            prob += pulp.LpConstraint(expr, pulp.LpConstraintGE, f"r{j}l", lo)
        if hi is not None:
            prob += pulp.LpConstraint(expr, pulp.LpConstraintLE, f"r{j}h", hi)
    return prob, xs


def solve_cbc(model: LinearModel, hint: dict[int, int], time_limit_s: float) -> Answer:
    t0 = time.perf_counter()
    try:
        import pulp
    except ImportError:
        raise SolverUnavailable("ilp backend 'cbc' needs PuLP (its 3.3 releases bundle CBC): "
                                "pip install 'pulp>=3.3.1,<4'") from None
    prob, xs = pulp_problem(model)
    for v, val in hint.items():
        xs[v].setInitialValue(val)
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "cbc.log")
        # gapRel=0: "optimal" must mean proved, not within CBC's default gap
        cmd = pulp.COIN_CMD(path=cbc_path(), msg=False, timeLimit=max(1, math.ceil(_left(t0, time_limit_s))),
                            warmStart=bool(hint), logPath=log, threads=1, gapRel=0.0)
        if not cmd.available():
            raise SolverUnavailable("ilp backend 'cbc' finds no CBC binary: PuLP 3.3 bundles one; "
                                    "pip install 'pulp>=3.3.1,<4'")
        prob.solve(cmd)
        text = open(log).read() if os.path.exists(log) else ""
    bound = cbc_bound(text)
    return pulp_answer(prob, xs, bound)


def cbc_path() -> str | None:
    """The CBC binary PuLP 3 bundles, run through ``COIN_CMD`` (PuLP 3.3 deprecates ``PULP_CBC_CMD``, which
    runs that binary, for 4.0); None where the wheel has none for this platform: ``COIN_CMD`` then looks for
    a ``cbc`` on the PATH."""
    import pulp

    path = getattr(pulp.PULP_CBC_CMD, "pulp_cbc_path", None)  # a class attribute: reading it warns of nothing
    return path if path and os.access(path, os.X_OK) else None


def cbc_bound(log: str) -> float | None:
    """CBC's best possible objective, from its log ('best possible X' / 'Objective value' lines)."""
    import re

    if "Result - Optimal solution found" in log:
        # proved (gapRel=0): the optimum is the bound; the last 'best possible' line may be a stale one
        # from an early node (seen: node 0's, 5% under the optimum CBC then proved 4 nodes later)
        proved = re.findall(r"Objective value:\s+(-?[0-9.eE+-]+)", log)
        if proved:
            return float(proved[-1])
    found = re.findall(r"best possible (-?[0-9.eE+-]+)", log)
    if found:
        return float(found[-1])
    found = re.findall(r"Lower bound:\s+(-?[0-9.eE+-]+)", log)
    return float(found[-1]) if found else None


HIGHSPY_PIN = "highspy==1.12.0"  # the HiGHS that OR-Tools 9.15 bundles (libhighs.so.1): both load together


def solve_highs(model: LinearModel, time_limit_s: float) -> Answer:
    """HiGHS through PuLP, in this process when highspy loads here, else in a child process.

    OR-Tools ships its own ``libhighs.so.1``. Once OR-Tools is loaded, a highspy built against another
    HiGHS release finds that library already loaded under the same soname and fails with an undefined
    symbol; a highspy of the bundled release (pyproject pins it) loads beside it."""
    try:
        import highspy  # noqa: F401
    except ModuleNotFoundError:
        raise SolverUnavailable(f"ilp backend 'highs' needs highspy: pip install '{HIGHSPY_PIN}'") from None
    except ImportError as e:  # another HiGHS library is loaded in this process (OR-Tools')
        if "undefined symbol" not in str(e):
            raise SolverUnavailable(f"ilp backend 'highs': highspy does not load ({e}); "
                                    f"pip install '{HIGHSPY_PIN}'") from None
        return solve_child(model, {}, time_limit_s, "highs", 1)
    return solve_highs_here(model, time_limit_s)


def solve_highs_here(model: LinearModel, time_limit_s: float) -> Answer:
    import pulp

    t0 = time.perf_counter()
    prob, xs = pulp_problem(model)
    # gapRel=0: HiGHS stops at a 1e-4 relative gap by default and calls that optimal. Its default
    # integrality tolerance (1e-6) lets big-M rows slip, and its presolve mis-handled the offload clock's
    # big-M rows (false optima and "infeasible" on MiB-scale offload graphs): tighter on both
    opts = {"mip_feasibility_tolerance": 1e-9, **({"presolve": "off"} if model.timed else {})}
    prob.solve(pulp.HiGHS(msg=False, timeLimit=max(0.01, _left(t0, time_limit_s)), threads=1, gapRel=0.0, **opts))
    h = getattr(prob, "solverModel", None)
    bound = None
    if h is not None:
        try:
            bound = float(h.getInfo().mip_dual_bound)
        except Exception:  # an older highspy without the field: no bound
            bound = None
    return pulp_answer(prob, xs, bound)


def pulp_answer(prob, xs, bound: float | None) -> Answer:
    """A solved PuLP problem as an :class:`Answer` (CBC and HiGHS alike); ``bound`` is the backend's."""
    import pulp

    if prob.status == pulp.LpStatusInfeasible:
        return Answer("infeasible", None, None, None, {})
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return Answer("unknown", None, None, bound, {})
    values = [round(x.value() or 0) for x in xs]
    obj = pulp.value(prob.objective) or 0.0
    optimal = prob.sol_status == pulp.LpSolutionOptimal
    if optimal:  # the backend's own bound when it reports one (an optimum within its tolerances)
        bound = obj if bound is None else min(bound, obj)
    return Answer("optimal" if optimal else "feasible", values, obj, bound, {})


def solve_child(model: LinearModel, hint: dict[int, int], time_limit_s: float, backend: str, workers: int) -> Answer:
    """Solve in a fresh Python process: highspy and OR-Tools ship incompatible HiGHS libraries and cannot
    both be loaded in one process (whichever comes second fails with an undefined symbol)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "model.json"), os.path.join(tmp, "answer.json")
        with open(src, "w") as f:
            json.dump({"model": model.to_json(), "hint": list(hint.items()), "time_limit_s": time_limit_s,
                       "backend": backend, "workers": workers}, f)
        code = ("import sys; from memplan.solvers.ilp.backends import child_main; child_main(sys.argv[1], sys.argv[2])")
        try:
            proc = subprocess.run([sys.executable, "-c", code, src, dst], capture_output=True, text=True,
                                  timeout=time_limit_s + 60)
        except subprocess.TimeoutExpired:
            return Answer("unknown", None, None, None, {"child": "killed after the time limit"})
        if proc.returncode != 0 or not os.path.exists(dst):
            tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
            if "No module named" in tail[0] or "undefined symbol" in tail[0] or "not available" in tail[0]:
                what = HIGHSPY_PIN if backend == "highs" else "ortools"
                raise SolverUnavailable(f"ilp backend {backend!r} is unavailable ({tail[0]}); "
                                        f"pip install '{what}'")
            raise MemplanError(f"ilp backend {backend!r} failed in its child process: {tail[0]}")
        with open(dst) as f:
            a = json.load(f)
    return Answer(a["status"], a["values"], a["objective"], a["bound"], a.get("stats", {}))


def model_from_json(mj: dict) -> LinearModel:
    """A :class:`LinearModel` from the JSON a parent process wrote for a solver child."""
    return LinearModel(lb=mj["lb"], ub=mj["ub"], binary=mj["binary"], names=[f"x{i}" for i in range(len(mj["lb"]))],
                       rows=[({int(v): int(c) for v, c in t}, lo, hi) for t, lo, hi in mj["rows"]],
                       objective={int(v): int(c) for v, c in mj["objective"]}, timed=mj.get("timed", False))


def child_main(src: str, dst: str) -> None:
    with open(src) as f:
        job = json.load(f)
    mj = job["model"]
    model = model_from_json(mj)
    hint = {int(v): int(c) for v, c in job["hint"]}
    if job["backend"] == "highs":
        ans = solve_highs_here(model, job["time_limit_s"])
    else:
        ans = solve_cpsat(model, hint, job["time_limit_s"], job["workers"])
    with open(dst, "w") as f:
        json.dump({"status": ans.status, "values": ans.values, "objective": ans.objective, "bound": ans.bound,
                   "stats": ans.stats}, f)


def run_backend(cfg: Config, model: LinearModel, hint: dict[int, int], time_limit_s: float) -> Answer:
    if cfg.backend == "cpsat":
        return solve_cpsat(model, hint, time_limit_s, cfg.workers)
    if cfg.backend == "cbc":
        return solve_cbc(model, hint, time_limit_s)
    return solve_highs(model, time_limit_s)
