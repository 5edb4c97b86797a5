"""Weights an exporter computes from constants at run time (weight_norm): folded, then quantized."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import qtool
from qtool.graph.prepare import prepare_model
from tests.conftest import save_checked

RNG = np.random.default_rng(11)


def _init(name: str, *shape: int, low: float | None = None) -> onnx.TensorProto:
    values = RNG.uniform(low, 1.5, shape) if low is not None else RNG.standard_normal(shape)
    return numpy_helper.from_array(values.astype(np.float32), name)


def _weight_norm_model(path: Path) -> Path:
    """Three Convs whose weights are PyTorch weight_norm's g * v / ||v|| (ReduceL2, Div, Mul), LeakyRelu between."""
    nodes, inits, x, cin = [], [], "x", 8
    for i, cout in enumerate([32, 32, 16]):
        inits += [_init(f"v{i}", cout, cin, 5), _init(f"g{i}", cout, 1, 1, low=0.5), _init(f"b{i}", cout)]
        nodes += [
            helper.make_node("ReduceL2", [f"v{i}"], [f"n{i}"], axes=[1, 2], keepdims=1, name=f"norm{i}"),
            helper.make_node("Div", [f"v{i}", f"n{i}"], [f"d{i}"], name=f"div{i}"),
            helper.make_node("Mul", [f"g{i}", f"d{i}"], [f"w{i}"], name=f"mul{i}"),
            helper.make_node("Conv", [x, f"w{i}", f"b{i}"], [f"c{i}"], pads=[2, 2], name=f"conv{i}"),
            helper.make_node("LeakyRelu", [f"c{i}"], [f"a{i}"], alpha=0.1, name=f"act{i}"),
        ]
        x, cin = f"a{i}", cout
    graph = helper.make_graph(
        nodes,
        "weight_norm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 400])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 16, 400])],
        inits,
    )
    return save_checked(graph, path)


def test_weight_norm_convolutions_get_constant_weights_and_are_quantized(tmp_path):
    model = _weight_norm_model(tmp_path / "wn.onnx")
    data = tmp_path / "data"
    data.mkdir()
    for i in range(8):
        np.save(data / f"{i:03d}.npy", RNG.standard_normal((1, 8, 400)).astype(np.float32))
    out = tmp_path / "q.onnx"
    result = qtool.quantize(model, out, data_dir=data, search=None, evaluation=None)
    assert result.prepare.folded_computed_weights == [f"{op}{i}" for i in range(3) for op in ("norm", "div", "mul")]
    assert sorted(result.rewrite.quantized_nodes) == ["conv0", "conv1", "conv2"]
    quantized = onnx.load(str(out))
    onnx.checker.check_model(quantized, full_check=True)
    assert not {"ReduceL2", "Div"} & {n.op_type for n in quantized.graph.node}
    inits = {i.name: i for i in quantized.graph.initializer}
    assert {f"v{i}" for i in range(3)}.isdisjoint(inits)  # the float sources are gone: int8 weights only
    assert all(inits[f"w{i}/quantized"].data_type == TensorProto.INT8 for i in range(3))
    reference = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    candidate = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    x = np.load(data / "000.npy")
    r, c = reference.run(None, {"x": x})[0].astype(np.float64), candidate.run(None, {"x": x})[0]
    assert 10 * np.log10(np.sum(r**2) / np.sum((r - c) ** 2)) > 25
    assert model.stat().st_size / out.stat().st_size > 2.5


def test_a_weight_whose_folded_form_would_take_more_bytes_stays_computed(tmp_path):
    # MatMul(x, Concat(w, w)): folded, w would be stored twice; and a weight a graph output returns stays a node
    graph = helper.make_graph(
        [
            helper.make_node("Concat", ["w", "w"], ["ww"], axis=1, name="twice"),
            helper.make_node("MatMul", ["x", "ww"], ["y"], name="mm"),
            helper.make_node("Mul", ["u", "two"], ["u2"], name="scaled"),
            helper.make_node("MatMul", ["y", "u2"], ["z"], name="mm2"),
        ],
        "kept",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [
            helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 8]),
            helper.make_tensor_value_info("u2", TensorProto.FLOAT, [32, 8]),
        ],
        [_init("w", 16, 16), _init("u", 32, 8), numpy_helper.from_array(np.array(2.0, np.float32), "two")],
    )
    model = onnx.load(str(save_checked(graph, tmp_path / "kept.onnx")))
    prepared, report = prepare_model(model)
    assert report.folded_computed_weights == []
    assert [n.name for n in prepared.graph.node] == ["twice", "mm", "scaled", "mm2"]


