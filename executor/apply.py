"""``apply(model, plan, ...)``: run an unchanged training loop under a plan.

    ex = memplan.executor.apply(model, "plan.json", graph="graph.json", optimizer=opt)
    for batch in data:                       # the loop does not change
        opt.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        opt.step()
    ex.remove()                              # or: with memplan.executor.apply(...) as ex: ...

A step begins at the model's forward (a forward pre-hook on the root module enters the op-counting mode
and the saved-tensor hooks; ops of the loss after the model's forward are counted too, as the profiler
counted them) and its forward ends when backward starts; the mode is left at ``optimizer.step()``, at the
next forward, or at ``remove()``. Only training forwards with grad enabled are planned.

What a step pays is what its plan needs: a plan that moves nothing (and no fusion) runs with neither the
mode nor the hooks, as plain training. Otherwise the saved-tensor hooks are on for all of forward and the
mode for the window of ops the plan needs watched (``planner/core/watch.py``, which the simulator charges:
from the producer of the first tensor it moves, reads or re-creates to the last op a replay runs). The
first step watches every op from the start; it learns each op's ATen overload, where its new tensors are
among its outputs, and the op position at each module boundary. Later steps enter the mode at the last
module boundary before the window and leave it at the first after it; inside, an op the plan decides
nothing about is only checked to be the graph's op at that position (its overload compared by identity),
and the ops that produce tracked tensors or are replayed take the full handler (recipes, shape checks,
tensor ids). Ops outside the window are not matched against the graph (a divergence there cannot touch a
decision); a divergence inside it, or a tracked tensor of another shape, is refused naming the op.
"""

from __future__ import annotations

import bisect
import contextlib
import difflib
import functools
import itertools
import math
import warnings
import weakref
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

from memplan.executor.hoststep import host_stand_ins
from memplan.executor.recipes import SIGNATURES_PER_OP, Segment
from memplan.executor.states import StateStreamer
from memplan.executor.step import Packed, Step, StepMode, held, prefetch_order, release_order
from memplan.executor.transfers import HostPool
from memplan.planner.core.boundaries import BEGIN, END, Boundary, boundary_positions
from memplan.planner.core.errors import MemplanError, MemplanWarning, PlanError, PlanMismatch
from memplan.planner.core.graph import DETACH, Graph
from memplan.planner.core.plan import Action, Plan
from memplan.planner.core.schedule import Schedule, schedule
from memplan.planner.core.shapes import family_of
from memplan.planner.core.simulator import simulate, static_facts
from memplan.planner.core.units import format_bytes
from memplan.planner.core.watch import forward_watch, fused_forward_watch
from memplan.planner.probe.device import device_of
from memplan.planner.probe.fusion import BACKWARD_STEPPERS, FusedOptimizer
from memplan.planner.probe.profiler import model_fingerprint
from memplan.planner.workloads import refuse_compiled


def _fingerprint_diff(model: nn.Module, graph: Graph | None) -> str:
    """Name the first parameter that differs from the profiled model's. The graph keeps the parameters'
    shapes and dtypes in registration order (one per storage), not their names, so the two sequences are
    aligned (difflib) and the first parameter of this model outside the alignment is named."""
    if graph is None:
        return ""
    ours: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        key = p.untyped_storage()._cdata
        if key not in seen:  # the profiler registered each storage once
            seen.add(key)
            ours.append((name, p))
    theirs = [t for t in graph.tensors if t.kind == "param"]

    def sig(shape, dtype) -> str:
        return f"{dtype}{list(shape)}"

    a = [sig(p.shape, str(p.dtype).removeprefix("torch.")) for _, p in ours]
    b = [sig(t.shape, t.dtype) for t in theirs]
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        if tag == "replace":
            return f": parameter {ours[i1][0]} is {a[i1]} here, {b[j1]} in the profiled model"
        if tag == "delete":  # only in this model
            more = f" and {i2 - i1 - 1} more after it" if i2 - i1 > 1 else ""
            return (f": parameter {ours[i1][0]} ({a[i1]}){more} is not in the profiled model "
                    f"({len(a)} parameter tensors here, {len(b)} there)")
        after = f" after {ours[i1 - 1][0]}" if i1 > 0 else " at the start"
        return (f": the profiled model has {j2 - j1} more parameter tensor(s){after} (first {b[j1]}) "
                f"({len(a)} here, {len(b)} there)")
    return ": parameter names differ (shapes and dtypes agree)"


