"""Re-synchronising a step whose forward ops differ from the graph's (the part of
:class:`memplan.executor.step.Step` that decides whether a difference touches the plan).

A model may run other ops than the profiled step where nothing of the plan happens: transformers builds
an attention mask one way for a padded batch and another (or not at all) for an unpadded one, a module
branches on a flag. A step therefore does not stop at the first op that differs:

* **Diverged.** From that op (:meth:`Resync.diverge`) the model's ops run as they are (:meth:`stray`):
  no graph op is theirs, their new storages are no graph tensor, and what autograd saves of them is
  kept as plain training keeps it.
* **Re-synchronised.** At the next module boundary the graph knows (module path, call number, begin or
  end; :mod:`memplan.planner.core.boundaries`) at or after the op where it diverged, the step is back at
  the graph's position there (:meth:`at_boundary`). A step that reaches a boundary the graph reached
  later (the model skipped ops: an unpadded batch builds no mask) re-synchronises the same way. Inside
  one module call, the model running the graph's next op of that name (:meth:`resync_at_op`) is back at
  it too: ops inserted (transformers' ``sdpa`` turns a padded batch's mask into a float one before the
  attention op) or left out before it are the difference; left out only where the plan decides nothing
  in them (else the op is taken for one the model inserted, and the step looks further).
* **Refused** only where the plan decides something in the graph ops that did not run (:meth:`skip`,
  ``Executor.concerns``): a tensor the plan recomputes or offloads is made or saved there, a replay
  re-runs one of those ops, an offloaded tensor is written there last; or a moved tensor was saved by
  the model's own ops while diverged. The refusal names the module and the tensor.
* **Bound.** A tensor made there that a replay reads (the mask every replayed attention reads) is the
  model's own tensor at the first op after the boundary that reads it as the graph's op reads its graph
  tensor (:meth:`bind_inputs`): its bytes must be the graph's, and replays then read it as they would
  have read the profiled one. One that no op binds before the plan's last decision is refused.

Gradients stay those of plain training: the executor never changes what the model runs, only what autograd
holds, and it holds the model's own tensors where the ops differ.
"""

from __future__ import annotations

from typing import Any

import torch

from memplan.planner.core.boundaries import END, Boundary
from memplan.planner.core.graph import DETACH
from memplan.planner.probe.storage import storage_of, tensors_in


def where(key: Boundary | None) -> str:
    if key is None:
        return "the end of the forward"
    path, n, side = key
    return f"the {'end' if side == END else 'start'} of module {path or '(the model)'} (call {n})"


