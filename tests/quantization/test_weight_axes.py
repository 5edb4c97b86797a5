"""Per-channel weight scales lie along each op's output-channel axis (transB aware)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import qtool
from tests.conftest import INTEGER, run_model


def _build(
    tmp_path: Path, node: onnx.NodeProto, weight: np.ndarray, x_shape: list[int], y_shape: list[int], opset: int = 13
) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        [numpy_helper.from_array(weight, "w")],
    )
    model_path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8), model_path)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(8):
        np.save(data / f"{i}.npy", rng.normal(size=x_shape[1:]).astype(np.float32))
    return model_path, data


# Output channels get very different magnitudes so that a wrong axis shows up as a large error.
GAINS = np.array([100.0, 1.0, 0.01, 10.0, 0.1, 1000.0], np.float32)

CASES = {
    "conv": (
        helper.make_node("Conv", ["x", "w"], ["y"], name="op"),
        np.random.default_rng(1).normal(size=(6, 2, 1, 1)).astype(np.float32) * GAINS[:, None, None, None],
        [1, 2, 4, 4],
        [1, 6, 4, 4],
        0,
    ),
    "gemm": (
        helper.make_node("Gemm", ["x", "w"], ["y"], name="op"),
        np.random.default_rng(2).normal(size=(5, 6)).astype(np.float32) * GAINS[None, :],
        [1, 5],
        [1, 6],
        1,
    ),
    "gemm_transB": (
        helper.make_node("Gemm", ["x", "w"], ["y"], name="op", transB=1),
        np.random.default_rng(3).normal(size=(6, 5)).astype(np.float32) * GAINS[:, None],
        [1, 5],
        [1, 6],
        0,
    ),
    "matmul": (
        helper.make_node("MatMul", ["x", "w"], ["y"], name="op"),
        np.random.default_rng(4).normal(size=(5, 6)).astype(np.float32) * GAINS[None, :],
        [1, 5],
        [1, 6],
        1,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_per_channel_axis_is_the_output_axis(tmp_path, case):
    node, weight, x_shape, y_shape, axis = CASES[case]
    model_path, data = _build(tmp_path, node, weight, x_shape, y_shape)
    out = tmp_path / "q.onnx"
    qtool.quantize(model_path, out, data_dir=data, config_path=INTEGER, evaluation=None)
    model = onnx.load(str(out))
    inits = {i.name: i for i in model.graph.initializer}
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == "w")
    assert {a.name: a.i for a in dq.attribute}["axis"] == axis
    assert numpy_helper.to_array(inits[dq.input[1]]).shape == (6,)
    stored = numpy_helper.to_array(inits[dq.input[0]]).astype(np.float32)
    scale = numpy_helper.to_array(inits[dq.input[1]])
    zero = numpy_helper.to_array(inits[dq.input[2]]).astype(np.float32)
    shape = [1] * weight.ndim
    shape[axis] = -1
    restored = (stored - zero.reshape(shape)) * scale.reshape(shape)
    # each output channel keeps its own relative precision, including the tiny-gain ones: its own scale, at most
    # twice the full-range one (channels whose weight pairs could saturate AVX2 kernels are fitted coarser)
    ref_c = np.abs(np.moveaxis(weight, axis, 0).reshape(6, -1)).max(axis=1)
    err_c = np.moveaxis(restored - weight, axis, 0).reshape(6, -1)
    assert np.all(scale >= ref_c / 127 * 0.9999) and np.all(scale <= ref_c / 127 * 2)
    assert np.all(np.abs(err_c).max(axis=1) <= scale / 2 * 1.0001)
    x = np.load(data / "0.npy")[None]
    reference, quantized = run_model(model_path, {"x": x})[0], run_model(out, {"x": x})[0]
    assert np.linalg.norm(quantized - reference) <= 0.02 * np.linalg.norm(reference)


def test_opset_11_model_is_upgraded_for_per_axis_dequantize(tmp_path):
    node, weight, x_shape, y_shape, _ = CASES["conv"]
    model_path, data = _build(tmp_path, node, weight, x_shape, y_shape, opset=11)
    out = tmp_path / "q.onnx"
    result = qtool.quantize(model_path, out, data_dir=data, config_path=INTEGER, evaluation=None)
    assert (result.prepare.opset_before, result.prepare.opset_after) == (11, 13)
    model = onnx.load(str(out))
    assert model.opset_import[0].version == 13
    run_model(out, {"x": np.load(data / "0.npy")[None]})  # onnxruntime loads and runs it


def test_per_tensor_weights_keep_an_opset_11_model_at_11(tmp_path):
    node, weight, x_shape, y_shape, _ = CASES["gemm"]
    model_path, data = _build(tmp_path, node, weight, x_shape, y_shape, opset=11)
    config = tmp_path / "c.yaml"
    config.write_text("global: {weight: {granularity: per_tensor}}\n")
    out = tmp_path / "q.onnx"
    qtool.quantize(model_path, out, data_dir=data, config_path=config, evaluation=None)
    model = onnx.load(str(out))
    assert model.opset_import[0].version == 11
    assert all(not n.attribute for n in model.graph.node if n.op_type == "DequantizeLinear")
    run_model(out, {"x": np.load(data / "0.npy")[None]})


def test_weights_in_constant_nodes_are_quantized_like_initializers(tmp_path):
    rng = np.random.default_rng(5)
    weight = rng.normal(size=(256, 128)).astype(np.float32)
    nodes = [
        helper.make_node("Constant", [], ["w"], name="const_w", value=numpy_helper.from_array(weight)),
        helper.make_node("MatMul", ["x", "w"], ["y"], name="op"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 128])],
    )
    model_path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), model_path)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        np.save(data / f"{i}.npy", rng.normal(size=(256,)).astype(np.float32))
    out = tmp_path / "q.onnx"
    result = qtool.quantize(model_path, out, data_dir=data, config_path=INTEGER, evaluation=None)
    assert result.prepare.constants_to_initializers == 1 and result.rewrite.quantized_weights == ["w"]
    model = onnx.load(str(out))
    assert not [n for n in model.graph.node if n.op_type == "Constant"]
    assert {i.data_type for i in model.graph.initializer if i.name == "w/quantized"} == {TensorProto.INT8}
    assert model_path.stat().st_size / out.stat().st_size > 3.5