def _load(plan: Plan | str | Path, graph: Graph | str | Path | None) -> tuple[Plan, Graph]:
    plan_path = None
    if not isinstance(plan, Plan):
        plan_path = Path(plan)
        plan = Plan.load(str(plan_path))
    if graph is None:
        sibling = plan_path.with_name("graph.json") if plan_path is not None else None
        if sibling is None or not sibling.is_file():
            raise PlanError("the executor needs the graph the plan was made for: pass graph=Graph or a path "
                            "(memplan plan writes graph.json next to plan.json)")
        graph = sibling
    if not isinstance(graph, Graph):
        graph = Graph.load(str(graph))
    return plan, graph


class Executor:
    """A plan applied to a model (and optionally its optimizer). See :func:`apply`."""

    def __init__(self, model: nn.Module, plan: Plan, graph: Graph, *, optimizer: torch.optim.Optimizer | None,
                 fuse: str | None, accumulation_steps: int, max_grad_norm: float | None):
        plan.check_against(graph)
        fp = model_fingerprint(model)
        expected = plan.model_fingerprint or graph.model_fingerprint
        if expected and fp != expected:
            raise PlanMismatch(f"the plan was made for model {expected}, this model is {fp}"
                               f"{_fingerprint_diff(model, graph)}; re-profile and re-solve for this model")
        if fuse is not None and optimizer is None:
            raise MemplanError(f"fuse={fuse!r} needs the optimizer: apply(..., optimizer=opt)")
        if max_grad_norm is not None and fuse is None:
            raise MemplanError("max_grad_norm is applied by fused steps; without fusion call "
                               "torch.nn.utils.clip_grad_norm_ in the loop as usual")
        self.model = model
        self.plan = plan
        self.graph = graph
        self.optimizer = optimizer
        self.family = family_of(graph)  # a step may run any shape of it up to the graph's own
        self.actions = {t: a for t, a in plan.actions().items() if a != Action.KEEP}
        offloaded = sorted(t for t, a in self.actions.items() if a == Action.OFFLOAD)
        # the plan lowered once (planner/core/schedule.py): where each prefetch starts, what replays pin; a
        # step's ``events`` record what it performed in the same terms (Schedule.executed() compares)
        self.schedule: Schedule = schedule(graph, plan, check=False, fuse=fuse)
        # Forward records a recipe only for the ops the schedule's replays run (the executor replays
        # what the schedule says, event for event), and captures RNG state only before the random ones
        # among them: a CPU generator state is 5 KiB per capture, held all step.
        self.recorded_ops = frozenset(p for ev in self.schedule.replays() for p in ev.ops)
        self.records = bool(self.recorded_ops)
        self.rng_ops = frozenset(p for p in self.recorded_ops if graph.ops[p].random)
        # A plan that moves nothing needs no per-op work: without forward fusion, a step runs with neither the
        # op-counting mode nor the saved-tensor hooks (plain training; the op-by-op graph check is skipped,
        # there being no decision it protects).
        # Forward fusion checks each forward op's inputs against the updates still pending; backward fusion
        # works from gradient hooks alone and watches what the plan needs, as without fusion.
        self.watch = bool(self.actions) or fuse == "forward"
        self.prefetch_order = prefetch_order(self.schedule.prefetch_at)
        self.release_order = release_order(self.schedule.released)
        self.pins = dict(self.schedule.pins)
        self.tag_nodes = bool(offloaded) or bool(self.pins)
        # The forward ops the step watches (planner/core/watch.py, which the simulator charges): the mode is
        # entered at the last module boundary before ``watch.first`` and left at the first one after
        # ``watch.last`` (the saved-tensor hooks stay on all forward), so the rest of forward and all of
        # backward dispatch plainly. Inside, only the ``needed`` ops take the full handler.
        self.watch_plan = forward_watch(
            graph, self.actions, self.recorded_ops, self.pins,
            # backward steps whose nodes are tagged: prefetches and releases start there
            [*self.schedule.prefetch_at.values(),
             *(k for phase, k in self.schedule.released.values() if phase == "backward")],
            static_facts(graph).d2h_after,
            release_ops=[k for phase, k in self.schedule.released.values() if phase == "forward"])
        if fuse == "forward":  # the ops that read parameters are checked against pending updates
            self.watch_plan = fused_forward_watch(graph, self.watch_plan)
        self.watch_until = self.watch_plan.last
        self.needed = [k in self.watch_plan.needed for k in range(len(graph.ops))]
        # learned by the first watched step (``Step.fast`` steps use them): op k's ATen overload, the
        # positions of its new storages among its flattened outputs, and the op position at each module
        # boundary it met (module path, call number, begin or end), where a later step enters the mode
        self.funcs: list = [None] * len(graph.ops)
        self.new_positions: list[tuple[int, ...] | None] = [None] * len(graph.ops)
        self.boundaries: list[tuple[Boundary, int]] = []
        self.learned = False
        self.enter_at: Boundary | None = None  # where a fast step enters the mode (None: at once)
        self.enter_cursor = 0
        self.last_real_op = max((op.id for op in graph.ops if op.name != DETACH), default=-1)
        # where a step whose ops differ from the graph's is back at the graph's position
        # (planner/core/boundaries.py; executor/resync.py): the graph's module boundaries, whether the
        # graph recorded them (or they are derived, and used only once the ops differed), the first op
        # after each position that is not autograd's detach, and what the plan decides at each op
        self.positions = boundary_positions(graph)
        self.recorded_calls = bool(graph.module_calls)
        # how many times the profiled step called the model (a loss_fn may call it twice: a siamese or
        # contrastive loss); a call of the model within a step's forward is that step's, up to this many
        self.model_calls = max(1, sum(1 for c in graph.module_calls if c.path == ""))
        self.next_real = _next_real(graph)
        self.concerns = self._concerns(static_facts(graph).d2h_after)
        self.concern_count = list(itertools.accumulate((p in self.concerns for p in range(len(graph.ops))),
                                                       initial=0))  # concerns before each position
        self.call_end = _call_ends(graph) if self.recorded_calls else [0] * len(graph.ops)
        self.by_name: dict[str, list[int]] = {}
        for op in graph.ops:
            if op.name != DETACH:
                self.by_name.setdefault(op.name, []).append(op.id)
        # the device the graph was profiled on, as this machine has it (a CUDA graph needs a GPU or the
        # emulation): how it charges bytes, its copy stream, its generators
        self.device = device_of(graph.device)
        self.pool = HostPool(graph, offloaded, self.device)  # allocated once, reused every step
        streamed, hosted = plan.streamed(), plan.hosted()
        self.copies = self.device.copy_stream() if offloaded or streamed or hosted else None
        if (streamed or hosted) and optimizer is None:
            raise MemplanError(f"the plan moves the optimizer state of {len(streamed) + len(hosted)} unit(s) off "
                               f"the device: apply(..., optimizer=opt) with the optimizer it was profiled with")
        # the streamed and host-stepped units' optimizer state, in their own host pools (executor/states.py,
        # executor/hoststep.py)
        self.states = (StateStreamer(model, optimizer, graph, streamed, self.device, self.copies, hosted,
                                     self.schedule.grads_released)
                       if streamed or hosted else None)
        self.fixed_tensors = list(model.parameters()) + list(model.buffers())
        self.step_state: Step | None = None
        self.last_step: Step | None = None
        self.busy = False
        self.steps = 0
        # compiled replays, kept across steps (recipes.Segment): target -> segments, newest first; recorded
        # op -> the recipe signatures seen for it, as (id, signature); and counts of what each replay did
        # ("planned" / "plan reused", "compiled" / "recompiled" / "compiled reused")
        self.segments: dict[int, list[Segment]] = {}
        self.signatures: dict[int, list[tuple[int, tuple]]] = {}
        self.segment_stats: Counter[str] = Counter()
        self.expected_outputs: dict[int, tuple] = {}  # tensor id -> (dtype, bytes, shape) as a step met the graph's
        self.reuse_replays = True  # False: every replay is planned and run op by op (for comparisons)
        self._signature_ids = itertools.count()
        # what the executor owns refers back to it weakly (the mode, each Step, the saved-tensor hooks, the
        # optimizer's shadows): after remove(), dropping the executor, the model and the optimizer frees them
        # by reference counting, as plain PyTorch frees a model and its optimizer, not at a later collection
        me = weakref.ref(self)
        self._mode = StepMode(self)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(functools.partial(_weak_pack, me), Executor._unpack)
        self._entered = False
        self._mode_entered = False
        self.fused = (FusedOptimizer(model, optimizer, fuse, accumulation_steps=accumulation_steps,
                                     max_grad_norm=max_grad_norm,
                                     exclude=self.states.hosted_params() if self.states is not None else ())
                      if fuse is not None else None)
        if self.states is not None and self.fused is not None:
            # backward fusion steps the resident and the streamed units (their state fetched around it)
            self.states.fused = True
            self.fused.around = self.states.fused_bucket
        if fuse == "backward" or (self.states is not None and self.states.hoststep is not None):
            _refuse_grad_scaling(self)  # and guard the clipping functions (host-stepped: they see the host's)
        self._handles = [model.register_forward_pre_hook(self._begin)]
        # an exception that leaves the model's forward (a bad batch, a hook, KeyboardInterrupt) ends the step
        # there: the mode and the hooks must not outlive it into the loop's recovery code
        self._forward_shadow = _forward_guard(model, self)
        if self.watch and fuse is None:
            for path, module in model.named_modules():
                self._handles.append(module.register_forward_pre_hook(functools.partial(self._boundary, path, BEGIN)))
                self._handles.append(module.register_forward_hook(functools.partial(self._boundary, path, END)))
        if self.fused is not None and fuse == "forward":
            for module in self.fused.module_buckets:
                if module is not model:
                    self._handles.append(module.register_forward_pre_hook(self._before_module))
        if optimizer is not None:
            real_step = optimizer.step

            def step(closure=None):
                ex = me()
                if ex is not None:
                    ex.end_step()
                    if ex.fused is not None:
                        if ex.states is not None and ex.states.hoststep is not None:
                            ex.states.hoststep.before_step()  # the schedule frees their gradients first
                        loss = ex.fused.user_step(closure)
                        if ex.states is not None:  # the moved units' updates, after what fusion left
                            ex.states.step(real_step, None, ex.last_step.log if ex.last_step is not None else None)
                        return loss
                    if ex.states is not None:
                        return ex.states.step(real_step, closure,
                                              ex.last_step.log if ex.last_step is not None else None)
                return real_step(closure) if closure is not None else real_step()

            real_zero_grad = optimizer.zero_grad

            def zero_grad(set_to_none: bool = True):
                ex = me()
                if ex is not None:
                    ex.end_step()  # a step whose backward never came (a skipped batch) ends here
                    if ex.states is not None and ex.states.hoststep is not None:
                        ex.states.hoststep.zero_grad()
                return real_zero_grad(set_to_none=set_to_none)

            optimizer.step = step  # type: ignore[method-assign]
            optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
            self._step_shadow = step
            self._zero_grad_shadow = zero_grad

    def _concerns(self, d2h_after: dict[int, int]) -> dict[int, tuple[int, str]]:
        """Forward op -> (tensor, how the op touches it) where the plan decides something at the op: it makes
        or saves a tensor the plan moves, writes an offloaded one last, or a replay re-runs it. A step whose
        ops differ from the graph's is refused where such an op did not run as profiled (resync.py)."""
        g = self.graph
        out: dict[int, tuple[int, str]] = {}
        for t, action in sorted(self.actions.items()):
            out.setdefault(g.tensors[t].producer, (t, "is made by"))
            for s in g.savers.get(t, ()):
                out.setdefault(s, (t, "is saved by"))
            if action == Action.OFFLOAD and t in d2h_after:
                out.setdefault(d2h_after[t], (t, "is written last by"))
        for p in sorted(self.recorded_ops):
            made = g.ops[p].outputs or g.ops[p].inputs
            if made and p not in out:
                out[p] = (made[0], "is re-created by a replay that re-runs")
        return out

    def op_at(self, name: str, k: int) -> int | None:
        """The first graph op named ``name`` at or after position ``k`` that the innermost module call
        running op ``k`` runs itself (not a call inside it); None if there is none among the first few
        ops of that name, or the graph did not record its module calls."""
        ids = self.by_name.get(name)
        if not ids:
            return None
        end = self.call_end[k]
        module = self.graph.ops[k].module
        i = bisect.bisect_left(ids, k)
        for q in ids[i:i + 8]:
            if q >= end:
                return None
            if self.call_end[q] == end and self.graph.ops[q].module == module:
                return q
        return None

    def signature_id(self, op: int, signature: tuple) -> int:
        """A number for recorded op ``op``'s recipe signature (recipes.recipe_signature), the same for
        equal signatures while it is remembered (the last few per op); a forgotten one gets a new number,
        so a compiled replay traced from it is never taken for another."""
        known = self.signatures.setdefault(op, [])
        for i, sig in known:
            if sig == signature:
                return i
        i = next(self._signature_ids)
        known.insert(0, (i, signature))
        del known[SIGNATURES_PER_OP:]
        return i

    # ---- the step's boundaries ---------------------------------------------------------------------
    def _begin(self, module: nn.Module, _args) -> None:
        if not (module.training and torch.is_grad_enabled()):
            # an evaluation forward (or one without grad) is not a step: the one still open (its forward
            # raised, or its backward never came) ends here, so that these ops are not matched against it
            self.end_step()
            if self.fused is not None:
                # an evaluation forward reads the parameters too: apply the root's pending updates, as
                # the pre-hooks of the other modules do for theirs
                with self.internal():
                    self.fused.before_module(module)
            return
        step = self.step_state
        if (step is not None and not step.backward_started and not step.failed
                and step.model_calls < self.model_calls):
            step.model_calls += 1  # the step's loss calls the model again, as in the profiled step
            return
        # a step still open ends here: the loop's next step begins (a forward that raised, or whose backward
        # never came, is abandoned)
        self.end_step()
        if self.fused is not None:
            self.fused.begin_forward()
            with self.internal():
                self.fused.before_module(module)
        self.step_state = Step(self)
        self.steps += 1
        if self.states is not None:
            self.states.log = self.step_state.log  # where backward's state and gradient copies are logged
            if self.states.hoststep is not None:
                self.states.hoststep.log = self.step_state.log
        if not self.watch:
            self.step_state.forward_done = True
            return
        self._hooks.__enter__()
        self._entered = True
        if not (self.step_state.fast and self.enter_at is not None):  # else at boundary ``enter_at``
            self._mode.__enter__()
            self._mode_entered = True

    def _boundary(self, path: str, side: int, *_args) -> None:
        """At a module boundary (a forward pre- or post-hook of module ``path``; ``side``: BEGIN or END). Each
        step counts the calls of each module, which names the boundary (path, call number, side). The
        first watched step, watched from its first op, records the op position at each boundary; a later
        step enters the mode at the last boundary before ``watch.first``. Inside the mode the step
        re-synchronises with the graph there if its ops differed (``Step.at_boundary``). Once forward has
        passed ``watch_until``, the mode is left for the rest of the step. The saved-tensor hooks stay on all
        forward (their pack returns a kept tensor as is): with hooks installed autograd keeps saved tensors
        as the profiled graph's lifetimes have them (leaving the hooks too measured 12% below the predicted
        peak on GPT-2 under a DP plan)."""
        step = self.step_state
        if step is None or self.busy:
            return
        if step.release_queue and not step.backward_started:
            step.release_copied(step.cursor)  # where the schedule releases offloaded tensors, also outside
                                              # the mode's window
        if step.forward_done:
            return
        counts = step.ended if side else step.begun
        n = counts.get(path, 0)
        counts[path] = n + 1
        key = (path, n, side)
        if not self._mode_entered:
            if step.fast and key == self.enter_at:
                step.enter(self.enter_cursor)
                self._mode.__enter__()
                self._mode_entered = True
            return
        step.at_boundary(key)
        if not step.fast and step.diverged is None:
            self.boundaries.append((key, step.cursor))
        if (step.cursor <= self.watch_until or step.diverged is not None
                or _get_current_dispatch_mode() is not self._mode):
            return
        step.resolve_pending()
        step.check_bound()
        step.unwatched_from = step.cursor
        step.forward_done = True
        if not step.fast and not step.failed:
            self.learn()
        self._mode_entered = False
        self._mode.__exit__(None, None, None)

    def learn(self) -> None:
        """The first watched step ran its forward through the window without a mismatch: later steps take
        the fast path, entering the mode at the last recorded boundary before the window."""
        self.learned = True
        first = self.watch_plan.first
        before = [(key, c) for key, c in self.boundaries if c <= first]
        self.enter_at, self.enter_cursor = before[-1] if before and first > 0 else (None, 0)

    def begin_step(self, module: nn.Module) -> None:
        """Start a step now, as the pre-hook on ``module``'s forward does: for a caller that applies the plan
        from inside that forward's own pre-hooks (a hook registered there runs from the next call on), or
        whose step does not begin with the module's forward (a Lightning ``training_step``)."""
        self._begin(module, ())
        if self.watch and self.fused is None and any(m is module for m in self.model.modules()):
            # its boundary pre-hook did not run this call either: count that boundary as it would have,
            # or the first step's calls of it are one short of a later step's and the fast path enters
            # its window at the wrong call (HF's Trainer applies the plan from the model's pre-hook)
            path = next(name for name, m in self.model.named_modules() if m is module)
            self._boundary(path, BEGIN)

    def _before_module(self, module: nn.Module, _args) -> None:
        with self.internal(), self.outside_mode():
            self.fused.before_module(module)

    def end_step(self) -> None:
        """Leave the op-counting mode and the saved-tensor hooks, and release what the step (or the one before
        it) holds for a backward. Called at ``optimizer.step()``, ``optimizer.zero_grad()``, the next
        forward and ``remove()``: whatever ended the step, the next one starts clean. A step whose backward
        is still to come keeps working until the next of those (gradient accumulation runs each
        micro-batch's backward before the next forward)."""
        if self.last_step is not None:
            self.last_step.release()
        if not self._entered:
            if self.step_state is not None:  # an unwatched step (a plan that moves nothing)
                self.last_step, self.step_state = self.step_state, None
            return
        if self._mode_entered and _get_current_dispatch_mode() is not self._mode:
            raise MemplanError("executor: another TorchDispatchMode was entered inside the step and is still "
                               "active; leave it before optimizer.step() or the next forward")
        self._entered = False
        self._hooks.__exit__(None, None, None)
        if self._mode_entered:
            self._mode_entered = False
            self._mode.__exit__(None, None, None)
        self.last_step, self.step_state = self.step_state, None

    @contextlib.contextmanager
    def outside_mode(self) -> Iterator[None]:
        """Run below the executor's dispatch mode when it is on top (forward fusion's updates, applied in
        module pre-hooks during a watched forward): each ATen call through a Python mode costs tens of
        microseconds even when passed straight through, and a bucket's update is a dozen of them (the built-in
        GPT-2's forward-fused step read +22% over plain training with its updates inside the mode)."""
        if self._mode_entered and _get_current_dispatch_mode() is self._mode:
            with _pop_mode_temporarily():
                yield
        else:
            yield

    @contextlib.contextmanager
    def internal(self) -> Iterator[None]:
        """The executor's own ops (copies, replays, optimizer updates) are not the model's."""
        busy, self.busy = self.busy, True
        try:
            yield
        finally:
            self.busy = busy

    # ---- saved-tensor hooks -------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        step = self.step_state
        # past the mode's window too: a tracked tensor is found by its storage, whichever op saves it
        if step is None or step.failed or step.backward_started or self.busy:
            return held(t, self)
        return step.pack(t)

    @staticmethod
    def _unpack(p):
        if isinstance(p, Packed):
            step = p.step()
            if step is None:
                raise MemplanError(f"executor: backward reads tensor {p.tid} of a step that no longer exists "
                                   f"(the executor was removed or replaced before its backward ran)")
            return step.unpack(p)
        return p

    # ---- public -----------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Apply pending fused updates (forward fusion) now: before evaluating, saving or comparing."""
        self.end_step()
        if self.fused is not None:
            self.fused.flush()

    def remove(self) -> None:
        """Flush, remove every hook and give the optimizer its own ``step`` back."""
        self.flush()
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.fused is not None:
            self.fused.remove()
            _BACKWARD_FUSED.discard(self)
        _HOST_STEPPED.discard(self)
        if self.states is not None:
            self.states.remove()
        if self.optimizer is not None:
            for name, shadow in (("step", "_step_shadow"), ("zero_grad", "_zero_grad_shadow")):
                if self.optimizer.__dict__.get(name) is getattr(self, shadow, None):
                    delattr(self.optimizer, name)
        if self.model.__dict__.get("forward") is self._forward_shadow:
            del self.model.forward
        if self.last_step is not None:
            self.last_step.release()

    def abandon(self) -> None:
        """The step's forward raised: leave the mode and the hooks now, and drop what the step holds."""
        if self.step_state is not None:
            self.step_state.failed = True
        self.end_step()
        if self.last_step is not None:
            self.last_step.release()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    @property
    def host_pool_bytes(self) -> int:
        """The pinned host memory the plan holds: offloaded activations' pool and streamed state's."""
        return self.pool.bytes + (self.states.bytes if self.states is not None else 0)