class Resync:
    """Re-synchronisation methods of a step. They read the step's ``ex``, ``g``, ``cursor``, ``by_key``,
    ``fast``, ``shapes`` and its ``_see``, ``_fail`` and ``_passed_detach``."""

    diverged: tuple[int, str] | None   # (graph position where the ops began to differ, what differed)
    unbound: dict[int, str]            # tensor id a replay reads, made where ops differed -> that difference
    resyncs: int                       # times the step re-synchronised after ops that differed
    stray_saves: list[int]             # moved tensors the model's own ops saved while diverged
    pending_saves: list[int]           # moved tensors packed while diverged, since the last op dispatched
    moved_packs: list[tuple[int, int]]  # (moved tensor, len(log) then) per pack while not diverged

    # Autograd packs the inputs an op saves before the op reaches the dispatch mode, and its outputs after:
    # a pack is judged at the next op dispatched. Packed while diverged, it is the model's own ops' save
    # unless the next op is the graph's op the step re-synchronises at and the graph has it save the tensor.

    def diverge(self, k: int, why: str) -> None:
        """The model's ops differ from the graph's from position ``k`` on (``why`` says how)."""
        if self.ex.fused is not None:  # fused updates are checked op by op against the graph's modules
            self._fail(f"{why}; re-profile and re-solve for this model and batch")
        g = self.g
        prev = k - 1
        while prev >= 0 and g.ops[prev].name == DETACH:
            prev -= 1
        n = len(self.log)  # packed since the last op matched: its output saves, or the op that differs saves
        self.stray_saves += [t for t, at in self.moved_packs if at == n and (prev < 0 or t not in g.ops[prev].saved)]
        self.diverged = (k, why)
        self.n_fast = -1  # every op to the full handler, which runs it as it is

    def stray(self, func, args, kwargs):
        """An op of a diverged region: run as the model has it. The first step knows every storage (a
        later op's new storage is one it has not seen), so it registers these as no graph tensor."""
        if self.pending_saves:
            self.stray_saves += self.pending_saves
            self.pending_saves.clear()
        if not self.fast:
            for t in tensors_in((args, kwargs)):
                self._see(t, -1)
        out = func(*args, **kwargs)
        if not self.fast:
            for t in tensors_in(out):
                self._see(t, -1)
        return out

    def resync_at_op(self, func) -> bool:
        """While diverged: is ``func`` the graph's next op of its name in the module call where the ops
        began to differ? Then the step is back there (True), and the op runs as the graph's."""
        ex = self.ex
        k, why = self.diverged
        at = ex.op_at(str(func), k)
        if at is None or ex.concern_count[at] != ex.concern_count[k]:
            # none; or the ops left out before it would touch the plan: this op may be one the model adds
            # before the graph's (an insertion), so the step looks further (refused at the boundary if not)
            return False
        if self.pending_saves:  # packed for this op: fine if the graph's op saves them too
            self.stray_saves += [t for t in self.pending_saves if t not in self.g.ops[at].saved]
            self.pending_saves.clear()
        self.skip(k, at, f"op {at} ({self.g.ops[at].name}), the same op later in the same module call", why)
        return True

    def at_boundary(self, key: Boundary) -> None:
        """The step, watched, meets module boundary ``key``: re-synchronise there if its ops differed, or
        if the graph reached this boundary after ops the model did not run."""
        ex = self.ex
        j = ex.positions.get(key)
        if j is None:
            return
        if self.diverged is not None:
            k, why = self.diverged
            if j < k:  # a boundary the graph passed before the ops differed: not where the step is
                return
            self.stray_saves += self.pending_saves
            self.pending_saves.clear()
            self.skip(k, j, where(key), why)
            return
        c = self.cursor
        if j <= c or not ex.recorded_calls:
            return
        if ex.next_real[c] >= j:  # only autograd's detaches in between (not dispatched under the hooks)
            while self.cursor < j:
                self._passed_detach()
            return
        op = self.g.ops[c]
        self.skip(c, j, where(key), f"the model reached {where(key)} after {c} forward ops, the profiled graph "
                                    f"after {j}: ops {c}..{j - 1} ({op.name}, module {op.module or '?'}, ...) did "
                                    f"not run")

    def skip(self, k: int, j: int, at: str, why: str) -> None:
        """Graph ops ``k``..``j - 1`` did not run as profiled and the step is at position ``j`` (``at`` says
        where that is: a module boundary, an op, the end of the forward): refuse if the plan decides
        something there (module docstring), else note the tensors made there that a replay reads, for
        :meth:`bind_inputs`."""
        ex, g = self.ex, self.g
        concerns = ex.concerns
        for p in range(k, j):
            hit = concerns.get(p)
            if hit is not None:
                tid, relation = hit
                self._refuse(tid, f"{relation} op {p} ({g.ops[p].name}), which did not run as profiled", p, why, at)
        if self.stray_saves:
            tid = self.stray_saves[0]
            self._refuse(tid, "is saved by ops of the model the profiled step did not run",
                         self.g.tensors[tid].producer, why, at)
        tracked = ex.watch_plan.tracked
        for p in range(k, j):
            for t in g.ops[p].outputs:
                if t in tracked:
                    self.unbound[t] = why
        self.diverged = None
        self.resyncs += 1
        self.n_fast = ex.last_real_op + 1
        self.cursor = max(self.cursor, j)

    def _refuse(self, tid: int, relation: str, op: int | None, why: str, at: str | None) -> None:
        g = self.g
        info = g.tensors[tid]
        module = g.ops[op].module if op is not None else ""
        action = self.ex.actions.get(tid)
        role = f"which the plan marks {action.value}" if action is not None else "which a replay reads"
        self._fail(f"module {module or '(the model)'}: tensor {tid} ({info.dtype}{info.shape}, {role}) {relation}: "
                   f"{why}"
                   f"{f'; the step re-synchronised at {at}' if at else ''}; "
                   f"re-profile and re-solve for this model and batch")

    def bind_inputs(self, k: int, op: Any, args: Any, kwargs: Any) -> None:
        """Graph op ``k`` reads tensors made where the ops differed: the model's op reads its own in their
        place, in the same order (the graph's inputs are the op's tensor arguments' storages, each once,
        as the tracer met them). Each becomes that graph tensor, if its bytes are the graph's; an op run
        with another number of tensor arguments binds none (:meth:`check_bound` refuses what stays unbound)."""
        real: dict[int, tuple[torch.Tensor, torch.UntypedStorage]] = {}
        for t in tensors_in((args, kwargs)):
            s = storage_of(t)
            if s is not None and s._cdata not in real:
                real[s._cdata] = (t, s)
        found = list(real.values())
        if len(found) != len(op.inputs):  # not read here as the graph reads it: a later reader may bind it
            return
        for i, tid in enumerate(op.inputs):
            why = self.unbound.get(tid)
            if why is not None:
                t, s = found[i]
                self._bind(tid, t, s, k, op, why)

    def _made(self, tid: int) -> str:
        p = self.g.tensors[tid].producer
        return f"is made by op {p} ({self.g.ops[p].name}), which did not run as profiled, and"

    def _bind(self, tid: int, t: torch.Tensor, s: torch.UntypedStorage, k: int, op: Any, why: str) -> None:
        info = self.g.tensors[tid]
        raw = s.nbytes()
        nbytes = self.ex.device.charged_bytes(raw)
        fits = nbytes == info.bytes or (self.shapes is not None and nbytes <= info.bytes)
        entry = self.by_key.get(s._cdata)
        if not fits:
            self._refuse(tid, f"{self._made(tid)} read by op {k} ({op.name}) as {raw} B, not the profiled "
                              f"{info.bytes} B", info.producer, why, None)
        if entry is not None and entry[0] >= 0 and entry[0] != tid:
            self._refuse(tid, f"{self._made(tid)} read by op {k} ({op.name}) as tensor {entry[0]} of the graph",
                         info.producer, why, None)
        if entry is not None:
            del self.by_key[s._cdata]
        self._see(t, tid)
        if tid in self.ex.pins:
            self.pinned[tid] = s
        del self.unbound[tid]

    def check_bound(self) -> None:
        """The plan's last decision is behind: every tensor a replay reads is the model's own by now."""
        if self.unbound:
            tid, why = next(iter(self.unbound.items()))
            self._refuse(tid, f"{self._made(tid)} read by no op that ran as profiled after it",
                         self.g.tensors[tid].producer, why, None)
