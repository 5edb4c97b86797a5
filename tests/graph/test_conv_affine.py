"""Per-channel Mul/Add/Sub/Div by a constant after a Conv (PP-LCNetV3's affine block): folded into the Conv."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import qtool
from qtool.graph.prepare import prepare_model
from qtool.graph.weights import Weights
from tests.conftest import run_model, save_checked

CHANNELS, SIDE = 6, 10
SHAPE = [1, CHANNELS, SIDE, SIDE]


def _model(path: Path, ops: list[tuple[str, np.ndarray, bool]], *, bias: bool = True, extra_reader: bool = False):
    """x -> Conv -> each (op, constant, constant first) in turn -> Conv -> y."""
    rng = np.random.default_rng(0)
    weight = rng.normal(0, 0.3, (CHANNELS, CHANNELS, 3, 3)).astype(np.float32)
    inits = [numpy_helper.from_array(weight, "w1"), numpy_helper.from_array(weight[::-1].copy(), "w2")]
    conv_inputs = ["x", "w1"]
    if bias:
        inits.append(numpy_helper.from_array(rng.normal(0, 0.1, CHANNELS).astype(np.float32), "b1"))
        conv_inputs.append("b1")
    nodes = [helper.make_node("Conv", conv_inputs, ["c1"], name="conv1", pads=[1, 1, 1, 1])]
    x = "c1"
    for index, (op, value, constant_first) in enumerate(ops):
        name = f"k{index}"
        inits.append(numpy_helper.from_array(value.astype(np.float32), name))
        inputs = [name, x] if constant_first else [x, name]
        nodes.append(helper.make_node(op, inputs, [f"a{index}"], name=f"{op.lower()}{index}"))
        x = f"a{index}"
    nodes.append(helper.make_node("Conv", [x, "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPE)]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("c1", TensorProto.FLOAT, SHAPE))
    graph = helper.make_graph(
        nodes, "affine", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)], outputs, inits
    )
    return save_checked(graph, path, opset=13)


def _prepared(path: Path) -> tuple[onnx.ModelProto, list[str]]:
    weights = Weights()
    prepared, report = prepare_model(onnx.load(str(path)), weights)
    return weights.embedded(prepared), report.folded_affine


def _close(path: Path, prepared: onnx.ModelProto) -> None:
    feed = {"x": np.random.default_rng(1).normal(0, 1, SHAPE).astype(np.float32)}
    for reference, folded in zip(run_model(path, feed), run_model(prepared.SerializeToString(), feed), strict=True):
        np.testing.assert_allclose(folded, reference, rtol=1e-5, atol=1e-5 * float(np.abs(reference).max()))


CHANNEL = np.linspace(0.5, 2.0, CHANNELS)


@pytest.mark.parametrize(
    ("ops", "bias"),
    [
        ([("Mul", np.array([1.38]), False), ("Add", np.array([-0.2]), False)], True),  # PP-LCNetV3's scale, bias
        ([("Mul", CHANNEL.reshape(1, -1, 1, 1), True), ("Add", CHANNEL.reshape(-1, 1, 1), True)], False),
        ([("Sub", np.array(0.5), False), ("Div", CHANNEL.reshape(1, -1, 1, 1), False)], True),
    ],
)
def test_a_constant_affine_op_after_a_conv_is_folded_into_it(tmp_path, ops, bias):
    path = _model(tmp_path / "m.onnx", ops, bias=bias)
    prepared, folded = _prepared(path)
    assert len(folded) == len(ops)
    assert Counter(n.op_type for n in prepared.graph.node) == {"Conv": 2}
    conv = prepared.graph.node[0]
    assert conv.output[0] == f"a{len(ops) - 1}"  # the Conv writes what the last folded node wrote
    _close(path, prepared)


@pytest.mark.parametrize(
    "ops",
    [
        [("Add", np.ones((1, CHANNELS, SIDE, SIDE)), False)],  # varies over space, not per channel
        [("Sub", np.array([0.5]), True)],  # 0.5 - x: negates x
        [("Div", np.array([2.0]), True)],  # 2 / x
        [("Div", np.where(np.arange(CHANNELS) == 2, 0.0, 1.0).reshape(1, -1, 1, 1), False)],  # by zero
    ],
)
def test_what_is_no_per_channel_affine_function_of_the_conv_stays(tmp_path, ops):
    path = _model(tmp_path / "m.onnx", ops)
    prepared, folded = _prepared(path)
    assert folded == []
    assert Counter(n.op_type for n in prepared.graph.node)[ops[0][0]] == 1
    _close(path, prepared)


def test_a_conv_output_read_elsewhere_keeps_its_affine_op(tmp_path):
    path = _model(tmp_path / "m.onnx", [("Mul", np.array([2.0]), False)], extra_reader=True)
    prepared, folded = _prepared(path)
    assert folded == [] and Counter(n.op_type for n in prepared.graph.node)["Mul"] == 1


def test_an_integer_conv_chain_has_no_float_op_where_the_affine_block_was(tmp_path):
    path = _model(tmp_path / "m.onnx", [("Mul", np.array([1.38]), False), ("Add", np.array([-0.2]), False)])
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(2)
    for i in range(8):
        np.save(data / f"{i:03d}.npy", rng.normal(0, 1, SHAPE).astype(np.float32))
    config = tmp_path / "c.yaml"
    config.write_text("version: 1\nglobal: {placement: integer}\n")
    out = tmp_path / "q.onnx"
    result = qtool.quantize(path, out, data_dir=data, config_path=config, search=None, evaluation=None)
    assert result.prepare.folded_affine == ["mul0", "add1"]
    assert result.kernels == {"QLinearConv": 2}
    assert result.boundaries == {"QuantizeLinear": 1, "DequantizeLinear": 1}  # the model's input and output only
    feed = {"x": np.load(data / "000.npy")}
    reference, candidate = run_model(path, feed)[0], run_model(out, feed)[0]
    assert 10 * np.log10(np.sum(reference.astype(np.float64) ** 2) / np.sum((reference - candidate) ** 2)) > 25
