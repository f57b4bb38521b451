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

from memplan.planner.core.graph import FusedStep, Graph

Placement = Literal["resident", "stream", "host"]
PLACEMENTS: tuple[str, ...] = ("resident", "stream", "host")
GRADS_TO_HOST = "gradients copied to the host"  # the reason of a host-stepped unit's gradient copy
GRADS_RELEASED = "gradients on the host: device copy freed"  # the reason of its device gradients' free
STATE_IN = "optimizer state streamed in"  # a streamed unit's state fetched inside backward (backward fusion)
STATE_BACK = "optimizer state copied back"  # and its copy back after its fused step
STATE_RELEASED = "optimizer state back on the host: device copy freed"
HOST_WAIT = "the next forward reads the host-stepped units' updated parameters"  # compute's wait for the host
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


def host_slot_bytes(graph: Graph, u: int) -> int:
    """A host-stepped unit's part of the host pool: its state's slot, then its gradients' and its parameters'
    host copies (each tensor aligned as a state tensor is)."""
    unit = graph.state_units[u]
    return (slot_bytes(unit.state_bytes, unit.state_tensors) + 2 * slot_bytes(unit.param_bytes, unit.params))


def host_state_bytes(graph: Graph, streamed: list[int], hosted: list[int] = ()) -> int:
    """The host pool that holds the streamed units' states and the host-stepped units' states, gradients and
    parameters: one buffer, pinned once at apply (so the bytes pinned are these, not the pinned allocator's
    power-of-two rounding of many requests)."""
    units = graph.state_units
    return (sum(slot_bytes(units[u].state_bytes, units[u].state_tensors) for u in streamed)
            + sum(host_slot_bytes(graph, u) for u in hosted))


def device_state_bytes(graph: Graph, streamed: list[int], hosted: list[int] = ()) -> int:
    """The streamed and host-stepped units' state bytes, which forward and backward run without."""
    return sum(graph.state_units[u].state_bytes for u in [*streamed, *hosted])


def unit_grads(graph: Graph) -> dict[int, FusedStep]:
    """State unit -> where backward completes its gradients and their bytes (the graph's ``fused_backward``,
    the same buckets, matched by module in order); units backward gives no gradient are absent."""
    by_module: dict[str, list[FusedStep]] = {}
    for f in graph.fused_backward:
        by_module.setdefault(f.module, []).append(f)
    out = {}
    for u, unit in enumerate(graph.state_units):
        left = by_module.get(unit.module)
        if left:
            out[u] = left.pop(0)
    return out


def host_refusal(graph: Graph, units: list[int]) -> str | None:
    """Why ``units`` cannot be stepped on the host with this graph (None: they can)."""
    if not units:
        return None
    if graph.host_optimizer_bytes_per_s is None:
        return ("the graph records no host optimizer rate (profiled before it was measured, or for an optimizer "
                "that does not run on CPU tensors): re-profile, or place the units' state resident or streamed")
    grads = unit_grads(graph)
    missing = [u for u in units if u not in grads]
    if missing:
        return (f"the graph does not record where backward completes the gradients of state unit {missing[0]} "
                f"({graph.state_units[missing[0]].module or 'the model'}): it cannot be stepped on the host")
    return None


class GradCopies:
    """Host-stepped units' gradients on their way to the host (the rule the lowering and the search graphs
    share): backward completes a unit at its ``after`` step, its gradients' copy is queued on the gradients'
    own copy stream, and the device copies of earlier units whose copies have ended by then are freed there."""

    def __init__(self, graph: Graph, hosted: list[int], bandwidth_bytes_per_s: float):
        grads = unit_grads(graph)
        rank = {id(f): n for n, f in enumerate(graph.fused_backward)}
        self.at: dict[int, list[int]] = {}  # backward step -> the units it completes, in completion order
        self.bytes: dict[int, int] = {}
        for u in sorted(hosted, key=lambda u: rank[id(grads[u])]):
            self.at.setdefault(grads[u].after, []).append(u)
            self.bytes[u] = grads[u].grad_bytes
        self.after = {u: grads[u].after for u in hosted}
        self.bw = bandwidth_bytes_per_s
        self.copy_free = 0.0
        self.pending: list[tuple[float, int]] = []  # (copy end, unit) awaiting its device free
        self.released: dict[int, int | None] = {}  # unit -> the unit at whose completion it was freed
        self.finish_wait = 0.0  # keep_all_grad_copies: the wait at optimizer.step()

    def complete(self, u: int, now: float) -> list[int]:
        """Unit ``u`` completed at ``now``: queue its copy; returns the units whose device gradients go now."""
        end = max(self.copy_free, now) + self.bytes[u] / self.bw
        self.copy_free = end
        gone = [v for e, v in self.pending if e <= now]
        self.pending = [(e, v) for e, v in self.pending if e > now] + [(end, u)]
        for v in gone:
            self.released[v] = u
        return gone

    def finish(self, now: float) -> tuple[float, list[int]]:
        """At ``optimizer.step()``: how long compute waits for the last copies, and the units freed then."""
        if not self.pending:
            return 0.0, []
        wait = max(0.0, max(e for e, _ in self.pending) - now)
        gone = [v for _, v in self.pending]
        self.pending = []
        for v in gone:
            self.released[v] = None
        return wait, gone


