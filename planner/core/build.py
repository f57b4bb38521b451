"""From a trace of one training step to its :class:`Graph`: the torch-free half of the profiler.

The probe's tracer (:mod:`memplan.planner.probe.tracing`) records what one step did as plain data, a
:class:`Trace`; :func:`build_graph` turns it into the graph the simulator reads. A test can write a trace
by hand (a few ops, a view, an in-place op, a saved set) and check the graph it makes.

What a trace holds:

* **Storages** (:class:`TraceStorage`), numbered in the order they were first seen; the first
  ``n_fixed`` are the parameters, buffers and batch registered before the step. A view or an in-place
  result is not a new storage: an op's ``outputs`` are only the storages it created, an in-place op's
  target is in its ``writes``. ``born``/``died`` are clocks ``(phase, index)``: ``("forward", op)``,
  ``("backward", step)``, ``("optimizer", 0)``.
* **Forward ops** (:class:`TraceOp`) in execution order, with the storages they read, created and wrote.
* **Saved**: forward op -> storages its autograd node saved.
* **Backward events**: ``(step, storage, +bytes born / -bytes died)`` in the order they happened, a step
  being the forward op whose backward ran; storage ``-1`` is kernel scratch (a ``+``/``-`` pair).
* **Optimizer events**: ``+bytes``/``-bytes`` of the storages ``optimizer.step()`` made or freed.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from memplan.planner.core.errors import GraphError, first_validation_error
from memplan.planner.core.graph import FixedMemory, FusedStep, Graph, ModuleCall, Op, TensorInfo

NOMINAL_HOST_BANDWIDTH_BYTES_PER_S = 12e9  # on CPU offload is a logical move (see docs/model.md)


@dataclass
class TraceStorage:
    """One storage seen in the step. ``kind``: ``activation`` (created by the step), ``param``,
    ``buffer`` (a pre-existing storage the step read, or a registered buffer) or ``input``. ``died``
    stays None while it lives; ``held``: alive after backward (the caller holds it: the loss, outputs).
    ``producer``/``output_index``: the forward op that created it and its place among that op's
    outputs."""

    tid: int
    kind: str
    nbytes: int
    dtype: str
    shape: list[int]
    born: tuple[str, int] | None = None
    died: tuple[str, int] | None = None
    producer: int | None = None
    output_index: int = 0
    requires_grad: bool = False
    held: bool = False


@dataclass
class TraceOp:
    """One forward ATen call: storages read (``inputs``), created (``outputs``) and written in place
    (``writes``); ``random``: it draws random numbers. ``scope`` (the call's number, which keys its
    allocator high-water mark) and ``positions`` (each output's place among the call's result tensors)
    are the tracer's bookkeeping; ``workspace_bytes`` is its kernel scratch beyond its outputs."""

    name: str
    module: str
    time_s: float
    inputs: list[int]
    outputs: list[int]
    writes: list[int]
    random: bool
    scope: int = -1
    workspace_bytes: int = 0
    has_backward: bool = False
    positions: list[int] = field(default_factory=list)


@dataclass
class Trace:
    """Everything one traced training step observed (see the module docstring)."""

    storages: list[TraceStorage] = field(default_factory=list)
    n_fixed: int = 0                                                 # storages registered before the step
    ops: list[TraceOp] = field(default_factory=list)
    saved: dict[int, list[int]] = field(default_factory=dict)       # op -> saved storage ids
    backward_time_s: dict[int, float] = field(default_factory=dict)  # step -> seconds
    # (step, storage id, +bytes born / -bytes died); storage id -1: kernel scratch
    backward_events: list[tuple[int, int, int]] = field(default_factory=list)
    backward_order: list[int] = field(default_factory=list)          # steps in the order they ran
    optimizer_events: list[int] = field(default_factory=list)        # +bytes / -bytes
    optimizer_scratch_bytes: int = 0                                 # allocator high-water mark of step()
    optimizer_survivors_bytes: int = 0
    optimizer_time_s: float = 0.0
    # forward module calls as [path, first op, end op (exclusive; -1 until the call returns)], in call order
    module_calls: list[list] = field(default_factory=list)
    draw_branches: list[str] = field(default_factory=list)  # modules whose code branched on a random draw
    # optimizer fusion's buckets as backward completed them: (step, owning module, gradient bytes)
    fused_steps: list[tuple[int, str, int]] = field(default_factory=list)


