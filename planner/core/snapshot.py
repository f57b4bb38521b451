"""PyTorch memory snapshots (the format of ``torch.cuda.memory._snapshot()``) of a predicted step and of a
step measured on a CPU, written so that they open at pytorch.org/memory_viz and with ``python -m
torch.cuda._memory_viz trace_plot FILE -o out.html`` (torch-free: plain dicts, lists, strings and numbers).

    snap = predicted_snapshot(graph, memory_trace(graph, schedule(graph, plan), plan.actions()))
    summary = write_snapshot("predicted.pickle", snap)

A snapshot is a dict with ``segments`` (per segment: ``device``, ``address``, ``total_size``, ``stream``
and ``blocks`` tiling it, each ``size``, ``state``, ``requested_size``, ``frames``) and ``device_traces``
(per device, the events ``alloc`` / ``free_requested`` / ``free_completed`` with ``addr``, ``size``,
``stream``, ``time_us`` and ``frames``). memplan's events also carry ``category`` (what holds the block:
:data:`memplan.planner.core.memtrace.CATEGORIES`; the viewer colours the timeline by it) and
``user_metadata`` (what memplan decided for the block, shown on hover). Frames name the ATen op (as a
frame's name), the module that ran it (as its file) and the op's id in the graph (as its line).

What the viewer needs, and this module keeps to: pickle protocol 4 (its unpickler refuses 5,
pytorch/pytorch#183842), no ``bytes`` objects, and an ``'unknown'`` category among the categories used
(its code appends one when it is missing and fails doing so): the trace's last event, the ``snapshot``
action PyTorch's own traces end with, carries it. The viewer draws only the 15,000 largest allocations
(pytorch/pytorch#158364) and merges the rest into one band: :class:`SnapshotSummary` says how many and
how large they are.
"""

from __future__ import annotations

import bisect
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.memtrace import Block, MemoryTrace

#: the viewer's unpickler reads protocols 2 to 4 (pytorch/pytorch#183842)
PICKLE_PROTOCOL = 4
#: allocations the viewer's Active Memory Timeline draws; the smaller ones are merged into one band
VIEWER_MAX_ALLOCATIONS = 15_000
#: where the predicted step's one segment starts (an address of the kind CUDA hands out; any would do)
_BASE_ADDRESS = 0x7F00_0000_0000
_ALIGN = 512          # CUDA's caching allocator's block granularity
_SEGMENT_ROUND = 2 << 20  # its large segments' granularity


