"""Rich tables of a simulator report and of a run report (predicted against measured)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from memplan.api.cli.base import out
from memplan.planner.core.units import format_bytes


def report_dict(report: Any) -> dict[str, Any]:
    d = report.model_dump(exclude={"timeline"})
    return d


def print_report(report: Any, title: str, budget: int | None = None) -> None:
    t = Table(title=title, show_header=False)
    if budget is not None:
        t.add_row("budget", format_bytes(budget))
    t.add_row("peak", f"{format_bytes(report.peak_bytes)}  (at {report.peak_note})")
    t.add_row("step time", f"{report.time_s * 1e3:.2f} ms")
    t.add_row("  recompute", f"{report.recompute_time_s * 1e3:.2f} ms")
    t.add_row("  exposed transfers", f"{report.exposed_transfer_s * 1e3:.2f} ms")
    t.add_row("fixed memory", format_bytes(report.fixed_bytes))
    t.add_row("host memory (offload)", format_bytes(report.host_peak_bytes))
    out.print(t)


def print_run(r: Any) -> None:
    def pct(predicted: float, measured: float | None) -> str:
        return f"{(predicted / measured - 1) * 100:+.1f}%" if measured else "-"

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.1f} ms"

    t = Table(title=f"{r.workload} on {r.device}: {r.solver} plan ({r.status}), {r.decisions['recompute']} "
                    f"recomputed, {r.decisions['offload']} offloaded"
                    + (f", fused {r.fuse}" if r.fuse else "") + f"; median of {r.steps} steps")
    for c in ("", "predicted", "measured", "predicted vs measured"):
        t.add_column(c, justify="left" if not c else "right")
    t.add_row("peak under the plan", format_bytes(r.predicted_peak_bytes), format_bytes(r.measured_peak_bytes),
              pct(r.predicted_peak_bytes, r.measured_peak_bytes))
    t.add_row("step time under the plan", ms(r.predicted_step_s), ms(r.measured_step_s),
              pct(r.predicted_step_s, r.measured_step_s))
    kp = r.keep_all_measured_peak_bytes
    t.add_row("peak keeping everything", format_bytes(r.keep_all_predicted_peak_bytes),
              format_bytes(kp) if kp is not None else "-", pct(r.keep_all_predicted_peak_bytes, kp))
    t.add_row("step time keeping everything", ms(r.keep_all_predicted_step_s), ms(r.keep_all_measured_step_s),
              pct(r.keep_all_predicted_step_s, r.keep_all_measured_step_s))
    mo = r.measured_overhead
    t.add_row("step overhead vs keep-all", f"{r.predicted_overhead * 100:+.1f}%",
              f"{mo * 100:+.1f}%" if mo is not None else "-",
              f"{(r.predicted_overhead - mo) * 100:+.1f} points" if mo is not None else "-")
    out.print(t)
    if r.budget_bytes is not None:
        within = r.within_budget()
        out.print(f"budget {format_bytes(r.budget_bytes)}: measured peak is "
                  f"{r.measured_peak_bytes / r.budget_bytes * 100:.1f}% of it "
                  + ("[green](within budget + 5%)[/green]" if within else "[red](over budget + 5%)[/red]"))
    if r.profile_peak_bytes is not None:
        out.print(f"profiling peak {format_bytes(r.profile_peak_bytes)} (allocator); keeping everything would "
                  f"need {format_bytes(r.keep_all_predicted_peak_bytes)} (predicted"
                  + (")" if kp else ", never allocated)"))
    if kp and r.keep_all_measured_step_s:
        out.print(f"measured: {(1 - r.measured_peak_bytes / kp) * 100:.1f}% less peak memory than keeping "
                  f"everything, at {(r.measured_step_s / r.keep_all_measured_step_s - 1) * 100:+.1f}% step time")