def backward_figures(trace: Trace) -> tuple[list[int], list[int], list[int], dict[int, int]]:
    """Per forward op: (grad alloc, grad free, backward workspace) bytes of its backward step, and, for each
    storage that existed before backward and died in it, the step that released it (activations only)."""
    n_ops = len(trace.ops)
    alloc = [0] * n_ops
    free = [0] * n_ops
    workspace = [0] * n_ops
    born_step: dict[int, int] = {}
    death_step: dict[int, int] = {}
    for step, tid, delta in trace.backward_events:
        if tid < 0:
            continue
        if delta > 0:
            born_step[tid] = step
        else:
            death_step[tid] = step
    for tid, b in born_step.items():
        d = death_step.get(tid)
        # Died in its own step (or, engine order differing from op order, in a step simulated earlier): a
        # transient of its birth step. Otherwise it outlives the step: allocated at b, released at d.
        if d is not None and d >= b:
            continue
        alloc[b] += trace.storages[tid].nbytes
        if d is not None:
            free[d] += trace.storages[tid].nbytes
    # The in-step high-water mark, segment by segment (a step's events are normally one run).
    segment_step, running, high = None, 0, 0
    highs: dict[int, int] = {}
    for step, _tid, delta in trace.backward_events:
        if step != segment_step:
            if segment_step is not None:
                highs[segment_step] = max(highs.get(segment_step, 0), high)
            segment_step, running, high = step, 0, 0
        running += delta
        high = max(high, running)
    if segment_step is not None:
        highs[segment_step] = max(highs.get(segment_step, 0), high)
    for step, high in highs.items():
        workspace[step] = max(0, high - alloc[step])
    released = {tid: step for tid, step in death_step.items()
                if tid not in born_step and trace.storages[tid].kind == "activation"}
    return alloc, free, workspace, released


def initialisers(trace: Trace, new_id: dict[int, int], mutated_by: dict[int, list[int]]) -> dict[int, list[int]]:
    """{graph tensor id: the ops that finish it in place} for the mutated activations a replay can rebuild
    by running their producer and then these ops in forward order, under the recorded RNG state: each of
    these ops writes only that storage (through any view of it) and creates none, and the producer has no
    other output (a replay for another output would skip them). Covered: dropout's ``empty_like`` ->
    ``bernoulli_`` -> ``div_`` mask, ``relu_`` after a linear, ``x += residual``, and recurrent cells'
    gates finished by ``add_``/``sigmoid_``/``tanh_``/``mul_`` on chunks that read other activations.
    ``new_id``: trace storage id -> graph tensor id; ``mutated_by``: graph tensor id -> the ops other
    than its producer that write it.

    What the ops read besides the storage is needed by the replay as any input is; that it holds the
    value the op read in forward is checked by :func:`stale_readers` (the other half of the rule)."""
    out: dict[int, list[int]] = {}
    trace_id = {gid: tid for tid, gid in new_id.items()}
    for gid, ops in mutated_by.items():
        if len(trace.ops[trace.storages[trace_id[gid]].producer].outputs) != 1:
            continue
        if all(not trace.ops[k].outputs and {new_id.get(t) for t in trace.ops[k].writes} == {gid} for k in ops):
            out[gid] = sorted(ops)
    return out


def stale_readers(trace: Trace, new_id: dict[int, int], mutated_by: dict[int, list[int]],
                  chains: dict[int, list[int]]) -> set[int]:
    """Ops that read an activation which a later op writes in place, outside a rebuildable chain
    (``chains``, from :func:`initialisers`): replayed, such an op would read the tensor's final content,
    not what it read in forward. A tensor whose replay runs one of them cannot be rebuilt; its readers
    still can, from the kept tensor. A reader of a chain mid-way (``y = h * 3; h.relu_()``; autograd's
    clone of a GRU chunk before its in-place ``mul_``) is not stale: a replay re-creates the chain up to
    it (:func:`memplan.planner.core.replay.reads_mid_chain`)."""
    last_write = {gid: max(ops) for gid, ops in mutated_by.items() if gid not in chains}
    out = set()
    for k, op in enumerate(trace.ops):
        for t in op.inputs:
            gid = new_id.get(t, -1)
            # an op that writes the tensor itself reads it mid-chain by design: it runs only in a replay
            # that rebuilds that tensor, in forward order with the rest of the chain
            if last_write.get(gid, -1) > k and k not in mutated_by[gid]:
                out.add(k)
    return out


