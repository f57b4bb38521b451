"""Small graph generators for tests and benchmarks (torch-free), after Checkmate's ``gen_linear_graph``.

Gradients are filled structurally (:func:`fill_structural_grads`): a backward step creates the gradient
of each input that requires one, unless a later op's backward already did, and frees the gradient of each
of its outputs. Profiled graphs carry measured figures instead.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from memplan.planner.core.graph import FixedMemory, Graph, Op, TensorInfo


def fill_structural_grads(graph: Graph) -> Graph:
    """Set every op's ``backward_grad_alloc_bytes`` / ``backward_grad_free_bytes`` from the structure."""
    has_grad: set[int] = set()
    for op in reversed(graph.ops):
        if not op.has_backward:
            op.backward_grad_alloc_bytes = op.backward_grad_free_bytes = 0
            continue
        alloc = 0
        for t in dict.fromkeys(op.inputs):
            info = graph.tensors[t]
            if info.requires_grad and t not in has_grad:
                has_grad.add(t)
                alloc += info.bytes
        free = 0
        for t in op.outputs:
            if t in has_grad and graph.tensors[t].kind == "activation":
                free += graph.tensors[t].bytes
        op.backward_grad_alloc_bytes = alloc
        op.backward_grad_free_bytes = free
    return graph.invalidate()


def linear_chain(n: int, *, time_s: Sequence[float] | float = 1.0, backward_time_s: Sequence[float] | float = 2.0,
                 activation_bytes: Sequence[int] | int = 100, input_bytes: int = 100, param_bytes: int = 0,
                 name: str = "chain") -> Graph:
    """A chain of ``n`` ops: op i reads activation i-1 (op 0 reads the input) and saves it, like a
    Linear layer; op i's output is activation i. Per-op figures may be scalars or sequences."""

    def at(v, i):
        return v[i] if isinstance(v, Sequence) else v

    tensors = [TensorInfo(id=0, kind="input", bytes=input_bytes, requires_grad=False)]
    ops = []
    prev = 0
    for i in range(n):
        inputs = [prev]
        if param_bytes:
            tensors.append(TensorInfo(id=len(tensors), kind="param", bytes=param_bytes, requires_grad=True))
            inputs.append(tensors[-1].id)
        out = len(tensors)
        tensors.append(TensorInfo(id=out, kind="activation", producer=i, bytes=int(at(activation_bytes, i)),
                                  requires_grad=True))
        ops.append(Op(id=i, name="synthetic.layer", module=f"layers.{i}", time_s=float(at(time_s, i)),
                      backward_time_s=float(at(backward_time_s, i)), inputs=inputs, outputs=[out],
                      saved=[prev], has_backward=True))
        prev = out
    ops[-1].saved.append(prev)  # the loss-like last op keeps its output too
    g = Graph(name=name, tensors=tensors, ops=ops,
              fixed=FixedMemory(inputs_bytes=input_bytes, params_bytes=param_bytes * n))
    return fill_structural_grads(g)


def random_dag(n: int, *, seed: int = 0, max_inputs: int = 2, max_bytes: int = 64, skip_prob: float = 0.3,
               name: str = "dag") -> Graph:
    """A random DAG of ``n`` ops. Op i reads its predecessor's output and, with probability
    ``skip_prob``, an older one (a long skip); each op saves a random non-empty subset of what it reads
    and writes, so some outputs are saved by their own op and some by their consumers."""
    rng = random.Random(seed)
    tensors = [TensorInfo(id=0, kind="input", bytes=rng.randint(1, max_bytes), requires_grad=False)]
    ops: list[Op] = []
    outs: list[int] = []
    skip = skip_prob if max_inputs > 1 else 0.0
    for _ in range(n):
        _add_random_op(rng, tensors, ops, outs, skip=skip, max_bytes=max_bytes, save_prob=0.6)
    g = Graph(name=name, tensors=tensors, ops=ops, fixed=FixedMemory(inputs_bytes=tensors[0].bytes))
    return fill_structural_grads(g)