def keep_all_grad_copies(graph: Graph, hosted: list[int], bandwidth_bytes_per_s: float) -> GradCopies:
    """:class:`GradCopies` over keeping every activation: forward's ops, then backward's steps, on the compute
    clock (no replay, no wait: the least time any plan takes between two backward steps)."""
    copies = GradCopies(graph, hosted, bandwidth_bytes_per_s)
    now = sum(op.time_s for op in graph.ops)
    for op in reversed(graph.ops):
        now += op.backward_time_s
        for u in copies.at.get(op.id, ()):
            copies.complete(u, now)
    copies.finish_wait, _ = copies.finish(now)
    return copies


def in_backward_stream(graph: Graph, streamed: list[int], hosted: list[int] = ()) -> list[tuple[int, int, str]]:
    """Where backward fusion's streaming of ``streamed`` allocates and frees their states, as
    ``(backward step, bytes, "alloc" | "free")`` in the lowering's order: the first fused bucket's step fetches
    the first streamed unit (in completion order); each streamed unit's step frees the previous one's state
    (its copy back waited for) and fetches the next; the last is freed when backward ends (backward step 0:
    the last one that runs). For the search graphs: an allocation charged from the start of its step, a free
    at its end (the lowering's come after the step and before the bucket's step), never under."""
    grads = unit_grads(graph)
    rank = {id(f): n for n, f in enumerate(graph.fused_backward)}
    order = sorted((u for u in streamed if u in grads), key=lambda u: rank[id(grads[u])])
    off = {id(grads[u]) for u in hosted if u in grads}  # not fused: stepped on the host
    first = next((f for f in graph.fused_backward if id(f) not in off), None)
    if not order or first is None:
        return []
    units = graph.state_units
    out = [(first.after, units[order[0]].state_bytes, "alloc")]
    for n, u in enumerate(order):
        at = grads[u].after
        if n:
            out.append((at, units[order[n - 1]].state_bytes, "free"))
        if n + 1 < len(order):
            out.append((at, units[order[n + 1]].state_bytes, "alloc"))
    out.append((0, units[order[-1]].state_bytes, "free"))
    return out


def host_step_s(graph: Graph, u: int) -> float:
    """The host's optimizer time for unit ``u``: a call's cost and its parameter bytes at the graph's
    measured host rate."""
    return graph.host_optimizer_call_s + graph.state_units[u].param_bytes / (graph.host_optimizer_bytes_per_s
                                                                             or float("inf"))


def _share(graph: Graph, units: list[int]) -> float:
    total = sum(u.param_bytes for u in graph.state_units)
    return sum(graph.state_units[u].param_bytes for u in units) / total if total else 0.0


def optimizer_phase(graph: Graph, streamed: list[int], bandwidth_bytes_per_s: float,
                    step_bytes: int, step_s: float, hosted: list[int] = (),
                    resident_bytes: int | None = None) -> tuple[list[PhaseEvent], float]:
    """The optimizer step with ``streamed`` units' states streamed (in that order) and ``hosted`` units
    stepped on the host, as events, and the time the copy stream is busy until (relative to the phase's
    start). ``step_bytes`` / ``step_s``: the whole device step's transient and time, shared among the
    device's updates by parameter bytes (a host-stepped unit's share is not the device's).

    Host-stepped units (their gradients are on the host when the phase starts): the host steps each in
    turn (``host`` events: host time, not the compute stream's), starting with the phase, beside the device's
    updates; each unit's updated parameters are copied back on the copy stream after its host step and
    after the streamed units' copies (the executor queues them last); compute then waits until the last
    has landed (the next forward reads them).

    ``resident_bytes``: the resident units' update's transient where it is not their share of ``step_bytes``
    (under backward fusion they were stepped inside backward: what is left of the step's transient)."""
    units = graph.state_units
    chosen = set(streamed) | set(hosted)
    resident = [u for u in range(len(units)) if u not in chosen]
    events: list[PhaseEvent] = []
    if resident or not chosen:
        share = _share(graph, resident) if chosen else 1.0
        held = step_bytes if not chosen else min(step_bytes, math.ceil(step_bytes * share) + CALL_BYTES)
        if resident_bytes is not None:
            held = resident_bytes
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
    if hosted:
        host_now = 0.0
        for u in hosted:
            t = host_step_s(graph, u)
            host_now += t
            events.append(PhaseEvent("host", u, f"optimizer step of {units[u].module or 'the model'} on the host",
                                     duration_s=t))
            b = units[u].param_bytes
            copy_free = max(copy_free, host_now) + b / bandwidth_bytes_per_s
            events.append(PhaseEvent("h2d", u, "its updated parameters copied back to the device", copy_bytes=b))
        events.append(PhaseEvent("wait", None, HOST_WAIT, duration_s=max(0.0, copy_free - now)))
    return events, copy_free