class _FirstFit:
    """Addresses for the blocks of one segment: the lowest free range that fits, ``_ALIGN``-aligned,
    ranges merged again on free (as a caching allocator's one segment would place them)."""

    def __init__(self) -> None:
        self.starts: list[int] = []   # free ranges below ``top``, by start
        self.sizes: dict[int, int] = {}
        self.top = 0                  # everything at or above is free
        self.high = 0

    def alloc(self, nbytes: int) -> int:
        need = -(-nbytes // _ALIGN) * _ALIGN
        for i, s in enumerate(self.starts):
            if self.sizes[s] >= need:
                size = self.sizes.pop(s)
                del self.starts[i]
                if size > need:
                    self.sizes[s + need] = size - need
                    bisect.insort(self.starts, s + need)
                return s
        s = self.top
        self.top += need
        self.high = max(self.high, self.top)
        return s

    def free(self, addr: int, nbytes: int) -> None:
        size = -(-nbytes // _ALIGN) * _ALIGN
        i = bisect.bisect_left(self.starts, addr)
        if i < len(self.starts) and addr + size == self.starts[i]:  # merge with the next free range
            nxt = self.starts.pop(i)
            size += self.sizes.pop(nxt)
        if i > 0 and self.starts[i - 1] + self.sizes[self.starts[i - 1]] == addr:  # and the previous
            prev = self.starts[i - 1]
            self.sizes[prev] += size
            addr, size = prev, self.sizes[prev]
        else:
            self.starts.insert(i, addr)
            self.sizes[addr] = size
        if addr + size == self.top:  # the free range at the top goes back to the unused space
            self.starts.remove(addr)
            del self.sizes[addr]
            self.top = addr


def _frames(graph: Graph, b: Block) -> list[dict[str, Any]]:
    """Frames of a predicted block, innermost first: the ATen op that allocated it (the frame's name), its
    module (the file) and op id (the line); then the phase of the step."""
    frames = []
    if b.op is not None and b.op < len(graph.ops):
        op = graph.ops[b.op]
        frames.append({"filename": op.module or "<model>", "line": op.id, "name": op.name})
    frames.append({"filename": f"memplan {graph.name}", "line": 0, "name": f"{b.phase} ({b.category})"})
    return frames


def predicted_snapshot(graph: Graph, trace: MemoryTrace) -> dict[str, Any]:
    """The snapshot of a predicted step: every block of ``trace`` (:func:`memplan.planner.core.memtrace.memory_trace`)
    allocated and freed in one segment of device 0 at first-fit addresses, in the trace's order, at its
    simulated times (``time_us``); the blocks still live at the end (parameters, optimizer state, the
    parameters' gradients) are the segment's ``active_allocated`` blocks."""
    heap = _FirstFit()
    where: dict[int, int] = {}
    live: dict[int, Block] = {}
    events: list[dict[str, Any]] = []
    for e in trace.events:
        b = e.block
        if e.action == "alloc":
            addr = where[b.id] = _BASE_ADDRESS + heap.alloc(b.bytes)
            live[b.id] = b
            events.append({"action": "alloc", "addr": addr, "size": b.bytes, "stream": 0,
                           "time_us": int(e.time_s * 1e6), "frames": _frames(graph, b), "category": b.category,
                           "user_metadata": b.note})
        else:
            addr = where.pop(b.id)
            del live[b.id]
            heap.free(addr - _BASE_ADDRESS, b.bytes)
            for action in ("free_requested", "free_completed"):
                events.append({"action": action, "addr": addr, "size": b.bytes, "stream": 0,
                               "time_us": int(e.time_s * 1e6), "frames": _frames(graph, b), "category": b.category,
                               "user_metadata": b.note})
    total = max(_SEGMENT_ROUND, -(-heap.high // _SEGMENT_ROUND) * _SEGMENT_ROUND)
    blocks = []
    cursor = _BASE_ADDRESS
    for bid in sorted(live, key=where.__getitem__):
        b, addr = live[bid], where[bid]
        if addr > cursor:
            blocks.append({"address": cursor, "size": addr - cursor, "requested_size": 0, "state": "inactive",
                           "frames": []})
        blocks.append({"address": addr, "size": b.bytes, "requested_size": b.bytes, "state": "active_allocated",
                       "frames": _frames(graph, b), "category": b.category, "user_metadata": b.note})
        cursor = addr + b.bytes
    if cursor < _BASE_ADDRESS + total:
        blocks.append({"address": cursor, "size": _BASE_ADDRESS + total - cursor, "requested_size": 0,
                       "state": "inactive", "frames": []})
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    segment = {"device": 0, "address": _BASE_ADDRESS, "total_size": total, "allocated_size": allocated,
               "active_size": allocated, "requested_size": allocated, "stream": 0, "segment_type": "large",
               "frames": [], "blocks": blocks}
    start = {"action": "segment_alloc", "addr": _BASE_ADDRESS, "size": total, "stream": 0, "time_us": 0,
             "frames": [], "user_metadata": f"memplan's predicted step of {graph.name}: one segment holds every block"}
    end = _taken(int(trace.end_s * 1e6), f"the end of the predicted step of {graph.name}")
    return {"segments": [segment], "device_traces": [[start, *events, end]],
            "memplan": {"kind": "predicted", "graph": graph.name, "graph_fingerprint": graph.fingerprint}}


@dataclass(frozen=True)
class Storage:
    """A storage live when a measured step began: its address, bytes and what it is (category, note)."""

    address: int
    bytes: int
    category: str
    note: str


@dataclass(frozen=True)
class Report:
    """One report of an allocator during a measured step: ``bytes`` positive for an allocation, negative
    for a free, at ``address``; ``ops``: the names of the ops around it, innermost first."""

    time_ns: int
    bytes: int
    address: int
    ops: tuple[str, ...] = ()


def measured_snapshot(storages: list[Storage], reports: list[Report], *, name: str) -> dict[str, Any]:
    """The snapshot of a step measured from an allocator's reports (a CPU's, which has no segments): the
    storages live when it began are allocated first (category: what they are), then every report in time
    order (category ``forward``, ``backward`` or ``optimizer`` by the ops around it; frames: those ops);
    each block live at the end is a segment of its own."""
    t0 = min((r.time_ns for r in reports), default=0)
    events: list[dict[str, Any]] = []
    live: dict[int, dict[str, Any]] = {}
    for s in storages:
        ev = {"action": "alloc", "addr": s.address, "size": s.bytes, "stream": 0, "time_us": 0,
              "frames": [{"filename": "live when the step began", "line": 0, "name": s.category}],
              "category": s.category, "user_metadata": s.note}
        events.append(ev)
        live[s.address] = ev
    for r in sorted(reports, key=lambda r: r.time_ns):
        at_us = (r.time_ns - t0) // 1000
        if r.bytes > 0:
            category = _phase_of(r.ops)
            ev = {"action": "alloc", "addr": r.address, "size": r.bytes, "stream": 0, "time_us": at_us,
                  "frames": [{"filename": "aten", "line": 0, "name": n} for n in r.ops] or
                            [{"filename": "<no op>", "line": 0, "name": "allocation"}],
                  "category": category, "user_metadata": f"{category}: {r.ops[-1] if r.ops else 'outside any op'}"}
            events.append(ev)
            live[r.address] = ev
        elif r.bytes < 0:
            ev = live.pop(r.address, None)
            frames = ev["frames"] if ev else []
            for action in ("free_requested", "free_completed"):
                events.append({"action": action, "addr": r.address, "size": -r.bytes, "stream": 0, "time_us": at_us,
                               "frames": frames, "category": ev["category"] if ev else "unknown",
                               "user_metadata": ev["user_metadata"] if ev else ""})
    events.append(_taken(events[-1]["time_us"] if events else 0, f"the end of the measured step of {name}"))
    segments = [{"device": 0, "address": ev["addr"], "total_size": ev["size"], "allocated_size": ev["size"],
                 "active_size": ev["size"], "requested_size": ev["size"], "stream": 0, "segment_type": "small",
                 "frames": [], "blocks": [{"address": ev["addr"], "size": ev["size"], "requested_size": ev["size"],
                                           "state": "active_allocated", "frames": ev["frames"],
                                           "category": ev["category"], "user_metadata": ev["user_metadata"]}]}
                for ev in sorted(live.values(), key=lambda e: e["addr"])]
    return {"segments": segments, "device_traces": [events], "memplan": {"kind": "measured", "workload": name}}


def _taken(time_us: int, note: str) -> dict[str, Any]:
    """The trace's last event: the snapshot taken (an action of PyTorch's own traces), in category
    ``unknown``, so that the viewer finds that category among those used."""
    return {"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "time_us": time_us, "frames": [],
            "category": "unknown", "user_metadata": note}


def _phase_of(ops: tuple[str, ...]) -> str:
    """forward, backward or optimizer from the names of the ops around an allocation (innermost first)."""
    for n in reversed(ops):  # the outermost decides
        if n.startswith("Optimizer.") or "optimizer" in n.lower():
            return "optimizer"
        if n.startswith("autograd::engine") or "Backward" in n:
            return "backward"
    return "forward" if ops else "unknown"


@dataclass(frozen=True)
class SnapshotSummary:
    """What :func:`write_snapshot` wrote: ``allocations`` (alloc events), ``peak_bytes`` (the most live at
    once, allocations only), and what the viewer merges past its 15,000 largest: ``merged`` allocations,
    each of at most ``merged_max_bytes``."""

    path: str
    allocations: int
    peak_bytes: int
    merged: int
    merged_max_bytes: int

    def line(self) -> str:
        head = f"{self.path}: {self.allocations} allocations"
        if not self.merged:
            return f"{head} (the viewer draws each)"
        return (f"{head}; the viewer draws the {VIEWER_MAX_ALLOCATIONS} largest and merges the other {self.merged} "
                f"(each at most {self.merged_max_bytes} bytes) into one band (its Detail slider draws more)")


def summarize(snapshot: dict[str, Any], path: str = "") -> SnapshotSummary:
    sizes = []
    live = peak = 0
    for trace in snapshot.get("device_traces", []):
        for e in trace:
            if e["action"] == "alloc":
                sizes.append(e["size"])
                live += e["size"]
                peak = max(peak, live)
            elif e["action"] == "free_completed":
                live -= e["size"]
    sizes.sort(reverse=True)
    merged = sizes[VIEWER_MAX_ALLOCATIONS:]
    return SnapshotSummary(path, len(sizes), peak, len(merged), merged[0] if merged else 0)


def write_snapshot(path: str | Path, snapshot: dict[str, Any]) -> SnapshotSummary:
    """Pickle ``snapshot`` to ``path`` with protocol 4 (the viewer's); returns its :class:`SnapshotSummary`.
    Raises :class:`MemplanError` when the file cannot be written."""
    try:
        with open(path, "wb") as f:
            pickle.dump(snapshot, f, protocol=PICKLE_PROTOCOL)
    except OSError as e:
        raise MemplanError(f"cannot write memory snapshot {path}: {e.strerror}") from None
    return summarize(snapshot, str(path))