def _add_random_op(rng: random.Random, tensors: list[TensorInfo], ops: list[Op], outs: list[int], *,
                   skip: float, max_bytes: int, save_prob: float) -> None:
    """Append op ``len(ops)`` of :func:`random_dag`: it reads the latest activation (the input first) and,
    with probability ``skip``, an older one; makes one activation; saves each of those with probability
    ``save_prob`` (at least one)."""
    i = len(ops)
    inputs = [outs[-1] if outs else 0]
    if outs and rng.random() < skip:
        inputs.append(rng.choice(outs[:-1] or [0]))
    inputs = list(dict.fromkeys(inputs))
    out = len(tensors)
    tensors.append(TensorInfo(id=out, kind="activation", producer=i, bytes=rng.randint(1, max_bytes),
                              requires_grad=True))
    candidates = inputs + [out]
    saved = [t for t in candidates if rng.random() < save_prob] or [rng.choice(candidates)]
    ops.append(Op(id=i, name=f"synthetic.op{i % 3}", module=f"block{i // 3}.op{i % 3}",
                  time_s=round(rng.uniform(0.1, 2.0), 3), backward_time_s=round(rng.uniform(0.1, 3.0), 3),
                  inputs=inputs, outputs=[out], saved=saved, has_backward=True))
    outs.append(out)


def inplace_dag(n: int, *, seed: int = 0, max_bytes: int = 64, chain_prob: float = 0.35, skip_prob: float = 0.3,
                name: str = "inplace") -> Graph:
    """A random DAG of ``n`` ops with in-place chains, like a recurrent cell's gates: with probability
    ``chain_prob`` an op writes one of the three latest activations in place (it reads that tensor and
    maybe another one, creates nothing, and joins the tensor's ``rebuilt_by``), otherwise it is an op of
    :func:`random_dag`. An op that reads a tensor before a later in-place op on it reads it mid-chain
    (:func:`memplan.planner.core.replay.reads_mid_chain`), so replays need scratch copies."""
    rng = random.Random(seed)
    tensors = [TensorInfo(id=0, kind="input", bytes=rng.randint(1, max_bytes), requires_grad=False)]
    ops: list[Op] = []
    outs: list[int] = []
    for i in range(n):
        in_place = bool(outs) and rng.random() < chain_prob
        if in_place:
            h = rng.choice(outs[-3:])
            inputs = [h]
            if len(outs) > 1 and rng.random() < 0.4:
                inputs.append(rng.choice([t for t in outs if t != h]))
            saved = [t for t in inputs if rng.random() < 0.5]
            tensors[h].rebuilt_by.append(i)
            ops.append(Op(id=i, name="synthetic.inplace_", module=f"block{i // 3}.op{i % 3}",
                          time_s=round(rng.uniform(0.05, 1.0), 3), backward_time_s=round(rng.uniform(0.1, 2.0), 3),
                          inputs=inputs, outputs=[], saved=saved, has_backward=True))
            continue
        _add_random_op(rng, tensors, ops, outs, skip=skip_prob, max_bytes=max_bytes, save_prob=0.5)
    g = Graph(name=name, tensors=tensors, ops=ops, fixed=FixedMemory(inputs_bytes=tensors[0].bytes))
    return fill_structural_grads(g)


