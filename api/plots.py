"""PNG plots (matplotlib, Agg backend: no display needed, safe in threads): the memory timeline of a
plan, predicted against measured when a run report is given, and the memory/overhead frontier.

Figures are built with ``matplotlib.figure.Figure`` directly, not pyplot, so no global state is touched;
each PNG is exactly ``width_px`` x ``height_px``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memplan.planner.core.errors import MemplanError
from memplan.planner.core.memtrace import MemoryTrace
from memplan.planner.core.simulator import Event
from memplan.planner.core.units import format_bytes

_PHASE_COLOURS = {"forward": "tab:blue", "backward": "tab:green", "recompute": "tab:red",
                  "prefetch": "tab:purple", "wait": "tab:orange", "optimizer": "tab:gray"}


@dataclass(frozen=True)
class MeasuredRun:
    """What a real run measured: its peak and, where recorded, memory over time ``(time_s, bytes)``, the
    step time, and the fingerprint of the graph it ran (``memplan run -o`` writes all four)."""

    peak_bytes: int | None
    timeline: list[tuple[float, int]] = field(default_factory=list)
    step_time_s: float | None = None
    graph_fingerprint: str | None = None


def read_run_report(data: Mapping[str, Any], *, source: str = "run report") -> MeasuredRun:
    """A :class:`MeasuredRun` from a run report (JSON object).

    Accepted keys: the peak as ``measured_peak_bytes``, ``peak_bytes`` or ``measured.peak_bytes``; the
    timeline as ``timeline`` (or ``measured.timeline``), a list of objects with a time (``time_s``,
    ``start_s`` or ``t_s``) and a size (``bytes``, ``allocated_bytes`` or ``live_bytes``); optionally
    ``measured_step_s`` and ``graph_fingerprint``. The ``memplan.run/1`` report of ``memplan run -o`` is
    such an object.
    """
    if not isinstance(data, Mapping):
        raise MemplanError(f"{source}: expected a JSON object")
    measured = data.get("measured") if isinstance(data.get("measured"), Mapping) else {}
    peak = data.get("measured_peak_bytes", data.get("peak_bytes", measured.get("peak_bytes")))
    if peak is not None and (isinstance(peak, bool) or not isinstance(peak, int) or peak < 0):
        raise MemplanError(f"{source}: peak_bytes must be a non-negative integer, got {peak!r}")
    raw = data.get("timeline", measured.get("timeline")) or []
    if not isinstance(raw, list):
        raise MemplanError(f"{source}: timeline must be a list")
    points = []
    for i, p in enumerate(raw):
        t = _first(p, ("time_s", "start_s", "t_s")) if isinstance(p, Mapping) else None
        b = _first(p, ("bytes", "allocated_bytes", "live_bytes")) if isinstance(p, Mapping) else None
        if not (isinstance(t, (int, float)) and isinstance(b, (int, float)) and math.isfinite(t)
                and math.isfinite(b)):
            raise MemplanError(f"{source}: timeline[{i}] needs a time (time_s) and a size (bytes), got {p!r}")
        points.append((float(t), int(b)))
    if peak is None and not points:
        raise MemplanError(f"{source}: no measured peak (measured_peak_bytes) or timeline in it")
    step = data.get("measured_step_s", measured.get("step_time_s"))
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float)) or not step >= 0):
        raise MemplanError(f"{source}: measured_step_s must be a non-negative number, got {step!r}")
    fingerprint = data.get("graph_fingerprint")
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise MemplanError(f"{source}: graph_fingerprint must be a string, got {fingerprint!r}")
    return MeasuredRun(peak, points, None if step is None else float(step), fingerprint)


def load_run_report(path: str | Path) -> MeasuredRun:
    try:
        data = json.loads(Path(path).read_bytes())
    except OSError as e:
        raise MemplanError(f"cannot read run report {path}: {e.strerror}") from None
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested past the parser's depth
        raise MemplanError(f"run report {path}: not valid JSON ({type(e).__name__}: {e})") from None
    return read_run_report(data, source=str(path))


def _first(d: Mapping[str, Any], keys: Sequence[str]) -> Any:
    return next((d[k] for k in keys if k in d), None)


def _figure(width_px: int, height_px: int, dpi: int) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if width_px < 50 or height_px < 50:
        raise MemplanError(f"plot size {width_px}x{height_px} px is too small (at least 50x50)")
    fig = Figure(figsize=(width_px / dpi, height_px / dpi), dpi=dpi)
    FigureCanvasAgg(fig)  # attaches the Agg canvas: no display, no pyplot
    return fig


def _bytes_axis(ax: Any, axis: str = "y") -> None:
    from matplotlib.ticker import FuncFormatter

    fmt = FuncFormatter(lambda v, _pos: format_bytes(v))
    (ax.yaxis if axis == "y" else ax.xaxis).set_major_formatter(fmt)


def _save(fig: Any, path: str | Path, dpi: int) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, format="png")  # no bbox_inches="tight": keep the exact pixel size
    return path


#: how the timeline stacks the device memory (bottom first): (label, the trace's categories, colour)
STACK = (("parameters", ("parameter", "buffer"), "#4e79a7"), ("batch", ("input",), "#9c755f"),
         ("optimizer state", ("optimizer state",), "#76b7b2"), ("other fixed", ("other",), "#bab0ab"),
         ("gradients", ("gradient",), "#59a14f"), ("kept activations", ("activation",), "#f28e2c"),
         ("offloaded / fetched back", ("offloaded", "fetched"), "#af7aa1"),
         ("replay transients", ("replayed",), "#e15759"), ("workspaces", ("workspace",), "#edc949"),
         ("unknown", ("unknown",), "#ff9da7"))


def stacked_series(trace: MemoryTrace) -> tuple[list[float], dict[str, list[int]]]:
    """The device memory of ``trace`` over simulated time, by :data:`STACK` group: ``(times, {label:
    bytes})``, one point per instant at which an event happens, holding the state with the most memory at
    that instant (so a peak between two events at the same time survives); each point lasts until the
    next. The groups' sum at a point is the simulator's live memory there."""
    group_of = {c: label for label, cats, _ in STACK for c in cats}
    live = dict.fromkeys((label for label, _, _ in STACK), 0)
    times: list[float] = []
    rows: list[dict[str, int]] = []
    totals: list[int] = []
    total = 0
    for e in trace.events:
        label = group_of.get(e.block.category, "unknown")
        delta = e.block.bytes if e.action == "alloc" else -e.block.bytes
        live[label] += delta
        total += delta
        if times and times[-1] == e.time_s:
            if total >= totals[-1]:
                rows[-1], totals[-1] = dict(live), total
            continue
        times.append(e.time_s)
        rows.append(dict(live))
        totals.append(total)
    return times, {label: [r[label] for r in rows] for label, _, _ in STACK}


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


class _RoundBytes:
    """Ticks at round sizes: 1, 2, 2.5 or 5 times a power of ten of one binary unit (B, KiB, MiB, GiB),
    the unit of a sixth of the span (200 B, 20 MiB, 500 MiB)."""

    @staticmethod
    def unit(span: float, n: int = 6) -> int:
        return 1024 ** max(0, min(4, int(math.log(max(span / n, 1), 1024))))

    @staticmethod
    def step(span: float, n: int = 6) -> float:
        if span <= 0:
            return 1.0
        unit = _RoundBytes.unit(span, n)
        raw = span / n / unit
        mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
        nice = next((m for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), 10) * mag
        return max(1.0, nice * unit)


def _round_ticks(ax: Any, vmax: float) -> None:
    """Byte ticks on ``ax``'s y axis at round sizes, all in the step's unit (25 MiB, 50 MiB, ...)."""
    from matplotlib.ticker import FuncFormatter, MultipleLocator

    unit = _RoundBytes.unit(vmax)
    name = _UNITS[int(round(math.log(unit, 1024)))]
    ax.yaxis.set_major_locator(MultipleLocator(_RoundBytes.step(vmax)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: "0" if v <= 0 else f"{v / unit:g} {name}"))


def timeline_png(path: str | Path, timeline: Sequence[Event], *, budget_bytes: int | None = None,
                 measured: MeasuredRun | None = None, title: str = "memory timeline",
                 width_px: int = 1200, height_px: int = 600, dpi: int = 100, trace: MemoryTrace | None = None,
                 keep_all: Sequence[Event] | None = None) -> Path:
    """Write the simulator's memory timeline (``simulate(graph, plan).timeline``) as a PNG.

    With ``trace`` (:func:`memplan.planner.core.memtrace.memory_trace` of the same schedule), the device
    memory is stacked by what holds it (:data:`STACK`: parameters, gradients, optimizer state, kept
    activations, offloaded copies, replay transients, workspaces), and, where the plan offloads, the host
    memory its copies hold is drawn below on an axis of its own; without it, live memory as a line and
    each step's peak as a dot coloured by phase. ``keep_all``: keep-everything's timeline, drawn behind as
    a line on its own (shorter) time. The budget and the predicted peak are horizontal lines; a measured
    run's timeline and peak, when given, in black. The measured timeline is in wall time (a real step is
    slower or faster than predicted, and slower still under the allocator profiler that records it), so
    it is stretched to the predicted step's span, and the legend says by how much. Byte ticks fall at
    round sizes. Returns ``path``.
    """
    if not timeline:
        raise MemplanError("timeline is empty: simulate with timeline=True")
    fig = _figure(width_px, height_px, dpi)
    fig.set_layout_engine("constrained")  # the legend beside the axes, the host axis below
    host = [(t, b) for t, b in (trace.host if trace is not None else [])]
    if host and max(b for _, b in host) > 0:
        grid = fig.add_gridspec(2, 1, height_ratios=(4, 1))
        ax = fig.add_subplot(grid[0])
        host_ax = fig.add_subplot(grid[1], sharex=ax)
    else:
        ax, host_ax = fig.add_subplot(1, 1, 1), None
    times = [e.start_s for e in timeline]
    end_s = max(max(times), trace.end_s if trace is not None else 0.0)
    predicted_peak = max(e.peak_bytes for e in timeline)
    top = predicted_peak
    if keep_all:
        top = max(top, max(e.peak_bytes for e in keep_all))
        ax.step([e.start_s for e in keep_all], [e.peak_bytes for e in keep_all], where="post", color="0.55",
                lw=1.2, ls="--", zorder=1,
                label=f"keep everything (peak {format_bytes(max(e.peak_bytes for e in keep_all))})")
    if trace is not None and trace.events:
        xs, series = stacked_series(trace)
        xs = [*xs, end_s]
        drawn = [(label, colour, [*series[label], series[label][-1]]) for label, _, colour in STACK
                 if any(series[label])]
        ax.stackplot(xs, *[ys for _, _, ys in drawn], step="post", colors=[c for _, c, _ in drawn],
                     labels=[label for label, _, _ in drawn], alpha=0.9, zorder=2, lw=0)
    else:
        ax.step(times, [e.live_bytes for e in timeline], where="post", color="0.4", lw=1.2, label="predicted live")
        for phase, colour in _PHASE_COLOURS.items():
            pts = [(e.start_s, e.peak_bytes) for e in timeline if e.phase == phase]
            if pts:
                ax.scatter(*zip(*pts, strict=True), s=10, color=colour, label=f"{phase} peak", zorder=3)
    peak_at = next(e for e in timeline if e.peak_bytes == predicted_peak)
    ax.axhline(predicted_peak, color="tab:blue", ls=":", lw=1, zorder=3,
               label=f"predicted peak {format_bytes(predicted_peak)}")
    ax.plot([peak_at.start_s], [predicted_peak], marker="v", color="tab:blue", ms=7, zorder=4)
    if budget_bytes is not None:
        top = max(top, budget_bytes)
        ax.axhline(budget_bytes, color="tab:red", ls="--", lw=1.2, zorder=3, label=f"budget {format_bytes(budget_bytes)}")
    if measured is not None:
        if measured.timeline:
            mt, mb = zip(*measured.timeline, strict=True)
            span_s, predicted_span_s = max(mt) - min(mt), max(times) - min(times)
            scale = predicted_span_s / span_s if span_s > 0 and predicted_span_s > 0 else 1.0
            ax.plot([min(times) + (t - min(mt)) * scale for t in mt], mb, color="black", lw=1, zorder=4,
                    label="measured" if scale == 1.0 else f"measured (time x{scale:.2g} to the predicted span)")
            top = max(top, max(mb))
        if measured.peak_bytes is not None:
            top = max(top, measured.peak_bytes)
            ax.axhline(measured.peak_bytes, color="black", ls="-.", lw=1, zorder=4,
                       label=f"measured peak {format_bytes(measured.peak_bytes)}")
    ax.set_ylabel("device memory")
    ax.set_ylim(0, top * 1.08 if top else 1)
    ax.set_xlim(0, end_s if end_s > 0 else 1)
    _round_ticks(ax, top * 1.08)
    ax.set_title(title)
    ax.grid(alpha=0.3, zorder=0)
    if trace is not None:  # beside the axes: the stack fills them
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    else:
        ax.legend(loc="lower right", fontsize="small", ncols=2)
    if host_ax is not None:
        hx, hb = zip(*[(0.0, 0), *host, (end_s, host[-1][1])], strict=True)
        host_ax.fill_between(hx, hb, step="post", color="#af7aa1", alpha=0.7, lw=0)
        host_ax.step(hx, hb, where="post", color="#6b4a66", lw=1)
        host_ax.set_ylim(0, max(hb) * 1.15)
        _round_ticks(host_ax, max(hb) * 1.15)
        host_ax.set_ylabel("host (pinned)")
        host_ax.grid(alpha=0.3)
        host_ax.set_xlabel("simulated time (s)")
        ax.tick_params(labelbottom=False)
    else:
        ax.set_xlabel("simulated time (s)")
    return _save(fig, path, dpi)


def frontier_png(path: str | Path, series: Mapping[str, Sequence[tuple[int, float | None]]], *,
                 keep_all_peak_bytes: int | None = None, title: str = "memory against overhead",
                 width_px: int = 1000, height_px: int = 600, dpi: int = 100) -> Path:
    """Write memory (budget, y) against predicted step-time overhead (x, %) for each solver: one line
    per ``series[solver] = [(budget_bytes, overhead or None), ...]``; infeasible points (None) are left
    out. Returns ``path``."""
    if not series:
        raise MemplanError("frontier plot: no solver series given")
    fig = _figure(width_px, height_px, dpi)
    ax = fig.add_subplot(1, 1, 1)
    plotted = 0
    markers = "os^Dv<>p"
    for i, (name, points) in enumerate(series.items()):
        pts = sorted((ov * 100.0, b) for b, ov in points if ov is not None)
        if pts:
            xs, ys = zip(*pts, strict=True)
            # distinct markers and thinning lines: solvers that agree stay visible under each other
            ax.plot(xs, ys, marker=markers[i % len(markers)], ms=7 - min(i, 4), lw=2.5 - 0.4 * min(i, 4),
                    label=name)
            plotted += 1
        else:
            ax.plot([], [], label=f"{name} (no feasible budget)")
    if keep_all_peak_bytes is not None:
        ax.axhline(keep_all_peak_bytes, color="0.5", ls="--", lw=1,
                   label=f"keep everything {format_bytes(keep_all_peak_bytes)}")
    ax.set_xlabel("predicted step-time overhead (%)")
    ax.set_ylabel("memory budget")
    _bytes_axis(ax)
    ax.set_title(title if plotted else f"{title} (no feasible point)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return _save(fig, path, dpi)
