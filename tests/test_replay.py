"""planner/core/replay.py: what a replay runs, on hand-built graphs (a chain, layer norm's input, mean and
rstd, a dropout mask with its in-place initialisers, a pinned tensor that cannot be rebuilt, an
offloaded input, a depth limit), and on random DAGs against a plain recursive reference (the simulator's
former ``_materialize`` traversal, extended to the initialisers' inputs)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.planner.core.errors import PlanError
from memplan.planner.core.graph import FixedMemory, Graph, Op, TensorInfo
from memplan.planner.core.plan import Action
from memplan.planner.core.replay import kept_by_replays, reads_mid_chain, rebuild_ops, replay
from memplan.planner.core.simulator import simulate_actions
from memplan.planner.core.synthetic import linear_chain, random_dag


def test_a_chain_replays_from_the_nearest_available_tensor():
    g = linear_chain(6)  # tensor k+1 is op k's output
    r = replay(g, 5, available={2})
    assert r.ops == (2, 3, 4)
    assert r.rebuilds == (3, 4, 5)
    assert r.reads == (2,)
    # each intermediate goes right after its only reader; the target stays
    assert r.frees_after == ((), (3,), (4,))
    assert r.kept == (5,)
    assert r.missing == (5, 4, 3) and not r.blocked and not r.fetches


def test_a_retained_intermediate_stays_after_the_replay():
    g = linear_chain(6)
    r = replay(g, 5, available={2}, retain={4})  # 4 is saved by a backward step still to come
    assert r.frees_after == ((), (3,), ())
    assert r.kept == (5, 4)


def _layer_norm() -> Graph:
    """op 0 makes x; op 1 (native_layer_norm) reads x and a weight, makes y, mean, rstd and saves x, mean
    and rstd; op 2 reads y."""
    t = [TensorInfo(id=0, kind="input", bytes=8), TensorInfo(id=1, kind="param", bytes=8),
         TensorInfo(id=2, kind="activation", producer=0, bytes=64),
         TensorInfo(id=3, kind="activation", producer=1, output_index=0, bytes=64),
         TensorInfo(id=4, kind="activation", producer=1, output_index=1, bytes=4),
         TensorInfo(id=5, kind="activation", producer=1, output_index=2, bytes=4),
         TensorInfo(id=6, kind="activation", producer=2, bytes=64)]
    ops = [Op(id=0, name="aten.mm.default", inputs=[0, 1], outputs=[2], saved=[0, 1], has_backward=True),
           Op(id=1, name="aten.native_layer_norm.default", inputs=[2, 1], outputs=[3, 4, 5], saved=[2, 4, 5, 1],
              has_backward=True),
           Op(id=2, name="aten.relu.default", inputs=[3], outputs=[6], saved=[6], has_backward=True)]
    return Graph(tensors=t, ops=ops, fixed=FixedMemory(inputs_bytes=8, params_bytes=8))


def test_layer_norm_input_then_mean_and_rstd_in_one_replay():
    """Backward of the norm unpacks x, then mean and rstd (all recomputed, y kept). x's replay is op 0;
    the mean's, with x now resident, is op 1 once, re-creating mean and rstd (y is there already): rstd
    is retained for the same step, so it needs no replay of its own."""
    g = _layer_norm()
    first = replay(g, 2, available={3})
    assert first.ops == (0,) and first.kept == (2,)
    second = replay(g, 4, available={2, 3}, retain={5})
    assert second.ops == (1,)
    assert second.rebuilds == (4, 5)      # y is available: not re-created
    assert second.kept == (4, 5)
    assert second.reads == (2,)
    # without x resident, the mean's replay runs both ops, and drops x after op 1 unless retained
    both = replay(g, 4, available={3}, retain={5})
    assert both.ops == (0, 1) and both.frees_after == ((), (2,))
    assert replay(g, 4, available={3}, retain={2, 5}).kept == (4, 2, 5)


def _dropout() -> Graph:
    """a = op 0; mask = empty_like(a) (op 1), bernoulli_ (op 2), div_ (op 3) finish it in place; op 4
    multiplies a by the mask and saves both."""
    t = [TensorInfo(id=0, kind="input", bytes=8),
         TensorInfo(id=1, kind="activation", producer=0, bytes=64),
         TensorInfo(id=2, kind="activation", producer=1, bytes=64, rebuilt_by=[2, 3]),
         TensorInfo(id=3, kind="activation", producer=4, bytes=64)]
    ops = [Op(id=0, name="aten.relu.default", inputs=[0], outputs=[1], saved=[1], has_backward=True),
           Op(id=1, name="aten.empty_like.default", inputs=[1], outputs=[2]),
           Op(id=2, name="aten.bernoulli_.float", inputs=[2], random=True),
           Op(id=3, name="aten.div_.Scalar", inputs=[2]),
           Op(id=4, name="aten.mul.Tensor", inputs=[1, 2], outputs=[3], saved=[1, 2], has_backward=True)]
    return Graph(tensors=t, ops=ops, fixed=FixedMemory(inputs_bytes=8))


def _copy_initialised() -> Graph:
    """a = op 0, b = exp(a) (op 1); c = empty_like(a) (op 2) filled by copy_(c, b) (op 3) and div_ (op 4);
    op 5 reads a and c and saves both."""
    t = [TensorInfo(id=0, kind="input", bytes=8),
         TensorInfo(id=1, kind="activation", producer=0, bytes=64),
         TensorInfo(id=2, kind="activation", producer=1, bytes=64),
         TensorInfo(id=3, kind="activation", producer=2, bytes=64, rebuilt_by=[3, 4]),
         TensorInfo(id=4, kind="activation", producer=5, bytes=64)]
    ops = [Op(id=0, name="aten.relu.default", inputs=[0], outputs=[1], saved=[1], has_backward=True),
           Op(id=1, name="aten.exp.default", inputs=[1], outputs=[2], saved=[2], has_backward=True),
           Op(id=2, name="aten.empty_like.default", inputs=[1], outputs=[3]),
           Op(id=3, name="aten.copy_.default", inputs=[3, 2]),
           Op(id=4, name="aten.div_.Scalar", inputs=[3]),
           Op(id=5, name="aten.mul.Tensor", inputs=[1, 3], outputs=[4], saved=[1, 3], has_backward=True)]
    return Graph(tensors=t, ops=ops, fixed=FixedMemory(inputs_bytes=8))


def test_a_dropout_mask_replays_with_its_in_place_initialisers():
    g = _dropout()
    assert rebuild_ops(g, 2) == (1, 2, 3)
    r = replay(g, 2, available={1})
    assert r.ops == (1, 2, 3)
    assert r.rebuilds == (2,) and r.frees_after == ((), (), ())
    # the initialisers' other inputs are needed too: a copy_ from b pulls in b's producer
    h = _copy_initialised()
    r = replay(h, 3, available={1})
    assert r.ops == (1, 2, 3, 4)
    assert r.rebuilds == (2, 3)
    assert r.frees_after == ((), (), (2,), ())  # b goes after the copy_ that reads it


def test_an_unrebuildable_tensor_is_read_when_pinned_and_blocks_otherwise():
    g = _dropout()
    g.tensors[1].recomputable = False  # mutated in place later, say
    pinned = replay(g, 2, available={1})
    assert pinned.reads == (1,) and not pinned.blocked
    pinned.check(g, 4)
    lost = replay(g, 2, available=set())
    assert lost.blocked == (1,)
    with pytest.raises(PlanError, match=r"backward of op 4 needs tensor 2, whose recomputation needs tensor 1 "
                                        r"\(output of op 0 aten\.relu\.default\), which is neither kept nor "
                                        r"recomputable"):
        lost.check(g, 4)


def test_an_offloaded_input_is_fetched_not_rebuilt():
    g = linear_chain(5)
    r = replay(g, 5, available=set(), fetchable={3})
    assert r.fetches == (3,)
    assert r.ops == (3, 4)  # op 3 reads tensor 3 (fetched), op 4 makes the target from op 3's output
    assert r.rebuilds == (4, 5)
    # the target itself is rebuilt even when it has a host copy (a replay is asked for when it is missing)
    assert replay(g, 5, available={4}, fetchable={5}).ops == (4,)


def test_a_depth_limit_stops_the_traversal_at_a_frontier():
    g = linear_chain(6)
    r = replay(g, 6, available=set(), max_depth=2)
    assert r.missing == (6, 5, 4)
    assert r.frontier == (3,) and r.blocked == (3,)


def _mid_chain() -> Graph:
    """h = op 1 (from x = op 0); y = h * 3 (op 2) reads h before relu_ (op 3) finishes it; op 4 reads
    the finished h and y and saves both."""
    t = [TensorInfo(id=0, kind="input", bytes=8),
         TensorInfo(id=1, kind="activation", producer=0, bytes=64),
         TensorInfo(id=2, kind="activation", producer=1, bytes=64, rebuilt_by=[3]),
         TensorInfo(id=3, kind="activation", producer=2, bytes=64),
         TensorInfo(id=4, kind="activation", producer=4, bytes=64)]
    ops = [Op(id=0, name="aten.relu.default", inputs=[0], outputs=[1], saved=[1], has_backward=True),
           Op(id=1, name="aten.addmm.default", inputs=[1], outputs=[2], saved=[1], has_backward=True),
           Op(id=2, name="aten.mul.Tensor", inputs=[2], outputs=[3]),
           Op(id=3, name="aten.relu_.default", inputs=[2], saved=[2], has_backward=True),
           Op(id=4, name="aten.mul.Tensor", inputs=[2, 3], outputs=[4], saved=[2, 3], has_backward=True)]
    return Graph(tensors=t, ops=ops, fixed=FixedMemory(inputs_bytes=8))


def test_a_reader_mid_chain_gets_a_scratch_copy_up_to_its_op():
    g = _mid_chain()
    assert reads_mid_chain(g, 2, 2) and not reads_mid_chain(g, 3, 2) and not reads_mid_chain(g, 4, 2)
    # h resident (finished): y's replay re-creates h privately up to op 2 (not relu_), frees it after
    r = replay(g, 3, available={1, 2})
    assert r.scratch == (2,) and r.ops == (1, 2) and r.rebuilds == (3,)
    assert r.frees_after == ((), (2,)) and r.kept == (3,) and r.reads == (1,)
    # h missing and needed finished too (op 4's output): the whole chain runs once, in forward order,
    # and op 2 reads h before relu_ as in forward: no scratch copy
    both = replay(g, 4, available={1})
    assert not both.scratch and both.ops == (1, 2, 3, 4) and both.rebuilds == (2, 3, 4)
    # h resident, the target reads it finished and y (whose replay needs h mid-chain): a scratch copy for
    # op 2, the resident h for op 4
    mixed = replay(g, 4, available={1, 2})
    assert mixed.scratch == (2,) and mixed.ops == (1, 2, 4) and mixed.reads == (1, 2)
    assert mixed.frees_after == ((), (2,), (3,))
    # a mid-chain reader of a tensor that cannot be rebuilt is blocked
    g.tensors[2].recomputable = False
    assert replay(g, 3, available={1, 2}).blocked == (2,)


def test_recompute_each_is_not_kept_by_another_tensors_replay():
    """A chain whose activations are all saved: recompute keeps what a replay passes (checkpointing),
    recompute_each replays from the input for each backward step: less memory, more replays."""
    assert kept_by_replays(Action.RECOMPUTE) and not kept_by_replays(Action.RECOMPUTE_EACH)
    g = linear_chain(8)
    rebuild = {t: Action.RECOMPUTE for t in g.saved_activations if t > 1}
    each = {t: Action.RECOMPUTE_EACH for t in rebuild}
    one, per_use = simulate_actions(g, rebuild), simulate_actions(g, each)
    assert per_use.peak_bytes < one.peak_bytes
    assert one.recomputed_ops == 7  # ops 1..7 once (tensor 1 is kept)
    # backward of op 7 replays ops 1..6 for tensor 7, then op 7 for its output 8; op k < 7 replays 1..k-1
    assert per_use.recomputed_ops == 6 + 1 + sum(range(1, 6))
    assert per_use.time_s > one.time_s


def _reference_ops(g: Graph, target: int, available: set[int], fetchable: set[int]) -> set[int]:
    """A plain recursive traversal: producers and initialisers of every missing tensor."""
    ops: set[int] = set()
    seen: set[int] = set()

    def visit(u: int) -> None:
        if u in seen:
            return
        seen.add(u)
        info = g.tensors[u]
        if info.kind != "activation" or (u != target and (u in available or u in fetchable)):
            return
        if not info.recomputable:
            return
        for p in (info.producer, *info.rebuilt_by):
            ops.add(p)
            for v in g.ops[p].inputs:
                visit(v)

    visit(target)
    return ops


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 14), seed=st.integers(0, 10_000), data=st.data())
def test_random_dags_replay_what_the_reference_finds_and_free_nothing_read_later(n, seed, data):
    g = random_dag(n, seed=seed)
    acts = [t.id for t in g.tensors if t.kind == "activation"]
    target = data.draw(st.sampled_from(acts))
    available = set(data.draw(st.lists(st.sampled_from(acts), max_size=n)))
    fetchable = set(data.draw(st.lists(st.sampled_from(acts), max_size=3))) - available
    available.discard(target)
    retain = set(data.draw(st.lists(st.sampled_from(acts), max_size=3)))
    r = replay(g, target, available=available, fetchable=fetchable, retain=retain)

    assert set(r.ops) == _reference_ops(g, target, available, fetchable)
    assert list(r.ops) == sorted(r.ops)
    assert r.kept[0] == target
    have = set(r.reads) | set(r.fetches) | {t.id for t in g.tensors if t.kind != "activation"}
    for p, freed in zip(r.ops, r.frees_after, strict=True):
        assert all(v in have for v in g.ops[p].inputs), "an op of the replay reads what is not there"
        have |= set(g.ops[p].outputs)
        later = {v for q in r.ops if q > p for v in g.ops[q].inputs}
        assert not (set(freed) & later), "freed a tensor a later op of the replay reads"
        assert target not in freed and not (set(freed) & retain)
        have -= set(freed)
    assert set(r.kept) == set(r.rebuilds) - {u for f in r.frees_after for u in f}


def test_a_long_replay_that_keeps_what_it_makes_is_linear_in_its_length():
    """Its frees are found from each tensor's last use, computed once: a replay of a chain that retains
    every tensor it re-creates took 1.1 s at 4,000 ops when each op scanned everything still live (10x
    the 1,000-op time), 17 ms now (docs/benchmarks.md). Counted, not timed: the Python lines the replay
    executes grow about 8x from 1,000 to 8,000 ops; a scan per op would make them grow 40x or more."""
    import sys

    import memplan.planner.core.replay as replay_module

    def lines_run(n: int) -> int:
        g = linear_chain(n)
        replay(g, n, available=())  # the per-graph facts, once
        count = 0

        def tracer(frame, event, arg):
            nonlocal count
            if frame.f_code.co_filename != replay_module.__file__:
                return None
            if event == "line":
                count += 1
            return tracer

        sys.settrace(tracer)
        try:
            r = replay(g, n, available=(), retain=lambda u: True)
        finally:
            sys.settrace(None)
        assert len(r.ops) == n and len(r.kept) == n
        return count

    assert lines_run(8000) < 12 * lines_run(1000)
