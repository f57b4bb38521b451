"""Stage views of a graph: a chain of stages (op-level for a chain graph, else the coarsened module chain)
for the ``dp`` method's DAG path and the chain baselines, the chain elements the stage DP chooses between,
their chain model, and the actions a choice of kept stages or elements stands for."""

from __future__ import annotations

from dataclasses import dataclass

from memplan.planner.core.graph import Graph, coarsen
from memplan.planner.core.plan import Action
from memplan.solvers.chain.model import OpChain, chain_model, op_chain

Actions = dict[int, Action]


@dataclass(frozen=True)
class Stages:
    """A chain of stages for the baselines and the DAG path. ``produced[s]``: the saved activations
    produced by stage ``s`` (kept or recomputed together); ``inputs[s]``: the saved activations crossing
    into stage ``s`` (a checkpoint at that boundary)."""

    ops: tuple[tuple[int, ...], ...]
    produced: tuple[tuple[int, ...], ...]
    inputs: tuple[tuple[int, ...], ...]
    time_s: tuple[float, ...]
    backward_time_s: tuple[float, ...]
    produced_bytes: tuple[int, ...]
    input_bytes: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.ops)


def stage_chain(graph: Graph, max_stages: int | None = None) -> Stages:
    """Op-level stages for a chain graph (grouped evenly to at most ``max_stages``); otherwise
    ``coarsen(graph)``, or the shallowest module depth giving at least 4 stages when that gives fewer."""
    n = len(graph.ops)
    if op_chain(graph) is not None:
        per = 1 if max_stages is None or n <= max_stages else -(-n // max_stages)
        groups = [tuple(range(i, min(i + per, n))) for i in range(0, n, per)]
    else:
        chain = coarsen(graph)
        if len(chain) < 4 and graph.ops:
            deepest = max(len([p for p in op.module.split(".") if p]) for op in graph.ops)
            for d in range(1, deepest + 1):
                finer = coarsen(graph, d)
                if len(finer) >= 4:
                    chain = finer
                    break
        groups = [s.ops for s in chain.stages]
        if max_stages is not None and len(groups) > max_stages:
            per = -(-len(groups) // max_stages)
            groups = [tuple(o for g in groups[i:i + per] for o in g) for i in range(0, len(groups), per)]
    saved = set(graph.saved_activations)
    tensors = graph.tensors
    stage_of = {}
    for s, ops in enumerate(groups):
        for o in ops:
            stage_of[o] = s
    produced: list[list[int]] = [[] for _ in groups]
    for t in graph.saved_activations:
        produced[stage_of[tensors[t].producer]].append(t)
    inputs: list[list[int]] = []
    for s, ops in enumerate(groups):
        crossing = {t for o in ops for t in (*graph.ops[o].inputs, *graph.ops[o].saved)
                    if t in saved and stage_of[tensors[t].producer] < s}
        inputs.append(sorted(crossing))
    return Stages(
        ops=tuple(tuple(g) for g in groups), produced=tuple(map(tuple, produced)), inputs=tuple(map(tuple, inputs)),
        time_s=tuple(sum(graph.ops[o].time_s for o in g) for g in groups),
        backward_time_s=tuple(sum(graph.ops[o].backward_time_s for o in g) for g in groups),
        produced_bytes=tuple(sum(tensors[t].bytes for t in p) for p in produced),
        input_bytes=tuple(sum(tensors[t].bytes for t in i) for i in inputs))


def stage_actions(graph: Graph, stages: Stages, keep_stages, keep_inputs=()) -> Actions:
    """Keep what the kept stages produce and the activations crossing into the checkpointed stages;
    recompute every other saved activation that can be (zero-byte ones are kept: nothing to gain)."""
    keep: set[int] = set()
    for s in keep_stages:
        keep.update(stages.produced[s])
    for s in keep_inputs:
        keep.update(stages.inputs[s])
    tensors = graph.tensors
    return {t: Action.RECOMPUTE for p in stages.produced for t in p
            if t not in keep and tensors[t].recomputable and tensors[t].bytes > 0}


def chain_elements(graph: Graph, stages: Stages, split: bool) -> list[tuple[int, tuple[int, ...]]]:
    """The chain elements of the stage DP: (stage, saved tensors kept or recomputed together). Whole
    stages, or (``split``) each stage's inner activations, then those it hands on to later stages (its
    boundary: keeping it while recomputing the inside is rotor's checkpoint without x-bar)."""
    if not split:
        return list(enumerate(stages.produced))
    stage_of = {o: s for s, ops in enumerate(stages.ops) for o in ops}
    out: list[tuple[int, tuple[int, ...]]] = []
    for s, produced in enumerate(stages.produced):
        later = {t for t in produced
                 if any(stage_of[o] > s for o in (*graph.consumers.get(t, ()), *graph.savers.get(t, ())))}
        inner = tuple(t for t in produced if t not in later)
        boundary = tuple(t for t in produced if t in later)
        out += [(s, part) for part in (inner, boundary) if part]
    return out


def stage_model(graph: Graph, stages: Stages, elements: list[tuple[int, tuple[int, ...]]]) -> OpChain:
    """The chain model of the elements, as if each were one linear_chain op producing its tensors (its
    stage's time to recompute, its stage's workspace and gradients on the stage's first element): an
    approximation on a DAG, used to rank stage plans that the simulator then scores."""
    ops, tensors = graph.ops, graph.tensors
    first = {s: i for i, (s, _) in reversed(list(enumerate(elements)))}

    def per_stage(i: int, s: int, value: int) -> int:
        return value if first[s] == i else 0

    return chain_model(
        tensors=tuple(range(len(elements))), bytes_=[sum(tensors[t].bytes for t in ts) for _, ts in elements],
        time_s=[stages.time_s[s] for s, _ in elements], recomputable=[True] * len(elements),
        ws=[per_stage(i, s, max(ops[o].workspace_bytes for o in stages.ops[s])) for i, (s, _) in enumerate(elements)],
        bws=[per_stage(i, s, max(ops[o].backward_workspace_bytes for o in stages.ops[s]))
             for i, (s, _) in enumerate(elements)],
        alloc=[per_stage(i, s, sum(ops[o].backward_grad_alloc_bytes for o in stages.ops[s]))
               for i, (s, _) in enumerate(elements)],
        free=[per_stage(i, s, sum(ops[o].backward_grad_free_bytes for o in stages.ops[s]))
              for i, (s, _) in enumerate(elements)],
        fixed=graph.fixed.resident_bytes, optimizer_bytes=graph.fixed.optimizer_step_bytes)


def element_actions(graph: Graph, elements: list[tuple[int, tuple[int, ...]]], kept: list[int]) -> Actions:
    keep = {t for i in kept for t in elements[i][1]}
    tensors = graph.tensors
    return {t: Action.RECOMPUTE for _, ts in elements for t in ts
            if t not in keep and tensors[t].recomputable and tensors[t].bytes > 0}