def _call_ends(graph: Graph) -> list[int]:
    """Position -> the end of the innermost recorded module call that runs it (the graph's end outside
    every call: the loss)."""
    out = [len(graph.ops)] * len(graph.ops)
    for call in graph.module_calls:  # in the order they began: a nested call after the one around it
        out[call.start:call.end] = [call.end] * (call.end - call.start)
    return out


def _next_real(graph: Graph) -> list[int]:
    """Position -> the first op at or after it that is not autograd's detach (``len(ops)`` if none)."""
    out = [len(graph.ops)] * (len(graph.ops) + 1)
    for k in range(len(graph.ops) - 1, -1, -1):
        out[k] = k if graph.ops[k].name != DETACH else out[k + 1]
    return out


def _forward_guard(model: nn.Module, ex: Executor) -> Any:
    """Shadow ``model.forward`` (an instance attribute, removed by ``remove()``) with a wrapper that calls
    ``ex.abandon()`` when an exception leaves it; ``functools.wraps`` keeps its signature for callers that
    inspect it (the Hugging Face Trainer)."""
    inner = model.forward
    executor = weakref.ref(ex)  # the model must not keep the executor alive after remove()

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        try:
            return inner(*args, **kwargs)
        except BaseException:
            _abandon(executor)  # (in a frame of its own: the traceback must not hold the executor)
            raise

    model.forward = forward  # type: ignore[method-assign]
    return forward


