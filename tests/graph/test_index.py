"""The graph view: producers, readers (bodies included), constants and a view of a bare graph."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qtool.graph.index import BODY, GraphView, all_nodes, subgraph_reads
from qtool.graph.names import fresh_name


def _model() -> onnx.ModelProto:
    """x -> Mul(x, x) -> If (its then-branch reads w) -> y; w is also a graph input (not a constant)."""
    then = helper.make_graph(
        [helper.make_node("Add", ["sq", "c"], ["t"], name="inner")],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["sq"], ["e"], name="inner2")],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])],
    )
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["sq"], name="square"),
        helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=then, else_branch=other),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [
            numpy_helper.from_array(np.ones(2, "float32"), "c"),
            numpy_helper.from_array(np.ones(2, "float32"), "w"),
        ],
    )
    return helper.make_model(graph)


def test_readers_keep_each_input_slot_and_the_bodies_reads():
    view = GraphView(_model())
    assert view.readers["x"] == [(0, 0), (0, 1)]
    assert view.readers["sq"] == [(1, BODY)]  # read inside both branches of the If
    assert [n.name for n in view.consumers["x"]] == ["square"]  # each node once
    assert [n.name for n in view.input_readers("x")] == ["square", "square"]
    assert view.input_readers("sq") == []  # a body's read is not an input slot
    assert view.producer("sq").name == "square" and view.producer("x") is None


def test_an_initializer_that_is_also_a_graph_input_is_no_constant():
    view = GraphView(_model())
    assert "c" in view.initializers and "w" not in view.initializers
    assert view.elem_types["w"] == TensorProto.FLOAT and view.is_float("x") and not view.is_float("cond")
    assert view.scalar("c") is None  # two elements


def test_a_bare_graph_gives_the_same_view_as_its_model():
    model = _model()
    assert GraphView(model.graph).readers == GraphView(model).readers


def test_subgraph_helpers_reach_every_body():
    model = _model()
    assert {n.name for n in all_nodes(model.graph)} == {"square", "branch", "inner", "inner2"}
    assert subgraph_reads(model.graph.node[1]) == {"sq", "c"}


def test_fresh_names_count_up_from_two_and_are_taken_once_given():
    taken = {"a", "a_2"}
    assert fresh_name("a", taken) == "a_3" and fresh_name("a", taken) == "a_4"
    assert fresh_name("b", taken) == "b" and "b" in taken
