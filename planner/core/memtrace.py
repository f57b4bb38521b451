"""A schedule's device memory as allocations and frees of blocks that say what holds them (torch-free).

    trace = memory_trace(graph, schedule(graph, plan))
    trace.events            # alloc / free of a Block (bytes, category, what memplan decided for it), in order
    trace.entries           # per entry of simulate(graph, plan).timeline: where its events are in ``events``
    trace.host              # (time_s, host bytes held) where the plan offloads

The simulator (:func:`memplan.planner.core.simulator.score`) sums each schedule event's bytes; this module
gives the same bytes an owner: every output of a forward op is a block of its own (an activation kept, freed
after its last forward use, rebuilt in backward, or offloaded), every replayed op's outputs a replay
transient, a copy back a fetched buffer, each step's workspace a block held while it runs, each backward
step's gradients a block (freed, as the simulator frees them, from the most recent gradient blocks: a
backward step frees the gradients of its op's outputs, made by the steps just before it), and the fixed
memory one block per parameter, buffer and input, with the optimizer's state and anything else. The running
sum of the events is the simulator's live memory, event for event: :attr:`MemoryTrace.entries` says which
events make each entry of its timeline, and tests hold the two to the byte. The plot of ``memplan show``
and the memory snapshot it writes (:mod:`memplan.planner.core.snapshot`) both read this trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action
from memplan.planner.core.schedule import Schedule, static_facts
from memplan.planner.core.states import GRADS_RELEASED, STATE_RELEASED

#: what holds a block, in the order the plot stacks them (bottom first)
CATEGORIES = ("parameter", "buffer", "input", "optimizer state", "other", "gradient", "activation",
              "offloaded", "fetched", "replayed", "workspace", "unknown")


@dataclass(frozen=True)
class Block:
    """One allocation: ``bytes``, ``category`` (one of :data:`CATEGORIES`), ``note`` (what memplan decided
    for it, in words: the snapshot's ``user_metadata``), the graph ``op`` whose event allocated it (None for
    the fixed memory and the optimizer step), its ``phase`` (start, forward, backward, optimizer) and the
    ``tensor`` it holds where it holds one."""

    id: int
    bytes: int
    category: str
    note: str
    op: int | None = None
    phase: str = "start"
    tensor: int | None = None


@dataclass(frozen=True)
class MemoryEvent:
    """``action`` ("alloc" or "free") of ``block`` at simulated time ``time_s``."""

    action: Literal["alloc", "free"]
    block: Block
    time_s: float


@dataclass(frozen=True)
class Entry:
    """The events that make one entry of the simulator's timeline: ``events[start:end]``; those before
    ``body`` are frees that happened between the previous entry and this one (the timeline counts them in
    neither entry's live memory after it, and in this entry's memory during it)."""

    start: int
    body: int
    end: int


@dataclass
class MemoryTrace:
    """:func:`memory_trace`'s result; ``fixed`` blocks are allocated by the first events (the ``start``
    entry); ``host`` is ``(time_s, host bytes)`` after each change of the offloaded copies' host memory."""

    events: list[MemoryEvent] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)
    host: list[tuple[float, int]] = field(default_factory=list)
    end_s: float = 0.0

    def live_bytes(self) -> list[int]:
        """The running sum after each event."""
        out, live = [], 0
        for e in self.events:
            live += e.block.bytes if e.action == "alloc" else -e.block.bytes
            out.append(live)
        return out

    def peak_bytes(self) -> int:
        return max(self.live_bytes(), default=0)

    def blocks(self) -> list[Block]:
        return [e.block for e in self.events if e.action == "alloc"]


def _decision_note(graph: Graph, t: int, action: Action | None, saved: bool) -> tuple[str, str]:
    """(category, note) of the block a forward op allocates for tensor ``t``."""
    info = graph.tensors[t]
    savers = sorted(graph.savers.get(t, ()))
    readers = f"op{'s' if len(savers) > 1 else ''} {', '.join(map(str, savers[:4]))}{', ...' if len(savers) > 4 else ''}"
    if info.held_by_caller:
        return "activation", "held by the caller to the end of the step (an output, the loss)"
    if not saved:
        return "activation", "not saved for backward: freed after its last forward use"
    if action == Action.OFFLOAD:
        return "offloaded", f"offloaded: copied to host, its device copy released once the copy ends; fetched back for the backward of {readers}"
    if action == Action.RECOMPUTE:
        return "activation", f"recomputed: freed after its last forward use, rebuilt for the backward of {readers}"
    if action == Action.RECOMPUTE_EACH:
        return "activation", f"recomputed at each use: freed after its last forward use, rebuilt for the backward of {readers}"
    return "activation", f"kept for the backward of {readers}"