def _weak_pack(executor: weakref.ref, t: torch.Tensor) -> Any:
    """The executor's pack hook, held without keeping the executor alive (the hooks are entered only by
    the executor, so it is there whenever they run)."""
    return executor()._pack(t)


def _abandon(executor: weakref.ref) -> None:
    live = executor()
    if live is not None:
        live.abandon()


_BACKWARD_FUSED: weakref.WeakSet[Executor] = weakref.WeakSet()  # executors that step inside backward
_HOST_STEPPED: weakref.WeakSet[Executor] = weakref.WeakSet()  # executors whose plan steps units on the host


def _refuse_grad_scaling(ex: Executor) -> None:
    """Register ``ex`` (backward fusion) with the guard on ``torch.amp.GradScaler.scale``, installed once: a
    loss scaled while a step of such an executor is open is refused before its backward. Backward fusion
    steps each module's parameters inside backward, with the gradients as they come: scaled ones, before
    the scaler's ``unscale_`` and its inf check (the steps were made, then torch's scaler failed with "No
    inf checks were recorded for this optimizer"), as PyTorch's optimizer-in-backward cannot use it either."""
    (_HOST_STEPPED if ex.fused is None else _BACKWARD_FUSED).add(ex)
    cls = torch.amp.GradScaler
    if getattr(cls.scale, "_memplan_guard", False):
        return
    unguarded = cls.scale

    def scale(self, outputs):  # noqa: ANN001, ANN202 - GradScaler.scale's own signature
        if any(e.step_state is not None for e in _BACKWARD_FUSED):
            raise MemplanError("fuse='backward' steps each module inside backward, with the gradients before "
                               "GradScaler.unscale_ and its inf check: with torch.amp.GradScaler use "
                               "fuse='forward' or no fusion")
        if any(e.step_state is not None for e in _HOST_STEPPED):
            raise MemplanError("the plan steps some units' optimizer on the host, whose gradients leave the device "
                               "during backward, out of GradScaler.unscale_'s and its inf check's sight: with "
                               "torch.amp.GradScaler plan with states='stream' (--states-on stream)")
        return unguarded(self, outputs)

    scale._memplan_guard = True  # type: ignore[attr-defined]
    cls.scale = scale  # type: ignore[method-assign]
    refuse_clipping_after_fused_backward()


