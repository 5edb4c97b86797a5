"""A Loop carrying its weight as unchanged state (tf2onnx's Keras LSTM, paddle2onnx's decoders): quantized."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import qtool
from tests.conftest import run_model, save_checked

HIDDEN, STEPS = 64, 6


def _loop_model(path: Path) -> Path:
    """h <- tanh(h @ W + x) for STEPS iterations; W enters as loop state and leaves as it came (via Identity)."""
    rng = np.random.default_rng(9)
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["h_in", "w_in"], ["hw"], name="step/matmul"),
            helper.make_node("Add", ["hw", "x"], ["pre"], name="step/add"),
            helper.make_node("Tanh", ["pre"], ["h_out"], name="step/tanh"),
            helper.make_node("Identity", ["w_in"], ["w_out"], name="step/keep_w"),
            helper.make_node("Identity", ["cond_in"], ["cond_out"], name="step/keep_cond"),
        ],
        "step",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("h_in", TensorProto.FLOAT, [1, HIDDEN]),
            helper.make_tensor_value_info("w_in", TensorProto.FLOAT, [HIDDEN, HIDDEN]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("h_out", TensorProto.FLOAT, [1, HIDDEN]),
            helper.make_tensor_value_info("w_out", TensorProto.FLOAT, [HIDDEN, HIDDEN]),
        ],
    )
    weight = (rng.standard_normal((HIDDEN, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Loop", ["steps", "true", "h0", "w"], ["h", "w_final"], body=body, name="while_loop")],
        "keras_lstm_like",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, HIDDEN])],
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, HIDDEN])],
        [
            numpy_helper.from_array(weight, "w"),
            numpy_helper.from_array(np.array(STEPS, np.int64), "steps"),
            numpy_helper.from_array(np.array(True), "true"),
            numpy_helper.from_array(np.zeros((1, HIDDEN), np.float32), "h0"),
        ],
    )
    return save_checked(graph, path)


def test_a_weight_carried_unchanged_through_a_loop_is_stored_quantized(tmp_path):
    model = _loop_model(tmp_path / "loop.onnx")
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(10)
    for i in range(8):
        np.save(data / f"{i:03d}.npy", rng.standard_normal((1, HIDDEN)).astype(np.float32))
    out = tmp_path / "q.onnx"
    result = qtool.quantize(model, out, data_dir=data, search=None, evaluation=None)
    assert result.prepare.loops_reading_constant_state == ["while_loop"]
    quantized = onnx.load(str(out))
    onnx.checker.check_model(quantized, full_check=True)
    inits = {i.name: i for i in quantized.graph.initializer}
    assert "w" not in inits  # no float copy: the body and the state's start read the weight restored at load
    assert inits["w/quantized"].data_type == TensorProto.INT8
    x = np.load(data / "000.npy")
    reference, candidate = run_model(model, {"x": x})[0], run_model(out, {"x": x})[0]
    assert 10 * np.log10(np.sum(reference.astype(np.float64) ** 2) / np.sum((reference - candidate) ** 2)) > 35
    assert model.stat().st_size / out.stat().st_size > 2.5
