"""Tiny float models built in code for the quantization tests."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qtool.graph.prepare import prepare_model
from qtool.graph.weights import Weights


def conv_chain(channels: int = 16, size: int = 32, depthwise_middle: bool = False) -> onnx.ModelProto:
    """x [1, 3, size, size] -> Conv -> Relu -> Conv (depthwise when asked) -> Relu -> Conv -> y."""
    rng = np.random.default_rng(0)
    group = channels if depthwise_middle else 1
    weights = {
        "w0": rng.normal(0, 0.2, (channels, 3, 3, 3)),
        "w1": rng.normal(0, 0.2, (channels, channels // group, 3, 3)),
        "w2": rng.normal(0, 0.2, (channels, channels, 1, 1)),
        "b0": rng.normal(0, 0.1, channels),
        "b1": rng.normal(0, 0.1, channels),
        "b2": rng.normal(0, 0.1, channels),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("Conv", ["r0", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1], group=group),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["y"], name="conv2"),
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, size, size])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 17)])


def prepared(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Weights]:
    """The model as the quantizer sees it (shapes inferred, weights detached)."""
    weights = Weights()
    ready, _ = prepare_model(model, weights, target_opset=17, source="test")
    return ready, weights
