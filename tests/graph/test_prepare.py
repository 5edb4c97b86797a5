from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qtool.graph.prepare import default_opset, prepare_model
from tests.conftest import run_model, sample


def _conv_bn_model(opset: int = 13, constant_weight: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32)
    inits = [
        numpy_helper.from_array(rng.normal(1, 0.2, 4).astype(np.float32), "gamma"),
        numpy_helper.from_array(rng.normal(0, 0.2, 4).astype(np.float32), "beta"),
        numpy_helper.from_array(rng.normal(0, 0.5, 4).astype(np.float32), "mean"),
        numpy_helper.from_array(rng.uniform(0.5, 2, 4).astype(np.float32), "var"),
    ]
    nodes = []
    if constant_weight:
        nodes.append(helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(w)))
    else:
        inits.append(numpy_helper.from_array(w, "w"))
    nodes += [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["y"], epsilon=1e-3),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def test_batchnorm_is_folded_into_conv_with_the_same_output():
    model = _conv_bn_model()
    prepared, report = prepare_model(model)
    assert [n.op_type for n in prepared.graph.node] == ["Conv"]
    assert len(report.folded_batchnorms) == 1 and report.removed_initializers == 4
    x = np.random.default_rng(1).normal(size=(1, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(
        run_model(prepared.SerializeToString(), {"x": x})[0],
        run_model(model.SerializeToString(), {"x": x})[0],
        rtol=1e-4,
        atol=1e-5,
    )


def test_constant_nodes_become_initializers_and_unnamed_nodes_get_names():
    prepared, report = prepare_model(_conv_bn_model(constant_weight=True))
    assert report.constants_to_initializers == 1
    assert "w" in {i.name for i in prepared.graph.initializer}
    assert all(n.name for n in prepared.graph.node)
    assert [n.op_type for n in prepared.graph.node] == ["Conv"]


def test_opset_11_is_raised_for_per_channel_and_still_runs():
    model = _conv_bn_model(opset=11)
    prepared, report = prepare_model(model, min_opset=13)
    assert (report.opset_before, report.opset_after, default_opset(prepared)) == (11, 13, 13)
    onnx.checker.check_model(prepared, full_check=True)


def test_prepare_never_modifies_its_input():
    model = onnx.load(str(sample("cnn")))
    before = model.SerializeToString()
    prepare_model(model, min_opset=13)
    assert model.SerializeToString() == before


def tf2onnx_shapes_model(rows: int = 16, columns: int = 32) -> onnx.ModelProto:
    """As tf2onnx writes it: a weight read only by a Shape -> Gather -> Concat -> Reshape chain, and an opset-15
    Shape(start=-1) of a weight that a MatMul also reads."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.1, (rows, columns)).astype(np.float32), name)
        for name in ("w_dead", "w_live")
    ]
    inits += [
        numpy_helper.from_array(np.array(1, np.int64), "one"),
        numpy_helper.from_array(np.array([0], np.int64), "axis0"),
        numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
    ]
    nodes = [
        helper.make_node("Shape", ["w_dead"], ["dead_shape"], name="shape_dead"),
        helper.make_node("Gather", ["dead_shape", "one"], ["columns"], axis=0),
        helper.make_node("Unsqueeze", ["columns", "axis0"], ["columns_1d"]),
        helper.make_node("Concat", ["minus_one", "columns_1d"], ["target"], axis=0),
        helper.make_node("MatMul", ["x", "w_live"], ["y"], name="matmul"),
        helper.make_node("Reshape", ["y", "target"], ["reshaped"]),
        helper.make_node("Shape", ["w_live"], ["live_columns"], name="shape_live", start=-1),
        helper.make_node("Concat", ["minus_one", "live_columns"], ["target2"], axis=0),
        helper.make_node("Reshape", ["reshaped", "target2"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tf2onnx",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", rows])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", columns])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)


def test_shapes_of_initializers_become_constants_and_weights_only_they_read_are_dropped():
    model = tf2onnx_shapes_model()
    prepared, report = prepare_model(model)
    assert report.folded_shapes == ["shape_dead", "shape_live"]
    assert report.removed_initializers == 1
    inits = {i.name: numpy_helper.to_array(i) for i in prepared.graph.initializer}
    assert "w_dead" not in inits and "w_live" in inits
    np.testing.assert_array_equal(inits["dead_shape"], [16, 32])
    np.testing.assert_array_equal(inits["live_columns"], [32])  # start=-1: the last dimension only
    assert "Shape" not in {n.op_type for n in prepared.graph.node}
    x = np.random.default_rng(1).normal(size=(3, 16)).astype(np.float32)
    np.testing.assert_array_equal(
        run_model(prepared.SerializeToString(), {"x": x})[0], run_model(model.SerializeToString(), {"x": x})[0]
    )


def test_a_shape_that_is_a_graph_output_is_left_alone():
    model = tf2onnx_shapes_model()
    model.graph.output.append(helper.make_tensor_value_info("dead_shape", TensorProto.INT64, [2]))
    prepared, report = prepare_model(model)
    assert report.folded_shapes == ["shape_live"]
    assert "w_dead" in {i.name for i in prepared.graph.initializer}


def test_an_op_no_onnx_domain_defines_is_refused_naming_its_node(tmp_path):
    # tf2onnx leaves an exact GELU's Erfc unconverted: before, onnxruntime's refusal named qtool's prepared model
    from typer.testing import CliRunner

    from qtool.cli import app

    graph = helper.make_graph(
        [helper.make_node("Erfc", ["x"], ["y"], name="gelu/erfc")],
        "unconverted",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), model)
    out = tmp_path / "q.onnx"
    r = CliRunner().invoke(app, ["quantize", str(model), "-o", str(out)])
    assert r.exit_code == 2 and "node 'gelu/erfc' is 'Erfc', which is no ONNX operator" in r.stderr
    assert not out.exists()


def test_a_model_of_ml_operators_alone_is_left_as_it_is_not_refused(tmp_path):
    # onnxmltools writes a tree ensemble with an ai.onnx.ml opset and none for the default domain: before, the
    # "upgrade from opset 1" that Q/DQ would need failed and the model was refused

    import qtool

    graph = helper.make_graph(
        [helper.make_node("Scaler", ["x"], ["y"], name="scale", domain="ai.onnx.ml", offset=[0.5], scale=[2.0])],
        "ml_only",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("ai.onnx.ml", 3)], ir_version=8), model)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        np.save(data / f"{i}.npy", np.full((1, 4), i, np.float32))
    result = qtool.quantize(model, tmp_path / "q.onnx", data_dir=data)
    assert result.rewrite.quantized_nodes == [] and result.comparison is not None
    assert result.comparison.overall.sqnr_db == float("inf")