def build_graph(trace: Trace, *, name: str = "graph", device: str = "cpu", fixed: FixedMemory | None = None,
                times: list[list[float]] | None = None, backward_times: list[dict[int, float]] | None = None,
                optimizer_time_s: float | None = None, fingerprint: str = "",
                host_bandwidth_bytes_per_s: float = NOMINAL_HOST_BANDWIDTH_BYTES_PER_S,
                meta: dict[str, Any] | None = None,
                lifetimes: dict[tuple[int, int], int | None] | None = None) -> Graph:
    """The :class:`Graph` of ``trace``.

    Tensor ids: the pre-existing storages (everything not an activation), then the activations born in
    forward, in birth order; storages born in backward or the optimizer step are not tensors. ``times``
    and ``backward_times``: per timed step, each forward op's seconds and each backward step's; the graph
    takes the median (None: the trace's own). ``fixed``: the parameters', buffers', batch's and optimizer
    state's bytes; ``other_bytes`` is set from the trace (pre-existing storages read that are none of
    those). ``lifetimes``: {(producer, output index): the op during which the program itself dropped the
    storage, None past the forward} from a pass without autograd's holds; it sets ``freed_after`` of the
    activations autograd held. ``meta`` (copied) gains ``saved_inferred``,
    ``backward_in_reverse_op_order``, ``optimizer_step_survivors_bytes`` and ``mutated_by``.

    An activation that lives into backward, is in no saved list and is not held by the caller is counted
    as saved by the op whose backward step released it (``meta["saved_inferred"]`` counts them). A
    mutated activation is recomputable only when its in-place ops can be replayed after its producer
    (:func:`initialisers`) and none of them, nor the producer, reads a stale input (:func:`stale_readers`).
    Raises :class:`memplan.planner.core.errors.GraphError`, naming the field, for a trace that makes no
    valid graph (an op reading a storage a later op creates, a dangling id).
    """
    n_ops = len(trace.ops)
    times = times if times is not None else [[op.time_s for op in trace.ops]]
    backward_times = backward_times if backward_times is not None else [trace.backward_time_s]
    order = [st for st in trace.storages if st.kind != "activation"] + \
            [st for st in trace.storages if st.kind == "activation" and st.born and st.born[0] == "forward"]
    new_id = {st.tid: i for i, st in enumerate(order)}
    alloc, free, workspace, released = backward_figures(trace)

    saved = {op: [new_id[t] for t in tids if t in new_id] for op, tids in trace.saved.items()}
    in_saved = {t for tids in saved.values() for t in tids}
    inferred = 0
    for tid, step in released.items():  # lived into backward, no node exposed it: saved by its releaser
        if tid in new_id and new_id[tid] not in in_saved and not trace.storages[tid].held:
            saved.setdefault(step, []).append(new_id[tid])
            inferred += 1

    mutated_by: dict[int, list[int]] = {}
    for k, op in enumerate(trace.ops):
        for t in op.writes:
            if t in new_id and trace.storages[t].kind == "activation" and trace.storages[t].producer != k:
                mutated_by.setdefault(new_id[t], []).append(k)

    rebuilders = initialisers(trace, new_id, mutated_by)
    stale = stale_readers(trace, new_id, mutated_by, rebuilders)
    producer_of = {new_id[st.tid]: st.producer for st in trace.storages if st.tid in new_id}
    while True:  # a chain that runs a stale reader is no chain: its own mid-chain readers become stale
        broken = [g for g, ops in rebuilders.items() if any(k in stale for k in (producer_of[g], *ops))]
        if not broken:
            break
        for g in broken:
            del rebuilders[g]
        stale = stale_readers(trace, new_id, mutated_by, rebuilders)
    tensors = []
    for i, st in enumerate(order):
        act = st.kind == "activation"
        freed_after = None
        if act and st.died is not None and st.died[0] == "forward":
            freed_after = max(st.died[1], st.producer)
        elif act and lifetimes is not None and not st.held and (st.producer, st.output_index) in lifetimes:
            # autograd held it in the traced step; without that hold the program drops it here (after the
            # forward if it outlived it): what a plan that recomputes or offloads it can free at the earliest
            died = lifetimes[(st.producer, st.output_index)]
            freed_after = max(n_ops - 1 if died is None else died, st.producer)
        producer_writes = act and bool(trace.ops[st.producer].writes)
        rebuilt_by = rebuilders.get(i, [])
        # rebuilt by re-running its producer and rebuilt_by ops: each must see what it saw in forward
        stale_replay = act and any(k in stale for k in (st.producer, *rebuilt_by))
        tensors.append(TensorInfo(
            id=i, kind=st.kind, producer=st.producer if act else None, output_index=st.output_index if act else 0,
            bytes=st.nbytes, dtype=st.dtype, shape=st.shape, requires_grad=st.requires_grad,
            freed_after=freed_after, held_by_caller=act and st.held,
            recomputable=not ((i in mutated_by and not rebuilt_by) or producer_writes or stale_replay),
            rebuilt_by=rebuilt_by if act and not stale_replay else []))

    ops = []
    for k, rec in enumerate(trace.ops):
        ops.append(Op(
            id=k, name=rec.name, module=rec.module,
            time_s=statistics.median(run[k] for run in times),
            backward_time_s=statistics.median(run.get(k, 0.0) for run in backward_times),
            inputs=[new_id[t] for t in rec.inputs if t in new_id],
            outputs=[new_id[t] for t in rec.outputs],
            saved=saved.get(k, []), workspace_bytes=rec.workspace_bytes,
            backward_workspace_bytes=workspace[k], backward_grad_alloc_bytes=alloc[k],
            backward_grad_free_bytes=free[k], has_backward=rec.has_backward, random=rec.random))

    # pre-existing storages the step read that are not parameters, buffers or the batch (module attributes)
    other = sum(st.nbytes for st in order if st.kind == "buffer" and st.tid >= trace.n_fixed)
    fixed = (fixed or FixedMemory()).model_copy(update={"other_bytes": other})
    reversed_ok = all(a > b for a, b in itertools.pairwise(trace.backward_order))
    meta = dict(meta or {})
    meta.update({
        "saved_inferred": inferred,
        "backward_in_reverse_op_order": reversed_ok,
        "optimizer_step_survivors_bytes": trace.optimizer_survivors_bytes,
        "mutated_by": {str(t): ops_ for t, ops_ in mutated_by.items()},
    })
    if trace.draw_branches:  # planner/probe/draws.py
        meta["draw_branches"] = list(dict.fromkeys(trace.draw_branches))
    try:
        calls = [ModuleCall(path=p, start=a, end=b) for p, a, b in trace.module_calls if b >= a]
        fused = [FusedStep(after=a, module=m, grad_bytes=b) for a, m, b in trace.fused_steps if 0 <= a < len(ops)]
        return Graph(name=name, device=device, model_fingerprint=fingerprint, tensors=tensors, ops=ops,
                     module_calls=calls, fused_backward=fused,
                     fixed=fixed, optimizer_time_s=trace.optimizer_time_s if optimizer_time_s is None
                     else optimizer_time_s, host_bandwidth_bytes_per_s=host_bandwidth_bytes_per_s, meta=meta)
    except ValidationError as e:
        raise GraphError(f"the trace of {name} makes no valid graph: {first_validation_error(e)}") from None


def share_fused_step_bytes(graph: Graph, storage_bytes: int | None = None) -> None:
    """Give each backward-fused bucket its share of the optimizer step's transient memory, by gradient
    bytes: the optimizers fusion supports allocate their step's temporaries per parameter, in proportion to
    it (AdamW's foreach step: one tensor the size of each parameter). ``storage_bytes``: the part of
    ``optimizer_step_bytes`` the step's storages make (None: all of it); the rest, the kernels' own scratch
    the allocator saw above them, each bucket's step makes again in full. Call once ``optimizer_step_bytes``
    is known."""
    total = sum(f.grad_bytes for f in graph.fused_backward)
    if total == 0:
        return
    step = graph.fixed.optimizer_step_bytes
    base = step if storage_bytes is None else min(storage_bytes, step)
    for f in graph.fused_backward:
        f.step_bytes = -(-base * f.grad_bytes // total) + (step - base)  # rounded up: never under