def memory_trace(graph: Graph, sched: Schedule, actions: dict[int, Action] | None = None) -> MemoryTrace:
    """The blocks of ``sched`` (lowered on ``graph``), walked as :func:`memplan.planner.core.simulator.score`
    walks it: the same live memory after every event, the same peak, the same timeline entries (one
    :class:`Entry` per entry of ``score(graph, sched).timeline``, in order). ``actions``: the plan's
    (``plan.actions()``) for the notes (None: every activation reads as kept).

    Raises :class:`MemplanError` for a schedule of another graph or one whose events free a tensor that
    they never allocated (a hand-edited schedule)."""
    if sched.graph_fingerprint != graph.fingerprint:
        raise MemplanError(f"schedule was lowered for graph {sched.graph_fingerprint}, not {graph.fingerprint} "
                           f"({graph.name})")
    actions = actions or {}
    st = static_facts(graph)
    ops, tensors = graph.ops, graph.tensors
    trace = MemoryTrace()
    events = trace.events
    ids = iter(range(1 << 62))
    now = 0.0

    def alloc(nbytes: int, category: str, note: str, *, op: int | None = None, phase: str = "start",
              tensor: int | None = None) -> Block | None:
        if nbytes <= 0:
            return None
        b = Block(next(ids), nbytes, category, note, op, phase, tensor)
        events.append(MemoryEvent("alloc", b, now))
        return b

    def free(b: Block) -> None:
        events.append(MemoryEvent("free", b, now))

    # ---- the fixed memory: one block per tensor where the graph's tensors account for its figure
    fixed = graph.fixed
    for kind, category, total in (("param", "parameter", fixed.params_bytes), ("buffer", "buffer", fixed.buffers_bytes),
                                  ("input", "input", fixed.inputs_bytes)):
        mine = [t for t in tensors if t.kind == kind and t.bytes > 0]
        if sum(t.bytes for t in mine) == total:
            for t in mine:
                alloc(t.bytes, category, f"{category} (tensor {t.id}, {t.dtype} {list(t.shape)})", tensor=t.id)
        else:
            alloc(total, category, f"{category}s")
    # streamed optimizer state (planner/core/states.py) starts the step in the host pool
    alloc(fixed.optimizer_state_bytes - sched.state_off_device_bytes, "optimizer state",
          "the optimizer's state (moments, step counts)"
          + (f", less the {len(sched.streamed)} streamed units' (in the host pool)" if sched.streamed else ""))
    alloc(fixed.other_bytes, "other", "live at the start of the step beyond the model's tensors (library workspaces)")
    trace.entries.append(Entry(0, 0, len(events)))

    resident: dict[int, Block] = {}   # tensor -> its device block
    scratch: dict[int, list[Block]] = {}  # tensor -> scratch copies a replay made of it
    grads: list[Block] = []           # live gradient blocks, oldest first
    scratch_frees = {(e.at, e.tensor) for e in sched.events if e.kind == "free" and e.reason.startswith("scratch copy")}
    host = sched.host_state_bytes
    if host:
        trace.host.append((0.0, host))
    streamed: dict[int, Block] = {}   # state unit -> its state's device block while it is streamed in
    in_backward: list[Block] = []     # states streamed in for backward fusion's steps, oldest first

    def release_gradients(nbytes: int, phase: str, at: int | None) -> None:
        while nbytes > 0:
            if not grads:
                raise MemplanError(f"the schedule frees {nbytes} bytes of gradients at {phase} step {at} that it "
                                   f"never allocated")
            b = grads.pop()
            free(b)
            if b.bytes > nbytes:  # part of a block: the rest stays, as a block of its own
                rest = alloc(b.bytes - nbytes, "gradient", b.note, op=b.op, phase=b.phase)
                grads.append(rest)
            nbytes -= b.bytes

    def step_blocks(ev, category: str, outputs: list[tuple[int, str, str, bool]]) -> None:
        """A step's allocations: its outputs' blocks, any rest of its ``alloc_bytes`` as one block."""
        given = 0
        for t, cat, note, is_scratch in outputs:
            b = alloc(tensors[t].bytes, cat, note, op=ev.at if ev.kind != "recompute" else ev.ops[0],
                      phase=ev.phase, tensor=t)
            if b is None:
                continue
            given += b.bytes
            (scratch.setdefault(t, []).append(b) if is_scratch else resident.__setitem__(t, b))
        if ev.alloc_bytes != given:
            if ev.alloc_bytes < given:
                raise MemplanError(f"{ev.kind} event at {ev.at} allocates {ev.alloc_bytes} bytes, less than its "
                                   f"outputs' {given}")
            alloc(ev.alloc_bytes - given, category, f"allocated by {ev.kind} {ev.at} ({ev.reason})", op=ev.at,
                  phase=ev.phase)

    open_key: tuple | None = None
    pending_start: int | None = None  # index where the frees before the next entry began
    entry_open: tuple[int, int] | None = None

    def close() -> None:
        nonlocal entry_open
        if entry_open is not None:
            trace.entries.append(Entry(entry_open[0], entry_open[1], len(events)))
            entry_open = None

    def open_entry() -> None:
        nonlocal entry_open, pending_start
        start = pending_start if pending_start is not None else len(events)
        entry_open = (start, len(events))
        pending_start = None

    for ev in sched.events:
        kind = ev.kind
        if kind == "free":
            if open_key is not None and (ev.phase, ev.at) != open_key:
                close()
                open_key = None
            if entry_open is None and pending_start is None:
                pending_start = len(events)
            t = ev.tensor
            if t is None and ev.reason == GRADS_RELEASED:  # a host-stepped unit's gradients, copied to the host
                release_gradients(ev.free_bytes, ev.phase, ev.at)
            elif t is None and ev.reason == STATE_RELEASED and in_backward:  # streamed inside backward
                block = in_backward.pop(0)
                if block is not None:
                    free(block)
            elif t is None and ev.phase == "optimizer" and ev.at in streamed:  # a streamed unit's state leaves
                block = streamed.pop(ev.at)
                if block is not None:
                    free(block)
            elif (ev.at, t) in scratch_frees and ev.reason.startswith("scratch copy") and scratch.get(t):
                free(scratch[t].pop(0))
            elif t in resident:
                free(resident.pop(t))
            else:
                raise MemplanError(f"the schedule frees tensor {t} at {ev.phase} step {ev.at}, which is not on the device")
            if ev.host_bytes:
                host += ev.host_bytes
                trace.host.append((now, host))
            continue
        if kind == "d2h":
            host += ev.host_bytes
            trace.host.append((now, host))
            continue
        if open_key is not None:
            close()
            open_key = None
        if kind in ("compute", "recompute", "backward", "optimizer"):
            open_entry()
            if kind == "compute":
                op = ops[ev.at]
                outs = [(t, *_decision_note(graph, t, actions.get(t), st.saved[t]), False)
                        for t in op.outputs if t not in resident]
                step_blocks(ev, "activation", outs)
            elif kind == "recompute":
                p = ev.ops[0]
                outs = []
                for t in ops[p].outputs:
                    if (ev.at, t) in scratch_frees:
                        outs.append((t, "replayed", f"scratch copy of tensor {t} for the replay of tensor {ev.tensor} "
                                                    f"(backward of op {ev.at})", True))
                    elif t not in resident:
                        way = "" if t == ev.tensor else f", on the way to tensor {ev.tensor}"
                        outs.append((t, "replayed", f"recomputed by op {p} for the backward of op {ev.at}{way}",
                                     False))
                step_blocks(ev, "replayed", outs)
            elif kind == "backward":
                b = alloc(ev.alloc_bytes, "gradient", f"gradients made by the backward of op {ev.at} "
                          f"({ops[ev.at].name}{', ' + ops[ev.at].module if ops[ev.at].module else ''})",
                          op=ev.at, phase="backward")
                if b is not None:
                    grads.append(b)
            else:  # the optimizer step, a fused bucket's, or forward fusion's held gradients
                b = alloc(ev.alloc_bytes, "gradient", ev.reason, op=ev.at, phase=ev.phase)
                if b is not None:
                    grads.append(b)
            ws = alloc(ev.workspace_bytes, "workspace",
                       ("optimizer.step()'s transient" if kind == "optimizer" and ev.phase == "optimizer"
                        else f"workspace of {ev.kind} {ev.at} ({ev.reason})"),
                       op=ev.at, phase=ev.phase)
            now += ev.duration_s
            if ws is not None:
                free(ws)
            if ev.free_bytes:
                release_gradients(ev.free_bytes, ev.phase, ev.at)
            if kind == "optimizer":
                close()  # the simulator closes an optimizer entry at once
            else:
                open_key = (ev.phase, ev.at)
        elif kind == "h2d" and ev.tensor is None and ev.phase == "backward":  # backward fusion's streamed state
            open_entry()
            in_backward.append(alloc(ev.alloc_bytes, "optimizer state", f"{ev.reason}, for its update inside "
                                     f"backward", op=ev.at, phase="backward"))
            close()
        elif kind == "h2d" and ev.tensor is None and not ev.alloc_bytes:
            open_entry()  # a host-stepped unit's parameters, copied back into their device storage
            close()
        elif kind == "h2d" and ev.tensor is None:  # a streamed unit's optimizer state, copied in
            open_entry()
            unit = graph.state_units[ev.at].module or "the model"
            streamed[ev.at] = alloc(ev.alloc_bytes, "optimizer state", f"{unit}'s optimizer state, streamed in "
                                    f"for its update", phase="optimizer")
            close()
        elif kind == "h2d":
            open_entry()
            t = ev.tensor
            resident[t] = alloc(ev.alloc_bytes, "fetched", f"offloaded tensor {t}, fetched back at backward step "
                                f"{ev.at} ({ev.reason})", op=ev.at, phase="backward", tensor=t)
            close()
        elif kind == "wait":
            if ev.duration_s > 0:
                open_entry()
                close()
                now += ev.duration_s
        elif kind == "watch":
            now += ev.duration_s
    close()
    if sched.streamed or sched.hosted:  # the simulator's closing entry: the last unit's state back in the host pool
        open_entry()
        close()
    trace.end_s = now
    return trace
