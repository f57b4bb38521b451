"""The executor's watch window (planner/core/watch.py) as linear rows: the forward ops from the lowest to
the highest op a plan needs, each charged its own watch cost (``schedule.watch_op_cost_s``), added to a
model's objective. Shared by the staircase relaxation and the replay model.

A *trigger* is a 0/1 variable with a span ``(lo, hi)`` of forward ops: when it is 1, the window covers
``lo..hi`` (a recomputed tensor's producer, a replayed op and the producers of what it reads). Per op
``j``: ``a_j`` (the window starts at or before ``j``: non-decreasing, 1 from each trigger's ``lo`` on),
``c_j`` (it ends at or after ``j``: non-increasing, 1 up to each trigger's ``hi``), ``a_j + c_j >= 1`` and
``w_j >= a_j + c_j - 1`` (``j`` is in the window: exact when some trigger is 1, 0 otherwise). ``a``, ``c``
and ``w`` are constant between span ends, so one variable stands for each such segment. When the
triggers are a subset of what the executor watches, the charge is at most the simulator's: the model
stays a relaxation.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from memplan.solvers.ilp.linear import LinearModel, lin

#: spans over at most this many window segments get their per-segment strengthening rows
SPAN_ROWS = 32


def watch_window(m: LinearModel, spans: Mapping[int, tuple[int, int]], n: int, watch_ticks: list[int],
                 strengthen: Collection[int] = ()) -> None:
    """Add the window of the triggers ``spans`` (variable -> (lo, hi), forward op ids) over a forward of
    ``n`` ops to ``m``'s objective at ``watch_ticks[j]`` per op ``j``. The triggers in ``strengthen`` also
    get ``w_k >= trigger`` for each segment of their span: implied for integers, but it makes the LP
    relaxation count the spans of fractional choices."""
    if not any(watch_ticks) or not spans:
        return
    cuts = sorted({0, n, *(lo for lo, _ in spans.values()), *(hi + 1 for _, hi in spans.values())})
    segments = list(zip(cuts[:-1], cuts[1:], strict=True))
    seg_of = {start: k for k, (start, _) in enumerate(segments)}
    a = [m.var(f"watch_a[{s}]") for s, _ in segments]
    c = [m.var(f"watch_c[{s}]") for s, _ in segments]
    w = [m.var(f"watch_w[{s}]") for s, _ in segments]
    for k in range(len(segments)):
        m.row(lin(0, (a[k], 1), (c[k], 1)), lo=1)
        m.row(lin(0, (w[k], 1), (a[k], -1), (c[k], -1)), lo=-1)
        if k:
            m.row(lin(0, (a[k], 1), (a[k - 1], -1)), lo=0)
            m.row(lin(0, (c[k - 1], 1), (c[k], -1)), lo=0)
        m.objective[w[k]] = m.objective.get(w[k], 0) + sum(watch_ticks[segments[k][0]:segments[k][1]])
    strengthen = set(strengthen)
    for x, (lo, hi) in spans.items():
        first, last = seg_of[lo], seg_of[cuts[cuts.index(hi + 1) - 1]]
        m.row(lin(0, (a[first], 1), (x, -1)), lo=0)
        m.row(lin(0, (c[last], 1), (x, -1)), lo=0)
        if x in strengthen and last - first < SPAN_ROWS:  # a span over many segments (rotary tables read
            for k in range(first, last + 1):              # by every layer) adds rows quadratically
                m.row(lin(0, (w[k], 1), (x, -1)), lo=0)