_CLIPPERS = ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_")


def refuse_clipping_after_fused_backward() -> None:
    """Guard torch's gradient clipping (``torch.nn.utils.clip_grad_norm_``, ``clip_grad_value_``,
    ``clip_grads_with_norm_``, what loops, Lightning and accelerate call), installed once: clipping the
    parameters of a model whose last backward stepped it under backward fusion is refused. That backward
    applied each module's update with its unclipped gradients and freed them, so the clip found no gradient
    and did nothing (silently: the loop trained unclipped). An infinite limit clips nothing and passes (a norm
    for the logs). A function imported by name before ``apply`` (``from torch.nn.utils import
    clip_grad_norm_``) is not reached."""
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    for name in _CLIPPERS:
        unguarded = getattr(clip_grad, name, None)
        if unguarded is None or getattr(unguarded, "_memplan_guard", False):
            continue

        def clip(parameters, *args, _unguarded=unguarded, _name=name, **kwargs):  # noqa: ANN001, ANN202
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            limit = args[0] if args else kwargs.get("clip_value" if _name == "clip_grad_value_" else "max_norm")
            # an infinite limit clips nothing: a norm taken for the logs (transformers' Trainer always takes one)
            clips = not (isinstance(limit, (int, float)) and math.isinf(limit))
            stepped = [s for s in list(BACKWARD_STEPPERS) if s.stepped_in_backward] if clips else []
            if stepped and params:
                keys = {id(p) for p in params}
                for stepper in stepped:
                    if any(id(p) in keys for p in stepper.params):
                        raise MemplanError(
                            f"{_name} after a backward under fuse='backward': that backward already stepped the "
                            f"model with its unclipped gradients and freed them, so there is nothing to clip; "
                            f"use fuse='forward' (apply(..., max_grad_norm=...) or the loop's own clipping) or "
                            f"no fusion")
            return _unguarded(host_stand_ins(params), *args, **kwargs)

        clip._memplan_guard = True  # type: ignore[attr-defined]
        clip.__name__ = clip.__qualname__ = name
        clip.__doc__ = unguarded.__doc__
        for module in (clip_grad, utils):
            if getattr(module, name, None) is unguarded:
                setattr(module, name, clip)