def inplace_chain(steps: int, *, state_bytes: int = 100, time_s: float = 1.0, backward_time_s: float = 2.0,
                  name: str = "inplace_chain") -> Graph:
    """A recurrent-like chain of ``steps`` steps, each two ops: ``h = layer(h_prev)`` (saves ``h_prev``,
    like a Linear) then ``h.relu_()`` in place (saves ``h``, joins its ``rebuilt_by``), so every state is
    an in-place chain a replay rebuilds with both ops. The last step's ``relu_`` is the loss-like op."""
    tensors = [TensorInfo(id=0, kind="input", bytes=state_bytes, requires_grad=False)]
    ops: list[Op] = []
    prev = 0
    for i in range(steps):
        h = len(tensors)
        p = len(ops)
        tensors.append(TensorInfo(id=h, kind="activation", producer=p, bytes=state_bytes, requires_grad=True,
                                  rebuilt_by=[p + 1]))
        ops.append(Op(id=p, name="synthetic.layer", module=f"steps.{i}", time_s=time_s,
                      backward_time_s=backward_time_s, inputs=[prev], outputs=[h], saved=[prev], has_backward=True))
        ops.append(Op(id=p + 1, name="synthetic.relu_", module=f"steps.{i}", time_s=time_s / 4,
                      backward_time_s=backward_time_s / 4, inputs=[h], saved=[h], has_backward=True))
        prev = h
    g = Graph(name=name, tensors=tensors, ops=ops, fixed=FixedMemory(inputs_bytes=state_bytes))
    return fill_structural_grads(g)


def repeated_blocks(blocks: int, block_ops: int = 3, *, seed: int = 0, max_bytes: int = 64, save_prob: float = 0.5,
                    replay_op_dispatch_s: float = 0.0, watch_op_dispatch_s: float = 0.0,
                    name: str = "repeated") -> Graph:
    """``blocks`` identical blocks of ``block_ops`` ops (modules ``layers.<b>.op<k>``), like a
    transformer's layers: one random template (sizes, times, which tensors each op saves, a skip from the
    block's input to its last op: a residual) repeated, each block reading the previous one's output.
    Some activations are saved by no op (a replay rebuilds them on the way). The dispatch figures are the
    graph's (the executor's per replayed op and per watched forward op)."""
    rng = random.Random(seed)
    template = []
    for k in range(block_ops):
        skip = k == block_ops - 1 and block_ops > 1
        template.append(dict(bytes=rng.randint(1, max_bytes), time_s=round(rng.uniform(0.1, 2.0), 3),
                             backward_time_s=round(rng.uniform(0.1, 3.0), 3), skip=skip,
                             save=[rng.random() < save_prob for _ in range(3)]))
    tensors = [TensorInfo(id=0, kind="input", bytes=rng.randint(1, max_bytes), requires_grad=False)]
    ops: list[Op] = []
    prev = 0
    for b in range(blocks):
        block_in = prev
        for k, t in enumerate(template):
            i = len(ops)
            inputs = [prev] + ([block_in] if t["skip"] and block_in != prev else [])
            out = len(tensors)
            tensors.append(TensorInfo(id=out, kind="activation", producer=i, bytes=t["bytes"], requires_grad=True))
            candidates = inputs + [out]
            saved = [v for v, keep in zip(candidates, t["save"], strict=False) if keep]
            ops.append(Op(id=i, name=f"synthetic.op{k}", module=f"layers.{b}.op{k}", time_s=t["time_s"],
                          backward_time_s=t["backward_time_s"], inputs=inputs, outputs=[out], saved=saved,
                          has_backward=True))
            prev = out
    ops[-1].saved = list(dict.fromkeys([*ops[-1].saved, prev]))  # the loss-like last op keeps its output
    g = Graph(name=name, tensors=tensors, ops=ops, fixed=FixedMemory(inputs_bytes=tensors[0].bytes),
              replay_op_dispatch_s=replay_op_dispatch_s, watch_op_dispatch_s=watch_op_dispatch_s)
    return fill_structural_grads(g)


def gpu_scale(graph: Graph, seed: int) -> Graph:
    """``graph`` with every tensor resized to an odd byte count of 64 MiB to 4 GiB and 3 GiB (+1 B) of
    parameters: the magnitudes of GPU training, where solvers' arithmetic once lost exactness."""
    rng = random.Random(seed)
    d = graph.model_dump()
    for t in d["tensors"]:
        t["bytes"] = rng.randint(64 * 2**20, 4 * 2**30) | 1
    d["fixed"]["inputs_bytes"] = d["tensors"][0]["bytes"]
    d["fixed"]["params_bytes"] = 3 * 2**30 + 1
    return fill_structural_grads(Graph.model_validate(d))
