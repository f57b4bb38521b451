"""The torch-free trace-to-graph builder (planner/core/build.py), fed hand-written traces: what the
tracer would record for a few ops, and the graph that must come out (exact figures)."""

import pytest

from memplan.planner.core.build import Trace, TraceOp, TraceStorage, backward_figures, build_graph
from memplan.planner.core.errors import GraphError
from memplan.planner.core.graph import FixedMemory


def act(tid, producer, nbytes=100, *, index=0, died=None, held=False):
    """An activation born in forward op ``producer``; ``died``: ("forward", op) / ("backward", step)."""
    return TraceStorage(tid, "activation", nbytes, "float32", [nbytes // 4], born=("forward", producer),
                        died=died, producer=producer, output_index=index, held=held)


def pre(tid, kind, nbytes=400):
    return TraceStorage(tid, kind, nbytes, "float32", [nbytes // 4])


def op(name, inputs, outputs=(), writes=(), *, random=False, time_s=1e-3):
    return TraceOp(name, "m", time_s, list(inputs), list(outputs), list(writes), random, has_backward=True)


def chain_trace() -> Trace:
    """W (param), x (input); h = x @ W (dies after relu), y = relu(h) (saved by relu), loss = sum(y)
    (held). Backward: sum's step makes dy (storage 5), relu's step frees dy and y, then makes dh (6),
    which mm's step frees with kernel scratch of 50 bytes."""
    return Trace(
        storages=[pre(0, "param"), pre(1, "input"), act(2, 0, died=("forward", 1)),
                  act(3, 1, died=("backward", 1)), act(4, 2, 4, held=True),
                  TraceStorage(5, "activation", 100, "float32", [25], born=("backward", 2), died=("backward", 1)),
                  TraceStorage(6, "activation", 100, "float32", [25], born=("backward", 1), died=("backward", 0))],
        n_fixed=2,
        ops=[op("aten.mm.default", [1, 0], [2]), op("aten.relu.default", [2], [3]), op("aten.sum.default", [3], [4])],
        saved={0: [1, 0], 1: [3]},
        backward_time_s={2: 1e-4, 1: 2e-4, 0: 3e-4},
        backward_events=[(2, 5, 100), (1, 5, -100), (1, 3, -100), (1, 6, 100), (0, -1, 50), (0, -1, -50),
                         (0, 6, -100)],
        backward_order=[2, 1, 0],
        optimizer_time_s=5e-3,
    )


def test_chain_tensors_ops_and_backward_figures():
    g = build_graph(chain_trace(), name="chain", fixed=FixedMemory(params_bytes=400, inputs_bytes=400))
    assert [(t.id, t.kind, t.producer) for t in g.tensors] == [
        (0, "param", None), (1, "input", None), (2, "activation", 0), (3, "activation", 1), (4, "activation", 2)]
    assert [t.id for t in g.tensors] == [0, 1, 2, 3, 4]  # backward-born storages 5, 6 are not tensors
    assert g.tensors[2].freed_after == 1          # died in forward while relu ran
    assert g.tensors[3].freed_after is None       # saved: lives into backward
    assert g.tensors[4].held_by_caller and not g.tensors[3].held_by_caller
    assert [o.saved for o in g.ops] == [[1, 0], [3], []]
    assert [o.inputs for o in g.ops] == [[1, 0], [2], [3]]
    # dy: born in sum's step, freed in relu's: allocated by step 2, released by step 1; dh likewise 1 -> 0
    assert [o.backward_grad_alloc_bytes for o in g.ops] == [0, 100, 100]
    assert [o.backward_grad_free_bytes for o in g.ops] == [100, 100, 0]
    assert [o.backward_workspace_bytes for o in g.ops] == [50, 0, 0]  # the scratch pair of mm's step
    assert [o.backward_time_s for o in g.ops] == [3e-4, 2e-4, 1e-4]
    assert g.optimizer_time_s == 5e-3
    assert g.fixed.params_bytes == 400 and g.fixed.other_bytes == 0
    assert g.meta["backward_in_reverse_op_order"] and g.meta["saved_inferred"] == 0
    assert all(t.recomputable for t in g.tensors)


def test_times_are_medians_over_timed_steps():
    trace = chain_trace()
    g = build_graph(trace, times=[[1.0, 2.0, 3.0], [3.0, 2.0, 1.0], [2.0, 9.0, 2.0]],
                    backward_times=[{0: 1.0}, {0: 5.0}, {0: 3.0, 2: 4.0}], optimizer_time_s=0.5)
    assert [o.time_s for o in g.ops] == [2.0, 2.0, 2.0]
    assert [o.backward_time_s for o in g.ops] == [3.0, 0.0, 0.0]
    assert g.optimizer_time_s == 0.5


def test_in_place_chain_is_rebuilt_by_its_initialisers():
    """Dropout's mask: m = empty_like(x); m.bernoulli_(); m.div_(): m is recomputable by re-running
    empty_like, bernoulli_, div_ in order (rebuilt_by), under the recorded RNG state."""
    trace = Trace(
        storages=[pre(0, "input"), act(1, 0, died=("backward", 2)), act(2, 3, held=True)],
        n_fixed=1,
        ops=[op("aten.empty_like.default", [0], [1]), op("aten.bernoulli_.float", [1], writes=[1], random=True),
             op("aten.div_.Scalar", [1], writes=[1]), op("aten.mul.Tensor", [0, 1], [2])],
        saved={3: [0, 1]},
    )
    g = build_graph(trace)
    m = g.tensors[1]
    assert m.recomputable and m.rebuilt_by == [1, 2]
    assert g.meta["mutated_by"] == {"1": [1, 2]}
    assert g.ops[1].random and not g.ops[2].random
    assert g.ops[1].outputs == [] and g.ops[1].inputs == [1]  # an in-place result is not a new tensor


def test_stale_reader_blocks_the_replay_that_needs_it():
    """h = f(x); y = h * 3; then an op that writes h in place and also creates a tensor (no replayable
    chain): replaying y's producer would read the written h, so y cannot be rebuilt, nor can h."""
    trace = Trace(
        storages=[pre(0, "input"), act(1, 0, died=("backward", 3)), act(2, 1, died=("backward", 3)),
                  act(3, 2, died=("backward", 3)), act(4, 3, held=True)],
        n_fixed=1,
        ops=[op("aten.exp.default", [0], [1]), op("aten.mul.Tensor", [1], [2]),
             op("aten.frexp.Tensor_out", [1], [3], writes=[1]), op("aten.add.Tensor", [1, 2, 3], [4])],
        saved={3: [1, 2, 3]},
    )
    g = build_graph(trace)
    h, y, z = g.tensors[1], g.tensors[2], g.tensors[3]
    assert not h.recomputable and h.rebuilt_by == []
    assert not y.recomputable and y.rebuilt_by == []
    assert not z.recomputable  # its producer writes into an input
    assert g.meta["mutated_by"] == {"1": [2]}


def test_in_place_on_an_output_of_a_multi_output_op_is_not_recomputable():
    """a, b = split-like op; a.add_(1): a replay for b would skip add_, so a's chain is refused."""
    trace = Trace(
        storages=[pre(0, "input"), act(1, 0, died=("backward", 2)), act(2, 0, index=1, died=("backward", 2)),
                  act(3, 2, held=True)],
        n_fixed=1,
        ops=[op("aten.unique_consecutive.default", [0], [1, 2]), op("aten.add_.Scalar", [1], writes=[1]),
             op("aten.mul.Tensor", [1, 2], [3])],
        saved={2: [1, 2]},
    )
    g = build_graph(trace)
    assert not g.tensors[1].recomputable and g.tensors[1].rebuilt_by == []
    assert g.tensors[2].recomputable  # the other output is untouched


def test_op_writing_its_input_makes_its_outputs_unrecomputable():
    """An op that writes into a pre-existing storage (a running-stats update) and creates an output:
    re-running it would write again."""
    trace = Trace(
        storages=[pre(0, "input"), pre(1, "buffer"), act(2, 0, died=("backward", 1)), act(3, 1, held=True)],
        n_fixed=2,
        ops=[op("aten._native_batch_norm_legit_functional.default", [0, 1], [2], writes=[1]),
             op("aten.sum.default", [2], [3])],
        saved={1: [2]},
    )
    g = build_graph(trace)
    assert not g.tensors[2].recomputable
    assert "2" not in g.meta["mutated_by"] and g.meta["mutated_by"] == {}  # buffers are not activations


def test_view_of_a_saved_tensor_is_the_same_storage():
    """v = h.view(...) creates no storage; a node that saves v saves h's storage: one tensor, counted
    once, saved by the op whose node saved the view."""
    trace = Trace(
        storages=[pre(0, "input"), act(1, 0, died=("backward", 2)), act(2, 2, held=True)],
        n_fixed=1,
        ops=[op("aten.exp.default", [0], [1]), op("aten.view.default", [1]), op("aten.sin.default", [1], [2])],
        saved={2: [1], 0: [1]},
    )
    g = build_graph(trace)
    assert len(g.tensors) == 3
    assert g.ops[1].outputs == [] and g.ops[1].inputs == [1]
    assert g.savers[1] == [0, 2]
    assert g.activation_bytes_kept() == 100  # one storage, whatever number of views and savers


def test_tensor_freed_before_backward_and_lifetimes():
    """An activation dead in forward is freed after the op during which it died (never before its
    producer); one autograd held takes its death from the lifetime pass (None: past the forward); a
    caller-held one ignores it."""
    trace = Trace(
        storages=[pre(0, "input"), act(1, 0, died=("forward", 0)), act(2, 1, died=("backward", 3)),
                  act(3, 2, died=("backward", 3)), act(4, 3, held=True)],
        n_fixed=1,
        ops=[op("aten.exp.default", [0], [1]), op("aten.exp.default", [0], [2]), op("aten.cos.default", [2], [3]),
             op("aten.mul.Tensor", [2, 3], [4])],
        saved={3: [2, 3]},
    )
    lifetimes = {(1, 0): 3, (2, 0): None, (3, 0): 0}
    g = build_graph(trace, lifetimes=lifetimes)
    assert g.tensors[1].freed_after == 0              # died while its own producer ran (a temporary)
    assert g.tensors[2].freed_after == 3              # the program drops it at op 3
    assert g.tensors[3].freed_after == 3              # past the forward: the last op
    assert g.tensors[4].freed_after is None and g.tensors[4].held_by_caller
    assert build_graph(trace).tensors[2].freed_after is None  # without the pass: lives into backward


def test_saved_inferred_from_a_death_in_backward():
    """An activation that lives into backward, in no node's saved list and not held by the caller, was
    saved by a node the walk could not see: the op whose backward step released it."""
    trace = Trace(
        storages=[pre(0, "input"), act(1, 0, died=("backward", 1)), act(2, 1, held=True)],
        n_fixed=1,
        ops=[op("aten.exp.default", [0], [1]), op("aten.sin.default", [1], [2])],
        saved={},
        backward_events=[(1, 1, -100)],
        backward_order=[1, 0],
    )
    g = build_graph(trace)
    assert g.ops[1].saved == [1]
    assert g.meta["saved_inferred"] == 1


def test_backward_out_of_op_order_and_a_transient_of_its_birth_step():
    trace = Trace(
        storages=[pre(0, "input"), act(1, 0, died=("backward", 1)), act(2, 1, held=True),
                  TraceStorage(3, "activation", 64, "float32", [16], born=("backward", 0), died=("backward", 1))],
        n_fixed=1,
        ops=[op("aten.exp.default", [0], [1]), op("aten.sin.default", [1], [2])],
        saved={1: [1]},
        # step 0 ran before step 1 (engine order differs from op order); storage 3 born in 0, died in 1
        backward_events=[(0, 3, 64), (1, 3, -64), (1, 1, -100)],
        backward_order=[0, 1],
    )
    g = build_graph(trace)
    assert g.meta["backward_in_reverse_op_order"] is False
    # died in a step simulated earlier than its birth step: a transient of step 0, not an allocation
    assert [o.backward_grad_alloc_bytes for o in g.ops] == [0, 0]
    assert g.ops[0].backward_workspace_bytes == 64
    assert backward_figures(trace)[3] == {1: 1}  # the forward activation released by step 1


def test_other_bytes_counts_storages_read_that_were_not_registered():
    """A module attribute tensor read by the step (a pre-existing storage found after the fixed ones)."""
    trace = Trace(
        storages=[pre(0, "input"), pre(1, "buffer", 48), act(2, 0, held=True)],
        n_fixed=1,
        ops=[op("aten.add.Tensor", [0, 1], [2])],
    )
    g = build_graph(trace, fixed=FixedMemory(inputs_bytes=400))
    assert g.fixed.other_bytes == 48 and g.fixed.inputs_bytes == 400


def test_a_trace_that_makes_no_graph_is_one_clear_error():
    trace = Trace(
        storages=[pre(0, "input"), act(1, 1, held=True)],
        n_fixed=1,
        ops=[op("aten.exp.default", [0, 1]), op("aten.sin.default", [0], [1])],  # op 0 reads op 1's output
    )
    with pytest.raises(GraphError, match=r"the trace of bad makes no valid graph: .*tensor 1, produced by later op 1"):
        build_graph(trace, name="bad")
