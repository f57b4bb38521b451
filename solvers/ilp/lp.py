"""HiGHS called directly (highspy, in this process) on a :class:`LinearModel`: its LP relaxation, or the
MIP under a time limit. The large-graph models (:mod:`.staircase`) have thousands of variables, and PuLP's
model building and file round trip cost more than HiGHS's LP solve there.

The LP relaxation's optimum is a lower bound on the MIP's, and so on whatever the MIP bounds.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from memplan.planner.core.errors import SolverUnavailable
from memplan.solvers.ilp.backends import HIGHSPY_PIN, model_from_json
from memplan.solvers.ilp.linear import LinearModel


@dataclass
class Solved:
    status: str                 # optimal | feasible | infeasible | unknown
    bound: float | None         # the relaxation's (LP) or the search's (MIP) dual bound, in ticks
    objective: float | None
    values: list[int] | None


def solve_direct(model: LinearModel, *, integral: bool, time_limit_s: float,
                 hint: dict[int, int] | None = None, on_bound: Callable[[float], None] | None = None) -> Solved:
    """Solve ``model`` with HiGHS: its LP relaxation (``integral=False``) or the MIP (zero relative gap,
    one thread) within ``time_limit_s``; ``hint`` a starting solution for the MIP (a full or partial
    assignment); ``on_bound`` is called with the MIP's dual bound as it rises. Raises :class:`SolverUnavailable` when highspy does not load."""
    try:
        import highspy
    except ImportError:
        raise SolverUnavailable(f"the large-graph ILP needs highspy: pip install '{HIGHSPY_PIN}'") from None
    n = len(model.lb)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n, len(model.rows)
    cost = np.zeros(n)
    for v, c in model.objective.items():
        cost[v] = c
    lp.col_cost_ = cost
    lp.col_lower_ = np.array(model.lb, dtype=float)
    lp.col_upper_ = np.array(model.ub, dtype=float)
    inf = highspy.kHighsInf
    lp.row_lower_ = np.array([-inf if lo is None else lo for _, lo, _ in model.rows], dtype=float)
    lp.row_upper_ = np.array([inf if hi is None else hi for _, _, hi in model.rows], dtype=float)
    starts, index, value = [0], [], []
    for terms, _, _ in model.rows:  # row-wise
        index += terms.keys()
        value += terms.values()
        starts.append(len(index))
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.array(starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(value, dtype=float)
    if integral:
        lp.integrality_ = [highspy.HighsVarType.kInteger] * n
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("time_limit", max(0.01, float(time_limit_s)))
    if integral:
        h.setOptionValue("mip_rel_gap", 0.0)
        h.setOptionValue("mip_feasibility_tolerance", 1e-9)
    h.passModel(lp)
    if integral and on_bound is not None:
        last = [-math.inf]

        def report(event) -> None:
            bound = float(event.data_out.mip_dual_bound)
            if math.isfinite(bound) and bound > last[0]:
                last[0] = bound
                on_bound(bound)

        h.enableCallbacks()
        h.cbMipInterrupt.subscribe(report)
    if integral and hint:
        sol = highspy.HighsSolution()
        col = np.zeros(n)
        for v, x in hint.items():
            col[v] = x
        sol.col_value = list(col)
        h.setSolution(sol)
    h.run()
    st = h.getModelStatus()
    info = h.getInfo()
    if st == highspy.HighsModelStatus.kInfeasible:
        return Solved("infeasible", None, None, None)
    if not integral:
        if st != highspy.HighsModelStatus.kOptimal:
            return Solved("unknown", None, None, None)
        obj = float(info.objective_function_value)
        return Solved("optimal", obj, obj, None)
    bound = float(info.mip_dual_bound)
    bound = bound if math.isfinite(bound) else None
    if info.primal_solution_status != 2:  # no feasible solution
        return Solved("unknown", bound, None, None)
    values = [round(x) for x in h.getSolution().col_value]
    obj = float(info.objective_function_value)
    optimal = st == highspy.HighsModelStatus.kOptimal
    if optimal:
        bound = obj if bound is None else min(bound, obj)
    return Solved("optimal" if optimal else "feasible", bound, obj, values)


def solve_bounded(model: LinearModel, *, time_limit_s: float) -> Solved:
    """The MIP of :func:`solve_direct` in a child process that is stopped at its time limit (plus a
    little): HiGHS does not check its own limit inside some of its sub-searches (a 10 s limit ran 77 s on
    an 80-layer model). Stopped, it answers ``unknown`` with the last dual bound the child reported
    (valid whenever it was reported), or none."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "model.json"), os.path.join(tmp, "answer.json")
        with open(src, "w") as f:
            # HiGHS gets most of the time: the child's start and the model's reading take the rest
            json.dump({"model": model.to_json(), "time_limit_s": 0.85 * time_limit_s - 0.5}, f)
        code = "import sys; from memplan.solvers.ilp.lp import child_main; child_main(sys.argv[1], sys.argv[2])"
        try:
            proc = subprocess.run([sys.executable, "-c", code, src, dst], capture_output=True, text=True,
                                  timeout=max(0.5, time_limit_s))
        except subprocess.TimeoutExpired:
            # the dual bound the child reported last is still a valid bound
            try:
                with open(dst + ".bound") as f:
                    return Solved("unknown", float(f.read()), None, None)
            except (OSError, ValueError):
                return Solved("unknown", None, None, None)
        if proc.returncode != 0 or not os.path.exists(dst):
            return Solved("unknown", None, None, None)
        with open(dst) as f:
            a = json.load(f)
    return Solved(a["status"], a["bound"], a["objective"], a["values"])


def child_main(src: str, dst: str) -> None:
    """:func:`solve_bounded`'s child: read the model, solve the MIP, write the answer."""
    with open(src) as f:
        job = json.load(f)
    mj = job["model"]
    model = model_from_json(mj)
    def write_bound(bound: float) -> None:
        with open(dst + ".tmp", "w") as f:
            f.write(repr(bound))
        os.replace(dst + ".tmp", dst + ".bound")  # atomic: the parent never reads half a number

    ans = solve_direct(model, integral=True, time_limit_s=job["time_limit_s"], on_bound=write_bound)
    with open(dst, "w") as f:
        json.dump({"status": ans.status, "bound": ans.bound, "objective": ans.objective, "values": ans.values}, f)
