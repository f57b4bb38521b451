"""The exact chain DPs: memplan's optimum on chains over every plan without offload (:mod:`.each`: keep /
recompute / recompute_each, chains of up to ``each.MAX_EACH_OPS`` ops) and over keep / recompute plans (the
rest of this package, any length), read at any budget. What follows is the keep / recompute DP; :mod:`.each`
states what the simulator makes of ``recompute_each`` on a chain and its own recurrence.

Read from the top down: :mod:`.solve` (pick an engine for a chain, read its plan at a budget, the least
budget), the engines :mod:`.grid` (memory in units of bytes, exact or rounded) and :mod:`.pareto` (exact
in bytes), the contract they share :mod:`.table`, and the chain model :mod:`.model`; :mod:`.stages` turns a
DAG into a chain of stages for the DP and the baselines. The ``dp`` method (:mod:`memplan.solvers.dp`) and
the baselines (:mod:`memplan.solvers.baselines`) are built on it.

**What ``dp`` is exact for.** On a graph that *is* a chain (op ``i`` has one output ``a_i``, reads only
``a_{i-1}`` among activations, its backward saves ``a_{i-1}``, and the last op also saves its own output:
the shape of :func:`memplan.planner.core.synthetic.linear_chain`), the simulator's lazy replay reduces to
single-level checkpointing: with ``K`` the kept activations, backward step ``s`` that finds ``a_{s-1}``
missing replays the run of recomputed ops above the nearest kept ``a_k``, and every replayed tensor stays
resident until its own backward (its saver is still to come), so each recomputed op runs exactly once.
Hence step time = keep-everything time + the replay cost of the recomputed ops (op time and the executor's
replay dispatch, :func:`memplan.planner.core.schedule.replay_op_cost_s`) + the executor's watch of forward
ops, which depends on where the replays fall and no DP term models (it only adds time: the DP's optimum is
then a lower bound, and ``dp`` checks its plan in the simulator before it claims more); every peak the
simulator records is ``F + S(k) + C(k, k')`` for two consecutive kept activations ``k < k'`` (``F`` fixed
bytes, ``S(k)`` the kept bytes up to ``k``, ``C`` the forward, replay and backward peaks of the run between
them: see :meth:`.model.OpChain.run_costs`), plus peaks no plan changes. Rewriting ``S(k) + C(k, k') <= B - F``
from the top down gives a budget-free table:

    ``D[k][r]`` = the most replay time saved by keeping activations above ``k`` (``k`` kept, ``-1`` = the
    input), over the suffixes whose memory requirement ``R(k) = max(C(k, k'), b_k' + R(k'))`` is at most
    ``r`` memory units; ``-inf`` when none is.

``D[k][r] = max_k' [C(k, k') <= r] (t_k' + D[k'][r - b_k'])`` (``k' = n``: nothing more kept, value 0).
The optimum for budget ``B`` is read at ``D[-1][B - F]``, so one table gives the whole frontier
(:func:`memplan.solvers.dp.dp_frontier`, which shares ``dp``'s code path: an engine's answer at a spare memory does
not depend on the largest spare it was built for). Three engines, all over the same recurrence:

- an **exact grid**: memory in units of the gcd of every byte figure of the chain (exact: no figure is
  rounded), when the table (ops x units) has at most ``GRID_CELLS`` cells. The window maximum over rows
  costs O(columns) per row (:class:`.grid.Windows`), so the 1000-op chain at 70% solves in about a second;
- an **exact Pareto frontier** in bytes (sizes sharing no useful gcd, e.g. GPU-scale tensors of odd
  sizes): per kept ``k`` the non-dominated (memory requirement, time saved) pairs, while at most
  ``PARETO_POINTS`` points are merged;
- otherwise a **rounded grid** whose unit depends on the chain alone: sizes rounded *up* (the plan fits;
  status ``feasible``) and a table rounded *down* giving a sound lower bound (``optimal`` when both agree).

The exact engines are equal to the exhaustive oracle at every budget, one byte below each trade-off point
included (tests/test_dp.py), and report the exact least feasible budget (:func:`.solve.chain_min_budget_bytes`).
Cost: O(n * L + n * M) numpy work for ``n`` ops, runs of at most ``L`` ops fitting the budget and ``M``
"""