def _x_to_y(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], name: str) -> onnx.GraphProto:
    """A graph of ``nodes`` from x [1, 64] to y [1, 128]."""
    return helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 128])],
        inits,
    )


def _quantized_on_samples(model: Path, tmp_path: Path, rng: np.random.Generator) -> qtool.QuantizeResult:
    """``model`` quantized on 8 random samples of x."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(8):
        np.save(data / f"{i}.npy", rng.standard_normal((1, 64)).astype(np.float32))
    return qtool.quantize(model, tmp_path / "q.onnx", data_dir=data, evaluation=None)


def test_a_weight_sliced_by_the_shape_of_an_expanded_state_is_computed_and_quantized(tmp_path):
    # torch's exporter without its optimizer: the gate slices of a weight are sized by the Shape of the zero
    # initial state, an Expand of a scalar that the model also reads; before, Expand (never folded) kept the
    # whole chain computed and the weight float (1.02x)
    rng = np.random.default_rng(9)
    inits = [
        numpy_helper.from_array((rng.standard_normal((64, 256)) * 0.1).astype(np.float32), "w_stack"),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        numpy_helper.from_array(np.array([1], np.int64), "one"),
        numpy_helper.from_array(np.array([128], np.int64), "hidden"),
        numpy_helper.from_array(np.array([1], np.int64), "axis"),
        numpy_helper.from_array(np.array([0], np.int64), "start"),
        numpy_helper.from_array(np.array([2], np.int64), "two"),
    ]
    nodes = [
        helper.make_node("Concat", ["one", "hidden"], ["state_shape"], name="state_shape", axis=0),
        helper.make_node("Expand", ["zero", "state_shape"], ["state"], name="zeros"),
        helper.make_node("Shape", ["state"], ["sizes"], name="shape"),
        helper.make_node("Slice", ["sizes", "one", "two"], ["width"], name="width"),
        helper.make_node("Slice", ["w_stack", "start", "width", "axis"], ["w"], name="gate"),
        helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
        helper.make_node("Add", ["h", "state"], ["y"], name="plus_state"),
    ]
    model = save_checked(_x_to_y(nodes, inits, "expanded_state"), tmp_path / "m.onnx")
    prepared, report = prepare_model(onnx.load(model))
    assert "gate" in report.folded_computed_weights and "w" in {i.name for i in prepared.graph.initializer}
    assert any(n.op_type == "Expand" for n in prepared.graph.node)  # still there for the Add that reads it
    result = _quantized_on_samples(model, tmp_path, rng)
    assert "w" in result.rewrite.quantized_weights and result.compression_ratio > 2.5


def test_a_weight_reshaped_by_a_product_of_its_own_dimensions_is_computed_and_quantized(tmp_path):
    # tf2onnx's Keras attention at opset 15+: Reshape(W, Concat(-1, ReduceProd(Gather(Shape(W), axes)))); before,
    # ReduceProd was not folded and the Shape of W counted as a new constant, so the Gemm kept its weight float
    rng = np.random.default_rng(10)
    inits = [
        numpy_helper.from_array((rng.standard_normal((64, 4, 32)) * 0.1).astype(np.float32), "w"),
        numpy_helper.from_array(np.array([1, 2], np.int64), "heads_dims"),
        numpy_helper.from_array(np.array([-1], np.int64), "rest"),
    ]
    nodes = [
        helper.make_node("Shape", ["w"], ["w_shape"], name="shape"),
        helper.make_node("Gather", ["w_shape", "heads_dims"], ["dims"], name="dims", axis=0),
        helper.make_node("ReduceProd", ["dims"], ["width"], name="width", keepdims=1),
        helper.make_node("Concat", ["rest", "width"], ["target"], name="target", axis=0),
        helper.make_node("Reshape", ["w", "target"], ["w2"], name="flatten"),
        helper.make_node("Gemm", ["x", "w2"], ["y"], name="proj"),
    ]
    model = save_checked(_x_to_y(nodes, inits, "reduce_prod"), tmp_path / "m.onnx")
    result = _quantized_on_samples(model, tmp_path, rng)
    assert "w2" in result.rewrite.quantized_weights and result.compression_ratio > 2.5
