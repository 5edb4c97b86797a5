"""Graph shapes the sample models do not have: shared weights, saturating biases, odd inputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import qtool
from qtool.errors import QtoolError
from tests.conftest import INTEGER, run_model

RNG = np.random.default_rng(7)


def save_model(tmp_path: Path, nodes, inputs, outputs, inits, opset=13, ir_version=8) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version), path)
    return path


def make_data(tmp_path: Path, shape, n=8, scale=1.0) -> Path:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    for i in range(n):
        np.save(data / f"{i}.npy", (RNG.normal(size=shape) * scale).astype(np.float32))
    return data


def relative_error(model: Path, quantized: Path, data: Path, name: str = "x") -> float:
    errors = []
    for f in sorted(data.glob("*.npy")):
        feed = {name: np.load(f)[None]}
        ref = run_model(model, feed)
        out = run_model(quantized, feed)
        errors += [np.linalg.norm(o - r) / np.linalg.norm(r) for r, o in zip(ref, out, strict=True)]
    return max(errors)


def test_weight_shared_by_ops_that_need_different_axes(tmp_path):
    w = (RNG.normal(size=(8, 8)) * np.logspace(-2, 2, 8)[None, :]).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["a"], name="mm"),  # per-channel along axis 1
        helper.make_node("Gemm", ["x", "w"], ["b"], name="gemm", transB=1),  # along axis 0
    ]
    model = save_model(
        tmp_path,
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 8]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [1, 8]),
        ],
        [numpy_helper.from_array(w, "w")],
    )
    data = make_data(tmp_path, (8,))
    out = tmp_path / "q.onnx"
    qtool.quantize(model, out, data_dir=data, config_path=INTEGER, evaluation=None)
    q = onnx.load(str(out))
    # before the fix the Gemm read the MatMul's axis-1 scales: about 100 % error
    axes = sorted(
        {a.name: a.i for a in n.attribute}["axis"]
        for n in q.graph.node
        if n.op_type == "DequantizeLinear" and n.input[0].startswith("w/")
    )
    assert axes == [0, 1]
    assert relative_error(model, out, data) < 0.05


def test_bias_that_would_saturate_int32_raises_the_weight_scale_instead(tmp_path):
    w = RNG.normal(size=(2, 3, 1, 1)).astype(np.float32)
    inits = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(np.array([1.0, 1e-9], np.float32), "gamma"),
        numpy_helper.from_array(np.array([0.0, 0.5], np.float32), "beta"),
        numpy_helper.from_array(np.zeros(2, np.float32), "mean"),
        numpy_helper.from_array(np.ones(2, np.float32), "var"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["y"], name="bn"),
    ]
    model = save_model(
        tmp_path,
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4, 4])],
        inits,
    )
    data = make_data(tmp_path, (3, 4, 4))
    out = tmp_path / "q.onnx"
    qtool.quantize(model, out, data_dir=data, evaluation=None)
    y = run_model(out, {"x": np.load(data / "0.npy")[None]})[0]
    np.testing.assert_allclose(y[0, 1], 0.5, atol=0.02)  # the float answer is beta = 0.5


def test_float_consumers_of_a_graph_input_keep_reading_the_float_value(tmp_path):
    w = RNG.normal(size=(4, 4)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
        helper.make_node("Identity", ["x"], ["x_copy"], name="copy"),
    ]
    model = save_model(
        tmp_path,
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4]),
            helper.make_tensor_value_info("x_copy", TensorProto.FLOAT, [1, 4]),
        ],
        [numpy_helper.from_array(w, "w")],
    )
    data = make_data(tmp_path, (4,))
    out = tmp_path / "q.onnx"
    qtool.quantize(model, out, data_dir=data, evaluation=None)
    x = np.load(data / "1.npy")[None]
    np.testing.assert_array_equal(run_model(out, {"x": x})[1], x)


def test_initializers_listed_as_graph_inputs_are_treated_as_constants(tmp_path):
    w = RNG.normal(size=(4, 3, 3, 3)).astype(np.float32)
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8]),
        helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 3, 3, 3]),
    ]
    model = save_model(
        tmp_path,
        [helper.make_node("Conv", ["x", "w"], ["y"], name="conv")],
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])],
        [numpy_helper.from_array(w, "w")],
        ir_version=3,
    )
    data = make_data(tmp_path, (3, 8, 8))
    out = tmp_path / "q.onnx"
    result = qtool.quantize(model, out, data_dir=data, evaluation=None)
    assert result.rewrite.quantized_nodes == ["conv"] and result.prepare.initializers_removed_from_inputs == 1
    assert any("treated as constants" in note for note in result.notes)
    assert relative_error(model, out, data) < 0.03


def test_opset_9_model_is_raised_to_10_for_per_tensor_quantize_linear(tmp_path):
    w = RNG.normal(size=(6, 5)).astype(np.float32)
    model = save_model(
        tmp_path,
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])],
        [numpy_helper.from_array(w, "w")],
        opset=9,
    )
    config = tmp_path / "c.yaml"
    config.write_text("global: {weight: {granularity: per_tensor}}\n")
    data = make_data(tmp_path, (6,))
    out = tmp_path / "q.onnx"
    result = qtool.quantize(model, out, data_dir=data, config_path=config, evaluation=None)
    assert (result.prepare.opset_before, result.prepare.opset_after) == (9, 10)
    assert relative_error(model, out, data) < 0.03


def test_wrongly_declared_output_shape_is_a_note_not_a_crash(tmp_path):
    w = RNG.normal(size=(4, 4)).astype(np.float32)
    model = save_model(
        tmp_path,
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 7])],
        [numpy_helper.from_array(w, "w")],
    )
    data = make_data(tmp_path, (4,))
    out = tmp_path / "q.onnx"
    result = qtool.quantize(model, out, data_dir=data, evaluation=None)
    assert any("full check" in note for note in result.notes)
    assert out.exists()


def test_misspelled_op_type_in_config_is_an_error(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("op_type:\n  matmul: null\n")
    with pytest.raises(QtoolError, match=r"c.yaml:2:3: .*unknown ONNX op type 'matmul'.*MatMul"):
        qtool.load_config(config)


def test_corrupt_npz_sample_is_a_clear_error(tmp_path):
    w = RNG.normal(size=(4, 4)).astype(np.float32)
    model = save_model(
        tmp_path,
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(w, "w")],
    )
    data = tmp_path / "npz"
    data.mkdir()
    (data / "a.npz").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(QtoolError, match=r"a\.npz: cannot read sample"):
        qtool.calibrate(model, data)


def test_weight_axis_override_keeps_the_bias_float_instead_of_mismatching_scales(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("global: {placement: integer}\nop_type: {Conv: {weight: {axis: 1}}}\n")
    from tests.conftest import calib_dir, sample

    out = tmp_path / "q.onnx"
    result = qtool.quantize(sample("cnn"), out, data_dir=calib_dir("cnn"), config_path=config, evaluation=None)
    assert not any("conv" in b for b in result.rewrite.quantized_biases)
    assert result.rewrite.quantized_biases == ["head.bias"]
