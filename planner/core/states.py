"""Model states a plan places: each state unit's optimizer state resident on the device, or kept in the
pinned host pool between steps and streamed through the device for its update (docs/model.md, "Model
states"). Torch-free: the cost model's part, which the lowering (planner/core/schedule.py) emits as events
and the searches (solvers/core.py) read as a graph (:func:`states_search_graph`); the runtime is
executor/states.py.

**Units** are :attr:`Graph.state_units`: a module's own parameters that the optimizer steps, the grain of
optimizer fusion's buckets (the profiler records each unit's parameter and state bytes).

**Streaming** (``stream``): between steps the unit's state is in the host pool (one pinned buffer, a slot
per unit, allocated once: its bytes are the plan's, not the pinned allocator's rounded ones). Forward and
backward run without it. At ``optimizer.step()`` the resident units are stepped first, all at once; then
each streamed unit in turn, with at most two units' states on the device:

    copy unit 0's state in
    for each streamed unit i:
        compute waits for unit i's copy in
        unit i+1's buffers are allocated and its copy in queued (it runs during unit i's update)
        unit i is updated on the device (the user's optimizer, its groups narrowed to the unit)
        its state is copied back to its host slot; compute waits for that copy; its device buffers go

The copy stream is the activations' (one stream, first in first out, at the plan's bandwidth). A unit's
update holds its share of the optimizer's transient and takes its share of the optimizer's time, both by
parameter bytes (the supported optimizers' work and temporaries are per parameter, elementwise), rounded
up, plus ``CALL_BYTES`` for a call's scalar temporaries: never under what the call holds (tests/test_states.py:
within 0.01% above, on GPT-2 and a ResNet).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

from memplan.planner.core.graph import Graph

Placement = Literal["resident", "stream"]
PLACEMENTS: tuple[str, ...] = ("resident", "stream")
HOST_SLOT_ALIGN = 512  # each unit's slot in the host pool starts at a multiple of this
STATE_ALIGN = 16  # each state tensor in a slot starts at a multiple of this (any dtype's alignment)
# what one narrowed update call holds beyond its share of the step's transient: the optimizer's scalar
# temporaries (7-12 B measured on a CPU; on CUDA they are host scalars), so that a share is never under
CALL_BYTES = 64


class PhaseEvent(NamedTuple):
    """One event of the optimizer phase, in :class:`memplan.planner.core.schedule.ScheduleEvent`'s terms:
    ``kind`` (optimizer, h2d, wait, d2h, free), ``unit`` (None: the resident units' update) and its costs."""

    kind: str
    unit: int | None
    reason: str
    alloc_bytes: int = 0
    workspace_bytes: int = 0
    free_bytes: int = 0
    duration_s: float = 0.0
    copy_bytes: int = 0


def slot_bytes(nbytes: int, tensors: int) -> int:
    """A unit's slot in the host pool: its state's bytes, each of its ``tensors`` aligned, rounded up to the
    slot alignment."""
    n = nbytes + STATE_ALIGN * tensors
    return -(-n // HOST_SLOT_ALIGN) * HOST_SLOT_ALIGN


def host_state_bytes(graph: Graph, streamed: list[int]) -> int:
    """The host pool that holds the streamed units' states: one buffer, pinned once at apply (so the bytes
    pinned are these, not the pinned allocator's power-of-two rounding of many requests)."""
    units = graph.state_units
    return sum(slot_bytes(units[u].state_bytes, units[u].state_tensors) for u in streamed)


def device_state_bytes(graph: Graph, streamed: list[int]) -> int:
    """The streamed units' state bytes, which forward and backward run without."""
    return sum(graph.state_units[u].state_bytes for u in streamed)


def _share(graph: Graph, units: list[int]) -> float:
    total = sum(u.param_bytes for u in graph.state_units)
    return sum(graph.state_units[u].param_bytes for u in units) / total if total else 0.0


def optimizer_phase(graph: Graph, streamed: list[int], bandwidth_bytes_per_s: float,
                    step_bytes: int, step_s: float) -> tuple[list[PhaseEvent], float]:
    """The optimizer step with ``streamed`` units' states streamed (in that order), as events, and the time
    the copy stream is busy until (relative to the phase's start). ``step_bytes`` / ``step_s``: the whole
    step's transient and time, shared among the updates by parameter bytes."""
    units = graph.state_units
    chosen = set(streamed)
    resident = [u for u in range(len(units)) if u not in chosen]
    events: list[PhaseEvent] = []
    if resident or not streamed:
        share = _share(graph, resident) if streamed else 1.0
        held = step_bytes if not streamed else min(step_bytes, math.ceil(step_bytes * share) + CALL_BYTES)
        events.append(PhaseEvent("optimizer", None, "optimizer step of the resident units",
                                 workspace_bytes=held, duration_s=step_s * share))
    now = sum(e.duration_s for e in events)
    copy_free = now
    ready: dict[int, float] = {}

    def fetch(u: int) -> None:
        nonlocal copy_free
        b = units[u].state_bytes
        copy_free = ready[u] = max(copy_free, now) + b / bandwidth_bytes_per_s
        events.append(PhaseEvent("h2d", u, f"optimizer state of {units[u].module or 'the model'} streamed in",
                                 alloc_bytes=b, copy_bytes=b))

    if streamed:
        fetch(streamed[0])
    for i, u in enumerate(streamed):
        exposed = max(0.0, ready[u] - now)
        now += exposed
        events.append(PhaseEvent("wait", u, "its update reads the state streamed in", duration_s=exposed))
        if i + 1 < len(streamed):
            fetch(streamed[i + 1])
        share = _share(graph, [u])
        t = step_s * share
        events.append(PhaseEvent("optimizer", u, f"optimizer step of {units[u].module or 'the model'} (streamed)",
                                 workspace_bytes=min(step_bytes, math.ceil(step_bytes * share) + CALL_BYTES),
                                 duration_s=t))
        now += t
        b = units[u].state_bytes
        copy_free = max(copy_free, now) + b / bandwidth_bytes_per_s
        events.append(PhaseEvent("d2h", u, "its updated state copied back to the host pool", copy_bytes=b))
        exposed = max(0.0, copy_free - now)
        now += exposed
        events.append(PhaseEvent("wait", u, "its device buffers are freed once the copy back has ended",
                                 duration_s=exposed))
        events.append(PhaseEvent("free", u, "streamed state leaves the device", free_bytes=b))
    return events, copy_free


def phase_extra(events: list[PhaseEvent]) -> tuple[int, float]:
    """The most the phase holds beyond what is live when it starts, and its time."""
    live = peak = 0
    seconds = 0.0
    for e in events:
        live += e.alloc_bytes
        peak = max(peak, live + e.workspace_bytes)
        live -= e.free_bytes
        seconds += e.duration_s
    return peak, seconds


def states_search_graph(graph: Graph, streamed: list[int], bandwidth_bytes_per_s: float | None = None) -> Graph:
    """The graph the activation searches run on for a placement of the model states: forward and backward
    without the streamed units' state (``fixed.optimizer_state_bytes`` less it), and the optimizer step's
    transient and time those of the streaming phase. A plan's peak and step time here are exactly its peak
    and time with the placement (tests/test_states.py); same fingerprint, so its plans are the graph's."""
    if not streamed:
        return graph
    bw = bandwidth_bytes_per_s or graph.host_bandwidth_bytes_per_s
    events, _ = optimizer_phase(graph, streamed, bw, graph.fixed.optimizer_step_bytes, graph.optimizer_time_s)
    extra, seconds = phase_extra(events)
    search = graph.model_copy(update={"fixed": graph.fixed.model_copy(), "optimizer_time_s": seconds})
    search.fixed.optimizer_state_bytes -= device_state_bytes(graph, streamed)
    search.fixed.optimizer_step_bytes = extra
    # a shallow copy: the views derived from the structure (fingerprint, static facts) are the graph's; a
    # memoised search of its plans' reports is not
    search.__dict__.pop("_memplan_multilevel", None)
    return search


def stream_order(graph: Graph) -> list[int]:
    """The order in which a search moves units' states off the device: most state bytes first (each byte
    moved costs the same link time twice; fewer, larger units free the bytes in fewer moves), then the
    optimizer's order."""
    return sorted(range(len(graph.state_units)), key=lambda u: (-graph.state_units[u].state_bytes, u))