def phase_extra(events: list[PhaseEvent]) -> tuple[int, float]:
    """The most the phase holds beyond what is live when it starts, and its time."""
    live = peak = 0
    seconds = 0.0
    for e in events:
        live += e.alloc_bytes
        peak = max(peak, live + e.workspace_bytes)
        live -= e.free_bytes
        if e.kind != "host":  # the host's time, beside the compute stream's
            seconds += e.duration_s
    return peak, seconds


def states_search_graph(graph: Graph, streamed: list[int], bandwidth_bytes_per_s: float | None = None,
                        hosted: list[int] = (), fuse: str | None = None) -> Graph:
    """The graph the activation searches run on for a placement of the model states: forward and backward
    without the moved units' state (``fixed.optimizer_state_bytes`` less it), and the optimizer step's
    transient and time those of the phase. With only streamed units, a plan's peak and step time here are
    exactly its peak and time with the placement (tests/test_states.py); same fingerprint, so its plans are
    the graph's.

    Host-stepped units' gradients leave the device in backward where their copies have ended on the clock;
    here they are freed where keeping every activation frees them (the backward step of a later unit's
    completion, else the last one), and the optimizer step waits as long as it waits there. A plan takes
    at least keep-all's time between two backward steps (a replay or a wait only adds), so its copies end
    no later, relative to the steps, than keep-all's: its peak and time here are at least its own.

    ``fuse="backward"``: the step the executor runs with backward fusion, where the moved units are not fused
    (their updates run in the phase) and the others are: the graph's ``fused_backward`` keeps the others'
    buckets, and its optimizer step's transient and time are such that ``simulate(..., fuse="backward")`` of
    a plan here charges the phase (``fixed.optimizer_step_bytes`` less those buckets' shares is the phase's
    transient; fusion's own cost is added by the simulator, as the executor's schedule adds it)."""
    if not streamed and not hosted:
        return graph
    bw = bandwidth_bytes_per_s or graph.host_bandwidth_bytes_per_s
    total = graph.fixed.optimizer_step_bytes
    left = max(0, total - sum(f.step_bytes for f in graph.fused_backward)) if fuse == "backward" else None
    # backward fusion steps the streamed units inside backward: the phase is the host-stepped units'
    events, _ = optimizer_phase(graph, [] if fuse == "backward" else streamed, bw, total, graph.optimizer_time_s,
                                hosted, resident_bytes=left)
    extra, seconds = phase_extra(events)
    update: dict = {"fixed": graph.fixed.model_copy(), "optimizer_time_s": seconds}
    if hosted:
        keep = keep_all_grad_copies(graph, hosted, bw)
        ops = list(graph.ops)
        for u, v in keep.released.items():
            at = keep.after[v] if v is not None else 0
            op = ops[at]
            ops[at] = op.model_copy(update={"backward_grad_free_bytes": op.backward_grad_free_bytes
                                            + keep.bytes[u]})
        update["ops"] = ops
        update["optimizer_time_s"] = seconds + keep.finish_wait
    fused_kept: list[FusedStep] = []
    if fuse == "backward":
        grads = unit_grads(graph)
        moved = {id(grads[u]) for u in hosted if u in grads}
        fused_kept = [f for f in graph.fused_backward if id(f) not in moved]
        update["fused_backward"] = fused_kept
        ops = update.get("ops") or list(graph.ops)
        for at, nbytes, kind in in_backward_stream(graph, streamed, hosted):
            field = "backward_grad_alloc_bytes" if kind == "alloc" else "backward_grad_free_bytes"
            ops[at] = ops[at].model_copy(update={field: getattr(ops[at], field) + nbytes})
        update["ops"] = ops
    search = graph.model_copy(update=update)
    search.fixed.optimizer_state_bytes -= device_state_bytes(graph, streamed, hosted)
    search.fixed.optimizer_step_bytes = extra + sum(f.step_bytes for f in fused_kept)
    # a shallow copy: the views derived from the structure (fingerprint, static facts) are the graph's; a
    # memoised search of its plans' reports is not
    search.__dict__.pop("_memplan_multilevel", None)
    return search


def stream_order(graph: Graph) -> list[int]:
    """The order in which a search moves units' states off the device: most state bytes first (each byte
    moved costs the same link time twice; fewer, larger units free the bytes in fewer moves), then the
    optimizer's order."""
    return sorted(range(len(graph.state_units)), key=lambda u: (-graph.state_units[u].state_bytes, u))
