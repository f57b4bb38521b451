"""The simulator against numbers worked out by hand, and invariants on random graphs.

linear_chain(4): input x (100 B, fixed) -> op0 -> a1 -> op1 -> a2 -> op2 -> a3 -> op3 -> a4, 100 B each;
op i saves its input, op3 also its output; forward 1 s, backward 2 s per op; op i's backward creates
the gradient of its input and frees that of its output.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.planner import Action, Plan, PlanError, PlanMismatch, simulate
from memplan.planner.core.errors import GraphError
from memplan.planner.core.graph import FixedMemory, Graph, Op, TensorInfo
from memplan.planner.core.simulator import simulate_actions
from memplan.planner.core.synthetic import fill_structural_grads, linear_chain, random_dag
from memplan.planner.core.watch import forward_watch


def _phases(report):
    return [(e.phase, e.op) for e in report.timeline]


def test_keep_all_by_hand():
    r = simulate(linear_chain(4))
    # forward ends with x + a1..a4 = 500; op3's backward adds grad(a3) = 600
    assert r.peak_bytes == 600
    assert (r.peak_phase, r.peak_op) == ("backward", 3)
    assert r.time_s == 12.0 and r.forward_time_s == 4.0 and r.backward_time_s == 8.0
    assert r.recompute_time_s == 0 and r.recomputed_ops == 0
    assert [e.live_bytes for e in r.timeline if e.phase == "forward"] == [200, 300, 400, 500]
    # after backward only the fixed memory is left
    assert r.timeline[-1].live_bytes == 100


def test_recompute_replays_from_the_nearest_kept_tensor_once():
    g = linear_chain(4)
    r = simulate(g, Plan.for_graph(g, {1: "recompute", 2: "recompute"}))
    # a1, a2 freed in forward: forward peaks at 300; op2's backward needs a2 -> replay op0, op1,
    # keeping a1 (op1's backward still needs it): 100 + grad(a3) + a1 + a2 + grad(a2) = 500
    assert r.peak_bytes == 500
    assert r.recompute_time_s == 2.0 and r.recomputed_ops == 2
    assert r.time_s == 14.0
    notes = [e.note for e in r.timeline if e.phase == "recompute"]
    assert notes == ["recompute op 0 (synthetic.layer) for op 2's backward",
                     "recompute op 1 (synthetic.layer) for op 2's backward"]


def test_offload_frees_after_the_copy_and_prefetch_hides_it():
    g = linear_chain(4)
    g.host_bandwidth_bytes_per_s = 200.0  # 100 B take 0.5 s
    r = simulate(g, Plan.for_graph(g, {1: "offload"}))
    assert r.peak_bytes == 500
    assert r.time_s == 12.0 and r.exposed_transfer_s == 0.0
    assert r.transfer_bytes == 200 and r.host_peak_bytes == 100
    # a1's copy ends at 1.5 s; it is released at the next op boundary (op2 starts at 2 s)
    assert [e.live_bytes for e in r.timeline if e.phase == "forward"] == [200, 300, 300, 400]
    # default prefetch point: op2's backward (2 s of compute covers the 0.5 s copy)
    assert ("prefetch", 0) in _phases(r)
    assert [e.note for e in r.timeline if e.phase == "prefetch"] == ["prefetch tensor 1 (scheduled at op 2)"]


def test_late_prefetch_is_exposed():
    g = linear_chain(4)
    g.host_bandwidth_bytes_per_s = 200.0
    r = simulate(g, Plan.for_graph(g, {1: "offload"}, {1: 1}))
    assert r.exposed_transfer_s == pytest.approx(0.5)
    assert r.time_s == pytest.approx(12.5)
    assert any(e.phase == "wait" and e.op == 1 for e in r.timeline)


def test_slow_copy_keeps_the_tensor_on_device():
    g = linear_chain(4)
    g.host_bandwidth_bytes_per_s = 1.0  # 100 s per copy: never done before backward needs it
    r = simulate(g, Plan.for_graph(g, {1: "offload"}))
    assert r.peak_bytes == simulate(g).peak_bytes  # nothing was freed
    assert r.exposed_transfer_s == 0.0


def test_workspace_and_held_tensors_count():
    g = linear_chain(3)
    g.ops[1].workspace_bytes = 1000
    assert simulate(g).peak_bytes == 100 + 200 + 1000  # x, a1, a2 plus op1's workspace
    g = linear_chain(3)
    g.tensors[3].held_by_caller = True  # the model output survives backward
    assert simulate(g).timeline[-1].live_bytes == 200


def test_freed_after_delays_release_of_unsaved_tensors():
    g = linear_chain(3)
    g.ops[1].saved = []  # a1 is no longer saved: freed after its last use (op1) ...
    g = fill_structural_grads(g.invalidate())
    assert [e.live_bytes for e in simulate(g).timeline if e.phase == "forward"] == [200, 200, 300]
    g.tensors[1].freed_after = 2  # ... unless Python held it until op2
    g.invalidate()
    assert [e.live_bytes for e in simulate(g).timeline if e.phase == "forward"] == [200, 300, 300]


def test_optimizer_step_transient():
    g = linear_chain(2)
    g.fixed = FixedMemory(inputs_bytes=100, optimizer_state_bytes=50, optimizer_step_bytes=10_000)
    g.optimizer_time_s = 3.0
    r = simulate(g)
    assert r.peak_bytes == 150 + 10_000 and r.peak_phase == "optimizer"
    assert r.time_s == 2 + 4 + 3


def test_plan_checks():
    g = linear_chain(4)
    with pytest.raises(PlanError, match="prefetch_at op 0 comes after its first backward use"):
        simulate(g, Plan.for_graph(g, {2: "offload"}, {2: 0}))
    with pytest.raises(PlanError, match="only meaningful for offload"):
        simulate(g, Plan.for_graph(g, {2: "recompute"}, {2: 3}))
    g.tensors[2].recomputable = False
    with pytest.raises(PlanError, match="tensor 2 .* cannot be recomputed"):
        simulate(g, Plan.for_graph(g, {2: "recompute"}))
    other = linear_chain(5)
    with pytest.raises(PlanMismatch, match="re-solve for this graph"):
        simulate(other, Plan.keep_all(g))
    with pytest.raises(PlanError, match="not an activation saved for backward"):
        simulate(g, Plan(graph_fingerprint=g.fingerprint, decisions=[{"tensor": 0, "action": "recompute"}]))


def test_replay_through_a_non_recomputable_tensor_pins_it():
    # a1 (500 B) cannot be rebuilt (say, mutated in place later) and is not saved, so the forward would
    # free it after op 1; recomputing a2 = op1(a1) in backward needs that very tensor, so the plan pins a1
    # from its production until the replay at op 2's backward, and pays for it.
    g = linear_chain(4, activation_bytes=[500, 100, 100, 100])
    g.tensors[1].recomputable = False
    g.ops[1].saved = []
    g.invalidate()
    keep = simulate(g, Plan.keep_all(g))
    r = simulate(g, Plan.for_graph(g, {2: "recompute"}))
    after = {(e.phase, e.op): e.live_bytes for e in r.timeline}
    assert [after[("forward", i)] for i in range(4)] == [600, 700, 700, 800]  # a1 stays; a2 goes after op 2
    assert after[("recompute", 1)] == 800            # a2 rebuilt from the pinned a1
    assert after[("backward", 2)] == 200              # a1 released with a2 after op 2's backward
    assert (r.peak_bytes, keep.peak_bytes) == (900, 700)  # recomputing here costs memory: no solver picks it
    assert r.recompute_time_s == 1.0 and r.time_s == keep.time_s + 1.0


def test_replay_reruns_the_in_place_initialisers():
    # a2 is made by op 1 (an empty_like, say) and finished in place by op 2 (bernoulli_), then read and
    # saved by op 3: recomputing a2 replays op 1 and then op 2, and both are charged
    T = [TensorInfo(id=0, kind="input", bytes=100),
         TensorInfo(id=1, kind="activation", producer=0, bytes=100, requires_grad=True),
         TensorInfo(id=2, kind="activation", producer=1, bytes=100, rebuilt_by=[2]),
         TensorInfo(id=3, kind="activation", producer=3, bytes=100, requires_grad=True)]
    ops = [Op(id=0, name="layer", time_s=1.0, backward_time_s=2.0, inputs=[0], outputs=[1], saved=[0],
              has_backward=True),
           Op(id=1, name="empty_like", time_s=0.5, inputs=[1], outputs=[2]),
           Op(id=2, name="bernoulli_", time_s=0.25, inputs=[2], random=True),
           Op(id=3, name="mul", time_s=1.0, backward_time_s=2.0, inputs=[1, 2], outputs=[3], saved=[1, 2, 3],
              has_backward=True)]
    g = fill_structural_grads(Graph(name="init", tensors=T, ops=ops, fixed=FixedMemory(inputs_bytes=100)))
    keep = simulate(g, Plan.keep_all(g))
    r = simulate(g, Plan.for_graph(g, {2: "recompute"}))
    assert [e.op for e in r.timeline if e.phase == "recompute"] == [1, 2]
    assert r.recompute_time_s == 0.75
    assert r.time_s == pytest.approx(keep.time_s + 0.75)
    bad = g.model_dump()
    bad["tensors"][2]["rebuilt_by"] = [0]
    with pytest.raises(GraphError, match="rebuilt_by names op 0"):
        Graph.from_dict(bad)
    bad["tensors"][2]["rebuilt_by"] = [3]
    with pytest.raises(GraphError, match="must read it and create no tensor"):
        Graph.from_dict(bad)


def test_replay_needing_a_lost_tensor_is_refused():
    # recomputing a non-recomputable tensor itself is a malformed plan
    g = linear_chain(4)
    g.tensors[1].recomputable = False
    g.invalidate()
    with pytest.raises(PlanError, match="neither kept nor recomputable"):
        simulate_actions(g, {1: Action.RECOMPUTE, 2: Action.RECOMPUTE})


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 14), seed=st.integers(0, 10_000), data=st.data())
def test_invariants_on_random_dags(n, seed, data):
    g = random_dag(n, seed=seed)
    saved = g.saved_activations
    acts = data.draw(st.lists(st.sampled_from(list(Action)), min_size=len(saved), max_size=len(saved)))
    actions = dict(zip(saved, acts, strict=True))
    base = simulate_actions(g, {}, timeline=True)
    r = simulate_actions(g, actions, timeline=True)
    # the report's peak is the timeline's peak, and never below any single moment's need
    assert r.peak_bytes == max(e.peak_bytes for e in r.timeline)
    # no plan makes the step faster than keeping everything; time adds up
    assert r.time_s >= base.time_s - 1e-9
    assert r.time_s == pytest.approx(r.forward_time_s + r.backward_time_s + r.recompute_time_s
                                     + r.exposed_transfer_s + r.optimizer_time_s)
    # every byte allocated is released by the end of the step (synthetic graphs hold nothing)
    assert r.timeline[-1].live_bytes == base.timeline[-1].live_bytes == g.fixed.resident_bytes
    # the lower bound used to refuse budgets is sound
    from memplan.solvers import memory_lower_bound
    assert memory_lower_bound(g) <= r.peak_bytes


def test_a_replayed_op_costs_its_time_and_the_executors_dispatch():
    g = linear_chain(4)
    g.replay_op_dispatch_s = 0.25
    r = simulate(g, Plan.for_graph(g, {1: "recompute", 2: "recompute"}))
    # the two replayed ops of test_recompute_replays_from_the_nearest_kept_tensor_once, 1 s + 0.25 s each
    assert r.recomputed_ops == 2 and r.recompute_time_s == 2.5 and r.time_s == 14.5
    assert simulate(g).time_s == 12.0  # nothing replayed, nothing charged


def test_the_executors_watched_forward_ops_are_charged():
    """Recomputing tensors 1 and 2 of a 4-op chain replays ops 0 and 1: the executor watches ops 0-1 (their
    producers and the replayed ops, planner/core/watch.py), charged watch_op_dispatch_s each in forward."""
    g = linear_chain(4)
    g.replay_op_dispatch_s = 0.25
    g.watch_op_dispatch_s = 0.5
    r = simulate(g, Plan.for_graph(g, {1: "recompute", 2: "recompute"}))
    assert (r.watched_ops, r.watch_time_s) == (2, 1.0)
    assert r.time_s == 15.5 and r.forward_time_s == 5.0
    w = forward_watch(g, {1: Action.RECOMPUTE, 2: Action.RECOMPUTE}, replayed_ops=[0, 1])
    assert (w.first, w.last, w.needed, w.tracked, w.full) == (0, 1, {0, 1}, {1, 2}, False)
    # only tensor 3 recomputed: op 2 replays from tensor 2, which the executor must find by its id
    w = forward_watch(g, {3: Action.RECOMPUTE}, replayed_ops=[2])
    assert (w.first, w.last, w.tracked) == (1, 2, {2, 3})
    # offload: every op's autograd node is tagged, from op 0 to the last saver (op 2 saves tensor 2)
    w = forward_watch(g, {2: Action.OFFLOAD}, replayed_ops=[])
    assert w.full and (w.first, w.last) == (0, 2) and w.needed == {0, 1, 2}
    assert simulate(g).watched_ops == 0 and forward_watch(g, {}, []).ops == 0  # nothing moved: plain
