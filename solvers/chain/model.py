"""The chain model: the per-element figures of a chain as the simulator sees them, and :func:`op_chain`,
which recognises a graph of linear_chain's shape (the package docstring says why the DP is exact there)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

import numpy as np

from memplan.planner.core.graph import Graph
from memplan.planner.core.schedule import replay_op_cost_s

NEG_BYTES = -(1 << 60)      # "no constraint" in the integer cost arrays


@dataclass(frozen=True)
class OpChain:
    """Per-element figures of a chain, as the simulator sees them (see the package docstring).

    Element ``i`` is activation ``a_i`` produced by op ``i``: ``bytes_[i]``, ``time_s[i]`` (what a replay of
    its producer costs the step when it is recomputed: the op's time and the executor's replay dispatch,
    :func:`memplan.planner.core.schedule.replay_op_cost_s`). ``fixed_bytes`` is live throughout; ``const_peak_bytes``
    is the highest peak no plan changes (start, backward of op 0, optimizer step).
    """

    tensors: tuple[int, ...]
    bytes_: np.ndarray          # int64 [n]
    time_s: np.ndarray          # float64 [n]
    recomputable: np.ndarray    # bool [n]
    fixed_bytes: int
    const_peak_bytes: int
    prefix: np.ndarray          # int64 [n+1]: prefix[i+1] = bytes of a_0..a_i
    fwd_full: np.ndarray        # forward op i with a_{i-1} recomputed: a_{i-1} + a_i + workspace
    fwd_first: np.ndarray       # forward op i with a_{i-1} kept (its bytes are in S): a_i + workspace
    bwd_step: np.ndarray        # backward step i: prefix(i-1) + grads + its allocation + workspace (+a_{n-1})
    replay: np.ndarray          # replay of op q: prefix(q) + workspace
    grads_before: np.ndarray    # gradient bytes live before backward step i
    unit_gcd: int               # gcd of every byte figure in the costs (exact memory unit)

    @property
    def n(self) -> int:
        return len(self.tensors)

    def run_costs(self, k: int) -> np.ndarray:
        """``C(k, k')`` for ``k' = k+1 .. n``: the peak bytes (beyond ``F + S(k)``) of the run of
        recomputed ops ``k+1 .. k'-1`` between kept ``a_k`` and kept ``a_k'`` (``k' = n``: none kept above):
        forward ops ``k+1 .. k'``, backward steps ``k+1 .. k'`` and the replay of the run at step
        ``min(k', n-1)``. ``NEG_BYTES`` where nothing is constrained."""
        n = self.n
        lo = k + 1
        kp = np.arange(lo, n + 1)
        out = np.full(len(kp), NEG_BYTES, dtype=np.int64)
        if lo >= n:
            return out
        hi = np.minimum(kp, n - 1) - lo                      # last op index of each pair, relative to lo
        f = self.fwd_full[lo:n].copy()
        f[0] = self.fwd_first[lo]
        pk = self.prefix[lo]                                  # prefix(k)
        fwd = np.maximum.accumulate(f)[hi]
        bwd = np.maximum.accumulate(self.bwd_step[lo:n])[hi] - pk
        out = np.maximum(out, np.maximum(fwd, bwd))
        # replay of ops lo .. min(k'-1, n-1), at step s = min(k', n-1); needs a non-empty run (k' >= k+2)
        if len(kp) > 1:
            top = np.minimum(kp[1:] - 1, n - 1) - lo
            s = np.minimum(kp[1:], n - 1)
            extra = np.where(kp[1:] == n - 1, self.bytes_[n - 1], 0)   # a_{n-1} kept: resident at that replay
            rep = np.maximum.accumulate(self.replay[lo:n])[top] - pk + self.grads_before[s] + extra
            out[1:] = np.maximum(out[1:], rep)
        return out


def op_chain(graph: Graph) -> OpChain | None:
    """The chain model of ``graph`` when it has linear_chain's shape (package docstring), else None."""
    ops, tensors = graph.ops, graph.tensors
    n = len(ops)
    if n == 0 or sum(t.kind == "activation" for t in tensors) != n:
        return None
    outs: list[int] = []
    for op in ops:
        if len(op.outputs) != 1:
            return None
        info = tensors[op.outputs[0]]
        if info.kind != "activation" or info.held_by_caller:
            return None
        outs.append(info.id)
    for i, op in enumerate(ops):
        acts_in = {t for t in op.inputs if tensors[t].kind == "activation"}
        if acts_in != ({outs[i - 1]} if i else set()):
            return None
        saved = {t for t in op.saved if tensors[t].kind == "activation"}
        want = ({outs[i - 1]} if i else set()) | ({outs[i]} if i == n - 1 else set())
        if saved != want:
            return None
        freed = tensors[outs[i]].freed_after
        if freed is not None and freed > min(i + 1, n - 1):
            return None
    return chain_model(
        tensors=tuple(outs), bytes_=[tensors[t].bytes for t in outs], time_s=[replay_op_cost_s(graph, op) for op in ops],
        recomputable=[tensors[t].recomputable for t in outs], ws=[op.workspace_bytes for op in ops],
        bws=[op.backward_workspace_bytes for op in ops], alloc=[op.backward_grad_alloc_bytes for op in ops],
        free=[op.backward_grad_free_bytes for op in ops], fixed=graph.fixed.resident_bytes,
        optimizer_bytes=graph.fixed.optimizer_step_bytes)


def chain_model(*, tensors, bytes_, time_s, recomputable, ws, bws, alloc, free, fixed: int,
           optimizer_bytes: int) -> OpChain:
    n = len(bytes_)
    b = np.asarray(bytes_, dtype=np.int64)
    ws_, bws_ = np.asarray(ws, dtype=np.int64), np.asarray(bws, dtype=np.int64)
    alloc_, free_ = np.asarray(alloc, dtype=np.int64), np.asarray(free, dtype=np.int64)
    net = alloc_ - free_
    grads_before = np.concatenate([np.cumsum(net[::-1])[::-1][1:], [0]]).astype(np.int64)
    prefix = np.concatenate([[0], np.cumsum(b)]).astype(np.int64)
    fwd_full = ws_ + b + np.concatenate([[0], b[:-1]])
    fwd_first = ws_ + b
    bwd_step = prefix[:n] + grads_before + alloc_ + bws_
    bwd_step[n - 1] += b[n - 1]
    if n > 1:
        bwd_step[0] = NEG_BYTES   # op 0's backward reads no activation: a constant peak
    replay = prefix[1:] + ws_
    const = max(fixed, fixed + int(grads_before[0] + net[0]) + optimizer_bytes)
    if n > 1:
        const = max(const, fixed + int(grads_before[0] + alloc_[0] + bws_[0]))
    figures = [int(x) for x in np.concatenate([b, ws_, bws_, alloc_, free_]) if x] + [fixed]
    g = reduce(math.gcd, figures, 0) or 1
    return OpChain(tuple(tensors), b, np.asarray(time_s, dtype=np.float64), np.asarray(recomputable, dtype=bool),
                    fixed, const, prefix, fwd_full, fwd_first, bwd_step, replay, grads_before, g)