def apply(model: nn.Module, plan: Plan | str | Path, *, graph: Graph | str | Path | None = None,
          optimizer: torch.optim.Optimizer | None = None, fuse: str | None = None, accumulation_steps: int = 1,
          max_grad_norm: float | None = None) -> Executor:
    """Apply ``plan`` (a :class:`Plan` or a plan file) to ``model`` for the training loop that follows.

    ``graph``: the graph the plan was made for (a :class:`Graph` or a file; default: ``graph.json`` beside
    the plan file). ``optimizer``: needed for ``fuse`` ("backward" or "forward", see
    :mod:`memplan.planner.probe.fusion`); ``accumulation_steps`` micro-batches per optimizer step (backward
    fusion steps in the last one); ``max_grad_norm``: global-norm clipping, forward fusion only.

    Returns the :class:`Executor` (``remove()`` undoes everything; usable as a context manager). Raises
    :class:`PlanMismatch` if the plan was made for another graph or model (naming the first differing
    parameter), and, during a step, if the model's forward ops diverge from the graph's (naming the op).
    """
    refuse_compiled(model)
    plan, graph = _load(plan, graph)
    _warn_if_solved_fused(plan, graph, fuse)
    return Executor(model, plan, graph, optimizer=optimizer, fuse=fuse, accumulation_steps=accumulation_steps,
                    max_grad_norm=max_grad_norm)


def _warn_if_solved_fused(plan: Plan, graph: Graph, fuse: str | None) -> None:
    """A plan solved for a fused step (``solve(..., fuse="backward" | "forward")``) may fit its budget only so:
    applied otherwise, say what its peak is against the budget (a warning: the budget is the user's)."""
    solved_for = plan.solver.settings.get("fuse") if plan.solver is not None else None
    if solved_for not in ("backward", "forward") or fuse == solved_for or plan.budget_bytes is None:
        return
    peak = simulate(graph, plan, timeline=False, fuse=fuse).peak_bytes
    if peak > plan.budget_bytes:
        warnings.warn(MemplanWarning(
            f"this plan was solved for the optimizer fused into {solved_for}; applied with fuse={fuse!r} its "
            f"predicted peak is {format_bytes(peak)}, over its budget of {format_bytes(plan.budget_bytes)}: "
            f"apply it with fuse={solved_for!r}, or solve again without fuse"), stacklevel=3)
