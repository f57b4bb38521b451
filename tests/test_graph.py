"""Graph file validation: every malformed input gets a GraphError naming the culprit."""

import json

import pytest

from memplan.planner.core.errors import GraphError
from memplan.planner.core.graph import Graph, coarsen
from memplan.planner.core.synthetic import linear_chain, random_dag


def _chain_dict():
    return json.loads(linear_chain(3).model_dump_json())


def test_round_trip_preserves_structure_and_fingerprint(tmp_path):
    g = random_dag(12, seed=3)
    path = tmp_path / "g.json"
    g.save(str(path))
    h = Graph.load(str(path))
    assert h == g
    assert h.fingerprint == g.fingerprint


def test_fingerprint_ignores_timings_but_not_structure():
    a, b = linear_chain(4, time_s=1.0), linear_chain(4, time_s=2.0)
    assert a.fingerprint == b.fingerprint
    c = linear_chain(4, activation_bytes=101)
    assert c.fingerprint != a.fingerprint


@pytest.mark.parametrize(("mutate", "expected"), [
    (lambda d: d.update(format="memplan.graph/2"), "unknown graph format version 'memplan.graph/2'"),
    (lambda d: d["tensors"][1].update(bytes=-5), "tensors.1.bytes"),
    (lambda d: d["tensors"][1].update(bytes=2**63), "tensors.1.bytes: 9223372036854775808 B is beyond any device"),
    (lambda d: d["tensors"][2].update(bytes=2**50 + 1), "tensors.2.bytes: 1125899906842625 B is beyond any device"),
    (lambda d: d["fixed"].update(params_bytes=2**51), "fixed.params_bytes: 2251799813685248 B is beyond any"),
    (lambda d: d["ops"][0].update(workspace_bytes=2**60), "ops.0.workspace_bytes: 1152921504606846976 B is beyond"),
    (lambda d: d["ops"][1].update(time_s=float("inf")), "ops.1.time_s"),
    (lambda d: d["ops"][1]["inputs"].append(99), "dangling edge: op 1 (synthetic.layer) inputs names tensor 99"),
    (lambda d: d["tensors"][2].update(producer=7), "dangling edge: tensor 2 names producer op 7"),
    (lambda d: d["ops"][0]["inputs"].append(3), "cycle"),
    (lambda d: d["ops"][2].update(id=5), "ops[2] has id 5"),
    (lambda d: d["tensors"][0].update(producer=0), "tensor 0 is a input but names producer op 0"),
    (lambda d: d["ops"][0].update(bogus=1), "ops.0.bogus"),
    (lambda d: d["tensors"][1].update(shape=[2, -1]), "negative dimension"),
])
def test_malformed_graph_names_the_problem(mutate, expected):
    d = _chain_dict()
    mutate(d)
    with pytest.raises(GraphError) as e:
        Graph.from_json(json.dumps(d), source="g.json")
    assert expected in str(e.value)
    assert str(e.value).startswith("g.json: ")


def test_nan_time_is_refused():
    text = json.dumps(_chain_dict()).replace('"time_s": 1.0', '"time_s": NaN', 1)
    with pytest.raises(GraphError, match="time_s"):
        Graph.from_json(text)


def test_out_of_order_edge_without_cycle_is_named():
    d = _chain_dict()
    # op 0 reads the output of op 2: a forward edge that runs backwards in time, not a cycle
    d["ops"][0]["inputs"] = [0, 3]
    d["ops"][2]["inputs"] = [2]
    with pytest.raises(GraphError, match="cycle|out of execution order"):
        Graph.from_json(json.dumps(d))


def test_not_json_and_not_object():
    with pytest.raises(GraphError, match="not valid JSON"):
        Graph.from_json("{")
    with pytest.raises(GraphError, match="expected a JSON object"):
        Graph.from_json("[1, 2]")


def test_derived_views():
    g = linear_chain(4)
    assert g.saved_activations == [1, 2, 3, 4]
    assert g.consumers[1] == [1]
    assert g.savers[4] == [3]
    assert g.edges() == [(0, 1), (1, 2), (2, 3)]


def test_coarsen_groups_consecutive_ops_by_module():
    g = random_dag(12, seed=1)  # modules block{i//3}.op{i%3}
    chain = coarsen(g, depth=1)
    assert [s.name for s in chain.stages] == ["block0", "block1", "block2", "block3"]
    assert [len(s.ops) for s in chain.stages] == [3, 3, 3, 3]
    assert sum(s.time_s for s in chain.stages) == pytest.approx(sum(o.time_s for o in g.ops))
    # the first stage's input is the batch only (not an activation), later stages carry activations
    assert chain.stages[0].input_bytes == 0
    assert all(s.input_bytes > 0 for s in chain.stages[1:])
    assert coarsen(g).depth == 2  # auto: deepest depth within max_stages


def test_schema_is_exported():
    schema = Graph.model_json_schema()
    assert "ops" in schema["properties"] and "tensors" in schema["properties"]


def test_byte_figures_that_add_up_beyond_any_device_are_refused():
    d = json.loads(linear_chain(70).model_dump_json())
    for t in d["tensors"]:
        t["bytes"] = 2**50  # each figure allowed; together over 2^56
    with pytest.raises(GraphError, match="the graph's byte figures add up to .* beyond any device"):
        Graph.from_json(json.dumps(d))
